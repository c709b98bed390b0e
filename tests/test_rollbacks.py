"""The loss guard's record across launches (hfscale.checkpoints.rollbacks): what each alarm does (replay,
skip, strike, stop), when an incident is resolved, which checkpoints a start passes over and the launch
moves aside, the record read as hostile input, the ``check`` line, the goodput bucket and ``status``'s line;
the guard's windows saved and restored. Pure: files in tmp_path, no process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from hfscale.checkpoints import rollbacks as rb
from hfscale.checkpoints.resume import decide, latest_checkpoint, scan_output, write_marker
from hfscale.config.errors import ConfigError
from hfscale.core.untrusted import Unreadable
from hfscale.training.loss_guard import GuardSettings, LossGuard

SPIKE = rb.Alarm("spike", "loss", 412, 410, 9.71, 2.41)
KW = dict(patience=3, skip_margin=10, max_rollbacks=3, resumed_from=None, at=1.0)


def after(record: rb.Rollbacks, alarm: rb.Alarm, **kw) -> rb.Incident:
    return rb.judge(record, alarm, **{**KW, **kw}).incidents[-1]


def test_a_first_spike_replays_and_the_same_spike_again_skips_its_window_plus_the_margin():
    one = rb.judge(rb.Rollbacks(), SPIKE, **KW, rollback_to=400)
    assert one.incidents[0].action == "replay" and rb.rollback_before(one) == 410
    two = rb.judge(one, rb.Alarm("spike", "grad_norm", 413, 411, 55.0, 1.2), **{**KW, "resumed_from": 400})
    first, second = two.incidents
    assert first.outcome == "spiked_again"
    assert (second.action, second.skip, second.outcome) == ("skip", (410, 423), None)
    assert rb.rollback_before(two) == 411 and rb.skipped_steps(two) == frozenset(range(410, 424))
    assert rb.resolve(two, 422) is None  # not past the window yet
    done = rb.resolve(two, 423)
    assert done is not None and done.incidents[-1].outcome == "passed" and rb.rollback_before(done) is None
    assert rb.skipped_steps(done) == frozenset(range(410, 424))  # the skips stay for every later start


def test_a_replay_that_passes_the_step_is_clean_and_a_spike_elsewhere_supersedes_the_pending_one():
    one = rb.judge(rb.Rollbacks(), SPIKE, **KW)
    assert rb.resolve(one, 411) is None
    clean = rb.resolve(one, 412)
    assert clean is not None and clean.incidents[0].outcome == "clean" and rb.rollback_before(clean) is None
    earlier = rb.judge(one, rb.Alarm("spike", "loss", 300, 298, 7.0, 2.0), **KW)
    assert [i.outcome for i in earlier.incidents] == ["superseded", None]
    assert earlier.incidents[-1].action == "replay" and rb.rollback_before(earlier) == 298


def test_a_nan_on_one_host_that_comes_back_there_strikes_the_host_then_one_that_follows_the_data_skips():
    nan = rb.Alarm("nan", "loss", 18, 18, None, None, ("node1",))
    one = rb.judge(rb.Rollbacks(), nan, **KW)
    assert one.incidents[-1].action == "replay"
    two = rb.judge(one, nan, **KW)
    assert (two.incidents[-1].action, two.incidents[-1].strike) == ("strike", ["node1"])
    # on the spare that took node1's place the NaN came back, on the spare: the data is to blame
    three = rb.judge(two, rb.Alarm("nan", "loss", 18, 18, None, None, ("spare1",)), **KW)
    assert (three.incidents[-1].action, three.incidents[-1].skip) == ("skip", (18, 28))


def test_a_host_with_a_transient_nan_before_is_struck_at_its_next_one():
    one = rb.judge(rb.Rollbacks(), rb.Alarm("nan", "loss", 18, 18, None, None, ("node1",)), **KW)
    clean = rb.resolve(one, 18)
    assert clean is not None and clean.incidents[0].outcome == "clean"
    again = after(clean, rb.Alarm("nan", "grad_norm", 70, 70, None, None, ("node1", "node2")))
    assert (again.action, again.strike) == ("strike", ["node1"])
    other = after(clean, rb.Alarm("nan", "loss", 70, 70, None, None, ("node2",)))
    assert other.action == "replay"


def test_more_rollbacks_than_allowed_stop_with_a_verdict_naming_steps_values_and_batches():
    r = rb.Rollbacks()
    for step in (100, 100, 300):
        r = rb.judge(r, rb.Alarm("spike", "loss", step, step - 1, 9.0, 2.0), **{**KW, "max_rollbacks": 2})
    last = r.incidents[-1]
    assert last.action == "stop" and last.outcome is None  # a relaunch by hand still rolls back first
    assert last.verdict is not None
    assert "3 loss alarms, more than training.loss_guard.max_rollbacks 2" in last.verdict
    assert "step 300 (loss 9)" in last.verdict and "batches of steps 99-110 skipped" in last.verdict


def test_incident_lines_say_what_status_shows():
    one = rb.judge(rb.Rollbacks(), SPIKE, **KW, rollback_to=400)
    assert rb.incident_line(one.incidents[0]) == ("rollback 1: step 412 loss 9.71 vs median 2.41 (x4.0), since step "
                                                  "410; back to checkpoint-400; replaying the same data")
    two = rb.judge(one, SPIKE, **KW, rollback_to=400)
    assert rb.incident_line(two.incidents[1]).endswith(
        "back to checkpoint-400; the replay spiked again; skipped steps 410-422's batches")
    nan = after(rb.Rollbacks(), rb.Alarm("nan", "grad_norm", 5, 5, None, None, ("node1",)))
    assert rb.incident_line(nan) == ("rollback 1: step 5 gradient norm nan/inf on node1; back to step 0 (no "
                                     "checkpoint before it); replaying the same data")


def test_the_record_round_trips_and_hostile_files_are_refused_by_name(tmp_path):
    assert rb.read_rollbacks(tmp_path) == rb.Rollbacks()  # none: an empty record
    one = rb.judge(rb.Rollbacks(), SPIKE, **KW)
    rb.write_rollbacks(tmp_path, one)
    assert rb.read_rollbacks(tmp_path) == one
    path = tmp_path / rb.ROLLBACKS_FILE
    for bad in ('{"format": 1, "incidents": [{"n": "1"}]}', "[1, 2", '{"format": 2}',
                json.dumps({"incidents": [{**one.incidents[0].model_dump(mode="json"), "step": -1}]})):
        path.write_text(bad)
        with pytest.raises(Unreadable, match=rb.ROLLBACKS_FILE):
            rb.read_rollbacks(tmp_path)
    path.write_bytes(b" " * (rb.ROLLBACKS_CAP + 1))
    with pytest.raises(Unreadable):
        rb.read_rollbacks(tmp_path)
    path.unlink()
    elsewhere = tmp_path.parent / "elsewhere.json"
    rb.write_rollbacks(tmp_path.parent, one)
    os.replace(tmp_path.parent / rb.ROLLBACKS_FILE, elsewhere)
    path.symlink_to(elsewhere)
    with pytest.raises(Unreadable):
        rb.read_rollbacks(tmp_path)


def checkpoint(out: Path, step: int) -> Path:
    """A small complete Trainer checkpoint (no DeepSpeed): state, model, optimizer, scheduler, RNG, marker."""
    import torch

    c = out / f"checkpoint-{step}"
    c.mkdir(parents=True)
    (c / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": 100, "log_history": []}))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(c / "model.safetensors"))
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({"x": 1}, c / name)
    write_marker(c, step, 1)
    return c


def test_starts_pass_over_checkpoints_saved_after_the_spike_began_and_the_launch_moves_them_aside(tmp_path):
    out = tmp_path / "out"
    for step in (10, 20, 30):
        checkpoint(out, step)
    assert latest_checkpoint(out) == str(out / "checkpoint-30")
    rb.write_rollbacks(out, rb.judge(rb.Rollbacks(), rb.Alarm("spike", "loss", 27, 25, 9.0, 2.0), **KW))
    with pytest.warns(UserWarning, match="checkpoint-30: saved at or after step 25"):
        assert latest_checkpoint(out) == str(out / "checkpoint-20")
    scan = scan_output(out, 1)
    assert scan.resume == str(out / "checkpoint-20") and scan.rolled_back == ("checkpoint-30",)
    d = decide(scan, 100)
    assert (d.action, d.rolled_back, d.set_aside) == ("resume", ("checkpoint-30",), ())
    # every checkpoint after the spike (a first run that spiked before its first save): fresh, all moved aside
    rb.write_rollbacks(out, rb.judge(rb.Rollbacks(), rb.Alarm("spike", "loss", 6, 5, 9.0, 2.0), **KW))
    d = decide(scan_output(out, 1), 100)
    assert (d.action, d.rolled_back) == ("fresh", ("checkpoint-10", "checkpoint-20", "checkpoint-30"))


def test_a_launch_plan_moves_the_rolled_back_checkpoints_and_refuses_an_unreadable_record(tmp_path):
    from hfscale.launch.build import ROLLED_BACK_DIR, build_plan
    from hfscale.launch.context import LaunchContext
    from hfscale.rules.config_file import load_job

    out = tmp_path / "out"
    for step in (10, 20, 30):
        checkpoint(out, step)
    rb.write_rollbacks(out, rb.judge(rb.Rollbacks(), rb.Alarm("spike", "loss", 27, 25, 9.0, 2.0), **KW))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"name": "g", "cluster": {"nproc_per_node": 1}, "distributed": {"backend": "ddp"},
                                   "precision": "no", "batch": {"micro_batch_size": 1},
                                   "training": {"output_dir": str(out), "max_steps": 100}}))
    job = load_job(cfg)

    def ctx() -> LaunchContext:
        return LaunchContext(cwd=str(tmp_path), python="/usr/bin/python3", job_id="20261129-000000-abcdef",
                             output=scan_output(out, 1))

    plan = build_plan(job, ctx())
    assert plan.moves == ((str(out / "checkpoint-30"), str(out / ROLLED_BACK_DIR / ctx().job_id / "checkpoint-30")),)
    assert any("rolls back: checkpoint-30" in n for n in plan.notes)
    (out / rb.ROLLBACKS_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="training.output_dir.*hfscale_rollbacks.json"):
        build_plan(job, ctx())


def test_check_says_what_is_guarded(tmp_path):
    from hfscale.cli.check_summary import loss_guard_line
    from hfscale.rules.config_file import load_job

    def line(**over) -> str:
        doc = {"name": "g", "cluster": {"nproc_per_node": 1}, "distributed": {"backend": "ddp"}, "precision": "no",
               "batch": {"micro_batch_size": 1}, "training": {"max_steps": 10}}
        for key, value in over.items():
            doc.setdefault(key, {}).update(value)
        (tmp_path / "j.yaml").write_text(yaml.safe_dump(doc))
        return loss_guard_line(load_job(tmp_path / "j.yaml"))

    assert line() == ("every step: NaN/inf; loss > 2x median (+0.5) or grad norm > 10x, 3 steps running; an alarm "
                      "stops the job unsaved (recovery.max_restarts 0); a relaunch rolls back and replays")
    assert line(recovery={"max_restarts": 2}).endswith(
        "an alarm rolls back before it, replays, skips its batches (+10) if it comes back; at most 3 rollbacks")
    assert line(training={"max_steps": 10, "loss_guard": {"enabled": False}}) == "off"
    assert line(training={"max_steps": 10, "loss_guard": {"loss_factor": None, "grad_norm_factor": None}}).startswith(
        "every step: NaN/inf; an alarm")
    with pytest.raises(ConfigError, match="training.loss_guard"):
        line(training={"max_steps": 10, "loss_guard": {"warmup": 200}})
    with pytest.raises(ConfigError, match="training.loss_guard.loss_factor"):
        line(training={"max_steps": 10, "loss_guard": {"loss_factor": 1.0}})


def test_the_guards_windows_come_back_from_its_state_and_bad_state_is_left_out():
    settings = GuardSettings(window=10, warmup=5, patience=2)
    g = LossGuard(settings)
    for step in range(1, 9):
        g.observe(step, 2.0 + 0.01 * step, 1.0)
    g.observe(9, 9.0, 1.0)  # one value above: running, not yet an alarm
    assert g.suspect
    again = LossGuard(settings)
    again.restore(json.loads(json.dumps(g.state())))
    assert again.suspect and again.observe(10, 9.5, 1.0) is not None  # the run goes on where it was
    fresh = LossGuard(settings)
    fresh.restore({"loss": {"window": ["x", True, float("nan"), 2.0], "run": [[1, "y"], 5]}, "grad_norm": 3})
    assert not fresh.suspect and fresh.observe(11, 9.0, 1.0) is None  # too few values left to judge


def test_goodput_counts_a_rollback_and_status_shows_its_line(tmp_path):
    from hfscale.launch.recovery.timeline import record_event
    from hfscale.runs.goodput import goodput, status_lines
    from hfscale.launch.recovery.timeline import read_timeline

    what = rb.LOSS_GUARD_SAID + "rollback 1: step 25 loss 6.2 vs median 4 (x1.5), since step 24; back to checkpoint-20"
    for e in (dict(kind="launch", attempt=0, at=1_800_000_000.0, resume_step=None),
              dict(kind="training", attempt=0, at=1_800_000_005.0, step=1),
              dict(kind="failure", attempt=0, at=1_800_000_030.0, cause="loss_spike", what=what, step=25, step_time=1.0),
              dict(kind="stopped", attempt=0, at=1_800_000_032.0),
              dict(kind="relaunch", attempt=1, at=1_800_000_033.0, resume_step=20),
              dict(kind="training", attempt=1, at=1_800_000_040.0, step=21, resume_step=20),
              dict(kind="finished", attempt=1, at=1_800_000_060.0, step=40, step_time=1.0)):
        record_event(str(tmp_path), **e)
    g = goodput(read_timeline(tmp_path))
    # detection (a step time: 1 s), stop 2 s, restart 8 s, the 5 steps replayed 5 s
    assert g is not None and g.lost["rollback"] == pytest.approx(1 + 2 + 8 + 5)
    assert g.lost["recompute"] == 0 and g.lost["restart"] == 0
    lines = status_lines(tmp_path)
    assert "rollback     rollback 1: step 25 loss 6.2 vs median 4 (x1.5), since step 24; back to checkpoint-20" in lines
