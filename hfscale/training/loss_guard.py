"""The loss guard's judgement (issue 39, its first part): on each optimizer step, is the loss or the
gradient norm NaN or infinite, or has it spiked?

A spike is a value above ``factor`` times the median of the last ``window`` ordinary values (and, for
the loss, more than ``loss_rise`` above it: near a loss of zero a factor alone fires on noise), for
``patience`` steps running. Values judged outliers stay out of the window, so a spike that lasts does
not raise the median it is judged against. Nothing is judged before ``warmup`` values are in the
window: the loss falls fast at first. A NaN or an infinity fires at once.

Pure and standard library only: :class:`LossGuard` is fed ``(step, loss, grad_norm)`` and answers an
:class:`Alarm` or None; its windows go into each checkpoint (``state``/``restore``) so that a replay
from that checkpoint judges its steps as the run that spiked did. What an alarm does on the ranks is
hfscale.training.callbacks.loss_guard, across launches hfscale.checkpoints.rollbacks.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GuardSettings:
    """The thresholds; defaults chosen never to fire on an ordinary run (tests/test_loss_guard.py)."""

    window: int = 100  # ordinary values in the rolling median
    warmup: int = 20  # values in the window before a spike is judged
    patience: int = 3  # steps running above the threshold
    loss_factor: float | None = 2.0  # None: loss spikes not judged (NaN still is)
    loss_rise: float = 0.5  # and at least this far above the median (the loss's own unit, nats)
    grad_norm_factor: float | None = 10.0  # None: gradient norm spikes not judged (NaN still is)
    nan: bool = True  # a NaN or infinite loss or gradient norm fires at once

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.warmup <= self.window or self.patience < 1:
            raise ValueError(f"loss guard: window {self.window}, warmup {self.warmup}, patience {self.patience}: "
                             "need 1 <= warmup <= window and patience >= 1")
        for name in ("loss_factor", "grad_norm_factor"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 1.0):
                raise ValueError(f"loss guard: {name} {v}: a factor above 1, or None")
        if not (math.isfinite(self.loss_rise) and self.loss_rise >= 0):
            raise ValueError(f"loss guard: loss_rise {self.loss_rise}: 0 or more")


Measure = Literal["loss", "grad_norm"]


class LossAlarm(RuntimeError):
    """The loss guard stopped training (raised out of ``trainer.train()`` on every rank at the same step);
    ``<output_dir>/hfscale_rollbacks.json`` says what the next start does."""


@dataclass(frozen=True)
class Alarm:
    """What fired: a NaN/infinity or a spike, of which value, at which step; for a spike the median it
    was judged against, and the step its run of outliers began (where a rollback must go before)."""

    kind: Literal["nan", "spike"]
    measure: Measure
    step: int
    value: float
    first_step: int
    median: float | None = None

    def line(self) -> str:
        name = "loss" if self.measure == "loss" else "gradient norm"
        if self.kind == "nan":
            return f"{name} {self.value} at step {self.step}"
        assert self.median is not None
        ratio = f"x{self.value / self.median:.1f}" if self.median > 0 else "over a median of 0"
        return (f"{name} spike at step {self.step}: {self.value:.4g} vs median {self.median:.4g} ({ratio}), "
                f"above it since step {self.first_step}")


class _Rolling:
    """The last ``size`` ordinary values, kept sorted as well for the median."""

    def __init__(self, size: int):
        self.order: deque[float] = deque()
        self.sorted: list[float] = []
        self.size = size

    def add(self, v: float) -> None:
        self.order.append(v)
        bisect.insort(self.sorted, v)
        if len(self.order) > self.size:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]

    def median(self) -> float:
        s, n = self.sorted, len(self.sorted)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class _Watch:
    """One measure's window and its current run of outliers."""

    def __init__(self, measure: Measure, factor: float | None, rise: float, settings: GuardSettings):
        self.measure, self.factor, self.rise, self.settings = measure, factor, rise, settings
        self.window = _Rolling(settings.window)
        self.run: list[tuple[int, float]] = []  # (step, value) of the outliers running

    def observe(self, step: int, value: float) -> Alarm | None:
        if not math.isfinite(value):
            if self.settings.nan:
                return Alarm("nan", self.measure, step, value, self.run[0][0] if self.run else step)
            return None
        if self.factor is None or len(self.window.order) < self.settings.warmup:
            self.window.add(value)
            return None
        median = self.window.median()
        if value > self.factor * median and value > median + self.rise:
            self.run.append((step, value))
            if len(self.run) >= self.settings.patience:
                return Alarm("spike", self.measure, step, value, self.run[0][0], median)
            return None
        self.run.clear()  # a blip shorter than the patience: its values stay out of the window
        self.window.add(value)
        return None

    def state(self) -> dict[str, list]:
        return {"window": list(self.window.order), "run": [list(r) for r in self.run]}

    def restore(self, state: dict) -> None:
        self.window = _Rolling(self.settings.window)
        for v in state.get("window", [])[-self.settings.window:]:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self.window.add(float(v))
        self.run = [(int(s), float(v)) for s, v in state.get("run", [])[:self.settings.patience]
                    if isinstance(s, int) and isinstance(v, (int, float)) and not isinstance(v, bool)]


class LossGuard:
    """Feed it every optimizer step; it answers the first alarm of that step (the loss's before the
    gradient norm's), or None."""

    def __init__(self, settings: GuardSettings | None = None):
        self.settings = s = settings or GuardSettings()
        self._loss = _Watch("loss", s.loss_factor, s.loss_rise, s)
        self._grad = _Watch("grad_norm", s.grad_norm_factor, 0.0, s)

    def observe(self, step: int, loss: float, grad_norm: float | None = None) -> Alarm | None:
        alarm = self._loss.observe(step, float(loss))
        if grad_norm is not None:
            alarm = alarm or self._grad.observe(step, float(grad_norm))
        return alarm

    @property
    def suspect(self) -> bool:
        """Values above the threshold are running (not yet ``patience`` of them): a checkpoint saved now
        may hold the start of a spike."""
        return bool(self._loss.run or self._grad.run)

    def state(self) -> dict[str, dict[str, list]]:
        """The windows and runs, JSON-ready (saved with each checkpoint)."""
        return {"loss": self._loss.state(), "grad_norm": self._grad.state()}

    def restore(self, state: object) -> None:
        """Take the windows back from :meth:`state`'s output (what does not parse is left out)."""
        if not isinstance(state, dict):
            return
        for key, watch in (("loss", self._loss), ("grad_norm", self._grad)):
            part = state.get(key)
            if isinstance(part, dict):
                try:
                    watch.restore(part)
                except (TypeError, ValueError):
                    watch.restore({})
