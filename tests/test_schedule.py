"""The learning-rate schedules hfscale computes for its resume notes, against transformers' own
schedulers, and the note a launch prints when a resumed run's schedule changed."""

from __future__ import annotations

import pytest
import torch
from transformers import get_scheduler

from hfscale.checkpoints.lr_schedule import rate, schedule_note
from hfscale.checkpoints.resume import SavedState
from hfscale.config.model import TrainingConfig


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
@pytest.mark.parametrize("warmup", [0, 7])
def test_rates_equal_transformers_schedulers(kind, warmup):
    t = TrainingConfig(max_steps=50, learning_rate=3e-4, lr_scheduler_type=kind, warmup_steps=warmup)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.learning_rate)
    sched = get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=50)
    real = []
    for _ in range(50):
        real.append(opt.param_groups[0]["lr"])  # the rate optimizer step k trains at
        opt.step()
        sched.step()
    assert [rate(t, k) for k in range(1, 51)] == pytest.approx(real, rel=1e-12, abs=1e-18)


def test_note_when_max_steps_grows_past_a_finished_linear_schedule():
    # measured (tests/test_user_script.py): saved at 20 of 20 with 5e-05, resumed with 30: step 25 at 2e-04
    t = TrainingConfig(max_steps=30, learning_rate=1e-3)
    state = SavedState(global_step=20, max_steps=20, num_train_epochs=1.0, last_lr=(20, 5e-05))
    assert schedule_note(t, state, "out/checkpoint-20") == (
        "the schedule changed since out/checkpoint-20 (max_steps 20 -> 30; learning rate at step 20: 5e-05 then, "
        "0.000367 with this YAML): the Trainer rebuilds the linear schedule from this YAML and continues it at step "
        "20, so step 21 trains at 0.000333")
    assert rate(t, 25) == pytest.approx(2e-4)


def test_no_note_when_the_schedule_is_the_same_and_a_note_for_a_new_peak_rate():
    t = TrainingConfig(max_steps=20, learning_rate=1e-3)
    same = SavedState(global_step=10, max_steps=20, num_train_epochs=1.0, last_lr=(10, rate(t, 10)))
    assert schedule_note(t, same, "c") is None
    faster = TrainingConfig(max_steps=20, learning_rate=2e-3)
    assert schedule_note(faster, same, "c") == (
        "the schedule changed since c (learning rate at step 10: 0.00055 then, 0.0011 with this YAML): the Trainer "
        "rebuilds the linear schedule from this YAML and continues it at step 10, so step 11 trains at 0.001")
    epochs = TrainingConfig(num_train_epochs=3.0)
    assert schedule_note(epochs, SavedState(10, 100, 2.0, None), "c") == (
        "c was saved by a run of 2 epochs; with 3 the Trainer rebuilds the linear schedule for the new length and "
        "continues it at step 10")
