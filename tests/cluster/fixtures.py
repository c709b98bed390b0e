"""pytest fixtures for the fake multi-host cluster (enable with ``pytest_plugins = ["cluster.fixtures"]``).

* ``cluster2``: a 2-node cluster shared by the whole session.
* ``make_cluster(n, **kw)``: a fresh n-node cluster, torn down at the end of the requesting test.
* ``slurm2``: Slurm (slurmctld + one slurmd per node, see ``start_slurm``) on its own 2-node cluster,
  shared by the whole session; ``slurm2.env()`` runs sbatch/squeue/scontrol/scancel and hfscale.
  Its own cluster, not ``cluster2``: tests there assert that nothing but their ranks runs on the nodes.
* ``podman2``: ``cluster2`` with podman behind a docker-compatible wrapper on each node and a test
  image imported there (see ``containers.py``); session-wide.

Outside CI they skip (with the reason) when the machine cannot host a cluster: not root,
namespaces not permitted, or sshd/pdsh/... (for ``slurm2`` also slurm-wlm/munge, for ``podman2``
podman/runc) missing (the reason gives the apt-get line).
With CI=true every such case, and any failure to start, is a test failure instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

import pytest

from . import (
    Cluster,
    ClusterUnavailable,
    Slurm,
    slurm_preflight,
    start_cluster,
    start_slurm,
    stop_cluster,
    stop_slurm,
)
from .containers import Podman, podman_preflight, start_podman, stop_podman

T = TypeVar("T")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _unavailable(what: str, e: ClusterUnavailable) -> NoReturn:
    if in_ci():
        pytest.fail(f"CI=true and the {what} cannot be created: {e}", pytrace=False)
    pytest.skip(f"{what} unavailable: {e}")


def _set_up(what: str, start: Callable[..., T], *args) -> T:
    """``start(*args)`` on a running test cluster: unavailable -> skip (fail in CI), error -> fail."""
    try:
        return start(*args)
    except ClusterUnavailable as e:
        _unavailable(what, e)
    except Exception as e:  # a real failure: never skip it
        pytest.fail(f"could not set up the {what}: {e}", pytrace=False)


def _start(n: int, workdir, **kw) -> Cluster:
    try:
        return start_cluster(n, workdir, **kw)
    except ClusterUnavailable as e:
        if in_ci():
            pytest.fail(f"CI=true and the test cluster cannot be created: {e}", pytrace=False)
        pytest.skip(f"multi-host test cluster unavailable: {e}")
    except Exception as e:  # a real failure: never skip it
        pytest.fail(f"could not start a {n}-node test cluster: {e}", pytrace=False)


@pytest.fixture(scope="session")
def cluster2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = _start(2, tmp_path_factory.mktemp("cluster2-"))
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


@pytest.fixture
def make_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(n: int = 2, **kw) -> Cluster:
        cluster = _start(n, tmp_path_factory.mktemp(f"cluster{n}-"), **kw)
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in reversed(made):
            stop_cluster(cluster)


@pytest.fixture(scope="session")
def slurm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    problem = slurm_preflight()  # before making a cluster it could not use
    if problem is not None:
        _unavailable("Slurm test cluster", problem)
    cluster = _start(2, tmp_path_factory.mktemp("slurm2-"))
    try:
        slurm = _set_up("Slurm test cluster", start_slurm, cluster)
        try:
            yield slurm
        finally:
            stop_slurm(slurm)
    finally:
        stop_cluster(cluster)


@pytest.fixture
def make_slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Slurm]]:
    """``make_slurm(n, **start_slurm's options)``: a Slurm on a fresh ``n``-node cluster, for this test
    alone (faults that stop a slurmd or cut a link must not reach the session's slurm2)."""
    problem = slurm_preflight()
    if problem is not None:
        _unavailable("Slurm test cluster", problem)
    made: list[tuple[Cluster, Slurm | None]] = []

    def make(n: int = 2, **kw) -> Slurm:
        cluster = _start(n, tmp_path_factory.mktemp(f"slurm{n}-"))
        made.append((cluster, None))
        slurm = _set_up("Slurm test cluster", lambda c: start_slurm(c, **kw), cluster)
        made[-1] = (cluster, slurm)
        return slurm

    try:
        yield make
    finally:
        for cluster, slurm in reversed(made):
            if slurm is not None:
                stop_slurm(slurm)
            stop_cluster(cluster)


@pytest.fixture(scope="session")
def podman2(cluster2: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    problem = podman_preflight()
    if problem is not None:
        _unavailable("container runtime", problem)
    podman = _set_up("container runtime", start_podman, cluster2, tmp_path_factory.mktemp("podman-"))
    try:
        yield podman
    finally:
        stop_podman(podman, cluster2)
