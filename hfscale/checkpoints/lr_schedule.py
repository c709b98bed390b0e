"""The HF Trainer's learning-rate schedules as numbers, to say what a resumed run will do.

The Trainer saves a schedule's step count, not its shape: on resume it builds the schedule anew
from the current arguments (max_steps, warm-up, type, peak rate) and continues it at the saved
step. Measured with transformers 5.23 and DeepSpeed ZeRO-2: a linear schedule saved at step 20 of
20 (rate 5e-05) and resumed with max_steps 30 trains step 21 at 3.3e-04, the new schedule's value,
not at the old run's rate. :func:`schedule_note` says so before anything starts.

The formulas are transformers.optimization's (linear, cosine with half a cycle, constant,
constant with warm-up); the rate of optimizer step ``k`` (1-based) is ``peak * factor(k - 1)``.
"""

from __future__ import annotations

import math

from hfscale.checkpoints.resume import SavedState
from hfscale.config.model import TrainingConfig


def factor(kind: str, step: int, warmup: int, total: int) -> float:
    """The schedule's multiplier of the peak rate after ``step`` optimizer steps."""
    if kind != "constant" and step < warmup:
        return step / max(1, warmup)
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown schedule {kind!r}")


def rate(t: TrainingConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based) under ``t`` (needs ``t.max_steps``)."""
    assert t.max_steps is not None
    return t.learning_rate * factor(t.lr_scheduler_type, step - 1, t.warmup_steps, t.max_steps)


def schedule_note(t: TrainingConfig, state: SavedState, checkpoint: str) -> str | None:
    """What the restored schedule does when it differs from the run that saved ``checkpoint``, or None."""
    if t.max_steps is None:
        if state.num_train_epochs and not math.isclose(state.num_train_epochs, t.num_train_epochs):
            return (f"{checkpoint} was saved by a run of {state.num_train_epochs:g} epochs; with "
                    f"{t.num_train_epochs:g} the Trainer rebuilds the {t.lr_scheduler_type} schedule for the new "
                    f"length and continues it at step {state.global_step}")
        return None
    changed = []
    if state.max_steps and state.max_steps != t.max_steps:
        changed.append(f"max_steps {state.max_steps} -> {t.max_steps}")
    if state.last_lr is not None:
        step, logged = state.last_lr
        ours = rate(t, step)
        if not math.isclose(ours, logged, rel_tol=1e-3, abs_tol=1e-15):
            changed.append(f"learning rate at step {step}: {logged:.3g} then, {ours:.3g} with this YAML")
    if not changed:
        return None
    after = state.global_step + 1
    return (f"the schedule changed since {checkpoint} ({'; '.join(changed)}): the Trainer rebuilds the "
            f"{t.lr_scheduler_type} schedule from this YAML and continues it at step {state.global_step}, so step "
            f"{after} trains at {rate(t, after):.3g}")
