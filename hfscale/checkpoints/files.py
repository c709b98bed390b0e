"""Whether a Trainer checkpoint folder is complete, judged by its own files (no marker needed).

An unchanged training script never writes hfscale's completion marker, so a checkpoint has to
speak for itself. Every rank of the HF Trainer saves in this order: the model, the optimizer and
scheduler (with DeepSpeed: the engine's shards, one per rank, and ``latest``), then its RNG state
(``rng_state_<rank>.pth``; ``rng_state.pth`` when it runs alone), and last, on rank 0,
``trainer_state.json``. So a folder is complete when

- ``trainer_state.json`` is readable and names the folder's step;
- an RNG state exists for every rank 0..N-1 (N: the number of ranks that saved it);
- the model is there (a safetensors/bin file, an index with all its shards, an FSDP folder; with
  DeepSpeed its shards hold it), and the optimizer state for the engine (DeepSpeed shards for every
  rank, an FSDP optimizer folder, or ``optimizer.pt``) and, without DeepSpeed, ``scheduler.pt``;
- every file is whole: torch.save's zip archives end with their end-of-central-directory record,
  a safetensors file is exactly as long as its header says, an FSDP folder has its ``.metadata``.

A few bytes are read per file; nothing is loaded and torch is not imported. Files are read
through hfscale.core.untrusted: a link, a FIFO or a device in a checkpoint is not followed or read, it
makes the checkpoint incomplete.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from hfscale.core.untrusted import (MiB, Missing, Unreadable, decode, open_regular, parse_json, read_bytes, real_dir, real_file,
                        tag_name)

if TYPE_CHECKING:
    from hfscale.core.records import TrainerState

TRAINER_STATE = "trainer_state.json"
# rank numbers of at most 6 digits: a crafted name cannot make a check count to 10**12
_RNG_RE = re.compile(r"^rng_state(?:_([0-9]{1,6}))?\.pth$")
_SHARD_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_([0-9]{1,6})_mp_rank_([0-9]{1,6})_(optim|model)_states\.pt$")
_MP_MODEL_RE = re.compile(r"^mp_rank_([0-9]{1,6})_model_states\.pt$")
_EOCD = b"PK\x05\x06"
_ZIP_SUFFIXES = (".pt", ".pth", ".bin")


def zip_whole(path: Path) -> bool:
    """True when the zip archive at ``path`` (torch.save's format) ends with its whole directory record."""
    try:  # the record (22 bytes) and at most a 64 KiB archive comment
        tail = read_bytes(path, 22 + 65535, tail=True)
    except Unreadable:
        return False
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        return False
    (comment_len,) = struct.unpack("<H", tail[at + 20:at + 22])
    return at + 22 + comment_len == len(tail)


def safetensors_whole(path: Path) -> bool:
    """True when the safetensors file at ``path`` is as long as its header says."""
    try:
        fd, st = open_regular(path)
    except Unreadable:
        return False
    try:
        size = st.st_size
        head = os.read(fd, 8)
        if len(head) < 8:
            return False
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * MiB:
            return False
        header = parse_json(os.read(fd, n), path)
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        return size == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, ArithmeticError, struct.error):
        return False
    finally:
        os.close(fd)


def file_problem(path: Path, rel: str) -> str | None:
    """Why the file ``rel`` (at ``path``) is not whole, or None."""
    if not real_file(path):
        return f"{rel} is missing" if not os.path.lexists(path) else \
            f"{rel} is not a regular file (a link, FIFO or device)"
    if path.suffix == ".safetensors" and not safetensors_whole(path):
        return f"{rel} is cut short (shorter than its safetensors header says)"
    if path.suffix in _ZIP_SUFFIXES and not zip_whole(path):
        return f"{rel} is cut short (no end record: the save did not finish)"
    return None


def _missing(ranks: set[int], n: int, first: int = 5) -> list[int]:
    """The first ``first`` of 0..n-1 not in ``ranks`` (without building the whole range)."""
    if len(ranks) >= n and max(ranks, default=-1) < n:
        return []
    out = []
    for r in range(n):
        if r not in ranks:
            out.append(r)
            if len(out) == first:
                break
    return out


def deepspeed_problem(ckpt: Path, world_size: int) -> str | None:
    """Check the DeepSpeed part of a Trainer checkpoint (``latest`` + ``global_step*/``), if any.
    ``world_size`` 0: expect the ranks the shards themselves show."""
    latest = ckpt / "latest"
    step_dirs = [p for p in ckpt.glob("global_step*") if real_dir(p)]
    if not os.path.lexists(latest) and not step_dirs:
        return None  # not a DeepSpeed checkpoint
    try:
        tag = read_tag(latest)
    except Missing:
        return "DeepSpeed file 'latest' is missing"
    except Unreadable as e:
        return f"DeepSpeed file 'latest': {e.reason}"
    tag_dir = ckpt / tag
    if not tag_name(tag) or not real_dir(tag_dir):
        return f"DeepSpeed tag folder {tag[:80]!r} named in 'latest' is missing"
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
        missing = _missing(ranks, dp or max(ranks) + 1)
        if missing:
            names = ", ".join(f"zero_pp_rank_{r}_mp_rank_{mp:02d}_{kind}_states.pt" for r in missing[:4])
            return f"DeepSpeed shard(s) missing in {tag}/: {names}" + (" ..." if len(missing) > 4 else "")
    return None


TAG_CAP = 256  # DeepSpeed's 'latest' names one folder


def read_tag(path: Path) -> str:
    """The folder name a tag file (DeepSpeed's ``latest``, ``latest_universal``) holds; raises Unreadable."""
    return decode(read_bytes(path, TAG_CAP), path).strip()


def deepspeed_tag(ckpt: str | os.PathLike[str]) -> str | None:
    """The DeepSpeed tag (``global_stepN``) a Trainer checkpoint's ``latest`` names, or None."""
    try:
        text = read_tag(Path(ckpt) / "latest")
    except Unreadable:
        return None
    return text if tag_name(text) and real_dir(Path(ckpt) / text) else None


def deepspeed_ranks(ckpt: Path) -> int | None:
    """The data-parallel ranks that wrote a DeepSpeed checkpoint (None: not one)."""
    tag = deepspeed_tag(ckpt)
    tag_dir = ckpt / tag if tag else next(
        (p for p in sorted(ckpt.glob("global_step*")) if real_dir(p) and not p.name.endswith("_universal")), None)
    if tag_dir is None:
        return None
    ranks = {int(m.group(1)) for p in tag_dir.iterdir() if (m := _SHARD_RE.match(p.name)) and m.group(3) == "optim"}
    return max(ranks) + 1 if ranks else None


INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def index_shards(ckpt: Path, index: str) -> tuple[list[str], str | None]:
    """(the shard files a weight index names, why it cannot be used): a shard named outside the
    checkpoint (a path, ``..``) is a problem, as the libraries would read it."""
    from hfscale.core.records import INDEX_CAP, WeightIndex
    from hfscale.core.untrusted import read_record

    try:
        shards = sorted(set(read_record(ckpt / index, WeightIndex, INDEX_CAP).weight_map.values()))
    except Unreadable as e:
        return [], f"unreadable {index}: {e.reason}"
    outside = next((s for s in shards if not tag_name(s)), None)
    return shards, f"{index} names a file outside the checkpoint: {outside[:80]!r}" if outside is not None else None


def model_problem(ckpt: Path, deepspeed: bool) -> str | None:
    names = {p.name for p in ckpt.iterdir()}
    for index in INDEXES:
        if index in names:
            shards, why = index_shards(ckpt, index)
            if why is not None:
                return why
            return next((w for shard in shards if (w := file_problem(ckpt / shard, shard))), None)
    for single in ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin"):
        if single in names:
            return file_problem(ckpt / single, single)
    fsdp = sorted(n for n in names if n.startswith("pytorch_model_fsdp"))
    if fsdp:
        return _fsdp_problem(ckpt, fsdp[0])
    return None if deepspeed else "no model weights (model.safetensors, pytorch_model.bin or an index)"


def _fsdp_problem(ckpt: Path, name: str) -> str | None:
    path = ckpt / name
    if real_dir(path):
        why = f"{name}/.metadata is missing (the sharded save did not finish)"
        return None if real_file(path / ".metadata") else why
    return file_problem(path, name)


def _optimizer_problem(ckpt: Path, deepspeed: bool, ranks: int) -> str | None:
    if deepspeed:
        why = deepspeed_problem(ckpt, ranks)
        if why is not None:
            return why
        tag = deepspeed_tag(ckpt)  # deepspeed_problem found it valid
        for p in sorted((ckpt / str(tag)).iterdir()):
            why = file_problem(p, f"{tag}/{p.name}") if not real_dir(p) else None
            if why:
                return why
        return None
    names = {p.name for p in ckpt.iterdir()}
    fsdp = sorted(n for n in names if n.startswith("optimizer_") and real_dir(ckpt / n))
    if fsdp:
        why = _fsdp_problem(ckpt, fsdp[0])
    elif "optimizer.bin" in names:
        why = file_problem(ckpt / "optimizer.bin", "optimizer.bin")
    else:
        why = file_problem(ckpt / "optimizer.pt", "optimizer.pt")
    return why or file_problem(ckpt / "scheduler.pt", "scheduler.pt")


def writer_ranks(ckpt: Path) -> tuple[int, str | None]:
    """(number of ranks that saved ``ckpt``, why that is unclear or incomplete) from its RNG states."""
    ranks: set[int] = set()
    alone = False
    for p in ckpt.iterdir():
        m = _RNG_RE.match(p.name)
        if m:
            if m.group(1) is None:
                alone = True
            else:
                ranks.add(int(m.group(1)))
    if alone and not ranks:
        return 1, file_problem(ckpt / "rng_state.pth", "rng_state.pth")
    if not ranks:
        return 0, ("no rng_state*.pth: the save did not get that far on any rank (or it was saved with "
                   "save_only_model, which cannot be resumed)")
    n = max(ranks) + 1
    missing = _missing(ranks, n)
    if missing:
        return n, f"rng_state_{missing[0]}.pth is missing (rank {missing[0]} did not finish saving)"
    for r in range(n):
        why = file_problem(ckpt / f"rng_state_{r}.pth", f"rng_state_{r}.pth")
        if why:
            return n, why
    return n, None


def odd_entry(ckpt: Path, allowed: tuple[str, ...] = (), limit: int = 1_000_000) -> str | None:
    """The first entry of the checkpoint folder (at any depth) that is neither a regular file nor a
    folder: a link (the libraries that read a checkpoint follow links, out of it too), a FIFO (a
    read waits for ever), a device or socket; None when there is none. Links are not followed.
    ``allowed``: names in the folder itself the caller reads with care (hfscale export's tokenizer
    files)."""
    todo, seen = [ckpt], 0
    while todo:
        folder = todo.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError as e:
            return f"{folder.relative_to(ckpt)}: cannot be listed ({e.strerror or e})"
        for e in entries:
            seen += 1
            if seen > limit:
                return f"holds over {limit:,} entries"
            if e.is_dir(follow_symlinks=False):
                todo.append(Path(e.path))
            elif not e.is_file(follow_symlinks=False) and not (folder == ckpt and e.name in allowed):
                rel = Path(e.path).relative_to(ckpt).as_posix()
                what = "a link" if e.is_symlink() else "a FIFO, device or socket"
                return f"{rel[:200]!r} is {what}, not a regular file"
    return None


def read_trainer_state(path: Path) -> "TrainerState":
    """A ``trainer_state.json``, typed (hfscale.core.records.TrainerState); raises Unreadable."""
    from hfscale.core.records import TRAINER_STATE_CAP, TrainerState
    from hfscale.core.untrusted import read_record

    return read_record(path, TrainerState, TRAINER_STATE_CAP)


# the Trainer writes trainer_state.json with sorted keys, indented by 2: "global_step" comes before
# log_history, so a file too big to parse whole still says its step near its start
_TOP_STEP = re.compile(rb'\n  "global_step": ([0-9]{1,15}),?\n')


def saved_step(path: Path) -> int:
    """The ``global_step`` of a ``trainer_state.json`` (its log_history is not built): parsed whole up
    to TRAINER_STATE_CAP; beyond that (a long run logging every step), read from its first 64 KiB
    as the Trainer writes it. Raises Unreadable."""
    from hfscale.core.records import TRAINER_STATE_CAP, TrainerStep
    from hfscale.core.untrusted import read_record

    fd, st = open_regular(path)
    try:
        head = os.read(fd, 64 * 1024) if st.st_size > TRAINER_STATE_CAP else None
    finally:
        os.close(fd)
    if head is None:
        return read_record(path, TrainerStep, TRAINER_STATE_CAP).global_step
    m = _TOP_STEP.search(head)
    if m is None:
        raise Unreadable(path, f"is {st.st_size:,} bytes, and its start names no global_step as the Trainer writes it")
    return int(m.group(1))


def content_problem(ckpt: Path, step: int | None) -> str | None:
    """Why the checkpoint folder ``ckpt`` (of ``step``, from its name) is not complete by its files, or None."""
    try:
        step_saved = saved_step(ckpt / TRAINER_STATE)
    except Missing:
        return f"{TRAINER_STATE} is missing (rank 0 writes it last: the save did not finish)"
    except Unreadable as e:
        return f"unreadable {TRAINER_STATE}: {e.reason}"
    if step is not None and step_saved != step:
        return f"{TRAINER_STATE} says step {step_saved}, the folder name says {step}"
    try:
        ranks, why = writer_ranks(ckpt)
        if why:
            return why
        deepspeed = os.path.lexists(ckpt / "latest") or any(real_dir(p) for p in ckpt.glob("global_step*"))
        ds_ranks = deepspeed_ranks(ckpt) if deepspeed else None
        if ds_ranks is not None and ds_ranks != ranks:
            return f"DeepSpeed shards of {ds_ranks} ranks but RNG states of {ranks}: a rank did not finish saving"
        return model_problem(ckpt, deepspeed) or _optimizer_problem(ckpt, deepspeed, ranks)
    except OSError as e:
        return f"cannot read the checkpoint: {os.strerror(e.errno) if e.errno else e}"
