"""ProgressCallback: each rank reports its optimizer steps to hfscale's hang watchdog."""

from __future__ import annotations

from transformers import TrainerCallback

from .. import progress


class ProgressCallback(TrainerCallback):
    """After every optimizer step, ``hfscale.progress.step(global_step)``: one small file per rank
    in the run directory (nothing outside ``hfscale launch``); after each evaluation batch and save,
    ``hfscale.progress.alive()``. No collective, no device sync."""

    def on_train_begin(self, args, state, control, **kwargs):
        progress.step(state.global_step)  # a resumed run starts where its checkpoint left off

    def on_step_end(self, args, state, control, **kwargs):
        progress.step(state.global_step)

    # work between steps counts as progress: a long evaluation or save is not a hang
    def on_prediction_step(self, args, state, control, **kwargs):
        progress.alive()

    def on_save(self, args, state, control, **kwargs):
        progress.alive()

    def on_evaluate(self, args, state, control, **kwargs):
        progress.alive()

    def on_log(self, args, state, control, logs=None, **kwargs):
        # rank 0's numbers for hfscale launch's progress line (hfscale.progress.report ignores other ranks)
        logs = logs or {}
        keys = {"loss": "loss", "learning_rate": "learning_rate", "grad_norm": "grad_norm", "epoch": "epoch",
                "hfscale/tokens_per_s": "tokens_per_s", "hfscale/eta_s": "eta_s", "hfscale/mfu": "mfu"}
        progress.report(step=state.global_step, max_steps=state.max_steps,
                        **{ours: logs[theirs] for theirs, ours in keys.items() if theirs in logs})
