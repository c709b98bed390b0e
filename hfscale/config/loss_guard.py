"""The ``training.loss_guard`` section: what counts as a loss spike or a NaN, and how far healing goes.

The judgement itself is hfscale.training.loss_guard (the defaults are its ``GuardSettings``'s, chosen
never to fire on an ordinary run: tests/test_loss_guard.py); what an alarm does across launches is
hfscale.checkpoints.rollbacks.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from hfscale.config.base import PositiveInt, Strict


class LossGuardConfig(Strict):
    """Every optimizer step, on every rank: a NaN or infinite loss or gradient norm, or a spike (the loss or
    the gradient norm above a multiple of its rolling median for ``patience`` steps running), stops the job
    without saving; it is rolled back to the newest checkpoint saved before the spike, replayed once on
    the same data, and the spike's batches are skipped if it comes back (the built-in entry point, a Trainer
    script run by hfscale launch, and a script that calls hfscale.instrument(trainer))."""

    enabled: bool = Field(True, description="Watch the loss and the gradient norm. False: off (no per-step "
                          "all_reduce).")
    window: PositiveInt = Field(100, le=100_000, description="Ordinary values in the rolling median.")
    warmup: PositiveInt = Field(20, le=100_000, description="Values in the window before a spike is judged (the loss "
                                "falls fast at first).")
    patience: PositiveInt = Field(3, le=10_000, description="Steps running above the threshold before a spike fires.")
    loss_factor: float | None = Field(2.0, gt=1, le=1e6, description="A loss spike: above this multiple of the median. "
                                      "Null: loss spikes not judged (a NaN still is).")
    loss_rise: float = Field(0.5, ge=0, le=1e6, description="... and at least this far above it (nats): near a loss "
                             "of zero a factor alone fires on noise.")
    grad_norm_factor: float | None = Field(10.0, gt=1, le=1e6, description="A gradient-norm spike: above this "
                                           "multiple of the median. Null: not judged (a NaN still is).")
    nan: bool = Field(True, description="A NaN or infinite loss or gradient norm fires at once.")
    skip_margin: int = Field(10, ge=0, le=100_000, description="Steps' batches skipped after a spike's window when "
                             "the replay spiked again (the data is to blame).")
    max_rollbacks: PositiveInt = Field(3, le=1000, description="Rollbacks before the job stops with a verdict "
                                       "naming the steps, the values and the batches.")

    @model_validator(mode="after")
    def _warmup_in_window(self) -> "LossGuardConfig":
        if self.warmup > self.window:
            raise ValueError(f"warmup {self.warmup} is more than window {self.window}: the window never holds it")
        return self
