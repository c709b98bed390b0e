"""The local tier of checkpoints on the ranks' side (``training.local_checkpoints``; the files and the
choices: hfscale.checkpoints.local_tier).

``LocalCheckpointCallback`` saves a checkpoint every ``every`` optimizer steps (not on the durable
tier's steps) into each node's own disk, right after the Trainer logged the step, with the
Trainer's own save (``Trainer._save_checkpoint``, the output_dir pointed at the node's folder for
that call): DeepSpeed's shards, the optimizer, the scheduler, the RNG states, the trainer state,
each written by the rank that writes it in a durable save (the whole model file left out: the
resume reads DeepSpeed's). Then the nodes exchange their listings (one ``all_gather_object``),
the ranks of each node take the CRC-32 of its files between them (each rank a share, one more
gather), and each node writes its holding of its own part with those checksums: the step is
restorable while every node answers. The buddy copy follows behind training
(hfscale.training.callbacks.buddy_stream: each node's first rank, in a thread, sends its node's
part to the next node's and receives the previous node's, over a gloo group of its own, both sides
checking every file against its checksum), and adds the copy to the holding when it is whole and
matches; the next local save waits for it. A rank killed during any of this leaves the step
without a holding, or held without its copy: the previous local step, complete with its copies,
stays on the nodes until the copy is whole. With ``training.async_save`` the save returns while
DeepSpeed's writers write the shards; the listing and the holding follow at the end of the first
step after the commit (hfscale.training.async_save), or before the next local save.

A full local disk costs local steps, never the training: before each one every node's folder is
asked for room (hfscale.checkpoints.local_room; one gather), and while a node has none no node saves
a step (it needs every node's part), said once with the node and its folder and again when there is
room. A write that fails anyway is caught where it fails (DeepSpeed's engine save, the RNG state, the
model's description), so the save's collectives still meet, and the step is not kept; with
``async_save`` the writer's failures come back at the commit (hfscale.training.async_save.unwritten).

The restore, before ``trainer.train``, with every file checked against its checksum:
hfscale.training.callbacks.local_restore.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback

from hfscale.checkpoints import local_tier as tier
from hfscale.checkpoints.local_room import short_of_room
from hfscale.checkpoints.lineage import begin_lineage
from hfscale.training import async_save as async_saves
from hfscale.training.callbacks.buddy_stream import Behind, Copied, Exchange, exchange
from hfscale.training.callbacks.collectives import Nodes, barrier, gather_objects, host, logger, nodes, rank_world
from hfscale.training.callbacks.data_state import DataStateCallback


def start_lineage(output_dir: str, fresh: bool) -> str:
    """The run's lineage, the same on every rank: rank 0 starts a new one at a fresh start (step 0:
    the local steps of an earlier run are not this one's), else keeps the output_dir's."""
    rank, world = rank_world()
    value = begin_lineage(output_dir, keep=not fresh) if rank == 0 else None
    if world > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return str(value)


def _describe_model(trainer: Any, output_dir: str | None) -> None:
    """What a local save keeps of ``save_model``: the small files that say what the model is."""
    if not output_dir or not trainer.args.should_save:
        return
    model = trainer.accelerator.unwrap_model(trainer.model)
    os.makedirs(output_dir, exist_ok=True)
    generates = callable(getattr(model, "can_generate", None)) and model.can_generate()
    for part in (getattr(model, "config", None), getattr(model, "generation_config", None) if generates else None,
                 getattr(trainer, "processing_class", None)):
        if part is not None and hasattr(part, "save_pretrained"):
            part.save_pretrained(output_dir)


# what torch.save's C++ stream raises when a write fails (a full disk: ENOSPC below it), as RuntimeError
_WRITE_FAILED = ("iostream error", "file write failed", "PytorchStreamWriter failed", "unexpected pos",
                 "No space left on device", "Disk quota exceeded")


def write_failed(e: BaseException) -> bool:
    """Whether ``e`` is a failed write to disk: an OSError, or torch.save's RuntimeError for one (any
    other RuntimeError, a collective's for one, is not the local disk's and is raised on)."""
    return isinstance(e, OSError) or (isinstance(e, RuntimeError) and any(m in str(e) for m in _WRITE_FAILED))


def _noting(failed: list[str], fn: Any, *args: Any, path: str | None = None) -> Any:
    """``fn(*args)``, a failed write recorded in ``failed`` instead of raised (its file removed: a part
    of a file is no checkpoint's)."""
    try:
        return fn(*args)
    except (OSError, RuntimeError) as e:
        if not write_failed(e):
            raise
        failed.append(f"{path + ': ' if path else ''}{type(e).__name__}: {e}")
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass
        return None


class LocalCheckpointCallback(TrainerCallback):
    """Saves every ``every`` steps into ``template`` (``{host}``: this node's name) and copies each
    node's part to the next node (``buddy``); keeps the ``keep`` newest local steps."""

    def __init__(self, trainer: Any, every: int, template: str, keep: int = 2, buddy: bool = True,
                 lineage: str = "") -> None:
        self.trainer, self.every, self.template, self.keep, self.buddy = trainer, every, template, keep, buddy
        self.lineage = lineage
        self.group = None
        self.pending: int | None = None
        self.writing: tuple[int, float] | None = None  # (step, pause so far) of a save DeepSpeed's writers still hold
        self._wrapped = False
        self.behind = Behind()  # the buddy copy of the newest local step, in its thread
        self._nodes: Nodes | None = None
        self.need = 0  # bytes a local step takes on a node: the largest node's part, and its buddy copy
        self.short: tuple[str, ...] = ()  # the nodes said to have no room, while local steps are skipped

    def _root(self, args: Any) -> Path:
        """This node's folder of the job's local steps (hfscale.checkpoints.local_tier.node_dir)."""
        return tier.node_dir(self.template, host(), args.output_dir)

    def nodes(self) -> Nodes:
        """Which node this rank is on (one collective, the first time: the ranks stay where they are)."""
        if self._nodes is None:
            self._nodes = nodes()
        return self._nodes

    def on_train_begin(self, args, state, control, **kwargs):
        if rank_world()[1] > 1 and self.buddy and self.group is None:
            self.group = dist.new_group(backend="gloo")  # every rank takes part in making a group
        if not self._wrapped:
            self._wrap()

    def on_step_end(self, args, state, control, **kwargs):
        if self.writing is not None and not async_saves.pending():  # committed in this step, on every rank
            self._finish_writing(args)
        step = state.global_step
        if step % self.every or control.should_save or step >= state.max_steps:
            return  # the durable tier saves this step
        self.pending = step  # saved once the Trainer has logged this step (its log_history is saved)

    def on_train_end(self, args, state, control, **kwargs):
        if self.writing is not None:  # the last local save's writes, waited for
            self._finish_writing(args, wait=True)
        self.behind.join()  # and its buddy copy

    def _finish_writing(self, args: Any, wait: bool = False) -> None:
        """The listing and the holding of the local save DeepSpeed's writers held (``wait``: commit
        its writes first, waiting for them: every rank calls it at the same point)."""
        assert self.writing is not None
        if wait:
            async_saves.commit_pending()
        (step, held), self.writing = self.writing, None
        t0 = time.perf_counter()
        lost = async_saves.unwritten(tier.part(self._root(args), tier.OWN, step))
        size = self.finish(step, args, f"{host()}: the asynchronous writer could not write {lost[0]}" + (
            f" (and {len(lost) - 1} more)" if len(lost) > 1 else "") if lost else None)
        self._said(step, held + time.perf_counter() - t0, size)

    def _said(self, step: int, seconds: float, size: int) -> None:
        if rank_world()[0] == 0:  # the node log's record (HFSCALE_ lines stay off the terminal)
            print(f"HFSCALE_LOCAL_SAVE step={step} seconds={seconds:.3f} bytes={size}", flush=True)

    def _wrap(self) -> None:
        """Save after the Trainer's own log-and-save of the step (``_maybe_log_save_evaluate``, right
        after ``on_step_end``), as a durable save is: the step's logged loss is then in the saved
        trainer state, and nothing of the next step has run."""
        original = self.trainer._maybe_log_save_evaluate

        def log_save_evaluate(*a: Any, **kw: Any) -> Any:
            out = original(*a, **kw)
            if self.pending is not None:
                step, self.pending = self.pending, None
                args = self.trainer.args
                if self.writing is not None:  # the previous local save is still being written: finish it first
                    self._finish_writing(args, wait=True)
                if not self._room(step, args):
                    return out
                t0 = time.perf_counter()
                error = self.save(step, args)
                # training.async_save: DeepSpeed's writers hold the shards. The listing and the buddy copy need
                # them on disk: they wait for the commit (at a later step's end), and training goes on meanwhile
                states = gather_objects((error is None, bool(async_saves.pending())))
                if all(ok and writing for ok, writing in states):
                    self.writing = (step, time.perf_counter() - t0)
                    return out
                if all(writing for _, writing in states):
                    async_saves.commit_pending()  # a barrier inside: all ranks or none
                size = self.finish(step, args, error)
                self._said(step, time.perf_counter() - t0, size)
            return out

        self.trainer._maybe_log_save_evaluate = log_save_evaluate
        self._wrapped = True

    def _room(self, step: int, args: Any) -> bool:
        """Whether every node's local folder has room for this step (every rank; one gather). A step
        needs every node's part, so while one node has no room no node saves one: said once, with the
        node and its folder, and again when the step after is saved. A full local disk never fails a
        rank: the durable tier and the local steps kept before carry the job meanwhile."""
        self.behind.join()  # the previous step's buddy copy and rotation have ended: the disk as it stays
        root = self._root(args)
        mine = short_of_room(root, self.need, host()) if self.nodes().first else None
        short = [s for s in gather_objects(mine) if s is not None]
        names = tuple(s.host for s in short)
        if rank_world()[0] == 0 and names != self.short:
            if short:
                print(f"hfscale: warning: local checkpoints skipped from step {step}: {short[0].line()}"
                      + (f" (and {len(short) - 1} more node(s): {', '.join(names[1:6])})" if len(short) > 1 else "")
                      + "; a local step needs every node's part, so no node saves one while it has no room; training "
                      "goes on with the durable tier and the local steps kept before; local saves resume when there "
                      "is room", flush=True)
            else:
                print(f"hfscale: local checkpoints resume at step {step}: {', '.join(self.short[:6])} "
                      "has room again", flush=True)
        self.short = names
        return not short

    def save(self, step: int, args: Any) -> str | None:
        """Save ``step`` locally with the Trainer's own save (every rank): what failed on this rank, or None.

        Left out of a local save: the Trainer's model file (``save_model`` writes only the model's
        config, generation config and processing class here: under DeepSpeed the resume reads the
        weights from DeepSpeed's own files, and the whole model, gathered and written by rank 0
        before the save returns, would be the largest part of the pause), its rotation of the
        folder (``save_total_limit``: the tier keeps ``keep``) and ``push_to_hub``."""
        nodes = self.nodes()
        self.behind.join()  # the previous step's buddy copy (its rotation included) has ended
        root = self._root(args)
        own = tier.part(root, tier.OWN, step)
        if nodes.first:
            shutil.rmtree(own, ignore_errors=True)
            own.parent.mkdir(parents=True, exist_ok=True)
        barrier()
        trainer = self.trainer
        kept = args.output_dir, args.save_total_limit, args.push_to_hub
        args.output_dir = str(own.parent)  # the Trainer saves into <root>/own/checkpoint-<step>
        args.save_total_limit, args.push_to_hub = None, False
        failed: list[str] = []  # the writes that failed, each caught where it failed (below)
        trainer.save_model = lambda output_dir=None, _internal_call=False: _noting(
            failed, _describe_model, trainer, output_dir)
        # a write that fails must not skip the collectives after it in the save (DeepSpeed's closing barrier):
        # this rank would then meet the others' barrier with its next gather. Each write is caught where it fails
        engine = trainer.model_wrapped
        ce = getattr(engine, "checkpoint_engine", None)
        if ce is not None and not ce.is_decoupled():  # a decoupled engine's writer fails in its own process
            ce.save = lambda state_dict, path, _save=ce.save: _noting(failed, _save, state_dict, path, path=path)
        rng = trainer._save_rng_state
        trainer._save_rng_state = lambda output_dir: _noting(failed, rng, output_dir)
        try:
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        except (OSError, RuntimeError) as e:  # a full or failed local disk costs this local step, not the training
            if not write_failed(e):
                raise
            failed.append(f"{type(e).__name__}: {e}")
        finally:
            args.output_dir, args.save_total_limit, args.push_to_hub = kept
            del trainer.save_model, trainer._save_rng_state
            if ce is not None and "save" in ce.__dict__:
                del ce.save
        callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", ())
        stream = next((c for c in callbacks if isinstance(c, DataStateCallback)), None)
        if stream is not None:  # a streaming dataset's position goes with the local step too (every rank: a gather)
            stream.save_position(str(own), step, args)
        return f"{host()}: {failed[0][:600]}" if failed else None

    def finish(self, step: int, args: Any, error: str | None) -> int:
        """Once every rank's files of ``step`` are on the local disks (every rank): list them and write
        each node's holding of its own part; then the buddy copy, behind training (a thread on each
        node's first rank), which adds the copy to the holding when it is whole. The checkpoint's
        bytes, every node's part."""
        _, world = rank_world()
        nodes = self.nodes()
        first = nodes.first
        root = self._root(args)
        own = tier.part(root, tier.OWN, step)
        barrier()  # every rank of every node has written its files (or failed to)
        listed = None
        if first:
            try:
                listed = tier.listing(own)
            except OSError as e:
                error = error or f"{host()}: {e}"
        gathered = gather_objects((error, listed))
        errors = [e for e, _ in gathered if e]  # every rank: kept everywhere or nowhere
        parts = [p for _, p in gathered if p is not None]  # node order
        files = {rel: size for p in parts for rel, size in p.items()}
        if parts:  # what the next step needs on a node (the largest part, and a buddy's copy of one)
            self.need = max(sum(p.values()) for p in parts) * (2 if self.buddy and len(parts) > 1 else 1)
        if errors:
            if first:
                tier.remove(root, step)
            if rank_world()[0] == 0:
                print(f"hfscale: warning: local checkpoint of step {step} not kept: {errors[0][:500]}"
                      + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
                      + "; training goes on, the previous local step and the durable tier stay", flush=True)
            return 0
        if first:
            n, node = len(parts), nodes.node
            holding = tier.Holding(step=step, world_size=world, lineage=self.lineage, files=files,
                                   own=sorted(parts[node]), buddy=[])
            x = Exchange(step, nodes.leaders[tier.buddy_of(node, n)], nodes.leaders[(node - 1) % n], own, parts[node],
                         tier.part(root, tier.BUDDY, step), parts[(node - 1) % n]) if self.buddy and n > 1 else None
            self.behind.start(lambda: self._behind(root, holding, x),
                              lambda copied: self._copied(root, holding, x, copied))
        return sum(files.values())

    def _behind(self, root: Path, holding: tier.Holding, x: Exchange | None) -> Copied:
        """In the thread, behind training: the CRC-32 of each file of this node's own part (read back
        from the page cache, several files at once), then its holding, with them (the step is
        restorable from here while every node answers), then the buddy copy (which the peer waits for
        even when this node's own part could not be read: it is sent as zeros and said)."""
        t0 = time.perf_counter()
        own = tier.part(root, tier.OWN, holding.step)
        problem = None
        try:
            sums = tier.sums_all(own, holding.own)
            tier.write_holding(root, holding.model_copy(update={"sums": sums}))
        except OSError as e:
            sums, problem = None, f"{host()}: {e}"
        if x is None:
            return Copied(problem is None, False, (problem,) if problem else (), time.perf_counter() - t0,
                          out_sums=sums)
        copied = exchange(replace(x, out_sums=sums), self.group, host())
        return replace(copied, read=copied.read and problem is None, out_sums=sums,
                       errors=((problem,) if problem else ()) + copied.errors)

    def _copied(self, root: Path, holding: tier.Holding, x: Exchange | None, copied: Copied) -> None:
        """In the thread, once the copy ended (or the own part's checksums, without a buddy): the copy
        received into the holding (the step is then complete without this node's own part too), or,
        when this node's own part could not be read as saved, the step dropped here; then the
        rotation, and the record."""
        step = holding.step
        if not copied.read:  # this node's own part is not whole: the step is not here
            tier.remove(root, step)
        elif copied.received and x is not None:
            try:
                tier.write_holding(root, holding.model_copy(update={"buddy": sorted(x.in_files),
                                                                    "sums": {**(copied.out_sums or {}),
                                                                             **(copied.in_sums or {})}}))
            except OSError as e:
                copied = replace(copied, received=False, errors=copied.errors + (f"{host()}: {e}",))
        if x is not None and not copied.received:
            shutil.rmtree(x.into, ignore_errors=True)
        if not copied.read:
            print(f"hfscale: warning: local step {step} dropped on {host()}: {copied.errors[0][:500]}; "
                  "the previous local step and the durable tier stay", flush=True)
        if x is None:  # no buddy copy: the own part's checksums were the thread's work
            self._rotate(root)
            return
        if copied.read and copied.cut:  # a peer died mid-copy: its failure is what the launch tells; the log's
            logger.warning("local checkpoints: the buddy copy of step %s was cut short on %s: %s", x.step, host(),
                           copied.errors[0][:500])
        elif copied.read and copied.errors:
            print(f"hfscale: warning: the buddy copy of local step {x.step} was not kept on {host()}: "
                  f"{copied.errors[0][:500]}; the step is held by its own nodes only", flush=True)
        self._rotate(root)
        print(f"HFSCALE_BUDDY_COPY step={x.step} seconds={copied.seconds:.3f} "
              f"bytes={sum(x.out_files.values())} whole={int(copied.received)} cut={int(copied.cut)}", flush=True)

    def _rotate(self, root: Path) -> None:
        for gone in tier.rotate(root, self.keep):
            logger.info("local checkpoints: removed step %s", gone)
