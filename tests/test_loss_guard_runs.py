"""The loss guard on real 2-process CPU runs under ``hfscale launch`` (local runner, recovery on): a Trainer
script (tests/scripts/loss_spikes.py, instrumented with hfscale.instrument) whose data or weights go bad
at a known step.

- Bad data (DeepSpeed ZeRO-2): steps 24-25's samples get labels of a byte the data never holds. The job stops at the spike
  without saving, rolls back to checkpoint-20, replays, spikes again, skips steps 24-27's batches
  (the window plus skip_margin 2) and finishes; every step's loss equals a reference run's on the same
  stream with those batches left out.
- A transient NaN (DDP, no recovery): rank 1's weights get a NaN once, before step 18. The launch stops
  with exit code 65 and says what a relaunch does; relaunched by hand, the job rolls back to
  checkpoint-15, the replay is clean, nothing is skipped, and every loss equals the uninterrupted run's.
- Bounds: with max_rollbacks 1 the spike that comes back stops the job with a verdict.

About 12 s per attempt on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hfscale.checkpoints.rollbacks import read_rollbacks
from hfscale.launch.recovery.timeline import read_timeline

from conftest import ROOT

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "scripts" / "loss_spikes.py"
GUARD = {"window": 20, "warmup": 8, "patience": 2, "skip_margin": 2, "loss_factor": 1.3}  # a tiny model: 3.9 -> 6.2


def write_config(where: Path, port: int, backend: str, env: dict[str, str], guard: dict | None = None,
                 restarts: int = 3) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    doc = {
        "name": "spiky",
        "cluster": {"nproc_per_node": 2, "master_port": port},
        "runner": {"launcher": "torchrun"},
        "distributed": {"backend": backend, **({"deepspeed": {"stage": 2, "steps_per_print": 100000}}
                                              if backend == "deepspeed" else {})},
        "precision": "no",
        "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
        "env": {"vars": env},
        "recovery": {"max_restarts": restarts},
        "training": {"script": str(SCRIPT), "script_args": ["--disable_tqdm", "true"], "output_dir": "out",
                     "max_steps": 40, "save_steps": 5, "logging_steps": 1, "learning_rate": 3.0e-3, "seed": 7,
                     "loss_guard": {**GUARD, **(guard or {})}},
    }
    path = where / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def launch(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=config.parent,
                          capture_output=True, text=True, timeout=600)


def losses(where: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((where / "out" / "losses.json").read_text()).items()}


def events(where: Path) -> list:
    (run_dir,) = (where / "runs").iterdir()
    return list(read_timeline(run_dir).events)


def test_bad_data_is_rolled_back_replayed_and_skipped_and_trains_as_without_it(tmp_path):
    job = write_config(tmp_path / "job", 29711, "deepspeed", {"POISON_STEPS": "24-25"})
    r = launch(job)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    record = read_rollbacks(tmp_path / "job" / "out")
    first, second = record.incidents
    assert (first.kind, first.first_step, first.resumed_from, first.rollback_to, first.action, first.outcome) == \
        ("spike", 24, None, 20, "replay", "spiked_again"), first
    assert (second.first_step, second.resumed_from, second.rollback_to, second.action, second.skip,
            second.outcome) == (24, 20, 20, "skip", (24, 27), "passed"), second
    # each skipped step's batches are recorded: one fingerprint per rank and micro-batch
    assert [s.step for s in second.skipped] == [24, 25, 26, 27]
    assert all(len(s.fingerprints) == 2 for s in second.skipped)
    assert len({f for s in second.skipped for f in s.fingerprints}) == 8
    # nothing saved once the spike began: the rollbacks moved nothing aside, and resumed from 20
    failures = [e for e in events(tmp_path / "job") if e.kind == "failure"]
    assert [e.cause for e in failures] == ["loss_spike", "loss_spike"]
    assert "rollback 2: step 25 loss" in failures[1].what and "; back to checkpoint-20; the replay spiked again; " \
        "skipped steps 24-27's batches" in failures[1].what
    relaunches = [e for e in events(tmp_path / "job") if e.kind == "relaunch"]
    assert [e.resume_step for e in relaunches] == [20, 20]
    assert "hfscale: restart 2" in out and "the replay spiked again" in out

    ref = write_config(tmp_path / "reference", 29712, "deepspeed", {"LEAVE_OUT_STEPS": "24-27"})
    r = launch(ref)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert not (tmp_path / "reference" / "out" / "hfscale_rollbacks.json").exists()
    healed, reference = losses(tmp_path / "job"), losses(tmp_path / "reference")
    assert sorted(healed) == list(range(1, 41))
    assert healed == reference


def test_a_transient_nan_is_rolled_back_and_replayed_to_the_uninterrupted_result(tmp_path):
    """Without recovery: the launch stops at the NaN with exit code 65 and says what a relaunch does; the
    relaunch by hand rolls back to checkpoint-15 and replays."""
    once = tmp_path / "nan-done"
    job = write_config(tmp_path / "job", 29713, "ddp", {"NAN_AT_STEP": "18", "NAN_RANK": "1", "NAN_ONCE": str(once)},
                       restarts=0)
    r = launch(job)
    out = r.stdout + r.stderr
    assert r.returncode == 65, out[-5000:]
    assert ("hfscale: the loss guard stopped training: rollback 1: step 18 loss nan/inf; back to checkpoint-15; "
            "replaying the same data; relaunch to roll back (it resumes from checkpoint-15) and replay the same "
            "data") in out
    assert once.exists() and "checkpoint-18" not in {p.name for p in (tmp_path / "job" / "out").iterdir()}
    r = launch(job)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert "hfscale: resuming from out/checkpoint-15" in r.stdout + r.stderr
    (incident,) = read_rollbacks(tmp_path / "job" / "out").incidents
    assert (incident.kind, incident.step, incident.first_step, incident.value, incident.action, incident.outcome,
            incident.skip, incident.rollback_to) == ("nan", 18, 18, None, "replay", "clean", None, 15), incident

    ref = write_config(tmp_path / "reference", 29714, "ddp", {})
    r = launch(ref)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert losses(tmp_path / "job") == losses(tmp_path / "reference")


def test_too_many_rollbacks_stop_the_job_with_a_verdict(tmp_path):
    job = write_config(tmp_path / "job", 29715, "ddp", {"POISON_STEPS": "24-25"}, guard={"max_rollbacks": 1})
    r = launch(job)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-5000:]
    first, second = read_rollbacks(tmp_path / "job" / "out").incidents
    assert (first.action, second.action) == ("replay", "stop")
    assert second.verdict is not None and "more than training.loss_guard.max_rollbacks 1" in second.verdict
    assert "step 25 (loss" in second.verdict
    assert "hfscale: 2 loss alarms, more than training.loss_guard.max_rollbacks 1" in r.stdout + r.stderr
    assert [e.kind for e in events(tmp_path / "job")][-1] == "gave_up"
    assert not any(p.name.startswith("checkpoint-") and int(p.name.split("-")[1]) >= 24
                   for p in (tmp_path / "job" / "out").iterdir())


def test_the_same_nan_on_every_replay_on_one_host_strikes_it_and_a_spare_takes_its_place(make_cluster, tmp_path):
    """The namespace cluster (pdsh over sshd, one rank per node, DeepSpeed ZeRO-2): node1's rank gets a NaN
    before step 18 every time it trains it. The first alarm replays; the NaN comes back on node1 alone, so
    node1 is struck and the spare node2 takes its place; the replay there is clean and the job finishes."""
    from test_recovery_cluster import node_env

    cluster = make_cluster(3)
    out = tmp_path / "out"
    config = write_config(tmp_path, 29716, "deepspeed", {**node_env(), "NAN_AT_STEP": "18", "NAN_RANK": "1",
                                                          "NAN_HOST": "node1"})
    doc = yaml.safe_load(config.read_text())
    doc["cluster"] = {"hosts": [{"host": "node0", "slots": 1}, {"host": "node1", "slots": 1},
                                {"host": "node2", "slots": 1, "spare": True}], "master_port": 29716}
    doc["runner"] = {"type": "pdsh", "launcher": "torchrun", "run_dir": str(tmp_path / "runs"), "connect_timeout": 5}
    doc["batch"] = {"micro_batch_size": 4, "gradient_accumulation_steps": 2}  # the local tests' global batch: 8
    doc["training"]["output_dir"] = str(out)
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600, env=cluster.env())
    output = r.stdout + r.stderr
    assert r.returncode == 0, output[-6000:]
    first, second = read_rollbacks(out).incidents
    assert (first.kind, first.step, first.hosts, first.action, first.outcome) == \
        ("nan", 18, ["node1"], "replay", "spiked_again"), first
    assert (second.hosts, second.action, second.strike, second.outcome, second.rollback_to) == \
        (["node1"], "strike", ["node1"], "clean", 15), second
    run_events = events(tmp_path)
    relaunches = [e for e in run_events if e.kind == "relaunch"]
    assert [[(x.host, x.spare) for x in e.replaced or ()] for e in relaunches] == [[], [("node1", "node2")]]
    assert relaunches[-1].hosts == ["node0", "node2"] and [e.resume_step for e in relaunches] == [15, 15]
    assert [(e.cause, e.host) for e in run_events if e.kind == "failure"] == [("loss_spike", None),
                                                                             ("loss_spike", "node1")]
    assert "struck node1" in output and "node2 (a spare that passed its probe) takes its place" in output
    assert sorted(losses(tmp_path)) == list(range(1, 41))
