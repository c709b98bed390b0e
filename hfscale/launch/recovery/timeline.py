"""``<run dir>/timeline.jsonl``: the attempts of a job that recovers from failures, one
hfscale.core.records.TimelineEvent a line (launch, failure, stopped, relaunch, training, gave_up,
finished). The supervisor appends; ``hfscale status``/``report`` read it back as untrusted
(hfscale.core.untrusted) and hfscale.runs.goodput turns it into time lost. Files only, no processes.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from hfscale.core.records import TIMELINE_CAP, TIMELINE_LINE_CAP, TimelineEvent
from hfscale.core.untrusted import Missing, Unreadable, read_json_lines
from hfscale.launch.run_dir import read_metrics
from hfscale.training.heartbeat import parts

TIMELINE_FILE = "timeline.jsonl"
MAX_TIMELINE_LINES = 1_000_000
_APPEND = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
           | getattr(os, "O_NOCTTY", 0))


@dataclass(frozen=True)
class Timeline:
    """The events of a timeline.jsonl in file order; ``skipped``: lines that were not events (torn by a
    crash, too long, a wrong type or time); ``cut``: the file was over TIMELINE_CAP and only its
    newest part was read."""

    events: tuple[TimelineEvent, ...]
    skipped: int = 0
    cut: bool = False


def append_event(run_dir: str | Path, event: TimelineEvent) -> str | None:
    """Append ``event`` as one JSON line to ``<run_dir>/timeline.jsonl`` (created 0644; a link, FIFO or
    device there is refused). Why it could not be written, or None: the job goes on either way."""
    path = Path(run_dir) / TIMELINE_FILE
    data = (event.model_dump_json(exclude_none=True) + "\n").encode()
    try:
        fd = os.open(path, _APPEND, 0o644)
    except OSError as e:
        return f"cannot write {path}: {e.strerror or e}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"cannot write {path}: not a regular file"
        view = memoryview(data)
        while view:  # one write in practice: O_APPEND keeps a line whole against other appenders
            view = view[os.write(fd, view):]
    except OSError as e:
        return f"cannot write {path}: {e.strerror or e}"
    finally:
        os.close(fd)
    return None


def start_parts(run_dir: str | Path, launched: float) -> dict[str, float] | None:
    """The parts of an attempt's start (hfscale.training.heartbeat.parts), from rank 0's marks in its
    metrics (None: none, or unreadable): for its "training" event."""
    try:
        marks = read_metrics(run_dir).phases
    except Unreadable:
        return None
    return parts(dict(marks), launched) or None if marks else None


def read_timeline(run_dir: str | Path) -> Timeline:
    """The events of ``<run_dir>/timeline.jsonl`` (empty when there is none). Lines that are not
    events are skipped and counted. Raises hfscale.core.untrusted.Unreadable when the file is not a
    regular file (a symbolic link is not followed) or cannot be read."""
    path = Path(run_dir) / TIMELINE_FILE
    try:
        lines = read_json_lines(path, TimelineEvent, TIMELINE_LINE_CAP, TIMELINE_CAP, MAX_TIMELINE_LINES, run_dir)
    except Missing:
        return Timeline(())
    return Timeline(tuple(lines.records), lines.skipped, lines.cut)


_ESSENTIAL = ("kind", "attempt", "at", "cause", "host", "what", "hosts", "excluded", "readmitted", "replaced", "spares")


def record_event(run_dir: str, **fields: object) -> None:
    """Append one event to the run's timeline; ``at`` defaults to now. A write that fails is
    skipped (the job goes on; its timeline then misses the event)."""
    fields = {k: v for k, v in fields.items() if v is not None}
    fields.setdefault("at", time.time())
    for keep in (fields, {k: v for k, v in fields.items() if k in _ESSENTIAL}):  # a bad measure costs that field
        try:
            event = TimelineEvent.model_validate(keep)
        except ValueError:
            continue
        if os.path.isdir(run_dir):
            append_event(run_dir, event)
        return
