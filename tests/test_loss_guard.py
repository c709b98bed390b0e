"""The loss guard's judgement (hfscale.training.loss_guard, issue 39's detection): NaNs and infinities at
once, spikes only when they last, no alarm on ordinary curves (synthetic ones here, seeded; a real
run's per-step losses in tests/data/loss_curves/)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from hfscale.training.loss_guard import Alarm, GuardSettings, LossGuard

CURVES = Path(__file__).parent / "data" / "loss_curves"


def pretraining_curve(steps: int, seed: int) -> list[tuple[float, float]]:
    """(loss, grad norm) per step: a loss falling from 5.5 to 2, each step's batch noisy (log-normal, sigma
    0.15: a 4-sigma batch is 1.8x), the gradient norm noisier (sigma 0.5)."""
    rng = random.Random(seed)
    return [((2.0 + 3.5 * math.exp(-t / 400)) * math.exp(rng.gauss(0, 0.15)), math.exp(rng.gauss(0, 0.5)))
            for t in range(steps)]


def feed(guard: LossGuard, values, start: int = 1) -> list[Alarm]:
    out = []
    for i, v in enumerate(values, start):
        loss, grad = v if isinstance(v, tuple) else (v, None)
        a = guard.observe(i, loss, grad)
        if a is not None:
            out.append(a)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_ordinary_noisy_curves_never_fire(seed):
    assert feed(LossGuard(), pretraining_curve(20_000, seed)) == []


def test_a_fine_tune_near_zero_loss_does_not_fire_on_its_noise():
    """A loss of 0.02 whose noisy batches reach 0.1 (5x the median): the rise of 0.5 keeps it quiet."""
    rng = random.Random(7)
    losses = [0.02 * math.exp(rng.gauss(0, 0.6)) for _ in range(5000)]
    assert max(losses) > 5 * 0.02
    assert feed(LossGuard(), losses) == []


def test_a_spike_that_lasts_fires_at_its_patience_and_says_where_it_began():
    guard = LossGuard()
    assert feed(guard, [2.4] * 200) == []
    assert guard.observe(201, 9.6) is None and guard.observe(202, 9.7) is None
    alarm = guard.observe(203, 9.71)
    assert alarm == Alarm("spike", "loss", 203, 9.71, 201, 2.4)
    assert alarm.line() == "loss spike at step 203: 9.71 vs median 2.4 (x4.0), above it since step 201"


def test_a_blip_shorter_than_the_patience_stays_out_of_the_window():
    """Two high steps, then ordinary ones: no alarm; the blip did not enter the median, so a later spike
    is judged against the same 2.4."""
    guard = LossGuard(GuardSettings(window=10, warmup=5))
    feed(guard, [2.4] * 10)
    assert feed(guard, [9.0, 9.0, 2.4], start=11) == []
    assert feed(guard, [5.0, 5.0, 5.0], start=14)[0].median == 2.4


def test_a_loss_that_settles_higher_for_good_is_judged_against_the_old_median():
    """The window takes no outlier: a loss that jumps to 3x and stays is a spike however long it lasts."""
    guard = LossGuard(GuardSettings(patience=50))
    feed(guard, [2.0] * 100)
    alarms = feed(guard, [6.0] * 60, start=101)
    assert [a.step for a in alarms][:1] == [150] and alarms[0].first_step == 101


def test_nan_and_infinity_fire_at_once_even_in_warmup():
    guard = LossGuard()
    assert guard.observe(1, float("nan")).kind == "nan"
    alarm = LossGuard().observe(2, 2.0, float("inf"))
    assert (alarm.kind, alarm.measure, alarm.step) == ("nan", "grad_norm", 2)
    assert alarm.line() == "gradient norm inf at step 2"
    assert LossGuard(GuardSettings(nan=False)).observe(1, float("nan")) is None


def test_a_nan_during_a_spike_names_the_spikes_first_step():
    guard = LossGuard()
    feed(guard, [2.0] * 50)
    guard.observe(51, 8.0)
    assert guard.observe(52, float("nan")).first_step == 51


def test_gradient_norm_spikes_and_the_factors_can_be_turned_off():
    curve = [(2.0, 1.0)] * 100 + [(2.0, 50.0)] * 3
    alarms = feed(LossGuard(), curve)
    assert [(a.measure, a.step, a.first_step) for a in alarms] == [("grad_norm", 103, 101)]
    assert feed(LossGuard(GuardSettings(grad_norm_factor=None)), curve) == []
    assert feed(LossGuard(GuardSettings(loss_factor=None)), [2.0] * 100 + [20.0] * 5) == []


@pytest.mark.parametrize("bad", [dict(window=0), dict(warmup=0), dict(warmup=101), dict(patience=0),
                                 dict(loss_factor=1.0), dict(grad_norm_factor=float("nan")), dict(loss_rise=-1.0)])
def test_settings_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="loss guard: "):
        GuardSettings(**bad)


def test_the_median_is_the_windows():
    guard = LossGuard(GuardSettings(window=4, warmup=4, loss_rise=0.0))
    feed(guard, [1.0, 2.0, 3.0, 4.0, 100.0])  # 100 is an outlier (x40 of 2.5): kept out
    assert guard._loss.window.median() == 2.5
    feed(guard, [3.0], start=6)  # ordinary: in, and 1.0 out
    assert list(guard._loss.window.order) == [2.0, 3.0, 4.0, 3.0] and guard._loss.window.median() == 3.0


def test_real_runs_per_step_losses_fire_no_alarm():
    """Every curve kept in tests/data/loss_curves (each file says how it was made): no alarm."""
    files = sorted(CURVES.glob("*.json"))
    assert files
    for f in files:
        doc = json.loads(f.read_text())
        assert len(doc["loss"]) >= 100, f
        grads = doc.get("grad_norm") or [None] * len(doc["loss"])
        assert feed(LossGuard(), list(zip(doc["loss"], grads))) == [], f
