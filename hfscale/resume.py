"""Find the checkpoint to resume from: the newest one that is known to be complete.

A Trainer checkpoint folder (``checkpoint-<step>``) counts as complete only when it holds the marker
``hfscale_complete.json`` that :class:`hfscale.callbacks.CheckpointCompleteCallback` writes after every
rank has finished saving, and everything the marker lists is still there with the same size::

    from hfscale.resume import latest_checkpoint
    trainer.train(resume_from_checkpoint=latest_checkpoint(args.output_dir))

Folders without a marker (a save cut short by a kill, or written without the callback), with a
missing or shortened file, or with missing DeepSpeed shards are skipped with an
:class:`IncompleteCheckpointWarning` naming the folder and the reason. ``None`` means "start from
scratch" (no output folder, or no complete checkpoint in it).

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
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MARKER = "hfscale_complete.json"
MARKER_FORMAT = 1
TRAINER_STATE = "trainer_state.json"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_SHARD_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim|model)_states\.pt$")
_MP_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")

__all__ = [
    "MARKER",
    "IncompleteCheckpointWarning",
    "checkpoint_problem",
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
        if m and e.is_dir():
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


def _deepspeed_problem(ckpt: Path, world_size: int) -> str | None:
    """Check the DeepSpeed part of a Trainer checkpoint (``latest`` + ``global_step*/``), if any."""
    latest = ckpt / "latest"
    step_dirs = [p for p in ckpt.glob("global_step*") if p.is_dir()]
    if not latest.exists() and not step_dirs:
        return None  # not a DeepSpeed checkpoint
    if not latest.is_file():
        return "DeepSpeed file 'latest' is missing"
    tag = latest.read_text(encoding="utf-8").strip()
    tag_dir = ckpt / tag
    if not tag or "/" in tag or not tag_dir.is_dir():
        return f"DeepSpeed tag folder {tag!r} named in 'latest' is missing"
    groups: dict[tuple[str, int], set[int]] = {}
    mp_model: set[int] = set()
    for p in tag_dir.iterdir():
        m = _SHARD_RE.match(p.name)
        if m:
            groups.setdefault((m.group(3), int(m.group(2))), set()).add(int(m.group(1)))
        m2 = _MP_MODEL_RE.match(p.name)
        if m2:
            mp_model.add(int(m2.group(1)))
    if not groups and not mp_model:
        return f"no DeepSpeed state files in {tag}/"
    if not any(kind == "model" for kind, _ in groups) and not mp_model:
        return f"no DeepSpeed model states in {tag}/"
    mp_ranks = {mp for _, mp in groups} | mp_model
    dp = world_size // max(1, len(mp_ranks)) if world_size else 0
    for (kind, mp), ranks in sorted(groups.items()):
        expected = set(range(dp)) if dp else set(range(max(ranks) + 1))
        missing = sorted(expected - ranks)
        if missing:
            names = ", ".join(f"zero_pp_rank_{r}_mp_rank_{mp:02d}_{kind}_states.pt" for r in missing[:4])
            return f"DeepSpeed shard(s) missing in {tag}/: {names}" + (" ..." if len(missing) > 4 else "")
    return None


def checkpoint_problem(ckpt: str | os.PathLike[str]) -> str | None:
    """Why ``ckpt`` cannot be resumed from, or ``None`` when it is complete."""
    ckpt = Path(ckpt)
    marker = ckpt / MARKER
    if not marker.is_file():
        return f"no {MARKER} (the save did not finish on every rank, or CheckpointCompleteCallback was not used)"
    try:
        doc = json.loads(marker.read_text(encoding="utf-8"))
        files = doc["files"]
        step = int(doc["global_step"])
        world_size = int(doc.get("world_size") or 0)
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MARKER}: {e}"
    m = CHECKPOINT_RE.match(ckpt.name)
    if m and int(m.group(1)) != step:
        return f"{MARKER} is for step {step}, the folder name says {m.group(1)}"
    for rel, size in files.items():
        p = Path(rel)
        if p.is_absolute() or ".." in p.parts:
            return f"{MARKER} lists a path outside the checkpoint: {rel!r}"
        try:
            actual = (ckpt / p).stat().st_size
        except OSError:
            return f"{rel} is missing"
        if actual != size:
            return f"{rel} has {actual} bytes, {size} when saved"
    if TRAINER_STATE not in files:
        return f"{TRAINER_STATE} is not part of the checkpoint"
    try:
        state = json.loads((ckpt / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"unreadable {TRAINER_STATE}: {e}"
    if state.get("global_step") != step:
        return f"{TRAINER_STATE} says step {state.get('global_step')}, {MARKER} says {step}"
    return _deepspeed_problem(ckpt, world_size)


def latest_checkpoint(output_dir: str | os.PathLike[str] | None) -> str | None:
    """The newest complete checkpoint folder in ``output_dir``, or ``None`` to start from scratch.

    Incomplete or damaged folders are skipped with an :class:`IncompleteCheckpointWarning` that names
    the folder and what is wrong with it.
    """
    if output_dir is None:
        return None
    found = checkpoints(output_dir)
    for ckpt in reversed(found):
        why = checkpoint_problem(ckpt.path)
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
