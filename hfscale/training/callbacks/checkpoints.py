"""CheckpointCompleteCallback: the completion marker after every rank saved, and safe rotation."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import TrainerCallback

from hfscale.checkpoints.files import content_problem
from hfscale.checkpoints.resume import MARKER, rotate_checkpoints, write_marker
from hfscale.training import async_save as async_saves
from hfscale.training.callbacks import collectives
from hfscale.training.callbacks.collectives import logger


class CheckpointCompleteCallback(TrainerCallback):
    """Marks a checkpoint complete once every rank finished saving it; rotates only after that.

    After each save, all ranks meet at a barrier; then the process that saves (rank 0, or each
    node's local rank 0 with ``save_on_each_node``) writes ``hfscale_complete.json`` into
    ``checkpoint-<step>``: every file's relative path and size, the global step and the world size.
    :func:`hfscale.checkpoints.resume.latest_checkpoint` resumes only from folders with a verified marker.

    Rotation. In transformers 5.23, ``Trainer._save_checkpoint`` deletes old checkpoints
    (``save_total_limit``) right after the saving process wrote its own files, before the other
    ranks finished theirs and before ``on_save``: with ``save_total_limit=1`` a kill at that moment
    leaves no complete checkpoint. This callback therefore takes the limit over: at ``on_train_begin``
    it moves ``args.save_total_limit`` (or uses ``save_total_limit=`` given here) into itself and sets
    the argument to ``None`` (TrainingArguments are mutable in this version; the value is put back at
    ``on_train_end``), and deletes old checkpoints itself after writing the marker. It never deletes
    the newest complete checkpoint, the best model checkpoint, or anything newer than the newest
    complete one; incomplete folders older than it are deleted. (``training_args.bin`` inside the
    checkpoints records ``save_total_limit=None``.)

    At each step end the saving process also removes a stale marker from a ``checkpoint-<step>``
    folder of the current step, left by an earlier run that went further, so that a save into that
    folder is never taken for complete before it is.

    Asynchronous saves (``training.async_save``, DeepSpeed's decoupled checkpoint writer,
    hfscale.training.async_save). When the save returns with DeepSpeed's writes still pending, the
    marker waits: they are committed at the first optimizer step at which every rank's writer has
    finished (rank 0 writes ``latest``, a barrier; training does not wait for the writers), and at
    that step's end the ranks meet at the barrier and the saving process checks the folder by its own
    files (every rank's shards and RNG state whole, ``latest`` naming them) and writes the marker. A
    save that begins before then waits for the commit, and the previous save is marked first. The
    last save of a run is committed at ``on_train_end``. Rotation waits for the marker too, so the
    previous complete checkpoint is never deleted while the next one is being written. The callback
    notices pending writes on its own; ``async_save=True`` is needed only to set the process up
    before the Trainer builds the engine.

    Args:
        save_total_limit: checkpoints to keep; default: ``args.save_total_limit``.
        fsync: flush every file to disk before writing the marker (against power loss; slower).
        async_save: the DeepSpeed JSON has ``checkpoint.writer.decoupled`` (hfscale's ``training.async_save``):
            set ``CROSS_RANK``/``CROSS_SIZE`` and patch the engine before the Trainer builds it (construct
            the callback before ``trainer.train()``); imports deepspeed.
    """

    def __init__(self, save_total_limit: int | None = None, fsync: bool = False, async_save: bool = False) -> None:
        self.save_total_limit = save_total_limit
        self.fsync = fsync
        self.pending: tuple[str, int] | None = None  # (folder, step) of a save whose writes are not committed
        if async_save:
            async_saves.prepare_env()
            async_saves.install()
        self.keep: int | None = None
        self.marked: list[str] = []
        self._args_limit: int | None = None
        self._took_over = False
        self._marked_steps: set[int] = set()

    def on_train_begin(self, args, state, control, **kwargs):
        if "deepspeed" in sys.modules:  # notices a decoupled writer set up without async_save=True
            async_saves.install()
        self._marked_steps = {
            int(name.removeprefix("checkpoint-"))
            for name in (os.listdir(args.output_dir) if os.path.isdir(args.output_dir) else [])
            if name.removeprefix("checkpoint-").isdigit() and os.path.exists(os.path.join(args.output_dir, name, MARKER))
        }
        self._args_limit = args.save_total_limit
        self.keep = self.save_total_limit if self.save_total_limit is not None else args.save_total_limit
        if args.save_total_limit is not None:
            args.save_total_limit = None  # the Trainer's own rotation runs before the save is complete
            self._took_over = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.pending is not None:
            async_saves.commit_pending()  # the last save has no next optimizer step to commit it
            self._mark_pending(args, state)
        if self._took_over:
            args.save_total_limit = self._args_limit
            self._took_over = False
        collectives.leave_process_group_at_exit()

    def on_step_end(self, args, state, control, **kwargs):
        # steps only go forward, so the markers that can go stale are known at train begin
        if state.global_step in self._marked_steps and args.should_save:
            self._marked_steps.discard(state.global_step)
            stale = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", MARKER)
            if os.path.exists(stale):
                os.remove(stale)
        if self.pending is not None and not async_saves.pending():  # DeepSpeed committed in this step
            self._mark_pending(args, state)

    def on_save(self, args, state, control, **kwargs):
        _, world = collectives.rank_world()
        if world > 1:
            dist.barrier()  # every rank has written (and closed) its part of the checkpoint, or handed it on
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if self.pending is not None:  # committed when this save began (a save waits for the one before)
            self._mark_pending(args, state)
        if async_saves.pending():  # the same on every rank: each engine commits at the same step
            self.pending = (ckpt, state.global_step)
            return
        if not args.should_save:
            return
        if not os.path.isdir(ckpt):
            logger.warning("CheckpointCompleteCallback: %s not found (hyperparameter search runs are not supported)", ckpt)
            return
        self._mark(args, state, ckpt, state.global_step)

    def _mark_pending(self, args, state) -> None:
        """Mark the save whose writes every rank has committed (call it on every rank)."""
        assert self.pending is not None
        ckpt, step = self.pending
        self.pending = None
        _, world = collectives.rank_world()
        lost = async_saves.unwritten(ckpt)  # this rank's files its writer could not write (a full disk)
        if lost:
            print(f"hfscale: warning: rank {collectives.rank_world()[0]}'s asynchronous writer could not write "
                  f"{lost[0]}" + (f" (and {len(lost) - 1} more)" if len(lost) > 1 else "")
                  + f"; {os.path.basename(ckpt)} is not kept, the previous complete checkpoint stays", flush=True)
        if world > 1:
            dist.barrier()
        if not args.should_save:
            return
        why = content_problem(Path(ckpt), step)
        if why is not None:  # a writer failed: its files are missing
            logger.error("CheckpointCompleteCallback: not marking %s complete after its asynchronous save: %s", ckpt, why)
            return
        self._mark(args, state, ckpt, step)

    def _mark(self, args, state, ckpt: str, step: int) -> None:
        write_marker(ckpt, step, args.world_size, fsync=self.fsync)
        self.marked.append(ckpt)
        protect = [state.best_model_checkpoint] if state.best_model_checkpoint else []
        for path in rotate_checkpoints(args.output_dir, self.keep, protect=protect):
            logger.info("Deleted old checkpoint %s (save_total_limit=%s)", path, self.keep)
