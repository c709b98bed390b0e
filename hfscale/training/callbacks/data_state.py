"""DataStateCallback: a streaming dataset resumes where its checkpoint left it instead of being replayed.

Resuming a Trainer on a ``datasets.IterableDataset`` fast-forwards the stream past every batch already
trained (``skip_first_batches``): every example is read and mapped again, so the time to resume grows
with the step (hours at real sizes: transformers #21934, #11284). With this callback:

- each rank records its dataset's position (datasets' own ``IterableDataset.state_dict()``) after
  every batch its data loader produces, and keeps the one of the last batch the Trainer consumed
  (accelerate's loader reads one batch ahead);
- at each save the ranks gather their positions, and the saving process writes them into the
  checkpoint, ``hfscale_data_state.json``, before hfscale's completion marker (which lists it); a
  local step of the local tier (``training.local_checkpoints``) holds them too;
- at a resume every rank loads its position into the dataset (``load_state_dict``) and the Trainer
  is told not to fast-forward (``ignore_data_skip`` for that ``train()`` call; the checkpoint's RNG
  state is restored as without a skip). The stream goes on with the next example, and nothing
  already trained is read or mapped again.

The ranks resume from the saved positions only if all of them can (one collective at the start):
otherwise, and for a position that cannot be exact, the Trainer replays as before and rank 0 says
why in one line. Replay is kept for a checkpoint without the file (saved without this callback,
or cut short), a position that does not fit the dataset's pipeline (changed since the save),
another world size, a stream past its first pass, a data loader with worker processes (its
positions are in the workers), and ``ignore_data_skip`` set by the script. As
datasets documents, an example in a shuffle buffer (``.shuffle(buffer_size=...)``) is not part of
the saved position. A map-style dataset is not touched.

Part of the training layer (imports torch and transformers); ``datasets`` only when the script has
imported it.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hfscale.checkpoints.resume import CHECKPOINT_RE
from hfscale.core.atomic_files import write_files
from hfscale.core.untrusted import Missing, Unreadable, printable, read_json
from hfscale.training.callbacks import collectives
from hfscale.training.callbacks.collectives import logger

STATE_FILE = "hfscale_data_state.json"
MAX_BYTES = 8 << 20  # a position is a few hundred bytes a rank; a file larger than this is not read
VERSION = 1


def streaming(dataset: Any) -> bool:
    """``dataset`` is a ``datasets.IterableDataset`` (without importing datasets)."""
    ds = sys.modules.get("datasets")
    return ds is not None and isinstance(dataset, ds.IterableDataset)


def iterated(loader: Any) -> Any:
    """The ``datasets.IterableDataset`` that ``loader`` (accelerate's prepared loader) reads on this
    rank: its dataset, or the one inside accelerate's ``IterableDatasetShard``; None for another kind."""
    ds = getattr(loader, "dataset", None)
    if type(ds).__name__ == "IterableDatasetShard":
        ds = getattr(ds, "dataset", None)
    return ds if streaming(ds) else None


def read_positions(checkpoint: str, step: int, world_size: int) -> tuple[list[Any] | None, str]:
    """The per-rank positions saved in ``checkpoint`` for ``step`` at ``world_size``, or None and why not.
    The file is read as hostile (hfscale.core.untrusted: a regular file inside the checkpoint, not a
    link, at most MAX_BYTES, JSON of bounded depth), then typed."""
    path = os.path.join(checkpoint, STATE_FILE)
    try:
        doc = read_json(path, MAX_BYTES, root=checkpoint)
    except Missing:
        return None, f"{os.path.basename(os.path.normpath(checkpoint))} has no {STATE_FILE}"
    except Unreadable as e:
        return None, str(e)
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        return None, f"{path}: not a version {VERSION} data state"
    def count(key: str) -> int | None:
        v = doc.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    if count("step") != step:
        return None, f"{path} is of step {printable(repr(doc.get('step')), 40)}, the checkpoint of step {step}"
    if count("world_size") != world_size:
        return None, f"saved at world size {printable(repr(doc.get('world_size')), 40)}, resumed at {world_size}"
    if count("pass") != 0:
        return None, "the stream was past its first pass"
    states = doc.get("states")
    if not isinstance(states, list) or len(states) != world_size or not all(s is None or isinstance(s, dict)
                                                                            for s in states):
        return None, f"{path}: 'states' is not one position (or null) a rank"
    return states, ""


def _fits(saved: Any, fresh: Any) -> bool:
    """``saved`` has the shape of ``fresh`` (a position of the same pipeline): the same keys, lists of
    the same length, the same kinds of value and the same iterable at each level (``type``); a None
    on either side is a part not started yet."""
    if saved is None or fresh is None:
        return True
    if isinstance(fresh, dict):
        return (isinstance(saved, dict) and saved.keys() == fresh.keys()
                and all(saved[k] == fresh[k] if k == "type" else _fits(saved[k], fresh[k]) for k in fresh))
    if isinstance(fresh, list):
        return isinstance(saved, list) and len(saved) == len(fresh) and all(map(_fits, saved, fresh))
    if isinstance(fresh, bool) or isinstance(saved, bool):
        return type(saved) is type(fresh)
    if isinstance(fresh, (int, float)):
        return isinstance(saved, (int, float))
    return type(saved) is type(fresh)


def misfit(dataset: Any, saved: dict) -> str | None:
    """Why ``saved`` cannot be loaded into ``dataset`` (a pipeline changed since the save: another
    map, filter or source), or None. The shape is compared with the dataset's own fresh position
    (datasets builds it without reading an example)."""
    before = dataset.__dict__.get("_state_dict")
    try:
        fresh = {"examples_iterable": dataset._prepare_ex_iterable_for_iteration()._init_state_dict(),
                 "epoch": saved.get("epoch")}
    except Exception as e:  # noqa: BLE001 - datasets' private builder: any failure means replay
        return f"this dataset's own position could not be taken ({type(e).__name__})"
    finally:
        dataset.__dict__["_state_dict"] = before
    if not _fits(saved, fresh):
        return "the saved position does not fit this dataset's pipeline (changed since the save?)"
    return None


def write_positions(checkpoint: str, step: int, states: list[Any], batches: int, passes: int) -> None:
    """Write the ranks' positions into ``checkpoint``, whole or not at all (a failed write, a full disk,
    leaves no partial file in the checkpoint: hfscale.core.atomic_files)."""
    doc = {"version": VERSION, "step": step, "world_size": len(states), "pass": passes, "batches": batches,
           "states": states}
    write_files(Path(checkpoint), {STATE_FILE: json.dumps(doc)})


def _resolve(resume: Any, output_dir: str) -> str | None:
    """The checkpoint ``Trainer.train(resume_from_checkpoint=...)`` resumes from (True: the Trainer's
    own choice, the last ``checkpoint-*`` in ``output_dir``)."""
    if isinstance(resume, bool):
        if not resume:
            return None
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    return str(resume) if resume else None


def _step_of(checkpoint: str) -> int | None:
    m = CHECKPOINT_RE.match(os.path.basename(os.path.normpath(checkpoint)))
    return int(m[1]) if m and len(m[1]) < 12 else None


class DataStateCallback(TrainerCallback):
    """Saves a ``datasets.IterableDataset``'s position with each checkpoint and resumes from it
    without replay (module docstring). Pass the Trainer: it wraps that Trainer's ``train`` and
    ``get_train_dataloader`` (on the instance; the class is not changed). Add it before
    ``CheckpointCompleteCallback`` so that the marker lists the file.

    Which position goes with a step: the loader's ``collate_fn`` is wrapped to take the dataset's
    position after each batch read on this rank. accelerate's loader reads ahead, so the count of
    batches read says nothing of the ones trained; the step does. In the stream's first pass, after
    optimizer step ``s`` the Trainer has taken ``(s - s0) * gradient_accumulation_steps`` batches since
    the loader began (``s0``: the step resumed from without replay, else 0, a replay starting from
    the stream's first example), and each is ``k`` batches read: the world size under accelerate's
    ``DataLoaderDispatcher`` (rank 0 reads every rank's batch), else 1."""

    def __init__(self, trainer: Any = None) -> None:
        self.trainer = trainer
        self._resume: str | None = None  # the checkpoint the running train() call resumes from
        self._dataset: Any = None  # the IterableDataset this rank's loader reads (None: not streaming)
        self._per_batch = 1  # batches read on this rank for each batch the Trainer takes
        self._snaps: dict[int, Any] = {}  # batches read this pass -> the position after them
        self._read = 0
        self._pass = -1  # passes over the stream begun in this train() call (the Trainer's epochs)
        self._start = 0  # the step at which this pass's reading began
        self.resumed_at: int | None = None  # the step resumed from without replay in this train() call
        self._rng_again = False
        if trainer is not None and not getattr(trainer, "_hfscale_data_state", False):
            trainer._hfscale_data_state = True
            trainer.train = self._wrap_train(trainer.train)
            trainer.get_train_dataloader = self._wrap_loader(trainer.get_train_dataloader)

    # ---- wrappers -------------------------------------------------------------------------------
    def _wrap_train(self, train):
        @functools.wraps(train)
        def wrapped(*args, **kwargs):
            resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
            self._resume = _resolve(resume, self.trainer.args.output_dir)
            self.resumed_at = None
            self._pass = -1
            skip = self.trainer.args.ignore_data_skip
            try:
                return train(*args, **kwargs)
            finally:
                self.trainer.args.ignore_data_skip = skip
                self._resume = None

        return wrapped

    def _wrap_loader(self, get_loader):
        @functools.wraps(get_loader)
        def wrapped(*args, **kwargs):
            loader = get_loader(*args, **kwargs)
            self._dataset = None
            if not streaming(getattr(self.trainer, "train_dataset", None)):
                return loader
            dataset = iterated(loader)
            workers = getattr(loader, "num_workers", 0) or 0
            if dataset is not None and workers == 0:
                self._dataset = dataset
                dispatched = type(loader).__name__ == "DataLoaderDispatcher" and not getattr(loader, "split_batches", False)
                self._per_batch = collectives.rank_world()[1] if dispatched else 1
                self._mark_batches(loader, dataset)
            if self._resume is not None and not self.trainer.args.ignore_data_skip:
                self._resume_position(workers)
            return loader

        return wrapped

    def _mark_batches(self, loader: Any, dataset: Any) -> None:
        """Take the dataset's position after each batch ``loader`` reads: its ``collate_fn``, or that of
        the DataLoader inside accelerate's adapter (a loader that ``skip_first_batches`` makes from it
        takes the same ``collate_fn``)."""
        reader = getattr(loader, "base_dataloader", loader)  # accelerate's adapters read through a DataLoader
        collate = reader.collate_fn
        me = self

        def collate_and_mark(batch):
            out = collate(batch)
            me._read += 1
            me._snaps[me._read] = dataset.state_dict()
            return out

        reader.collate_fn = collate_and_mark

    def _resume_position(self, workers: int) -> None:
        """Load this rank's saved position and turn the Trainer's fast-forward off, when every rank can."""
        rank, world = collectives.rank_world()
        step = _step_of(self._resume or "")
        states, why = (None, "the checkpoint's folder name has no step") if step is None else \
            read_positions(self._resume or "", step, world)
        if states is not None and workers:
            states, why = None, f"the data loader has {workers} worker processes"
        if states is not None and self._dataset is None and states[rank] is not None:
            states, why = None, "this rank's loader does not read a datasets.IterableDataset"
        if states is not None and states[rank] is not None:
            wrong = misfit(self._dataset, states[rank])
            if wrong is not None:
                states, why = None, wrong
        ok = collectives.all_gather([1.0 if states is not None else 0.0])
        if states is None or min(v[0] for v in ok) < 1.0:
            if rank == 0:
                why = why or "another rank cannot resume its stream's position"
                print(f"hfscale: data: the Trainer replays the stream up to step {step}: {why}", flush=True)
            return
        if states[rank] is not None:
            self._dataset.load_state_dict(states[rank])
        self.trainer.args.ignore_data_skip = True
        self.resumed_at = step
        self._rng_again = True
        if rank == 0:
            print(f"hfscale: data: the stream resumes where {os.path.basename(self._resume or '')} left it "
                  f"(no replay)", flush=True)

    # ---- callback -------------------------------------------------------------------------------
    def _needed(self, args, step: int) -> int:
        """Batches read this pass up to the last one the Trainer has trained on by optimizer step ``step``."""
        return (step - self._start) * args.gradient_accumulation_steps * self._per_batch

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._pass += 1
        self._read = 0
        self._snaps.clear()
        self._start = (self.resumed_at or 0) if self._pass == 0 else state.global_step

    def on_step_begin(self, args, state, control, **kwargs):
        # The Trainer restored the checkpoint's RNG state before its loader drew its seed for the new
        # iterator (and accelerate synchronised the ranks' RNGs): restore it again now, after that,
        # as its replay does after the skipped batches, so that dropout draws what an uninterrupted
        # run draws.
        if self._rng_again and self._resume is not None and hasattr(self.trainer, "_load_rng_state"):
            self.trainer._load_rng_state(self._resume)
        self._rng_again = False

    def on_step_end(self, args, state, control, **kwargs):
        needed = self._needed(args, state.global_step)
        for k in [k for k in self._snaps if k < needed]:
            del self._snaps[k]

    def on_save(self, args, state, control, **kwargs):
        self.save_position(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), state.global_step, args)

    def save_position(self, ckpt: str, step: int, args: Any) -> None:
        """Write the ranks' positions after optimizer step ``step`` into the checkpoint folder ``ckpt``:
        every rank calls it (one gather), the saving process writes. ``on_save`` calls it for the
        Trainer's saves, the local tier (hfscale.training.callbacks.local_tier) for its own."""
        if not streaming(getattr(self.trainer, "train_dataset", None)):
            return
        needed = self._needed(args, step)
        # a rank that read nothing (all but rank 0 under the dispatcher) has no position to keep
        known = self._dataset is not None and self._pass == 0 and (self._read == 0 or needed in self._snaps)
        mine = json.dumps(self._snaps.get(needed) if known and self._read else None)
        gathered = collectives.gather_objects((known, mine))
        if not args.should_save or not os.path.isdir(ckpt):
            return
        try:
            if all(k for k, _ in gathered):
                write_positions(ckpt, step, [json.loads(s) for _, s in gathered], needed, self._pass)
            elif os.path.lexists(os.path.join(ckpt, STATE_FILE)):  # an earlier run's, of the same step
                os.remove(os.path.join(ckpt, STATE_FILE))
        except (OSError, TypeError, ValueError) as e:  # a full disk: the next resume replays, and says why
            logger.warning("DataStateCallback: the stream's position was not saved in %s: %s", ckpt, e)

def attach(trainer: Any) -> DataStateCallback | None:
    """Give ``trainer`` a DataStateCallback unless it has one, ahead of any CheckpointCompleteCallback
    (whose marker then lists the file); the one added, or None."""
    callbacks = trainer.callback_handler.callbacks
    if any(isinstance(cb, DataStateCallback) for cb in callbacks):
        return None
    cb = DataStateCallback(trainer)
    collectives.add_ahead_of_marker(trainer, cb)
    return cb
