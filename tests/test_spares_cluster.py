"""Hot spares on the pdsh namespace cluster (issue 29): real pdsh over real sshd, torchrun, DeepSpeed
ZeRO-2 on CPU, one rank per node.

``test_a_killed_node_is_replaced_by_its_spare``: 4 nodes, node3 marked spare (``recovery.spares: 1``),
the job trains on node0-node2. At a step drawn at random (seeded; the seed is printed) node1's
processes are SIGKILLed: the spare takes node1's place at the same world size (no checkpoint
conversion, accumulation unchanged). node1, probed healthy, waits as the spare; node2 is then
killed and node1 takes its place. Every step's loss equals the uninterrupted run's within 1e-3;
``status`` names the replacements.

With node2's kill, a process on node0 takes the master port the moment the dying attempt's store
lets it go and holds it 6 s, as the previous attempt's torchrun still shutting down does under
Slurm (issue 35): the relaunch waits for the port (hfscale.launch.recovery.settle) instead of failing on
node0 with EADDRINUSE, and node0 stays node 0. Before, node0 was struck and replaced by node2, the
host just taken out.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from cluster import leftover_processes, run_on
from conftest import ROOT
from hfscale.launch.recovery.timeline import read_timeline
from test_healing_trips_cluster import GRAB_PORT
from test_recovery_cluster import fault_rng, MAX_STEPS, _attempt_training, _step, largest_loss_difference, run_dir_of, train_config, launched, wait_for

pytestmark = pytest.mark.slow


def test_a_killed_node_is_replaced_by_its_spare(make_cluster, tmp_path, uninterrupted_losses):
    rng = fault_rng()
    cluster = make_cluster(4)
    out = tmp_path / "out"
    config = train_config(tmp_path, "spare", out, 29936, cluster.nodes[:3],
                          {"max_restarts": 4, "strikes": 2, "min_nodes": 2, "spares": 1})
    doc = yaml.safe_load(config.read_text())
    doc["cluster"]["hosts"].append({"host": cluster.nodes[3], "slots": 1, "spare": True})
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    check = subprocess.run([sys.executable, "-m", "hfscale", "check", str(config)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "+ 1 spare (node3)" in check.stdout and "nothing converted" in check.stdout, check.stdout
    grab = tmp_path / "grab_port.py"
    grab.write_text(GRAB_PORT)
    t0 = time.time()
    faults: list[tuple[str, float, int]] = []
    with launched(config, cluster.env(), tmp_path) as job:
        run = run_dir_of(tmp_path)
        for n, victim in enumerate(("node1", "node2")):
            if n:
                wait_for(f"attempt {n} training", lambda: _attempt_training(run, n), job.proc)
            at = min(_step(run) + rng.randint(3, 8), MAX_STEPS - 6)
            wait_for(f"step {at}", lambda: _step(run) >= at, job.proc)
            if n:  # node0's master port taken as the dying attempt's store lets it go, held 6 s
                holder = subprocess.Popen([str(cluster.bin / "ssh"), "node0", f"{sys.executable} {grab} 29936 6"],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                time.sleep(1.0)  # its interpreter up, trying the port
            run_on(cluster, victim, "pkill -KILL '^python'", timeout=30)  # torchrun and its rank
            faults.append((f"kill {victim}", time.time(), _step(run)))
        held, _ = holder.communicate(timeout=180)
    output = job.output()
    for what, when, step in faults:
        print(f"{what} at +{when - t0:.1f} s, step {step}")
    print(held)
    assert job.proc.returncode == 0, output[-6000:]
    times = dict(line.split() for line in held.splitlines() if line.split()[:1] in (["held"], ["released"]))
    assert float(times["held"]) - faults[1][1] < 15, held  # it had the port before a relaunch could have
    run = run_dir_of(tmp_path)
    events = read_timeline(run).events
    for e in events:
        print(e.model_dump(exclude_none=True))
    relaunches = [e for e in events if e.kind == "relaunch"]
    failures = [e for e in events if e.kind == "failure"]
    assert [e.host for e in failures] == ["node1", "node2"], output[-6000:]
    assert all(f.at >= when for f, (_, when, _) in zip(failures, faults)), "a failure before its fault"
    assert [[(r.host, r.spare) for r in e.replaced or ()] for e in relaunches] == [[("node1", "node3")],
                                                                                  [("node2", "node1")]]
    assert [e.hosts for e in relaunches] == [["node0", "node3", "node2"], ["node0", "node3", "node1"]]
    assert relaunches[1].at >= float(times["released"]) - 1.0, (relaunches[1].at, times)  # it waited for the port
    assert "EADDRINUSE" not in output and "port_busy" not in output
    assert {(e.world_size, e.accumulation) for e in relaunches} == {(3, 2)}  # the batch math unchanged
    assert "ds_to_universal" not in output  # nothing converted
    assert "node1 passed its probe: readmitted" in output
    worst = largest_loss_difference(out, MAX_STEPS, uninterrupted_losses)  # every step logged, against the reference
    print(f"largest loss difference over {MAX_STEPS} steps: {worst:.2e}; restarts: "
          + ", ".join(f"{t.at - f.at:.1f} s" for f, t in zip([e for e in events if e.kind == "failure"],
                                                            [e for e in events if e.kind == "training" and e.attempt])))
    assert worst < 1e-3
    status = subprocess.run([sys.executable, "-m", "hfscale", "status", str(run)], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    print(status.stdout.split("\n---")[0])
    assert "replaced     node3 replaced node1 at +" in status.stdout
    assert "replaced     node1 replaced node2 at +" in status.stdout
    assert leftover_processes(cluster, timeout=20, contains=str(tmp_path)) == {}
