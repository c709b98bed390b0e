"""Health gates on the pdsh namespace cluster (issue 40): real pdsh over real sshd, torchrun, DeepSpeed
ZeRO-2 on CPU, one rank per node; the site's check (``recovery.health_check``) fails on a host while a
file names it (a sick host: its local disk read-only, say).

5 nodes: node0 and node1 train, node2-node4 are spares. node1 and node2 are sick from the start:
- at the first launch node1's gate fails (exit 69, no rank started there): node3 takes its place, and
  node2, whose probe runs the same check, is not taken as a spare;
- node0 falls sick while it trains, and node3's rank is then killed: node4 takes node3's place, and
  at that relaunch node0's gate fails: node3, probed healthy again, takes node0's place;
- node1 and node2 are probed at every relaunch and never come back; the job finishes on node3 and
  node4 with every step's loss. ``status`` and the timeline give the check's own words, and
  ``hfscale preflight`` says the same about node1.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from cluster import leftover_processes, run_on
from conftest import ROOT
from hfscale.launch.recovery.timeline import read_timeline
from test_recovery_cluster import _attempt_training, _step, launched, run_dir_of, train_config, wait_for

pytestmark = pytest.mark.slow
STEPS = 24


def test_a_sick_host_is_never_admitted_at_a_launch_a_relaunch_or_as_a_spare(make_cluster, tmp_path):
    cluster = make_cluster(5)
    out, sick = tmp_path / "out", tmp_path / "sick"
    sick.mkdir()
    check = f'test ! -e {sick}/"$(hostname)" || {{ echo "$(hostname): /scratch is read-only"; exit 3; }}'
    config = train_config(tmp_path, "gate", out, 29951, cluster.nodes[:2],
                          {"max_restarts": 4, "strikes": 2, "spares": 3,
                           "health_check": {"command": check, "timeout": 30}}, max_steps=STEPS)
    doc = yaml.safe_load(config.read_text())
    doc["cluster"]["hosts"] += [{"host": h, "slots": 1, "spare": True} for h in cluster.nodes[2:]]
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    checked = subprocess.run([sys.executable, "-m", "hfscale", "check", str(config)], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "health       each node before its ranks start" in checked.stdout and check in checked.stdout
    (sick / "node1").touch()
    (sick / "node2").touch()
    said = "recovery.health_check exited 3: node1: /scratch is read-only"
    pre = subprocess.run([sys.executable, "-m", "hfscale", "preflight", str(config)], cwd=ROOT, env=cluster.env(),
                         capture_output=True, text=True, timeout=180)
    assert pre.returncode != 0 and f"node1: {said}" in pre.stdout and "preflight failed on: node1" in pre.stderr, \
        pre.stdout + pre.stderr

    with launched(config, cluster.env(), tmp_path) as job:
        run = run_dir_of(tmp_path)
        wait_for("attempt 1 training", lambda: _attempt_training(run, 1), job.proc, timeout=400)
        (sick / "node0").touch()  # node0 falls sick as it trains; then node3's rank dies
        at = _step(run) + 2
        wait_for(f"step {at}", lambda: _step(run) >= at, job.proc)
        run_on(cluster, "node3", "pkill -KILL '^python'", timeout=30)
    output = job.output()
    assert job.proc.returncode == 0, output[-6000:]
    events = read_timeline(run).events
    for e in events:
        print(e.model_dump(exclude_none=True))
    failures = [e for e in events if e.kind == "failure"]
    relaunches = [e for e in events if e.kind == "relaunch"]
    assert [(e.host, e.cause) for e in failures] == [("node1", "unhealthy"), ("node3", "rank_failed"),
                                                     ("node0", "unhealthy")], output[-6000:]
    assert failures[0].what == f"node1 failed its health gate: {said}"  # the check's own words
    assert failures[2].what == "node0 failed its health gate: recovery.health_check exited 3: node0: /scratch is read-only"
    assert failures[0].error == "health gate failed: recovery.health_check exited 3: nodeN: /scratch is read-only"
    assert [e.hosts for e in relaunches] == [["node0", "node3"], ["node0", "node4"], ["node3", "node4"]]
    assert [[(r.host, r.spare) for r in e.replaced or ()] for e in relaunches] == [
        [("node1", "node3")], [("node3", "node4")], [("node0", "node3")]]
    assert not any("node1" in (e.readmitted or ()) or "node2" in (e.readmitted or ()) for e in relaunches)
    # the spare and the excluded host its probe kept out, said at each relaunch
    assert output.count("hfscale: node2: not admitted: recovery.health_check exited 3: node2: /scratch is "
                        "read-only") == 3, output[-6000:]
    assert f"hfscale: node1: not admitted: {said}" in output
    # no rank ever started on a sick host: node2 was never in a launch (no log of it), and every line node1 wrote,
    # and node0 at the relaunch its gate refused, is the check's, the gate's or the exit line (torchrun and the
    # ranks write their own lines as soon as they start)
    assert list(run.rglob("node2.log")) == []
    for host, attempt in (("node1", 0), ("node0", 2)):
        lines = (run / "attempts" / str(attempt) / "logs" / f"{host}.log").read_text().splitlines()
        assert [line for line in lines if not line.startswith("pdsh@")] == [  # pdsh's own "ssh exited" line aside
            f"{host}: {host}: /scratch is read-only",
            f"{host}: hfscale: health gate failed: recovery.health_check exited 3: {host}: /scratch is read-only",
            f"{host}: HFSCALE_EXIT rc=69"], lines
    assert [p for p in run.rglob("node1.log") if p.parent.parent.name != "0"] == []  # never launched again
    ckpt = out / f"checkpoint-{STEPS}"
    assert (ckpt / "hfscale_complete.json").is_file()
    status = subprocess.run([sys.executable, "-m", "hfscale", "status", str(run)], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    print(status.stdout.split("\n---")[0])
    assert f"unhealthy    attempt 0: node1 failed its health gate: {said}" in status.stdout, status.stdout
    assert "unhealthy    attempt 2: node0 failed its health gate: recovery.health_check exited 3: node0: " \
           "/scratch is read-only" in status.stdout, status.stdout
    assert leftover_processes(cluster, timeout=20, contains=str(tmp_path)) == {}
