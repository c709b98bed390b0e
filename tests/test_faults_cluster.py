"""Faults told plainly, across hosts (issue 20), on the namespace cluster (tests/cluster):

- one job per output_dir holds across hosts sharing a file system: a launch on node1 is refused
  while node0's launch holds the lock (node0's pid is not visible from node1: the lock's age on the
  file system decides);
- a stop holds for a node line that starts late: node0's ssh sessions start their command 6 s late
  (an ``env`` on its PATH that sleeps first, as a loaded host or a venv on NFS would), the other
  host is unreachable, so hfscale stops the job before node0's line starts. The line finds the stop
  marker and starts nothing; before the marker, it started afterwards and ran on (the CI failure
  this issue names).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cluster import STD_PATH, leftover_processes, run_on
from conftest import ROOT

pytestmark = pytest.mark.slow


def _job(tmp: Path, name: str, hosts: list[str] | None, python: str, runner: str = "local") -> Path:
    doc = {"name": name, "cluster": {"master_port": 29895, **({"hosts": [{"host": h, "slots": 1} for h in hosts]}
                                                              if hosts else {"nproc_per_node": 1})},
           "runner": {"type": runner, "launcher": "torchrun", "run_dir": str(tmp / "runs"), "python": python,
                      "connect_timeout": 5},
           "distributed": {"backend": "ddp"}, "precision": "no", "batch": {"micro_batch_size": 2},
           "training": {"output_dir": str(tmp / "out"), "max_steps": 4,
                        "model": {"config": {"model_type": "gpt2", "n_layer": 1}}}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _sleeper(tmp: Path) -> str:
    path = tmp / "python"
    # the node's health gate runs with the same interpreter first: the stand-in passes it
    path.write_text('#!/bin/sh\ncase "$*" in *hfscale.launch.node.health_gate*) exit 0 ;; esac\nsleep 300 &\nwait\n')
    path.chmod(0o755)
    return str(path)


def test_a_launch_from_another_host_into_a_used_output_dir_is_refused(cluster2, tmp_path):
    tmp_path.chmod(0o755)
    job = _job(tmp_path, "shared", None, _sleeper(tmp_path))
    hfscale = f"cd {ROOT} && exec {sys.executable} -m hfscale launch {job}"
    first = subprocess.Popen([str(cluster2.bin / "ssh"), "node0", hfscale], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = tmp_path / "out" / "_hfscale-lock.json"
    try:
        deadline = time.monotonic() + 60
        while not lock.exists():
            assert time.monotonic() < deadline and first.poll() is None, "node0's launch did not take the lock"
            time.sleep(0.2)
        held = json.loads(lock.read_text())
        assert held["host"] == "node0"
        r = run_on(cluster2, "node1", f"cd {ROOT} && {sys.executable} -m hfscale launch {job}", timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert (f"error: training.output_dir {tmp_path / 'out'} is in use by job {held['job_id']} (host node0, "
                f"pid {held['pid']}, run directory ") in r.stderr, r.stderr
        # node0's launcher is another host's process: its heartbeat in the run directory (every 5 s) tells
        assert f"its launcher's heartbeat in {held['run_dir']} changed " in r.stderr, r.stderr
        assert len(list((tmp_path / "runs").iterdir())) == 1
    finally:
        run_on(cluster2, "node0", f"pkill -TERM -f 'hfscale launch {job}'", timeout=30)
        first.wait(timeout=60)
        assert leftover_processes(cluster2, timeout=20, contains=str(tmp_path)) == {}
    assert not lock.exists()  # node0's launch released it when stopped


def test_a_node_line_that_starts_after_the_stop_starts_nothing(make_cluster, tmp_path):
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "env").write_text('#!/bin/sh\n[ "$(hostname)" = node0 ] && sleep 6\nexec /usr/bin/env "$@"\n')
    (slow / "env").chmod(0o755)
    cluster = make_cluster(2, setenv={"PATH": f"{slow}:{os.path.dirname(sys.executable)}:{STD_PATH}"})
    conf = cluster.dir / "ssh_config.d" / "ghost.conf"
    conf.write_text(f"Host ghost\n  HostName {cluster.bridge_address}\n  Port 1\n")
    job = _job(tmp_path, "late", ["node0", "ghost"], _sleeper(tmp_path), runner="pdsh")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(job)], cwd=ROOT, env=cluster.env(),
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 3 and "hfscale: cannot reach ghost over ssh" in r.stdout, out
    time.sleep(8)  # anything node0's late line could have started has started by now
    assert leftover_processes(cluster, contains=str(tmp_path)) == {}
    assert "node0: hfscale: the job was stopped before this node started" in r.stdout, out
    print(f"ended in {took:.1f} s; node0's line started ~6 s after the launch and exited at once")
