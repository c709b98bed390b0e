"""What a hang's stack dump leaves on the shared file system, and who answered it.

Before the dump, :class:`DumpMarks` notes each stack and flight recorder file's size and time;
after it, only files written since are read (an earlier dump's are not this hang's). A rank
answers through its own code: the flight recorder's thread (``flight/rank-N.json``) or
faulthandler's handler (``stacks/rank-N.fh``), both from hfscale.training.heartbeat; a stopped
rank, or one stuck in the kernel or a driver with the GIL held, cannot. py-spy's ``rank-N.txt`` is
no answer: py-spy reads a stopped process too. Reads files only, each capped and regular.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

from hfscale.core.records import FLIGHT_CAP, TEXT_CAP
from hfscale.core.untrusted import Unreadable, read_bytes, read_json
from hfscale.launch.spec import HangWatch
from hfscale.training.heartbeat import FAULTHANDLER_SUFFIX, FLIGHT_DIR


class LastCollective(NamedTuple):
    """A rank's newest flight recorder entry: collectives issued, the last one's name, its state."""

    issued: int
    name: str
    state: str


Marks = dict[str, tuple[int, int]]  # file name -> (size, mtime in ns)


def marks(folder: str) -> Marks:
    """The size and modification time of each file in ``folder``, taken before a dump: files that
    are the same after it are an earlier dump's, and a rank that wrote none did not answer."""
    out: Marks = {}
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return out
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        out[e.name] = (st.st_size, st.st_mtime_ns)
    return out


def _fresh(e: Path, before: Marks | None) -> bool:
    if before is None or e.name not in before:
        return True
    try:
        st = e.stat(follow_symlinks=False)
    except OSError:
        return False
    return (st.st_size, st.st_mtime_ns) != before[e.name]


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


@dataclass(frozen=True)
class DumpMarks:
    """The stack and flight recorder files as they were before the dump."""

    stacks: Marks
    flight: Marks

    @classmethod
    def take(cls, watch: HangWatch) -> DumpMarks:
        return cls(marks(watch.stacks_dir), marks(flight_dir(watch)))


def flight_dir(watch: HangWatch) -> str:
    return str(Path(watch.stacks_dir).parent / FLIGHT_DIR)


ANSWER_WAIT_S = 5.0  # a live rank's thread answers in well under this, on a loaded machine too
_ANSWER = re.compile(r"^rank-(\d{1,7})(" + re.escape(FAULTHANDLER_SUFFIX) + r"|\.json)$")


def answers(watch: HangWatch, before: DumpMarks) -> frozenset[int]:
    """The ranks that answered the dump: their own code wrote since ``before``, their flight
    recorder's thread (``flight/rank-N.json``) or faulthandler's signal handler (``stacks/rank-N.fh``).
    py-spy's file is no answer: py-spy reads a stopped process's stack too."""
    out: set[int] = set()
    for folder, marked in ((watch.stacks_dir, before.stacks), (flight_dir(watch), before.flight)):
        try:
            entries = list(Path(folder).iterdir())
        except OSError:
            continue
        for e in entries:
            m = _ANSWER.match(e.name)
            if m and _fresh(e, marked):
                out.add(int(m[1]))
    return frozenset(out)


def await_answers(watch: HangWatch, ranks: Iterable[int], before: DumpMarks, wait_s: float = ANSWER_WAIT_S,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> frozenset[int]:
    """:func:`answers`, read again until all of ``ranks`` have answered or ``wait_s`` has passed."""
    deadline, want = clock() + wait_s, set(ranks)
    while True:
        got = answers(watch, before)
        if want <= got or clock() >= deadline:
            return got
        sleep(0.5)
