"""The progress line across a restart (hfscale.launch.attempt.console.show_progress, AttemptRate): the rate
and the ETA count only rank 0's current start, never the stop and the restart. Rank 0's numbers
are fed as they would be read from progress/metrics.json, on a fake clock; no process starts."""

from __future__ import annotations

import types

import pytest

from hfscale.core.records import Rank0Metrics as M
from hfscale.launch.attempt import console


def shown(monkeypatch, seen: list[tuple[float, M]]) -> list[str]:
    """The lines show_progress shows (as on a terminal) for rank 0's numbers read at these times."""
    feed = list(seen)
    clock = [0.0]

    def read_metrics(run_dir):
        clock[0], m = feed.pop(0)
        return m

    class Done:
        def wait(self, timeout: float) -> bool:
            return len(feed) == 1  # the last reading is the one made when the run ended

    monkeypatch.setattr(console, "read_metrics", read_metrics)
    monkeypatch.setattr(console, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    lines: list[str] = []
    console.show_progress("run", Done(), lines.append, tty=True)  # type: ignore[arg-type]
    return lines


def test_torchrun_restart_starts_the_rate_and_eta_again(monkeypatch):
    # 1 step/s, then the ranks die at step 24; torchrun restarts them (restart 1) 90 s later from
    # checkpoint-20, and they go on at 1 step/s: the ETA is 170 s at step 30, not the 16 min that
    # counting from the first start (20 steps in 110 s) would say
    lines = shown(monkeypatch, [
        (0, M(step=10, max_steps=200, restart=0)), (10, M(step=20, max_steps=200, restart=0)),
        (14, M(step=24, max_steps=200, restart=0)),
        (100, M(step=20, max_steps=200, restart=1)), (110, M(step=30, max_steps=200, restart=1))])
    assert lines == ["hfscale: step 10/200 (5%)", "hfscale: step 20/200 (10%) | ETA 3m00s",
                     "hfscale: step 24/200 (12%) | ETA 2m56s", "hfscale: step 20/200 (10%)",
                     "hfscale: step 30/200 (15%) | ETA 2m50s"]


def test_a_restart_resumed_at_the_step_last_seen_starts_again_too(monkeypatch):
    # the restart resumed exactly where the line last was (step 20): only its restart count says so
    lines = shown(monkeypatch, [
        (0, M(step=10, max_steps=200, restart=0)), (10, M(step=20, max_steps=200, restart=0)),
        (300, M(step=20, max_steps=200, restart=1)), (310, M(step=30, max_steps=200, restart=1))])
    assert lines[-1] == "hfscale: step 30/200 (15%) | ETA 2m50s"


def test_a_step_going_back_starts_the_rate_again():
    from hfscale.launch.attempt.console import AttemptRate

    # a plain loop reports no restart count: a step below the last one seen is a resume
    rate = AttemptRate()
    assert rate(0, 10, None) is None and rate(10, 20, None) == 1.0
    assert rate(100, 15, None) is None  # resumed from checkpoint-15
    assert rate(110, 25, None) == 1.0
    assert rate(120, 25, None) == 10 / 20  # the same step later: slower, still this start's


def test_rank_0s_first_window_after_a_restart_leaves_the_start_up_out(monkeypatch):
    """MetricsCallback on a relaunch resumed at step 60: train() begins at t=0, the first step ends
    at t=10 (the start-up: lazy set-up, the first batches), then a step every 0.05 s. The report at
    step 65 counts 0.05 s a step, not 2.04 s (10.2 s over 5 steps), and tokens from the resumed
    count (the checkpoint's num_input_tokens_seen), not from 0."""
    from hfscale.training.callbacks import collectives, reporting

    clock = [0.0]
    monkeypatch.setattr(reporting, "time", types.SimpleNamespace(perf_counter=lambda: clock[0], time=lambda: 1.8e9))
    monkeypatch.setattr(collectives, "all_gather", lambda mine: [mine])
    monkeypatch.setattr(collectives, "peak_memory_mb", lambda device: 100.0)
    one = types.SimpleNamespace(non_data_parallel_size=1)
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(parallelism_config=one))
    metrics = reporting.MetricsCallback(every=5, seq_len=64, n_params=1000, trainer=trainer)
    args = types.SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=1, device="cpu",
                                 logging_steps=5, include_num_input_tokens_seen="no", output_dir="unused")
    state = types.SimpleNamespace(global_step=60, max_steps=200, logging_steps=5, num_input_tokens_seen=15360,
                                  is_world_process_zero=False, epoch=0.3)
    metrics.on_train_begin(args, state, None)
    for step, at in ((61, 10.0), (62, 10.05), (63, 10.1), (64, 10.15), (65, 10.2)):
        clock[0], state.global_step = at, step
        metrics.on_step_end(args, state, None)
    r = metrics.last
    assert r["step"] == 65 and r["window_steps"] == 4
    assert r["step_time_s"] == pytest.approx(0.05)
    assert r["tokens_per_s"] == pytest.approx(4 * 64 / 0.05) and r["eta_s"] == pytest.approx(135 * 0.05)
