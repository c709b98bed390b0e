"""The healer must not trip on itself (issue 35), on the pdsh namespace cluster (tests/cluster): real
pdsh over real sshd, torchrun and DeepSpeed ZeRO-2 on CPU, one rank per node, faults made from outside.

- ``test_a_save_cut_short_is_set_aside_by_the_relaunch_and_by_hand``: node1's ranks are SIGKILLed in
  the middle of the job's first checkpoint save (every rank's save is held inside the Trainer's
  ``_save_rng_state``, after DeepSpeed's shards and before the trainer state, by a sitecustomize
  while a flag file exists; a stop's TERM ends a rank there): the supervisor's relaunch sets the save
  cut short aside and trains
  from step 0 to the end. Then the same job in a new output_dir is stopped by ``hfscale stop`` in
  the middle of its first save, and the same launch run again by hand finishes too.

A master port still held at a relaunch, on the spare path: tests/test_spares_cluster.py (``GRAB_PORT``
below takes it); a cut link at Slurm's default timeouts: tests/test_recovery_slurm.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from cluster import leftover_processes, run_on
from conftest import ROOT
from site_hooks import site_hook
from hfscale.launch.build import INCOMPLETE_DIR
from hfscale.launch.recovery.timeline import read_timeline
from test_recovery_cluster import _attempt_training, launched, run_dir_of, train_config, wait_for

pytestmark = pytest.mark.slow

# every rank's save waits in _save_rng_state (DeepSpeed's shards written, the trainer state not) while FLAG exists
HOLD_SAVE = site_hook('''\
    import signal
    import time


    def _hold(module):
        _save_rng_state = module.Trainer._save_rng_state

        def _held(self, output_dir):
            flag = os.environ["HOLD_SAVE"]
            if os.path.exists(flag):
                # a stop's TERM ends the rank inside the save (its handler would wait for the step's end)
                signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
                open(flag + ".inside", "a").close()  # the test's sign: a save is under way
                deadline = time.monotonic() + 120
                while os.path.exists(flag) and time.monotonic() < deadline:
                    time.sleep(0.1)
            return _save_rng_state(self, output_dir)

        module.Trainer._save_rng_state = _held


    if os.environ.get("HOLD_SAVE"):
        _after_import("transformers.trainer", _hold)
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
    with open(tmp_path / "first.out", "w") as sink:  # a file, not a pipe nobody reads while the test waits
        first = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(config2)], cwd=ROOT,
                                 env=cluster.env(), stdout=sink, stderr=subprocess.STDOUT, text=True)
    wait_for("the first save under way", inside.exists, first, timeout=300)
    (run2,) = set((tmp_path / "runs").iterdir()) - runs_before
    stop = subprocess.run([sys.executable, "-m", "hfscale", "stop", str(run2)], cwd=ROOT, env=cluster.env(),
                          capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    first.wait(timeout=120)
    said = (tmp_path / "first.out").read_text(errors="replace")
    assert cut_short(out2) == ["checkpoint-4"], said[-4000:]  # the stop's TERM came inside the save
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
