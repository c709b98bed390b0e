"""The restarts a job's ranks make in their processes (``recovery.in_process``), as timeline events.

The launcher sees no node fail when the ranks heal one themselves (hfscale.training.inprocess). Rank 0
of each new in-process attempt marks its start again (hfscale.training.heartbeat.begin_attempt): its
number, why the attempt before ended, rank 0's last step before it, and then, as for a launch, when
each part of the start ended. ``follow`` reads that (``progress/metrics.json``, one small file) every
``FOLLOW_S`` during a launch attempt and, once the new attempt's first step is marked, appends one
``in_process`` event to the timeline (hfscale.launch.recovery.timeline): ``status``, ``report`` and
goodput count it as a restart. Two in-process restarts within one ``FOLLOW_S`` show as the later one.
Files only, no processes.
"""

from __future__ import annotations

import threading
from pathlib import Path

from hfscale.core.records import Rank0Metrics, TimelineEvent
from hfscale.core.untrusted import Unreadable
from hfscale.launch.recovery.timeline import append_event
from hfscale.launch.run_dir import read_metrics
from hfscale.training.heartbeat import parts

FOLLOW_S = 1.0


def event_of(m: Rank0Metrics, attempt: int, recorded: int) -> TimelineEvent | None:
    """The ``in_process`` event of launch attempt ``attempt`` that rank 0's metrics ``m`` show, once its
    first step is marked; None when there is none newer than in-process attempt ``recorded`` (pure)."""
    marks = dict(m.phases or {})
    if m.in_process is None or m.in_process <= recorded or "process" not in marks or "first_step" not in marks:
        return None
    return TimelineEvent(kind="in_process", attempt=attempt, at=marks["process"], in_process=m.in_process,
                         what=m.in_process_why or None, failed_step=m.failed_step, resume_step=m.resumed,
                         step=None if m.resumed is None else m.resumed + 1, phases=parts(marks, None) or None)


def record_new(run_dir: str | Path, attempt: int, recorded: int) -> int:
    """Append the newest in-process restart not yet recorded; returns the newest in-process attempt recorded."""
    try:
        event = event_of(read_metrics(run_dir), attempt, recorded)
    except Unreadable:  # half a file cannot be seen (it is replaced whole): not rank 0's; tried again
        return recorded
    if event is None:
        return recorded
    append_event(run_dir, event)
    return event.in_process or recorded


def follow(run_dir: str, attempt: int, done: threading.Event) -> threading.Thread:
    """A daemon thread that records launch attempt ``attempt``'s in-process restarts until ``done``."""
    def loop() -> None:
        recorded = 0
        while not done.wait(FOLLOW_S):
            recorded = record_new(run_dir, attempt, recorded)
        record_new(run_dir, attempt, recorded)

    t = threading.Thread(target=loop, daemon=True, name="hfscale-in-process-events")
    t.start()
    return t
