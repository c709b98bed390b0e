"""ProgressCallback: each rank reports its optimizer steps to hfscale's hang watchdog."""

from __future__ import annotations

import functools
import os
import sys

from transformers import TrainerCallback

from hfscale.training import heartbeat as progress


# the Trainer's log keys -> the names in progress/metrics.json
_REPORTED = {"loss": "loss", "learning_rate": "learning_rate", "grad_norm": "grad_norm", "epoch": "epoch",
             "hfscale/tokens_per_s": "tokens_per_s", "hfscale/eta_s": "eta_s", "hfscale/mfu": "mfu",
             "train_loss": "train_loss"}  # the Trainer's last log: the mean loss over this run's steps


def restart_count() -> int:
    """Which start of this process's ranks this is within one launch: torchrun's restarts of its
    workers (``TORCHELASTIC_RESTART_COUNT``), 0 for the first or elsewhere."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return int(count) if count.isdigit() and len(count) < 7 else 0


def dropped_engine() -> str | None:
    """The distributed type accelerate runs this process with when ``accelerate launch`` was told
    FSDP (ACCELERATE_USE_FSDP) but the Accelerator is not FSDP: accelerate uses FSDP on GPUs and
    other accelerators only, and on CPU silently trains DDP. None when nothing was dropped."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() != "true":
        return None
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if not AcceleratorState._shared_state:  # no Accelerator in this process (a Trainer makes one first)
        return None
    kind = AcceleratorState().distributed_type
    return None if kind == DistributedType.FSDP else str(kind.value)


def _time_checkpoint_loads() -> None:
    """DeepSpeed's engine: its checkpoint load starts the "checkpoint" part of a start and ends it
    (hfscale.training.heartbeat.PHASES); only when DeepSpeed is already imported, wrapped once."""
    engine = getattr(sys.modules.get("deepspeed.runtime.engine"), "DeepSpeedEngine", None)
    if engine is None or getattr(engine.load_checkpoint, "_hfscale_timed", False):
        return
    original = engine.load_checkpoint

    @functools.wraps(original)
    def load_checkpoint(self, *args, **kwargs):
        progress.phase("engine")
        try:
            return original(self, *args, **kwargs)
        finally:
            progress.phase("checkpoint")

    load_checkpoint._hfscale_timed = True  # type: ignore[attr-defined]
    engine.load_checkpoint = load_checkpoint


class ProgressCallback(TrainerCallback):
    """After every optimizer step, ``hfscale.training.heartbeat.step(global_step)``: one small file per rank
    in the run directory (nothing outside ``hfscale launch``); after each evaluation batch and save,
    ``hfscale.training.heartbeat.alive()``. No collective, no device sync. Rank 0 also marks the parts
    of this start (``heartbeat.phase``): its model built, its engine and checkpoint, its first batch
    and its first step."""

    _first: tuple[bool, bool] = (False, False)  # this process's first step began, ended

    def __init__(self) -> None:  # made with the Trainer (hfscale.instrument, the trainer hook)
        progress.phase("model")  # a user script's: its imports and model, built before its Trainer
        _time_checkpoint_loads()

    def on_train_begin(self, args, state, control, **kwargs):
        progress.phase("engine")  # no checkpoint loaded by DeepSpeed: engine and checkpoint end here
        progress.phase("checkpoint")
        # rank 0's numbers start again with this start: the progress line counts its rate from here,
        # and the previous start's tokens/s and ETA are gone (hfscale.launch.attempt.console.AttemptRate);
        # ``resumed``, before the progress file: the supervisor's step watch reads it when that moves
        progress.report(step=state.global_step, max_steps=state.max_steps, restart=restart_count(),
                        resumed=state.global_step)
        progress.step(state.global_step)  # a resumed run starts where its checkpoint left off
        if state.is_world_process_zero and (kind := dropped_engine()) is not None:
            # what check reported (fsdp) is not what runs: say so where the launch shows it
            print(f"hfscale: warning: distributed.backend is fsdp, but accelerate runs this job as {kind} "
                  "(it uses FSDP on GPUs and other accelerators only): every rank holds the whole model", flush=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if not self._first[0]:  # the data fast-forwarded and the first batch fetched
            self._first = (True, False)
            progress.phase("data")

    def on_step_end(self, args, state, control, **kwargs):
        if not self._first[1]:  # marked before the step is reported: the supervisor reads both at that step
            self._first = (True, True)
            progress.phase("first_step")
        progress.step(state.global_step)

    # work between steps counts as progress: a long evaluation or save is not a hang
    def on_prediction_step(self, args, state, control, **kwargs):
        progress.alive()

    def on_save(self, args, state, control, **kwargs):
        progress.alive()

    def on_evaluate(self, args, state, control, **kwargs):
        progress.alive()

    def on_log(self, args, state, control, logs=None, **kwargs):
        # rank 0's numbers for hfscale launch's progress line (hfscale.training.heartbeat.report ignores other ranks)
        logs = logs or {}
        progress.report(step=state.global_step, max_steps=state.max_steps,
                        **{ours: logs[theirs] for theirs, ours in _REPORTED.items() if theirs in logs})
