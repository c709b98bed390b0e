"""Find the checkpoint to resume from: the newest one that is known to be complete.

A Trainer checkpoint folder (``checkpoint-<step>``) is complete when it holds the marker
``hfscale_complete.json`` that :class:`hfscale.training.callbacks.CheckpointCompleteCallback` writes after every
rank has finished saving, and everything the marker lists is still there with the same size. A
folder without a marker (an unchanged script, or a save cut short) is judged by its own files
(:mod:`hfscale.checkpoints.files`: trainer state, an RNG state and DeepSpeed shards for every rank,
model, optimizer and scheduler, each file whole)::

    from hfscale import latest_checkpoint  # the public face
    trainer.train(resume_from_checkpoint=latest_checkpoint(args.output_dir))

Incomplete folders are skipped with an :class:`IncompleteCheckpointWarning` naming the folder and
the reason. ``None`` means "start from scratch" (no output folder, or no complete checkpoint in it).

Sizes catch files that were cut short or deleted, not flipped bits. The marker is written after
the ranks' files were closed, which is enough against killed processes; against a node losing
power, write it with ``fsync=True``.

This module is plain Python (no torch), so launchers and tools can import it cheaply.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from hfscale.checkpoints.files import (INDEXES, TRAINER_STATE, content_problem, deepspeed_problem, deepspeed_ranks,
                               index_shards, read_trainer_state, saved_step)
from hfscale.checkpoints.lineage import read_lineage
from hfscale.checkpoints.reshard import universal_ready
from hfscale.core.untrusted import Unreadable, read_record

if TYPE_CHECKING:
    from hfscale.core.records import LogEntry

MARKER = "hfscale_complete.json"
MARKER_FORMAT = 1
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")

__all__ = [
    "MARKER",
    "IncompleteCheckpointWarning",
    "checkpoint_problem",
    "scan_output",
    "checkpoints",
    "latest_checkpoint",
    "rotate_checkpoints",
    "write_marker",
]


class IncompleteCheckpointWarning(UserWarning):
    """A checkpoint folder was skipped because it is not known to be complete."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


def checkpoints(output_dir: str | os.PathLike[str]) -> list[Checkpoint]:
    """The ``checkpoint-<step>`` folders in ``output_dir``, oldest step first (none if it is missing)."""
    root = Path(output_dir)
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for e in entries:
        m = CHECKPOINT_RE.match(e.name)
        if m and e.is_dir(follow_symlinks=False):  # a link to a folder elsewhere is not a checkpoint here
            out.append(Checkpoint(int(m.group(1)), root / e.name))
    return sorted(out, key=lambda c: c.step)


def _manifest(ckpt: Path) -> dict[str, int]:
    files = {}
    for dirpath, _dirs, names in os.walk(ckpt):
        for name in names:
            full = Path(dirpath) / name
            rel = full.relative_to(ckpt).as_posix()
            if rel == MARKER or rel.startswith(MARKER + "."):
                continue
            files[rel] = full.stat().st_size
    return dict(sorted(files.items()))


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(ckpt: str | os.PathLike[str], global_step: int, world_size: int, fsync: bool = False) -> Path:
    """Declare ``ckpt`` complete: write the marker with a manifest of every file and its size.

    Call it only after every rank finished writing (the callback waits on a barrier first). The
    marker is written to a temporary name and renamed, so it is never seen half written.
    """
    ckpt = Path(ckpt)
    files = _manifest(ckpt)
    if fsync:
        for rel in files:
            _fsync_path(ckpt / rel)
    doc = {
        "format": MARKER_FORMAT,
        "global_step": int(global_step),
        "world_size": int(world_size),
        "time": time.time(),
        "files": files,
    }
    tmp = ckpt / f"{MARKER}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, ckpt / MARKER)
    if fsync:
        _fsync_path(ckpt, directory=True)
    return ckpt / MARKER


def checkpoint_problem(ckpt: str | os.PathLike[str], world_size: int | None = None, reshard: bool = False
                       ) -> str | None:
    """Why ``ckpt`` cannot be resumed from, or ``None`` when it is complete.

    ``world_size``: the processes of the job that would resume; a DeepSpeed ZeRO checkpoint saved
    by another number of processes loads into it only once converted to a universal checkpoint
    (hfscale.checkpoints.reshard); ``reshard``: the caller will convert it."""
    from hfscale.core.records import MARKER_CAP, CompleteMarker

    ckpt = Path(ckpt)
    m = CHECKPOINT_RE.match(ckpt.name)
    marker = ckpt / MARKER
    if not os.path.lexists(marker):
        why = content_problem(ckpt, int(m.group(1)) if m else None)
        if why is not None:
            return f"no {MARKER}, and by its own files: {why}"
        return _world_problem(ckpt, deepspeed_ranks(ckpt), world_size, reshard)
    try:
        doc = read_record(marker, CompleteMarker, MARKER_CAP)
    except Unreadable as e:
        return f"unreadable {MARKER}: {e.reason}"
    step, files, saved_world = doc.global_step, doc.files, doc.world_size
    if m and int(m.group(1)) != step:
        return f"{MARKER} is for step {step}, the folder name says {m.group(1)}"
    for rel, size in files.items():
        p = Path(rel)
        if p.is_absolute() or ".." in p.parts or not rel.isprintable():
            return f"{MARKER} lists a path outside the checkpoint: {rel[:120]!r}"
        try:
            st = os.lstat(ckpt / p)
        except (OSError, ValueError):
            return f"{rel} is missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{rel} is not a regular file (a link, FIFO or device)"
        if st.st_size != size:
            return f"{rel} has {st.st_size} bytes, {size} when saved"
    if TRAINER_STATE not in files:
        return f"{TRAINER_STATE} is not part of the checkpoint"
    try:
        state_step = saved_step(ckpt / TRAINER_STATE)
    except Unreadable as e:
        return f"unreadable {TRAINER_STATE}: {e.reason}"
    if state_step != step:
        return f"{TRAINER_STATE} says step {state_step}, {MARKER} says {step}"
    # the marker lists sizes, not what an index names: a shard named outside the checkpoint is not in it
    why = deepspeed_problem(ckpt, saved_world) or next(
        (w for index in INDEXES if os.path.lexists(ckpt / index) and (w := index_shards(ckpt, index)[1])), None)
    if why is not None:
        return why
    return _world_problem(ckpt, deepspeed_ranks(ckpt), world_size, reshard)


def _world_problem(ckpt: Path, saved: int | None, world_size: int | None, reshard: bool) -> str | None:
    if saved and world_size and saved != world_size and not reshard and not universal_ready(ckpt):
        return (f"DeepSpeed ZeRO state saved by {saved} processes; this job has {world_size}, and DeepSpeed "
                "loads ZeRO shards only into as many processes as wrote them (hfscale launch converts it to a "
                "universal checkpoint first)")
    return None


def latest_checkpoint(output_dir: str | os.PathLike[str] | None, world_size: int | None = None) -> str | None:
    """The newest complete checkpoint folder in ``output_dir``, or ``None`` to start from scratch.

    Incomplete or damaged folders, and DeepSpeed checkpoints of another ``world_size``, are skipped
    with an :class:`IncompleteCheckpointWarning` that names the folder and what is wrong with it.
    """
    if output_dir is None:
        return None
    found, before = checkpoints(output_dir), rollback_bound(output_dir)[0]
    for ckpt in reversed(found):
        if before is not None and ckpt.step >= before:
            warnings.warn(f"hfscale: not resuming from {ckpt.path}: {rolled_back(before)}", IncompleteCheckpointWarning,
                          stacklevel=2)
            continue
        why = checkpoint_problem(ckpt.path, world_size)
        if why is None:
            return str(ckpt.path)
        warnings.warn(f"hfscale: not resuming from {ckpt.path}: {why}", IncompleteCheckpointWarning, stacklevel=2)
    if found:
        warnings.warn(
            f"hfscale: no complete checkpoint in {output_dir} ({len(found)} incomplete); training starts from scratch",
            IncompleteCheckpointWarning,
            stacklevel=2,
        )
    return None


def rollback_bound(output_dir: str | os.PathLike[str]) -> tuple[int | None, str | None]:
    """The loss guard's rollback bound in ``output_dir`` (hfscale.checkpoints.rollbacks: a start resumes
    from a checkpoint saved before that step; None: any), and why its record cannot be read (None: it can)."""
    from hfscale.checkpoints.rollbacks import read_rollbacks, rollback_before

    try:
        return rollback_before(read_rollbacks(output_dir)), None
    except Unreadable as e:
        return None, str(e)


def rolled_back(before: int) -> str:
    return (f"saved at or after step {before}, where the loss spike the loss guard stopped the job for began "
            "(rolled back: hfscale_rollbacks.json)")


def rotate_checkpoints(
    output_dir: str | os.PathLike[str], keep: int | None, protect: Iterable[str | os.PathLike[str]] = ()
) -> list[str]:
    """Delete old checkpoints so that at most ``keep`` complete ones remain; return what was deleted.

    Never deletes the newest complete checkpoint, nor a folder in ``protect`` (the best model), nor
    anything newer than the newest complete checkpoint. Incomplete folders older than it (left by
    crashed saves) are deleted too. ``keep`` ``None`` or below 1: delete nothing.
    """
    if keep is None or keep < 1:
        return []
    found = checkpoints(output_dir)
    complete = [c for c in found if checkpoint_problem(c.path) is None]
    if not complete:
        return []
    newest = complete[-1].step
    protected = {os.path.realpath(p) for p in protect}
    kept = {c.path for c in complete[-keep:]}
    deleted = []
    for c in found:
        if c.step >= newest or c.path in kept or os.path.realpath(c.path) in protected:
            continue
        shutil.rmtree(c.path, ignore_errors=True)
        deleted.append(str(c.path))
    return deleted


@dataclass(frozen=True)
class SavedState:
    """What a checkpoint's trainer_state.json says about the run that wrote it."""

    global_step: int
    max_steps: int
    num_train_epochs: float
    last_lr: tuple[int, float] | None  # (step, learning rate) of the last log entry with one


@dataclass(frozen=True)
class OutputScan:
    """What a launch finds in ``training.output_dir`` before anything starts."""

    output_dir: str
    found: tuple[str, ...]  # checkpoint folder names, oldest first
    resume: str | None  # the newest complete checkpoint folder
    skipped: tuple[tuple[str, str], ...]  # (folder, why) for the incomplete ones looked at
    state: SavedState | None  # of ``resume``
    saved_world: int | None = None  # the processes that wrote ``resume``'s DeepSpeed ZeRO state (None: not one)
    universal: bool = False  # ``resume`` holds a universal conversion of that state (hfscale.checkpoints.reshard)
    # the output_dir holds a lineage (hfscale.checkpoints.lineage): hfscale started this job here, so the
    # checkpoints in it are its own
    lineage: bool = False
    rolled_back: tuple[str, ...] = ()  # complete or not, saved at or after the loss guard's rollback step
    rollbacks_problem: str | None = None  # the loss guard's record cannot be read (hfscale.checkpoints.rollbacks)


def saved_state(ckpt: str | os.PathLike[str]) -> SavedState | None:
    """The facts of ``ckpt``'s trainer_state.json (None when unreadable)."""
    try:
        doc = read_trainer_state(Path(ckpt) / TRAINER_STATE)
    except Unreadable:
        return None
    lrs = [(entry.step, entry.learning_rate) for e in doc.log_history
           if (entry := _entry(e)) is not None and entry.learning_rate is not None]
    return SavedState(doc.global_step, doc.max_steps or 0, doc.num_train_epochs or 0.0, lrs[-1] if lrs else None)


def _entry(e: object) -> "LogEntry | None":
    """One log_history entry, typed (hfscale.core.records.LogEntry), or None when it is not one."""
    from hfscale.core.records import LogEntry
    from hfscale.core.untrusted import as_record

    try:
        return as_record(e, LogEntry, TRAINER_STATE)
    except Unreadable:
        return None


def scan_output(output_dir: str | os.PathLike[str], world_size: int | None, reshard: bool = False) -> OutputScan:
    """The checkpoints in ``output_dir``: the one to resume from, and why newer ones are skipped.
    ``reshard``: a DeepSpeed checkpoint of another world size counts (the caller converts it)."""
    from dataclasses import replace

    return replace(_scan_output(output_dir, world_size, reshard), lineage=read_lineage(output_dir) is not None)


def _scan_output(output_dir: str | os.PathLike[str], world_size: int | None, reshard: bool) -> OutputScan:
    found = checkpoints(output_dir)
    before, problem = rollback_bound(output_dir)
    late = tuple(c.path.name for c in found if before is not None and c.step >= before)
    skipped = [(name, rolled_back(before)) for name in reversed(late) if before is not None]
    names = tuple(c.path.name for c in found)
    for ckpt in reversed(found):
        if ckpt.path.name in late:
            continue
        why = checkpoint_problem(ckpt.path, world_size, reshard)
        if why is None:
            return OutputScan(str(output_dir), names, str(ckpt.path), tuple(skipped), saved_state(ckpt.path),
                              deepspeed_ranks(ckpt.path), universal_ready(ckpt.path), rolled_back=late,
                              rollbacks_problem=problem)
        skipped.append((ckpt.path.name, why))
    return OutputScan(str(output_dir), names, None, tuple(skipped), None, rolled_back=late, rollbacks_problem=problem)


Action = Literal["fresh", "resume", "done", "refuse"]


@dataclass(frozen=True)
class ResumeDecision:
    """What a start does with the checkpoints in its output_dir. ``set_aside``: the incomplete
    checkpoints newer than ``checkpoint`` that the job's own saves left (the output_dir holds its
    lineage): a relaunch moves them aside (hfscale.launch.build) instead of refusing to start."""

    action: Action
    checkpoint: str | None = None
    reason: str = ""
    set_aside: tuple[str, ...] = ()
    rolled_back: tuple[str, ...] = ()  # saved at or after the loss guard's rollback step: moved aside too


def decide(scan: OutputScan, max_steps: int | None) -> ResumeDecision:
    """Resume from the newest complete checkpoint; nothing to do when it is at ``max_steps`` (the
    Trainer would still take one more step and save it); refuse to start over silently where
    checkpoints exist but none is complete, unless they are the job's own: the output_dir holds the
    lineage hfscale begins at a fresh start (before any checkpoint is there, so every checkpoint in
    it was saved since, by this job), and a save cut short by a failure is set aside, never a reason
    to stop the job."""
    late = scan.rolled_back
    own = tuple(name for name, _why in scan.skipped if name not in late) if scan.lineage else ()
    if scan.resume is not None:
        step = scan.state.global_step if scan.state is not None else None
        if max_steps is not None and step is not None and step >= max_steps:
            return ResumeDecision("done", scan.resume, f"{scan.resume} is at step {step}, max_steps is {max_steps}")
        return ResumeDecision("resume", scan.resume, set_aside=own, rolled_back=late)
    if scan.found and not scan.lineage and len(late) < len(scan.found):
        why = "; ".join(f"{name}: {reason}" for name, reason in scan.skipped)
        return ResumeDecision("refuse", None, f"{scan.output_dir} holds {len(scan.found)} checkpoint(s) but none "
                                              f"is complete ({why}); training would start over and overwrite them")
    return ResumeDecision("fresh", set_aside=own, rolled_back=late)


def first_start(env: Mapping[str, str]) -> bool:
    """Whether this is the job's first start: not a torchrun restart of its workers, not a Slurm requeue."""
    return all(env.get(k, "0") in ("", "0") for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
