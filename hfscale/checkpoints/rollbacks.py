"""The loss guard's record of rollbacks: ``<output_dir>/hfscale_rollbacks.json``, and what the next alarm does.

An alarm of the loss guard (hfscale.training.loss_guard: a NaN or a spike of the loss or the gradient
norm) stops the job without saving; rank 0 records it here as an *incident* with the action the job
takes (:func:`judge`):

- ``replay``: roll back to the newest checkpoint saved before the spike's first step and train the
  same data again. If the replay passes the alarm's step without one, the cause was transient
  (hardware, silent corruption): the incident is ``clean`` and the hosts whose ranks saw a NaN noted.
- ``skip``: the spike came back on the replay, so the data is to blame: roll back again and skip
  the batches of the steps from the spike's first step to its last plus ``skip_margin``. The skipped
  steps are listed with each rank's batches' fingerprints (SHA-256 of their ``input_ids``), enough to
  rebuild the run without them.
- ``strike``: a NaN that only some hosts' ranks saw came back on the same hosts (or a host that
  had a transient NaN before has another): those hosts are struck as the recovery policy strikes a
  failing host (replaced by a spare, or left out), and the same data replayed without them.
- ``stop``: more than ``max_rollbacks`` incidents; the verdict names the steps, values and batches.

While the newest incident is unresolved, every start resumes from a checkpoint older than its first
step (:func:`rollback_before`); the launch moves the newer ones aside (hfscale.launch.build).

Plain Python (no torch): the launch, ``status`` and the report read it; the file is hostile input like
every file hfscale reads back (a link, a huge or malformed file is not a record: :func:`read_rollbacks`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from hfscale.core.atomic_files import write_files
from hfscale.core.records import Count, Finite, Host, Number, Record
from hfscale.core.untrusted import Missing, read_record

ROLLBACKS_FILE = "hfscale_rollbacks.json"
LOSS_GUARD_SAID = "the loss guard stopped training: "  # how a failure it caused begins (timeline, status)
ROLLBACKS_CAP = 4 * 1024 * 1024
FORMAT = 1
MAX_INCIDENTS = 1000
Action = Literal["replay", "skip", "strike", "stop"]
Outcome = Literal["clean", "spiked_again", "superseded", "passed"]

__all__ = ["ROLLBACKS_FILE", "Incident", "Rollbacks", "read_rollbacks", "write_rollbacks", "judge", "resolve",
           "rollback_before", "skipped_steps", "incident_line"]


class SkippedStep(Record):
    """One step's batches left out: the step of the run that spiked, and each rank's batches' fingerprints."""

    step: Count
    fingerprints: Annotated[list[Annotated[str, Field(pattern=r"^[0-9a-f]{1,64}$")]], Field(max_length=100_000)] = []


class Incident(Record):
    """One alarm and what the job did about it."""

    n: Count
    kind: Literal["nan", "spike"]
    measure: Literal["loss", "grad_norm"]
    step: Count
    first_step: Count
    value: Number  # None: NaN or infinite
    median: Number = None
    hosts: Annotated[list[Host], Field(max_length=10_000)] = []  # hosts whose ranks alone saw a NaN
    resumed_from: Count | None = None  # the step the attempt that spiked resumed from (None: from scratch)
    rollback_to: Count | None = None  # the newest complete checkpoint saved before first_step (None: step 0)
    action: Action
    skip: tuple[Count, Count] | None = None  # skip: the first and last step whose batches are left out
    strike: Annotated[list[Host], Field(max_length=10_000)] = []
    outcome: Outcome | None = None  # None: not resolved yet (the next start rolls back before first_step)
    verdict: Annotated[str, Field(max_length=4000)] | None = None
    skipped: Annotated[list[SkippedStep], Field(max_length=100_000)] = []
    at: Finite = 0.0


class Rollbacks(Record):
    format: Literal[1] = 1
    incidents: Annotated[list[Incident], Field(max_length=MAX_INCIDENTS)] = []


def read_rollbacks(output_dir: str | os.PathLike[str]) -> Rollbacks:
    """The record in ``output_dir``; an empty one when there is none. Raises Unreadable for a file that
    is not a record (a link, too big, malformed): the caller says so and names it."""
    try:
        return read_record(Path(output_dir) / ROLLBACKS_FILE, Rollbacks, ROLLBACKS_CAP, output_dir)
    except Missing:
        return Rollbacks()


def write_rollbacks(output_dir: str | os.PathLike[str], record: Rollbacks) -> None:
    """Replace the record (rank 0 only), by rename: a reader sees the old one or the new one whole."""
    write_files(Path(output_dir), {ROLLBACKS_FILE: json.dumps(record.model_dump(mode="json"), indent=1)})


def pending(record: Rollbacks) -> Incident | None:
    """The newest incident if it is not resolved yet."""
    last = record.incidents[-1] if record.incidents else None
    return last if last is not None and last.outcome is None else None


def rollback_before(record: Rollbacks) -> int | None:
    """A start resumes from a checkpoint saved before this step (None: any): the unresolved incident's
    first step."""
    p = pending(record)
    return p.first_step if p is not None else None


def skipped_steps(record: Rollbacks) -> frozenset[int]:
    """The steps of the original run whose batches every start leaves out."""
    return frozenset(s for i in record.incidents if i.action == "skip" and i.skip is not None
                     for s in range(i.skip[0], i.skip[1] + 1))


@dataclass(frozen=True)
class Alarm:
    """What the ranks agreed fired (hfscale.training.loss_guard.Alarm, with the hosts whose ranks alone saw
    a NaN)."""

    kind: Literal["nan", "spike"]
    measure: Literal["loss", "grad_norm"]
    step: int
    first_step: int
    value: float | None
    median: float | None = None
    hosts: tuple[str, ...] = ()


def _came_back(p: Incident, a: Alarm, patience: int) -> bool:
    """The replay's alarm is the pending incident's again: their windows of steps overlap."""
    return a.first_step <= p.step + patience and a.step >= p.first_step - patience


def judge(record: Rollbacks, alarm: Alarm, *, patience: int, skip_margin: int, max_rollbacks: int,
          resumed_from: int | None, at: float, rollback_to: int | None = None) -> Rollbacks:
    """The record with ``alarm`` added as an incident, and the action it takes (see the module's doc)."""
    incidents = list(record.incidents)
    p = pending(record)
    n = len(incidents) + 1
    fields = dict(n=n, kind=alarm.kind, measure=alarm.measure, step=alarm.step, first_step=alarm.first_step,
                  value=alarm.value, median=alarm.median, hosts=list(alarm.hosts), resumed_from=resumed_from,
                  rollback_to=rollback_to, at=at)
    if p is not None:
        outcome: Outcome = "spiked_again" if _came_back(p, alarm, patience) else "superseded"
        incidents[-1] = p.model_copy(update={"outcome": outcome})
    if n > max_rollbacks:
        new = Incident(**fields, action="stop",
                       verdict=_verdict([*incidents, Incident(**fields, action="stop")], max_rollbacks))
        return Rollbacks(incidents=[*incidents, new])
    again = p is not None and _came_back(p, alarm, patience)
    one_host = bool(alarm.hosts)
    noted_before = {h for i in incidents if i.outcome == "clean" for h in i.hosts}
    if again and one_host and p is not None and p.action != "strike" and set(alarm.hosts) == set(p.hosts):
        new = Incident(**fields, action="strike", strike=list(alarm.hosts))  # the same NaN on the same hosts
    elif again and p is not None:
        first = min(p.first_step, alarm.first_step)
        new = Incident(**fields, action="skip", skip=(first, max(p.step, alarm.step) + skip_margin))
    elif one_host and set(alarm.hosts) & noted_before:
        new = Incident(**fields, action="strike", strike=sorted(set(alarm.hosts) & noted_before))
    else:
        new = Incident(**fields, action="replay")
    return Rollbacks(incidents=[*incidents, new])


def resolve(record: Rollbacks, step: int) -> Rollbacks | None:
    """The record with the pending incident resolved once training finished ``step`` without an alarm
    (None: nothing to resolve at this step): a replay or a strike passed its step (``clean``), a skip
    passed its window (``passed``)."""
    p = pending(record)
    if p is None:
        return None
    end = p.skip[1] if p.action == "skip" and p.skip is not None else p.step
    if step < end:
        return None
    outcome: Outcome = "passed" if p.action == "skip" else "clean"
    return Rollbacks(incidents=[*record.incidents[:-1], p.model_copy(update={"outcome": outcome})])


def _value(v: float | None) -> str:
    return "nan/inf" if v is None else f"{v:.4g}"


def incident_line(i: Incident) -> str:
    """One line: ``rollback 2: step 412 loss 9.71 vs median 2.41 (x4.0), since step 410; back to
    checkpoint-400; the replay spiked again; skipped steps 410-422's batches``."""
    name = "loss" if i.measure == "loss" else "gradient norm"
    what = f"rollback {i.n}: step {i.step} {name} {_value(i.value)}"
    if i.kind == "spike" and i.median is not None and i.value is not None:
        what += f" vs median {i.median:.4g}" + (f" (x{i.value / i.median:.1f})" if i.median > 0 else "")
    if i.hosts:
        what += f" on {', '.join(i.hosts[:4])}"
    parts = [what + (f", since step {i.first_step}" if i.first_step != i.step else "")]
    parts.append(f"back to checkpoint-{i.rollback_to}" if i.rollback_to is not None else
                 "back to step 0 (no checkpoint before it)")
    parts.append({"replay": "replaying the same data", "skip": "the replay spiked again",
                  "strike": f"struck {', '.join(i.strike)}", "stop": "stopped"}[i.action])
    if i.action == "skip" and i.skip is not None:
        parts.append(f"skipped steps {i.skip[0]}-{i.skip[1]}'s batches")
    if i.outcome == "clean":
        parts.append("the replay was clean (transient)" + (f"; noted {', '.join(i.hosts)}" if i.hosts else ""))
    elif i.outcome == "spiked_again":
        parts.append("it came back on the replay")
    return "; ".join(parts)


def _verdict(incidents: list[Incident], max_rollbacks: int) -> str:
    steps = ", ".join(f"step {i.step} ({i.measure} {_value(i.value)})" for i in incidents[-5:])
    skipped = [f"{i.skip[0]}-{i.skip[1]}" for i in incidents if i.action == "skip" and i.skip is not None]
    return (f"{len(incidents)} loss alarms, more than training.loss_guard.max_rollbacks {max_rollbacks}: {steps}"
            + (f"; batches of steps {', '.join(skipped)} skipped" if skipped else "")
            + "; stopped. Inspect the data and the hosts, then relaunch (it resumes before the last alarm) or raise "
            "the limit")
