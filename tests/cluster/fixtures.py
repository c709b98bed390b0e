"""pytest fixtures for the fake multi-host cluster (enable with ``pytest_plugins = ["cluster.fixtures"]``).

* ``cluster2``: a 2-node cluster shared by the whole session.
* ``make_cluster(n, **kw)``: a fresh n-node cluster, torn down at the end of the requesting test.

Outside CI they skip (with the reason) when the machine cannot host a cluster: not root,
namespaces not permitted, or sshd/pdsh/... missing (the reason gives the apt-get line).
With CI=true every such case, and any failure to start, is a test failure instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from . import Cluster, ClusterUnavailable, start_cluster, stop_cluster


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


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
