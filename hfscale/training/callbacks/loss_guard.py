"""LossGuardCallback: a loss spike or a NaN stops training without saving, for a rollback and a replay.

Every optimizer step, on every rank: the step's loss (the sum of ``training_step``'s returns, as the
Trainer logs it) is averaged over the ranks with one 1-element ``all_reduce``, and the gradient norm
(the Trainer's, the same on every rank) taken as it is; both go to the judgement
(hfscale.training.loss_guard.LossGuard), so every rank reaches the same verdict at the same step.

- No alarm: a step whose values are above the threshold but not yet ``patience`` of them running
  postpones a save due then to the first ordinary step after; so every checkpoint is saved before
  any spike's first step, and rotation never leaves only bad ones.
- An alarm: no save; rank 0 adds the incident to ``<output_dir>/hfscale_rollbacks.json``
  (hfscale.checkpoints.rollbacks.judge: replay, skip, strike or stop); every rank raises
  :class:`LossAlarm` out of ``trainer.train()``. For a NaN the ranks first gather which of them saw
  it themselves, and name those hosts when they are not all.
- At the start, the judgement's windows come back from the checkpoint resumed from
  (``hfscale_loss_guard.json``, written with each checkpoint ahead of hfscale's completeness
  marker), so a replay judges its steps as the run that spiked did; the batches of steps the record
  skips are read and dropped (``get_batch_samples``), their fingerprints recorded once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hfscale.checkpoints import rollbacks as record
from hfscale.checkpoints.resume import checkpoint_problem, checkpoints
from hfscale.core.atomic_files import write_files
from hfscale.core.untrusted import Unreadable, read_json
from hfscale.training.callbacks import collectives
from hfscale.training.loss_guard import GuardSettings, LossAlarm, LossGuard

STATE_FILE = "hfscale_loss_guard.json"
STATE_CAP = 8 * 1024 * 1024


def settings_of(config: Any) -> GuardSettings:
    """GuardSettings from a ``training.loss_guard`` section (hfscale.config.loss_guard)."""
    return GuardSettings(window=config.window, warmup=config.warmup, patience=config.patience,
                         loss_factor=config.loss_factor, loss_rise=config.loss_rise,
                         grad_norm_factor=config.grad_norm_factor, nan=config.nan)


def _fingerprint(batch: Any) -> str:
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if not isinstance(ids, torch.Tensor):
        return "0"
    return hashlib.sha256(ids.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class LossGuardCallback(TrainerCallback):
    """See the module. ``config``: a ``training.loss_guard`` section (None: its defaults)."""

    def __init__(self, trainer: Any, config: Any = None) -> None:
        from hfscale.config.loss_guard import LossGuardConfig

        self.trainer = trainer
        self.config = config if config is not None else LossGuardConfig()
        self.settings = settings_of(self.config)
        self.guard = LossGuard(self.settings)
        self.record = record.Rollbacks()
        self.skips: tuple[int, ...] = ()  # sorted
        self.resumed_from: int | None = None
        self.alarm: record.Incident | None = None
        self._loss: torch.Tensor | None = None
        self._grad_norm: Any = None
        self._owed_save = False
        self._pos = 0  # the data position (steps of the original run's batches) read so far
        for name, wrap in (("training_step", self._wrap_step), ("_get_grad_norm", self._wrap_norm),
                           ("get_batch_samples", self._wrap_batches)):
            original = getattr(trainer, name, None)
            if original is not None and not getattr(original, "_hfscale_guard", False):
                wrapped = wrap(original)
                wrapped._hfscale_guard = True  # type: ignore[attr-defined]
                setattr(trainer, name, wrapped)

    # -- what the Trainer hands over --------------------------------------------------------------
    def _wrap_step(self, original):
        @functools.wraps(original)
        def training_step(*args, **kwargs):
            loss = original(*args, **kwargs)
            self._loss = loss.detach().float() if self._loss is None else self._loss + loss.detach().float()
            return loss
        return training_step

    def _wrap_norm(self, original):
        @functools.wraps(original)
        def get_grad_norm(*args, **kwargs):
            self._grad_norm = original(*args, **kwargs)
            return self._grad_norm
        return get_grad_norm

    def _wrap_batches(self, original):
        @functools.wraps(original)
        def get_batch_samples(epoch_iterator, num_batches, device):
            target = self._position(self.trainer.state.global_step + 1)
            dropped = self._pos + 1 < target
            while self._pos + 1 < target:  # the batches of skipped steps: read, fingerprinted, dropped
                batches, _ = original(epoch_iterator, num_batches, device)
                self._pos += 1
                self._fingerprints(self._pos, batches)
            if dropped and collectives.rank_world()[0] == 0:  # the record written once per run of skipped steps
                record.write_rollbacks(self.trainer.args.output_dir, self.record)
            self._pos = target
            return original(epoch_iterator, num_batches, device)
        return get_batch_samples

    def _position(self, step: int) -> int:
        """The data position training step ``step`` reads: the step-th one not skipped."""
        pos = step
        for s in self.skips:
            if s <= pos:
                pos += 1
        return pos

    def _fingerprints(self, pos: int, batches: list) -> None:
        prints = collectives.gather_objects([_fingerprint(b) for b in batches])
        rank, _ = collectives.rank_world()
        if rank != 0:
            return
        for i, inc in enumerate(self.record.incidents):
            if inc.action == "skip" and inc.skip and inc.skip[0] <= pos <= inc.skip[1] and \
                    all(s.step != pos for s in inc.skipped):
                flat = [p for part in prints for p in part]
                skipped = [*inc.skipped, record.SkippedStep(step=pos, fingerprints=flat)]
                incidents = list(self.record.incidents)
                incidents[i] = inc.model_copy(update={"skipped": skipped})
                self.record = record.Rollbacks(incidents=incidents)

    # -- the Trainer's events ---------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        try:
            self.record = record.read_rollbacks(args.output_dir)
        except Unreadable as e:
            print(f"hfscale: warning: {e}; the loss guard starts a new record (earlier skips are not applied)",
                  flush=True)
            self.record = record.Rollbacks()
        self.skips = tuple(sorted(record.skipped_steps(self.record)))
        self.resumed_from = state.global_step or None
        data = next((cb for cb in self.trainer.callback_handler.callbacks if type(cb).__name__ == "DataStateCallback"),
                    None)
        # a stream restored from its saved position has read what the run read; else the Trainer skips one
        # step's batches per step trained
        restored = data is not None and getattr(data, "resumed_at", None) is not None
        self._pos = self._position(state.global_step) if restored else state.global_step
        if state.global_step:
            try:
                saved = read_json(os.path.join(args.output_dir, f"checkpoint-{state.global_step}", STATE_FILE),
                                  STATE_CAP, args.output_dir)
            except Unreadable:
                saved = None
            self.guard.restore(saved)

    def on_step_end(self, args, state, control, **kwargs):
        loss, self._loss = self._loss, None
        rank, world = collectives.rank_world()
        local = float(loss.item()) if loss is not None else 0.0
        t = torch.tensor([local, 1.0 if loss is not None else 0.0], dtype=torch.float64)
        if world > 1:
            t = t.to(collectives.comm_device())
            dist.all_reduce(t)
        total, count = (float(x) for x in t.tolist())
        norm = self._grad_norm
        norm = None if norm is None else float(norm.item() if hasattr(norm, "item") else norm)
        self._grad_norm = None
        if norm is not None and not math.isfinite(norm) and (args.fp16 or self._step_skipped()):
            norm = None  # fp16's loss scaler skipped the step on an overflow: its own business, not a NaN
        if count:
            alarm = self.guard.observe(state.global_step, total / count, norm)
            if alarm is not None:
                self._stop(args, state, control, alarm, local)
        if self.guard.suspect and control.should_save and not self._preempted(state.global_step):
            control.should_save, self._owed_save = False, True  # saved at the first ordinary step
        elif self._owed_save and not self.guard.suspect:
            control.should_save, self._owed_save = True, False
        resolved = record.resolve(self.record, state.global_step)
        if resolved is not None:
            self.record = resolved
            if rank == 0:
                record.write_rollbacks(args.output_dir, resolved)
        return control

    def _preempted(self, step: int) -> bool:
        """A PreemptionCallback saves at this step before the job stops: that save is not postponed (a
        checkpoint inside a spike is passed over by the rollback anyway; only rotation needs the wait)."""
        return any(getattr(cb, "stop_step", None) == step and getattr(cb, "preempted", False)
                   for cb in self.trainer.callback_handler.callbacks)

    def _step_skipped(self) -> bool:
        accelerator = getattr(self.trainer, "accelerator", None)
        return bool(getattr(accelerator, "optimizer_step_was_skipped", False))

    def _stop(self, args, state, control, alarm, local: float) -> None:
        control.should_save = False
        control.should_training_stop = True
        hosts: tuple[str, ...] = ()
        if alarm.kind == "nan":
            seen = collectives.gather_objects((collectives.host(), math.isfinite(local)))
            bad = sorted({h for h, finite in seen if not finite})
            hosts = tuple(bad) if bad and len(bad) < len({h for h, _ in seen}) else ()
        value = alarm.value if math.isfinite(alarm.value) else None
        first = collectives.rank_world()[0] == 0
        self.record = record.judge(
            self.record, record.Alarm(alarm.kind, alarm.measure, alarm.step, alarm.first_step, value, alarm.median,
                                      hosts),
            patience=self.settings.patience, skip_margin=self.config.skip_margin,
            max_rollbacks=self.config.max_rollbacks, resumed_from=self.resumed_from, at=time.time(),
            rollback_to=_newest_before(args.output_dir, alarm.first_step) if first else None)
        self.alarm = self.record.incidents[-1]
        if first:
            record.write_rollbacks(args.output_dir, self.record)
            print(f"hfscale: loss guard: {alarm.line()}: training stopped without saving; "
                  f"{record.incident_line(self.alarm)}", flush=True)
        collectives.barrier()
        raise LossAlarm(f"hfscale loss guard: {alarm.line()} ({self.alarm.action}; {record.ROLLBACKS_FILE} in "
                        f"{args.output_dir})")

    def on_save(self, args, state, control, **kwargs):
        if collectives.rank_world()[0] != 0 or not args.should_save:
            return
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(ckpt):
            write_files(Path(ckpt), {STATE_FILE: json.dumps(self.guard.state())})


def _newest_before(output_dir: str, step: int) -> int | None:
    """The step of the newest complete checkpoint in ``output_dir`` saved before ``step`` (None: none)."""
    found = [c for c in checkpoints(output_dir) if c.step < step]
    return next((c.step for c in reversed(found) if checkpoint_problem(c.path) is None), None)


def attach(trainer: Any, config: Any = None) -> LossGuardCallback | None:
    """Give ``trainer`` a LossGuardCallback unless it has one, ahead of any CheckpointCompleteCallback (whose
    marker then lists the judgement's file); the one added, or None."""
    callbacks = trainer.callback_handler.callbacks
    if any(isinstance(cb, LossGuardCallback) for cb in callbacks):
        return None
    cb = LossGuardCallback(trainer, config)
    collectives.add_ahead_of_marker(trainer, cb)
    return cb
