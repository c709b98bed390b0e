"""SlowNodeCallback: a node found slow is stopped at the job's next checkpoint, to be replaced.

It reads the StragglerCallback's reports (every rank gathers the same numbers in them: no collective
of its own) into hfscale.training.slow_nodes.SlowNodeWatch. On the verdict rank 0 says so; training
goes on to the next checkpoint the job saves anyway. Once it is saved, rank 0 puts the node in
``progress/metrics.json`` (``slow``, ``slow_host``: hfscale.training.heartbeat.report), where the
supervisor reads it when the attempt has ended (hfscale.launch.recovery.slow_stops); every rank stops
(the Trainer's own stop: its end-of-training callbacks run, asynchronous writes finish), and
``trainer.train()`` raises :class:`~hfscale.training.slow_nodes.SlowNodeStop` on every rank, so that a
user's script does not go on as if training had ended. The relaunch resumes from that checkpoint:
nothing is recomputed. A verdict whose next save is the last step's changes nothing: the job ends there.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import TrainerCallback

from hfscale.training import heartbeat
from hfscale.training.callbacks import collectives
from hfscale.training.slow_nodes import SlowNode, SlowNodeStop, SlowNodeWatch, SlowSettings


def settings_of(config: Any) -> SlowSettings:
    """SlowSettings from a ``recovery.slow_nodes`` section (hfscale.config.slow_nodes)."""
    return SlowSettings(factor=config.factor, window_s=float(config.window), windows=config.windows)


class SlowNodeCallback(TrainerCallback):
    """See the module. ``straggler``: the StragglerCallback whose reports are judged."""

    def __init__(self, trainer: Any, straggler: Any, settings: SlowSettings) -> None:
        self.trainer = trainer
        self.straggler = straggler
        self.watch = SlowNodeWatch(settings)
        self.verdict: SlowNode | None = None
        self.stopped_at: int | None = None  # the checkpoint's step training stopped at
        self._seen: Any = None
        original = trainer.train
        if not getattr(original, "_hfscale_slow", False):
            trainer.train = self._wrap_train(original)

    def _wrap_train(self, original):
        @functools.wraps(original)
        def train(*args, **kwargs):
            result = original(*args, **kwargs)
            if self.stopped_at is not None and self.verdict is not None:
                raise SlowNodeStop(f"hfscale: stopped after checkpoint-{self.stopped_at} to replace "
                                   f"{self.verdict.host} (slow)")
            return result
        train._hfscale_slow = True  # type: ignore[attr-defined]
        return train

    def on_step_end(self, args, state, control, **kwargs):
        report = self.straggler.last
        if report is None or report is self._seen or report.get("step") != state.global_step:
            return
        self._seen = report
        verdict = self.watch.observe(state.global_step, report["forward_s_per_rank"], report["step_time_s_per_rank"],
                                     int(report.get("window_steps") or 0), report["hosts"])
        if verdict is None:
            return
        self.verdict = verdict
        if collectives.rank_world()[0] == 0:
            print(f"hfscale: slow node: {verdict.line(self.watch.settings)}; the job stops at its next checkpoint to "
                  "replace it", flush=True)

    def on_save(self, args, state, control, **kwargs):
        last = bool(state.max_steps) and state.global_step >= state.max_steps  # training ends there anyway
        if self.verdict is not None and self.stopped_at is None and not last:
            self.stopped_at = state.global_step
            control.should_training_stop = True
            # for the supervisor, as the ranks stop (not at the verdict: a failure before this checkpoint is that)
            heartbeat.report(slow=self.verdict.line(self.watch.settings)[:500], slow_host=self.verdict.host)
        return control


def attach(trainer: Any, config: Any) -> SlowNodeCallback | None:
    """Give ``trainer`` a SlowNodeCallback (``config``: a ``recovery.slow_nodes`` section) after its
    StragglerCallback; None when it has none (one rank) or already has a SlowNodeCallback."""
    from hfscale.training.callbacks.reporting import StragglerCallback

    callbacks = trainer.callback_handler.callbacks
    straggler = next((cb for cb in callbacks if isinstance(cb, StragglerCallback)), None)
    if straggler is None or any(isinstance(cb, SlowNodeCallback) for cb in callbacks):
        return None
    cb = SlowNodeCallback(trainer, straggler, settings_of(config))
    trainer.add_callback(cb)
    return cb
