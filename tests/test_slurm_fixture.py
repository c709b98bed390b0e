"""The Slurm test fixture itself (tests/cluster: slurm_up.sh, start_slurm, ``slurm2``).

A real Slurm: slurmctld and munged on node0, one slurmd in each namespace node; sbatch/scontrol/
scancel from the root namespace with ``slurm2.env()``. Skips with the reason when this machine
cannot host it (not root, slurm-wlm/munge missing), fails instead under CI=true.
Timings are printed as ``SLURM_TIMING`` lines (``pytest -s`` shows them).
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import pytest

from cluster import leftover_processes, pids_in_node, start_slurm, stop_slurm
from conftest import ROOT

pytestmark = pytest.mark.slow


def timing(name: str, seconds: float) -> None:
    print(f"SLURM_TIMING {name}={seconds:.2f}s", flush=True)


def wait_for(path: Path, text: str, timeout: float = 60) -> float:
    """Seconds until ``path`` contains ``text``."""
    t0 = time.monotonic()
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() - t0 < timeout, f"{text!r} not in {path} after {timeout}s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_two_node_job_runs_on_both_nodes_as_root_with_this_python(slurm2, tmp_path):
    out = tmp_path / "out.txt"
    probe = ("echo $(hostname) uid=$(id -u) py=$(python -c 'import sys; print(sys.executable)') "
             f"repo=$(test -f {ROOT}/pyproject.toml && echo yes)")
    t0 = time.monotonic()
    job = slurm2.sbatch("-N2", f"--output={out}", "--wrap", f"srun bash -c {shlex.quote(probe)}", cwd=tmp_path)
    info = slurm2.wait(job, timeout=60)
    timing("sbatch_N2_srun_to_completed", time.monotonic() - t0)
    assert info["JobState"] == "COMPLETED", out.read_text() if out.exists() else info
    assert info["NodeList"] == "node[0-1]"
    lines = sorted(out.read_text().split("\n"))[1:]
    assert [line.split()[0] for line in lines] == ["node0", "node1"], lines
    for line in lines:
        assert f"uid=0 py={sys.executable} repo=yes" in line, line


def test_scontrol_requeue_restarts_a_running_job(slurm2, tmp_path):
    starts = tmp_path / "starts"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\necho \"start restart=${{SLURM_RESTART_COUNT:-0}} $(hostname)\" >> {starts}\n"
                      "sleep 300\n")
    job = slurm2.sbatch("-N2", f"--output={tmp_path}/slurm-%j.out", str(script), cwd=tmp_path)
    try:
        timing("sbatch_to_running", wait_for(starts, "restart=0", timeout=60))
        t0 = time.monotonic()
        slurm2.run("scontrol", "requeue", job)
        wait_for(starts, "restart=1", timeout=slurm2.requeue_delay + 60)
        timing("requeue_to_restart", time.monotonic() - t0)
        info = slurm2.wait(job, "RUNNING", timeout=10)
        assert info["Restarts"] == "1"
        assert starts.read_text().splitlines() == ["start restart=0 node0", "start restart=1 node0"]
    finally:
        slurm2.run("scancel", job, check=False)
    assert slurm2.wait(job, timeout=60)["JobState"] == "CANCELLED"


def test_scancel_usr1_batch_reaches_the_batch_scripts_trap(slurm2, tmp_path):
    marker, ready = tmp_path / "usr1", tmp_path / "ready"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"got=0; trap 'got=1; echo USR1 $(hostname) >> {marker}' USR1\n"
        f"echo ready > {ready}\n"
        # a trap runs between commands: sleep in the background and wait, which a signal interrupts
        'for i in $(seq 600); do sleep 0.1 & wait $!; [ "$got" = 1 ] && exit 0; done\n'
        "exit 1\n")
    job = slurm2.sbatch("-N2", f"--output={tmp_path}/slurm-%j.out", str(script), cwd=tmp_path)
    try:
        wait_for(ready, "ready", timeout=60)
        t0 = time.monotonic()
        slurm2.run("scancel", "--signal=USR1", "--batch", job)
        wait_for(marker, "USR1", timeout=30)
        timing("scancel_usr1_to_trap", time.monotonic() - t0)
        info = slurm2.wait(job, timeout=30)
    finally:
        slurm2.run("scancel", job, check=False)
    assert info["JobState"] == "COMPLETED", info
    assert marker.read_text() == "USR1 node0\n"  # the batch script runs on the first node, once


def test_stop_slurm_leaves_no_process_or_state(make_cluster, tmp_path_factory):
    cluster = make_cluster(2)
    # a short folder: slurmstepd's socket <dir>/spool/node0/node0_<job>.<step> must fit in 108 bytes,
    # which a test's own tmp_path under pytest-xdist (.../popen-gw0/test_stop_slurm_leaves_.../) does not
    tmp_path = tmp_path_factory.mktemp("slurm")
    t0 = time.monotonic()
    slurm = start_slurm(cluster, tmp_path / "slurm")
    timing("start_slurm_2_nodes", time.monotonic() - t0)
    try:
        daemons = {c.split()[0].rsplit("/", 1)[-1] for n in cluster.nodes for c in pids_in_node(cluster, n).values()}
        assert {"slurmctld", "slurmd", "munged"} <= daemons, daemons
        started = tmp_path / "started"
        job = slurm.sbatch("-N2", f"--output={tmp_path}/slurm-%j.out", "--wrap",
                           f"srun bash -c 'echo x >> {started}; sleep 300'", cwd=tmp_path)
        wait_for(started, "x\nx\n", timeout=60)
        assert slurm.state(job) == "RUNNING"
    finally:
        t0 = time.monotonic()
        stop_slurm(slurm)
        timing("stop_slurm_with_running_job", time.monotonic() - t0)
    assert leftover_processes(cluster) == {}
    assert sorted(p.name for p in (tmp_path / "slurm").iterdir()) == ["env", "log", "slurm.conf"]
    stop_slurm(slurm)  # idempotent
