"""ProgressCallback: each rank reports its optimizer steps to hfscale's hang watchdog."""

from __future__ import annotations

from transformers import TrainerCallback

from .. import progress


class ProgressCallback(TrainerCallback):
    """After every optimizer step, ``hfscale.progress.step(global_step)``: one small file per rank
    in the run directory (nothing outside ``hfscale launch``). No collective, no device sync."""

    def on_train_begin(self, args, state, control, **kwargs):
        progress.step(state.global_step)  # a resumed run starts where its checkpoint left off

    def on_step_end(self, args, state, control, **kwargs):
        progress.step(state.global_step)
