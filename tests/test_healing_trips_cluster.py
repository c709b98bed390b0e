"""The healer must not trip on itself (issue 35), on the pdsh namespace cluster (tests/cluster): real
pdsh over real sshd, torchrun and DeepSpeed ZeRO-2 on CPU, one rank per node, faults made from outside.

- ``test_a_save_cut_short_is_set_aside_by_the_relaunch_and_by_hand``: node1's ranks are SIGKILLed in
  the middle of the job's first checkpoint save (every rank's save is held inside the Trainer's
  ``_save_rng_state``, after DeepSpeed's shards and before the trainer state, by a sitecustomize
  while a flag file exists): the supervisor's relaunch sets the save cut short aside and trains
  from step 0 to the end. Then the same job in a new output_dir is stopped by ``hfscale stop`` in
  the middle of its first save, and the same launch run again by hand finishes too.
- ``test_a_master_port_still_held_strikes_no_host_and_keeps_node0``: 3 nodes and spare node3; node2's
  ranks are SIGKILLed, and a process on node0 takes the master port as soon as the dying attempt's
  store lets it go, and holds it 12 s (the previous attempt's torchrun still shutting down, as under
  Slurm). The spare takes node2's place; the relaunch waits for the port instead of failing on it:
  no failure on node0, no strike, node0 stays node 0.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from cluster import leftover_processes, run_on
from conftest import ROOT
from hfscale.launch.build import INCOMPLETE_DIR
from hfscale.launch.timeline import read_timeline
from test_recovery_cluster import _attempt_training, _step, launched, run_dir_of, train_config, wait_for

pytestmark = pytest.mark.slow

# every rank's save waits in _save_rng_state (DeepSpeed's shards written, the trainer state not) while FLAG exists
HOLD_SAVE = textwrap.dedent('''\
    import os

    if os.environ.get("HOLD_SAVE") and os.environ.get("RANK") is not None:
        import time

        import transformers

        _save_rng_state = transformers.Trainer._save_rng_state

        def _held(self, output_dir):
            flag = os.environ["HOLD_SAVE"]
            if os.path.exists(flag):
                open(flag + ".inside", "a").close()  # the test's sign: a save is under way
                deadline = time.monotonic() + 120
                while os.path.exists(flag) and time.monotonic() < deadline:
                    time.sleep(0.1)
            return _save_rng_state(self, output_dir)

        transformers.Trainer._save_rng_state = _held
''')
MAX_STEPS = 8


def held_save_config(tmp: Path, name: str, out: Path, port: int, hosts: list[str]) -> Path:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HOLD_SAVE)
    config = train_config(tmp, name, out, port, hosts, {"max_restarts": 3, "strikes": 2, "min_nodes": 2},
                          max_steps=MAX_STEPS)
    doc = yaml.safe_load(config.read_text())
    doc["env"]["vars"].update({"PYTHONPATH": str(site), "HOLD_SAVE": str(tmp / "hold")})
    doc["training"]["save_steps"] = 4
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    return config


def cut_short(out: Path) -> list[str]:
    """The checkpoints of ``out`` without a trainer state (a save cut short)."""
    return sorted(p.name for p in out.glob("checkpoint-*") if not (p / "trainer_state.json").exists())


def test_a_save_cut_short_is_set_aside_by_the_relaunch_and_by_hand(make_cluster, tmp_path):
    cluster = make_cluster(2)
    hold, inside = tmp_path / "hold", tmp_path / "hold.inside"
    out = tmp_path / "out"
    config = held_save_config(tmp_path, "cut", out, 29811, cluster.nodes)
    # 1. supervised: node1's ranks killed inside the first save; the relaunch sets it aside and starts over
    hold.touch()
    with launched(config, cluster.env(), tmp_path) as job:
        run = run_dir_of(tmp_path)
        wait_for("the first save under way", inside.exists, job.proc)
        run_on(cluster, "node1", "pkill -KILL '^python'", timeout=30)
        wait_for("the relaunch", lambda: any(e.kind == "relaunch" for e in read_timeline(run).events), job.proc)
        hold.unlink()  # the previous attempt is stopped everywhere (the supervisor settled it): saves go through
        wait_for("attempt 1 training", lambda: _attempt_training(run, 1), job.proc)
    said = job.output()
    assert job.proc.returncode == 0, said[-6000:]
    relaunch = [e for e in read_timeline(run).events if e.kind == "relaunch"]
    assert len(relaunch) == 1 and relaunch[0].resume_step is None, said[-4000:]  # nothing complete: step 0
    aside = out / INCOMPLETE_DIR / f"{run.name.split('-', 1)[1]}-r1"
    assert "checkpoint-4 this job's own save, cut short: " in said and f"set aside in {aside}" in said
    assert "no complete checkpoint: starting at step 0" in said, said[-4000:]
    assert cut_short(aside) == ["checkpoint-4"] and cut_short(out) == []
    assert (out / f"checkpoint-{MAX_STEPS}" / "hfscale_complete.json").is_file()

    # 2. by hand: hfscale stop inside the first save of a new output_dir, then the same launch again
    out2 = tmp_path / "out2"
    config2 = held_save_config(tmp_path, "cut2", out2, 29812, cluster.nodes)
    inside.unlink()
    hold.touch()
    runs_before = set((tmp_path / "runs").iterdir())
    first = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(config2)], cwd=ROOT, env=cluster.env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for("the first save under way", inside.exists, first, timeout=300)
    (run2,) = set((tmp_path / "runs").iterdir()) - runs_before
    stop = subprocess.run([sys.executable, "-m", "hfscale", "stop", str(run2)], cwd=ROOT, env=cluster.env(),
                          capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    first_out, _ = first.communicate(timeout=120)
    assert cut_short(out2) == ["checkpoint-4"], first_out[-4000:]  # the stop's KILL came inside the save
    hold.unlink()
    again = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config2)], cwd=ROOT, env=cluster.env(),
                           capture_output=True, text=True, timeout=600)
    print(again.stdout[-3000:])
    assert again.returncode == 0, again.stdout[-6000:] + again.stderr[-3000:]
    assert "checkpoint-4 this job's own save, cut short: " in again.stdout
    assert "no complete checkpoint: starting at step 0" in again.stdout
    assert cut_short(out2) == [] and (out2 / f"checkpoint-{MAX_STEPS}" / "hfscale_complete.json").is_file()
    assert len(list((out2 / INCOMPLETE_DIR).glob("*/checkpoint-4"))) == 1
    assert leftover_processes(cluster, timeout=20, contains=str(tmp_path)) == {}


GRAB_PORT = textwrap.dedent('''\
    import socket, sys, time
    port, hold = int(sys.argv[1]), float(sys.argv[2])
    deadline = time.monotonic() + 120
    while True:  # take the port the moment the dying attempt's store lets it go
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            break
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                sys.exit(1)
            time.sleep(0.005)
    s.listen()
    print(f"held {time.time():.3f}", flush=True)
    time.sleep(hold)
    s.close()
    print(f"released {time.time():.3f}", flush=True)
''')


def test_a_master_port_still_held_strikes_no_host_and_keeps_node0(make_cluster, tmp_path):
    cluster = make_cluster(4)
    out = tmp_path / "out"
    port = 29813
    config = train_config(tmp_path, "port", out, port, cluster.nodes[:3],
                          {"max_restarts": 4, "strikes": 1, "min_nodes": 2, "spares": 1}, max_steps=60)
    doc = yaml.safe_load(config.read_text())
    doc["cluster"]["hosts"].append({"host": cluster.nodes[3], "slots": 1, "spare": True})
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    grab = tmp_path / "grab_port.py"
    grab.write_text(GRAB_PORT)
    with launched(config, cluster.env(), tmp_path) as job:
        run = run_dir_of(tmp_path)
        wait_for("step 4", lambda: _step(run) >= 4, job.proc)
        holder = subprocess.Popen([str(cluster.bin / "ssh"), "node0", f"{sys.executable} {grab} {port} 12"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.0)  # its interpreter up, trying the port
        run_on(cluster, "node2", "pkill -KILL '^python'", timeout=30)
        killed = time.time()
        held, _ = holder.communicate(timeout=180)
    said = job.output()
    print(held)
    assert job.proc.returncode == 0, said[-6000:]
    times = dict(line.split() for line in held.splitlines() if line.split()[:1] in (["held"], ["released"]))
    assert float(times["held"]) - killed < 15, held  # it had the port before the relaunch could have
    events = read_timeline(run).events
    for e in events:
        print(e.model_dump(exclude_none=True))
    failures = [e for e in events if e.kind == "failure"]
    relaunches = [e for e in events if e.kind == "relaunch"]
    assert [(f.cause, f.host) for f in failures] == [("rank_failed", "node2")], said[-6000:]
    assert [e.hosts for e in relaunches] == [["node0", "node1", "node3"]]  # node0 stays node 0; the spare for node2
    assert relaunches[0].at >= float(times["released"]) - 1.0, (relaunches[0].at, times)  # it waited for the port
    assert "EADDRINUSE" not in said and "strike" not in said
    assert leftover_processes(cluster, timeout=20, contains=str(tmp_path)) == {}
