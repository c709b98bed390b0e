"""The local tier of checkpoints (``training.local_checkpoints``): frequent checkpoints on each node's
own disk, each node's part also copied to one buddy node, so that losing one node loses nothing.
This module is the files and the choices (no torch, no process group); the ranks' side, the save
and the restore, is hfscale.training.callbacks.local_tier.

On each node, under ``<dir>/<key>/`` (``key``: a hash of the output_dir, so jobs do not mix):

- ``own/checkpoint-<step>/``: what this node's ranks saved (the Trainer's own checkpoint layout);
- ``buddy/checkpoint-<step>/``: the previous node's part, received from it;
- ``checkpoint-<step>.json`` (:class:`Holding`): written last, by rename, once both are on disk:
  the whole checkpoint's files and sizes (every node's parts), the lineage, the world size, and
  which of the files this node holds. Without it the step is not there on this node.

A restore (:func:`choose`) takes the newest step, of the run's lineage and world size and newer than
the durable tier's newest, whose files the nodes still answering hold between them, own or buddy
copies, each file from one holder. Every file read back is checked: regular files inside the
folder, sizes as recorded; a holding that does not parse is skipped and counted.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field

from hfscale.checkpoints.lineage import LINEAGE_FILE  # which run the local checkpoints belong to
from hfscale.core.records import Count, Record
from hfscale.core.untrusted import MiB, Unreadable, read_record

HOLDING_CAP = 16 * MiB
MAX_FILES = 1_000_000
OWN, BUDDY = "own", "buddy"
_HOLDING = re.compile(r"^checkpoint-([0-9]{1,15})\.json$")
RelPath = Annotated[str, Field(min_length=1, max_length=4096)]


class Holding(Record):
    """``checkpoint-<step>.json`` on one node: the checkpoint, and this node's share of it."""

    step: Count
    world_size: Annotated[int, Field(ge=1, le=1 << 24)]
    lineage: Annotated[str, Field(pattern=r"^[0-9a-f]{8,64}$")]
    files: Annotated[dict[RelPath, Count], Field(max_length=MAX_FILES)]  # the whole checkpoint
    own: Annotated[list[RelPath], Field(max_length=MAX_FILES)]  # under own/checkpoint-<step>/
    buddy: Annotated[list[RelPath], Field(max_length=MAX_FILES)]  # under buddy/checkpoint-<step>/


def node_dir(template: str, host: str, output_dir: str) -> Path:
    """This node's folder of the job's local checkpoints: ``template`` with ``{host}`` replaced,
    then a key of the output_dir (its absolute path's hash)."""
    key = hashlib.sha256(os.path.abspath(output_dir).encode()).hexdigest()[:16]
    return Path(template.replace("{host}", host)) / key


def part(root: Path, kind: str, step: int) -> Path:
    return root / kind / f"checkpoint-{step}"


def listing(folder: Path) -> dict[str, int]:
    """Every regular file under ``folder`` and its size (links and other kinds are not a checkpoint's)."""
    out: dict[str, int] = {}
    for dirpath, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(dirpath, d))]
        for name in names:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if os.path.isfile(full) and not os.path.islink(full):
                out[Path(full).relative_to(folder).as_posix()] = st.st_size
    return dict(sorted(out.items()))


def holding_path(root: Path, step: int) -> Path:
    return root / f"checkpoint-{step}.json"


def write_holding(root: Path, h: Holding) -> Path:
    """Write ``h`` by rename: the step is there on this node from this moment."""
    path = holding_path(root, h.step)
    tmp = root / f".checkpoint-{h.step}.json.tmp{os.getpid()}"
    tmp.write_text(h.model_dump_json())
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class Held:
    """What one node holds of one step: its holding, and the files verified on disk (path -> folder)."""

    holding: Holding
    files: dict[str, str]  # relative path -> the folder it is in on this node (own or buddy part)


@dataclass(frozen=True)
class Scan:
    held: tuple[Held, ...]
    skipped: tuple[str, ...] = ()  # "<file>: why"


def _verified(root: Path, h: Holding) -> dict[str, str]:
    out: dict[str, str] = {}
    for kind, paths in ((OWN, h.own), (BUDDY, h.buddy)):
        folder = part(root, kind, h.step)
        for rel in paths:
            size = h.files.get(rel)
            full = folder / rel
            if size is None or ".." in Path(rel).parts or Path(rel).is_absolute():
                continue
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if os.path.isfile(full) and not os.path.islink(full) and st.st_size == size:
                out.setdefault(rel, str(folder))
    return out


def scan(root: Path) -> Scan:
    """The steps this node holds (newest first), each with the files found as recorded."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return Scan(())
    held, skipped = [], []
    for name in names:
        if not _HOLDING.match(name):
            continue
        try:
            h = read_record(root / name, Holding, HOLDING_CAP, root)
        except Unreadable as e:
            skipped.append(f"{name}: {e}")
            continue
        held.append(Held(h, _verified(root, h)))
    return Scan(tuple(sorted(held, key=lambda x: -x.holding.step)), tuple(skipped))


@dataclass(frozen=True)
class Restore:
    """Restore ``step``: each node (index into the scans given to :func:`choose`) copies these files."""

    step: int
    world_size: int
    files: dict[str, int]  # the whole checkpoint: path -> size
    by_node: dict[int, dict[str, str]]  # node -> {relative path: folder it is in}


def choose(scans: list[Scan], lineage: str | None, world_size: int, newer_than: int) -> Restore | None:
    """The newest step of ``lineage`` at ``world_size``, newer than ``newer_than``, whose files the
    nodes hold between them (each file from the first node that has it); None when there is none."""
    if lineage is None:
        return None
    steps = sorted({x.holding.step for s in scans for x in s.held
                    if x.holding.lineage == lineage and x.holding.world_size == world_size
                    and x.holding.step > newer_than}, reverse=True)
    for step in steps:
        mine = [(n, x) for n, s in enumerate(scans) for x in s.held if x.holding.step == step
                and x.holding.lineage == lineage and x.holding.world_size == world_size]
        files = mine[0][1].holding.files
        if any(x.holding.files != files for _, x in mine):
            continue  # nodes disagree about what the checkpoint is: not one checkpoint
        by_node: dict[int, dict[str, str]] = {}
        taken: set[str] = set()
        for n, x in mine:
            for rel, folder in x.files.items():
                if rel in files and rel not in taken:
                    taken.add(rel)
                    by_node.setdefault(n, {})[rel] = folder
        if taken == set(files):
            return Restore(step, world_size, dict(files), by_node)
    return None


def copy_files(files: dict[str, str], dest: Path) -> None:
    """Copy each relative path from its folder into ``dest`` (the shared output_dir's staging folder)."""
    for rel, folder in files.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(folder) / rel, target, follow_symlinks=False)


def rotate(root: Path, keep: int) -> list[int]:
    """Remove this node's local steps but the ``keep`` newest (holding first, then its parts); the
    steps removed. Parts with no holding older than the newest kept (a save cut short) go too."""
    s = scan(root)
    steps = [x.holding.step for x in s.held]
    drop = steps[keep:]
    newest_kept = min(steps[:keep]) if steps[:keep] else None
    for kind in (OWN, BUDDY):
        try:
            names = os.listdir(root / kind)
        except OSError:
            continue
        for name in names:
            m = re.match(r"^checkpoint-([0-9]{1,15})$", name)
            if m and int(m.group(1)) not in steps and newest_kept is not None and int(m.group(1)) < newest_kept:
                drop.append(int(m.group(1)))
    for step in sorted(set(drop)):
        remove(root, step)
    return sorted(set(drop))


def remove(root: Path, step: int) -> None:
    """Remove this node's ``step``: its holding first (the step is gone from this moment), then its parts."""
    try:
        os.remove(holding_path(root, step))
    except OSError:
        pass
    for kind in (OWN, BUDDY):
        shutil.rmtree(part(root, kind, step), ignore_errors=True)


def buddy_of(node: int, nodes: int) -> int:
    """The node that keeps a copy of ``node``'s part: the next one, round the ring."""
    return (node + 1) % nodes
