"""What a hang's stack dump leaves on the shared file system, and who answered it.

Before the dump, :class:`DumpMarks` notes each rank's stack and flight recorder files (inode, size,
time, taken from the opened file: opening is what makes an NFS client check its cached attributes,
and the files are looked up by name, not listed, as a cached listing may lack a new file); after
it, only files written since are read (an earlier dump's are not this hang's). A rank
answers through its own code: the flight recorder's thread (``flight/rank-N.json``) or
faulthandler's handler (``stacks/rank-N.fh``), both from hfscale.training.heartbeat; a stopped
rank, or one stuck in the kernel or a driver with the GIL held, cannot. py-spy's ``rank-N.txt`` is
no answer: py-spy reads a stopped process too. Reads files only, each capped and regular.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

from hfscale.core.records import FLIGHT_CAP, TEXT_CAP
from hfscale.core.untrusted import Unreadable, open_regular, read_bytes, read_json
from hfscale.launch.spec import HangWatch
from hfscale.training.heartbeat import FAULTHANDLER_SUFFIX, FLIGHT_DIR


class LastCollective(NamedTuple):
    """A rank's newest flight recorder entry: collectives issued, the last one's name, its state."""

    issued: int
    name: str
    state: str


Mark = tuple[int, int, int]  # (inode, size, mtime in ns) of the opened file: a replace changes the inode
Marks = dict[str, Mark]  # file name -> its mark


def mark(path: Path) -> Mark | None:
    """The file's mark, None when it is missing or not a regular file (hfscale.core.untrusted)."""
    try:
        fd, st = open_regular(path)
    except Unreadable:
        return None
    os.close(fd)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _fresh(path: Path, before: Marks | None) -> bool:
    """Written since ``before`` (or no marks to compare with)."""
    if before is None:
        return True
    now = mark(path)
    return now is not None and now != before.get(path.name)


def read_stacks(stacks_dir: str, before: Marks | None = None) -> dict[int, str]:
    """rank -> its dumped stack (py-spy's file, else faulthandler's); with ``before``, only files
    written since those marks."""
    out: dict[int, str] = {}
    folder = Path(stacks_dir)
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return out
    for e in entries:
        m = re.match(r"^rank-(\d+)(\.txt|" + re.escape(FAULTHANDLER_SUFFIX) + ")$", e.name)
        if not m or not _fresh(e, before):
            continue
        try:  # faulthandler appends each dump: the newest is at the end
            text = read_bytes(e, TEXT_CAP, folder, tail=True).decode("utf-8", "replace")
        except Unreadable:
            continue
        rank = int(m[1])
        if text.strip() and (m[2] == ".txt" or rank not in out):
            out[rank] = text
    return out


def read_flight(flight_dir: str, before: Marks | None = None) -> dict[int, LastCollective]:
    """rank -> (collectives issued, the last one's name, its state) from the flight recorder dumps
    hfscale.training.heartbeat wrote (the default process group's entries); with ``before``, only
    files written since those marks."""
    out: dict[int, LastCollective] = {}
    try:
        files = sorted(Path(flight_dir).glob("rank-*.json"))
    except OSError:
        return out
    def seq(e: dict) -> int:
        n = e.get("collective_seq_id")
        return n if isinstance(n, int) and not isinstance(n, bool) else 0

    for f in files:
        if not _fresh(f, before):
            continue
        try:
            dumps = read_json(f, FLIGHT_CAP, flight_dir)
            rank = int(f.stem.removeprefix("rank-"))
        except (Unreadable, ValueError):
            continue
        groups = [d.get("entries") for d in dumps if isinstance(d, dict)] if isinstance(dumps, list) else []
        entries = [e for g in groups if isinstance(g, list) for e in g if isinstance(e, dict)]
        if entries:
            last = max(entries, key=seq)
            out[rank] = LastCollective(seq(last), str(last.get("profiling_name", "?"))[:80],
                                       str(last.get("state", "?"))[:40])
    return out


def _stack_names(rank: int) -> tuple[str, str]:
    return f"rank-{rank}{FAULTHANDLER_SUFFIX}", f"rank-{rank}.txt"


@dataclass(frozen=True)
class DumpMarks:
    """The ranks' stack and flight recorder files as they were before the dump."""

    stacks: Marks
    flight: Marks

    @classmethod
    def take(cls, watch: HangWatch, ranks: Iterable[int]) -> DumpMarks:
        stacks, flight, ranks = Path(watch.stacks_dir), Path(flight_dir(watch)), list(ranks)
        return cls({n: m for r in ranks for n in _stack_names(r) if (m := mark(stacks / n)) is not None},
                   {n: m for r in ranks if (m := mark(flight / (n := f"rank-{r}.json"))) is not None})


def flight_dir(watch: HangWatch) -> str:
    return str(Path(watch.stacks_dir).parent / FLIGHT_DIR)


ANSWER_WAIT_S = 5.0  # a live rank's thread answers in well under this, on a loaded machine too


def answered(watch: HangWatch, rank: int, before: DumpMarks) -> bool:
    """The rank's own code wrote since ``before``: its flight recorder's thread (``flight/rank-N.json``)
    or faulthandler's signal handler (``stacks/rank-N.fh``). py-spy's file is no answer: py-spy reads
    a stopped process's stack too."""
    fh = Path(watch.stacks_dir) / _stack_names(rank)[0]
    return _fresh(Path(flight_dir(watch)) / f"rank-{rank}.json", before.flight) or _fresh(fh, before.stacks)


def await_answers(watch: HangWatch, ranks: Iterable[int], before: DumpMarks, wait_s: float = ANSWER_WAIT_S,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> frozenset[int]:
    """The ranks of ``ranks`` that :func:`answered`, looked at again (those not yet) until all have or
    ``wait_s`` has passed."""
    deadline, pending, got = clock() + wait_s, set(ranks), set()
    while True:
        got |= {r for r in pending if answered(watch, r, before)}
        pending -= got
        if not pending or clock() >= deadline:
            return frozenset(got)
        sleep(0.5)
