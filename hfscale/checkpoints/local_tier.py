"""The local tier of checkpoints (``training.local_checkpoints``): frequent checkpoints on each node's
own disk, each node's part also copied to one buddy node, so that losing one node loses nothing.
This module is the files and the choices (no torch, no process group); the ranks' side, the save
and the restore, is hfscale.training.callbacks.local_tier.

On each node, under ``<dir>/<key>/`` (``key``: a hash of the output_dir, so jobs do not mix):

- ``own/checkpoint-<step>/``: what this node's ranks saved (the Trainer's own checkpoint layout);
- ``buddy/checkpoint-<step>/``: the previous node's part, received from it;
- ``checkpoint-<step>.json`` (:class:`Holding`): written last, by rename, once both are on disk:
  the whole checkpoint's files and sizes (every node's parts), the lineage, the world size, which
  of the files this node holds, and the CRC-32 of each of them, taken when it was saved (own) or
  received (buddy). Without it the step is not there on this node.

A restore (:func:`choose`) takes the newest step, of the run's lineage and world size and newer than
the durable tier's newest, whose files the nodes still answering hold between them, own or buddy
copies, each file from one holder. Every file read back is checked: regular files inside the
folder, sizes as recorded, a checksum recorded (a file without one cannot be verified and is not
offered); a holding that does not parse is skipped and counted. The copy into the output_dir
computes each file's CRC-32 on the way (:func:`copy_checked`): a file whose bytes no longer match
(rot on the node's disk: sizes and times unchanged, and ``torch.load`` does not check a zip's
CRCs) is taken from its other holder instead (the buddy's copy), else the step is not restored and
an older one is tried (``choose`` with ``exclude`` and ``older_than``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from hfscale.checkpoints.lineage import LINEAGE_FILE  # noqa: F401 (here as before: which run the steps belong to)
from hfscale.core.records import Count, Record
from hfscale.core.untrusted import MiB, Unreadable, read_record

HOLDING_CAP = 16 * MiB
MAX_FILES = 1_000_000
OWN, BUDDY = "own", "buddy"
_HOLDING = re.compile(r"^checkpoint-([0-9]{1,15})\.json$")
RelPath = Annotated[str, Field(min_length=1, max_length=4096)]
Crc = Annotated[str, Field(pattern=r"^[0-9a-f]{8}$")]  # a file's CRC-32, 8 hex digits
CRC_CHUNK = 16 * MiB  # read this much at a time for a checksum; zlib's crc32 releases the GIL on it
COPY_CHUNK = MiB  # copied (and summed on the way) this much at a time: it stays in the CPU's cache between the two


class Holding(Record):
    """``checkpoint-<step>.json`` on one node: the checkpoint, and this node's share of it."""

    step: Count
    world_size: Annotated[int, Field(ge=1, le=1 << 24)]
    lineage: Annotated[str, Field(pattern=r"^[0-9a-f]{8,64}$")]
    files: Annotated[dict[RelPath, Count], Field(max_length=MAX_FILES)]  # the whole checkpoint
    own: Annotated[list[RelPath], Field(max_length=MAX_FILES)]  # under own/checkpoint-<step>/
    buddy: Annotated[list[RelPath], Field(max_length=MAX_FILES)]  # under buddy/checkpoint-<step>/
    # the CRC-32 of each file this node holds (own and buddy); a holding without them (an older hfscale's) offers nothing
    sums: Annotated[dict[RelPath, Crc], Field(max_length=MAX_FILES)] = {}


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
class Source:
    """Where one node holds one file of a step: the folder (its own part or its buddy copy) and the
    file's CRC-32 recorded when it got there."""

    folder: str
    kind: Literal["own", "buddy"]
    crc: str


@dataclass(frozen=True)
class Held:
    """What one node holds of one step: its holding, and the files found on disk as recorded."""

    holding: Holding
    files: dict[str, Source]  # relative path -> where it is on this node


@dataclass(frozen=True)
class Scan:
    held: tuple[Held, ...]
    skipped: tuple[str, ...] = ()  # "<file>: why"
    host: str = ""  # the node's name (the restore's messages)


def _verified(root: Path, h: Holding) -> dict[str, Source]:
    out: dict[str, Source] = {}
    for kind, paths in ((OWN, h.own), (BUDDY, h.buddy)):
        folder = part(root, kind, h.step)
        for rel in paths:
            size, crc = h.files.get(rel), h.sums.get(rel)
            full = folder / rel
            if size is None or crc is None or ".." in Path(rel).parts or Path(rel).is_absolute():
                continue
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if os.path.isfile(full) and not os.path.islink(full) and st.st_size == size:
                out.setdefault(rel, Source(str(folder), kind, crc))  # type: ignore[arg-type]
    return out


def scan(root: Path, host: str = "") -> Scan:
    """The steps this node (``host``) holds, newest first, each with the files found as recorded."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return Scan((), (), host)
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
    return Scan(tuple(sorted(held, key=lambda x: -x.holding.step)), tuple(skipped), host)


@dataclass(frozen=True)
class Restore:
    """Restore ``step``: each node (index into the scans given to :func:`choose`) copies these files."""

    step: int
    world_size: int
    files: dict[str, int]  # the whole checkpoint: path -> size
    by_node: dict[int, dict[str, Source]]  # node -> {relative path: where it is there}


def choose(scans: list[Scan], lineage: str | None, world_size: int, newer_than: int,
           exclude: frozenset[tuple[int, str]] = frozenset(), older_than: int | None = None) -> Restore | None:
    """The newest step of ``lineage`` at ``world_size``, newer than ``newer_than`` (and older than
    ``older_than``), whose files the nodes hold between them, each file from the node whose own part
    it is (the copies then spread over the nodes), else from the first node holding a buddy copy of
    it, but for ``exclude`` ((node, path): a copy that did not match its checksum); None when there is
    none."""
    if lineage is None:
        return None
    steps = sorted({x.holding.step for s in scans for x in s.held
                    if x.holding.lineage == lineage and x.holding.world_size == world_size
                    and newer_than < x.holding.step and (older_than is None or x.holding.step < older_than)},
                   reverse=True)
    for step in steps:
        mine = [(n, x) for n, s in enumerate(scans) for x in s.held if x.holding.step == step
                and x.holding.lineage == lineage and x.holding.world_size == world_size]
        files = mine[0][1].holding.files
        if any(x.holding.files != files for _, x in mine):
            continue  # nodes disagree about what the checkpoint is: not one checkpoint
        by_node: dict[int, dict[str, Source]] = {}
        taken: set[str] = set()
        for kinds in ((OWN,), (OWN, BUDDY)):  # each node copies its own part; a buddy's copy only where it must
            for n, x in mine:
                for rel, source in x.files.items():
                    if source.kind in kinds and rel in files and rel not in taken and (n, rel) not in exclude:
                        taken.add(rel)
                        by_node.setdefault(n, {})[rel] = source
        if taken == set(files):
            return Restore(step, world_size, dict(files), by_node)
    return None


def crc32_of(path: Path) -> str:
    """The CRC-32 of the file at ``path``, 8 hex digits (read CRC_CHUNK at a time)."""
    crc, buf = 0, bytearray(min(CRC_CHUNK, max(1, os.path.getsize(path))))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def sums_of(folder: Path, rels: Iterable[str]) -> dict[str, str]:
    """The CRC-32 of each of ``rels`` under ``folder`` (raises OSError for a file that cannot be read)."""
    return {rel: crc32_of(folder / rel) for rel in rels}


def sums_all(folder: Path, rels: Iterable[str], workers: int = 8) -> dict[str, str]:
    """``sums_of``, ``workers`` files at once (zlib's crc32 and the reads release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    rels = sorted(rels)
    if len(rels) < 2:
        return sums_of(folder, rels)
    with ThreadPoolExecutor(max_workers=min(workers, len(rels))) as pool:
        return dict(zip(rels, pool.map(lambda rel: crc32_of(folder / rel), rels)))


COPY_WORKERS = 8  # files copied at once by a node's restore (the copies and the checksums release the GIL)


def copy_all_checked(files: dict[str, Source], dest: Path, workers: int = COPY_WORKERS) -> dict[str, str | None]:
    """``copy_checked`` of every file, ``workers`` at a time: path -> None (copied, it matches), its
    CRC-32 now (it does not match), or "unreadable" (its source could not be read). Raises WriteFailed
    (the first one) when a copy cannot be written: the output_dir's disk, not the source."""
    from concurrent.futures import ThreadPoolExecutor

    def one(rel: str) -> str | None:
        try:
            return copy_checked(rel, files[rel], dest)
        except WriteFailed:
            raise
        except OSError:  # gone, a link put there since the scan, an I/O error of the node's disk
            return "unreadable"

    if not files:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(files)))) as pool:
        futures = {rel: pool.submit(one, rel) for rel in sorted(files)}
        return {rel: f.result() for rel, f in futures.items()}


def _write_all(w, data: memoryview) -> None:
    """An unbuffered file's write may take part of the bytes: write until all are written."""
    while data:
        n = w.write(data)
        data = data[n:]


class WriteFailed(OSError):
    """The copy could not be written where it goes (the output_dir's disk), as opposed to read."""


def copy_checked(rel: str, source: Source, dest: Path) -> str | None:
    """Copy ``rel`` from ``source`` into ``dest`` (the shared output_dir's staging folder), its CRC-32
    computed on the way (one read of each byte): None when it matches the recorded one, else what the
    bytes are now (the copy is removed). Raises OSError for a source that cannot be read, WriteFailed
    for a copy that cannot be written."""
    target = dest / rel
    crc, buf = 0, bytearray(COPY_CHUNK)
    view = memoryview(buf)
    fd = os.open(Path(source.folder) / rel, os.O_RDONLY | os.O_NOFOLLOW)  # never a link put there since the scan
    with open(fd, "rb", buffering=0) as r:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            w = open(target, "wb", buffering=0)
        except OSError as e:
            raise WriteFailed(e.errno, e.strerror, str(target)) from e
        with w:
            while n := r.readinto(buf):
                crc = zlib.crc32(view[:n], crc)
                try:
                    _write_all(w, view[:n])
                except OSError as e:
                    raise WriteFailed(e.errno, e.strerror, str(target)) from e
    if f"{crc:08x}" == source.crc:
        return None
    target.unlink()
    return f"{crc:08x}"


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
