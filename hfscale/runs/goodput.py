"""Goodput: how much of a run's time trained, and where the rest went (pure; it reads the
hfscale.launch.recovery.timeline.Timeline it is given).

From the events of ``timeline.jsonl`` (hfscale.core.records.TimelineEvent):

- **wall**: from the first ``launch`` event to ``finished`` or ``gave_up`` (``now`` while the job
  runs; without ``now``, the newest event).
- **start**: the first launch to the first attempt's first step (``training``), model loading
  included; to its failure when it never completed a step.
- per failure of an attempt:

  - **detection**: the failure's time minus that of the attempt's last step, estimated as the
    attempt's first ``training`` time + (failure step - that training step) x the attempt's step
    time, within [first training, failure]; 0 when the attempt did no step or the step or the step
    time is unknown;
  - **stop**: ``stopped`` - ``failure``;
  - **restart**: ``stopped`` to the next attempt's first step (probes, resharding, relaunch, model
    loading), or to that attempt's failure when it did no step; 0 when no relaunch followed;
  - **recompute**: (failure step - the step the next attempt resumed from) x step time, at least
    0; 0 when no relaunch followed. The step resumed from is what rank 0 said at its start (the
    next attempt's ``training`` event's ``resume_step``: a local checkpoint the ranks restored may
    be newer than the durable one the relaunch planned), else the ``relaunch``'s ``resume_step``
    (none: step 0).

- per restart the ranks made in their processes (``in_process``: hfscale.launch.recovery.in_process_events):
  **restart**: from the failed attempt's end to the next one's first step (its parts); **recompute**:
  (rank 0's last step before it - the step it resumed from) x the median step time, at least 0.

- **productive**: the steps this run made (the step of the last ``finished`` or ``failure`` event,
  less the step the first launch resumed from, as above) x the median of the attempts' step times, at most wall.
- **other**: wall - productive - the time lost above, at least 0 (steps not otherwise counted,
  the supervisor's own time, what could not be estimated).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hfscale.checkpoints.rollbacks import LOSS_GUARD_SAID
from hfscale.core.untrusted import printable

if TYPE_CHECKING:
    from hfscale.core.records import TimelineEvent
    from hfscale.launch.recovery.timeline import Timeline

# rollback: all a loss spike cost (its stop, restart and the steps replayed; hfscale.checkpoints.rollbacks)
BUCKETS = ("start", "detection", "stop", "restart", "recompute", "rollback", "other")
MAX_NAMES = 8  # hosts named on a line; the rest are counted


@dataclass(frozen=True)
class Goodput:
    """A run's time: ``wall`` (s), of it ``productive``, and ``lost`` per cause (keys: BUCKETS, in that order)."""

    wall: float
    productive: float
    lost: dict[str, float]
    restarts: int
    excluded: tuple[str, ...]
    in_process: int = 0  # restarts the ranks made in their processes (within ``restarts``' attempts)

    @property
    def ratio(self) -> float:
        return self.productive / self.wall if self.wall > 0 else 0.0


def _firsts(events: tuple["TimelineEvent", ...], kind: str) -> dict[int, "TimelineEvent"]:
    """The first event of ``kind`` of each attempt."""
    out: dict[int, TimelineEvent] = {}
    for e in events:
        if e.kind == kind:
            out.setdefault(e.attempt, e)
    return out


def _detection(failure: "TimelineEvent", training: "TimelineEvent | None") -> float:
    if training is None or failure.step is None or training.step is None or failure.step_time is None:
        return 0.0
    last = training.at + (failure.step - training.step) * failure.step_time
    return failure.at - min(max(last, training.at), failure.at)


def _resumed(launch: "TimelineEvent", trainings: dict[int, "TimelineEvent"]) -> int:
    """The step an attempt resumed from: rank 0's word at its first step, else the (re)launch's plan."""
    first = trainings.get(launch.attempt)
    if first is not None and first.resume_step is not None:
        return first.resume_step
    return launch.resume_step or 0


def goodput(timeline: "Timeline", now: float | None = None, last: tuple[float, int] | None = None) -> Goodput | None:
    """The goodput of a run's timeline (definitions: the module's docstring); None without a launch
    event. ``last``: (when, step) of rank 0's last step, for a run whose launcher died and whose
    job trained on without it: the run ends there, with that step."""
    events = timeline.events
    first = next((i for i, e in enumerate(events) if e.kind == "launch"), None)
    if first is None:
        return None
    events = events[first:]
    launch = events[0]
    ends = [e for e in events if e.kind in ("finished", "gave_up")]
    end = ends[-1].at if ends else now if now is not None else max(e.at for e in events)
    if not ends and last is not None:
        end = max(end, last[0])
    wall = max(0.0, end - launch.at)
    trainings, failures = _firsts(events, "training"), _firsts(events, "failure")

    def first_step_or_failure(attempt: int) -> float:
        e = trainings.get(attempt) or failures.get(attempt)
        return e.at if e is not None else end

    lost = dict.fromkeys(BUCKETS, 0.0)
    lost["start"] = max(0.0, first_step_or_failure(launch.attempt) - launch.at)
    for i, e in enumerate(events):
        if e.kind != "failure" or failures[e.attempt] is not e:
            continue
        later = events[i + 1:]
        stopped = next((s for s in later if s.kind == "stopped" and s.attempt == e.attempt), None)
        relaunch = next((r for r in later if r.kind == "relaunch" and r.attempt > e.attempt), None)
        spike = e.cause == "loss_spike"
        lost["rollback" if spike else "detection"] += max(0.0, _detection(e, trainings.get(e.attempt)))
        if stopped is not None:
            lost["rollback" if spike else "stop"] += max(0.0, stopped.at - e.at)
        if relaunch is not None:
            since = stopped.at if stopped is not None else e.at
            lost["rollback" if spike else "restart"] += max(0.0, first_step_or_failure(relaunch.attempt) - since)
            if e.step is not None and e.step_time is not None:
                lost["rollback" if spike else "recompute"] += max(0, e.step - _resumed(relaunch, trainings)) * e.step_time
    step_times = [e.step_time for e in events if e.kind in ("failure", "finished") and e.step_time is not None]
    started = [e for e in events if e.kind == "training" and e.step is not None]
    if not ends and last is not None and started and last[1] > started[-1].step and last[0] > started[-1].at:
        step_times.append((last[0] - started[-1].at) / (last[1] - started[-1].step))  # its own pace, to its last step
    final = next((e.step for e in reversed(events) if e.kind in ("finished", "failure") and e.step is not None), 0)
    if not ends and last is not None:  # the steps it trained after the timeline's last event
        final = max(final, last[1])
    done = max(0, final - _resumed(launch, trainings))  # the run may have started from an earlier run's checkpoint
    productive = min(wall, done * statistics.median(step_times)) if step_times else 0.0
    healed = [e for e in events if e.kind == "in_process"]
    for e in healed:
        lost["restart"] += sum((e.phases or {}).values())
        if e.failed_step is not None and e.resume_step is not None and step_times:
            lost["recompute"] += max(0, e.failed_step - e.resume_step) * statistics.median(step_times)
    lost["other"] = max(0.0, wall - productive - sum(lost.values()))
    relaunches = [e for e in events if e.kind == "relaunch"]
    excluded = tuple(relaunches[-1].excluded or ()) if relaunches else ()
    return Goodput(wall, productive, lost, len(relaunches), excluded, len(healed))


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s"


def _names(hosts: list[str] | tuple[str, ...]) -> str:
    shown = ", ".join(hosts[:MAX_NAMES])
    return shown + (f" and {len(hosts) - MAX_NAMES} more" if len(hosts) > MAX_NAMES else "")


def lines(g: Goodput) -> list[str]:
    """What ``hfscale status``/``report`` print of a run's goodput (buckets under 0.05 s left out)."""
    lost = ", ".join(f"{k} {_s(v)}" for k, v in g.lost.items() if round(v, 1) > 0) or "nothing"
    excluded = f"excluded: {_names(g.excluded)}" if g.excluded else "no host excluded"
    return [f"goodput {g.ratio:.1%} (productive {_s(g.productive)} of {_s(g.wall)}); lost: {lost}",
            f"restarts {g.restarts}{_in_process(g)}, {excluded}"]


def _in_process(g: Goodput) -> str:
    return f" (and {g.in_process} in process)" if g.in_process else ""


def _event_line(e: "TimelineEvent", t0: float, resumed: int | None = None) -> str:
    head = f"+{e.at - t0:.1f} s  attempt {e.attempt}  {e.kind}"
    if e.kind == "failure":
        parts = [head] + ([e.host] if e.host else [])
        what = printable(e.what or "", 1000)
        parts.append(f"{e.cause}: {what}" if e.cause and what else e.cause or what or "failed")
        if e.step is not None:
            parts.append(f"at step {e.step}")
        return "  ".join(parts)
    if e.kind == "relaunch":
        text = f"on {_names(e.hosts)}" if e.hosts else "on the same hosts"
        notes = [f"{r.spare} replaced {r.host}" for r in e.replaced or ()]
        notes += ([f"excluded {_names(e.excluded)}"] if e.excluded else []) + (
            [f"readmitted {_names(e.readmitted)}"] if e.readmitted else [])
        notes += [f"spares left: {_names(e.spares) if e.spares else 'none'}"] if e.spares is not None else []
        text += f" ({'; '.join(notes)})" if notes else ""
        text += f", resuming from step {e.resume_step}" if e.resume_step is not None else ", from the start"
        if resumed is not None and resumed != (e.resume_step or 0):  # rank 0's word: a newer local checkpoint
            text += f" (the ranks resumed from step {resumed})"
        text += f", world {e.world_size}" if e.world_size is not None else ""
        text += f", accumulation {e.accumulation}" if e.accumulation is not None else ""
        return f"{head}  {text}"
    if e.kind == "training" and e.phases:
        where = f"step {e.step}" if e.step is not None else "its first step"
        return f"{head}  {where} after {sum(e.phases.values()):.1f} s: " + start_parts_text(e.phases)
    if e.kind == "in_process":
        return f"{head.removesuffix('  in_process')}  {in_process_text(e)}"
    return f"{head}  {printable(e.what or '', 1000)}".rstrip()


PART_NAMES = {"process": "process start", "imports": "imports", "model": "model", "engine": "engine and process group",
              "checkpoint": "checkpoint load", "data": "data fast-forward", "first_step": "first step"}


def start_parts_text(phases: "dict[str, float]") -> str:
    """``process start 2.1 s, imports 7.6 s, ...``: the parts of a start, in order (a part a start did
    not mark is inside the next one)."""
    return ", ".join(f"{PART_NAMES[k]} {v:.1f} s" for k, v in phases.items() if k in PART_NAMES)


def in_process_text(e: "TimelineEvent") -> str:
    """``restart in process 2 (rank 1 (uid 1): RuntimeError: ...), from step 18: resumed from step 10, step
    11 after 3.9 s: model 0.2 s, ...``: one restart the ranks made in their processes."""
    text = f"restart in process {e.in_process}"
    text += f" ({printable(e.what, 300)})" if e.what else ""
    text += f", from step {e.failed_step}" if e.failed_step is not None else ""
    text += f": resumed from step {e.resume_step}" if e.resume_step is not None else ""
    if e.phases:
        where = f"step {e.step}" if e.step is not None else "its first step"
        text += f", {where} after {sum(e.phases.values()):.1f} s: " + start_parts_text(e.phases)
    return text


def _t0(t: "Timeline") -> float:
    """The time the status and report lines count from: the first launch (else the first event)."""
    return next((e.at for e in t.events if e.kind == "launch"), t.events[0].at if t.events else 0.0)


def replacement_lines(t: "Timeline") -> list[str]:
    """``replaced     node3 replaced node1 at +72.4 s (attempt 1; spares left: none)``: which spare took
    which host's place, and when (from the first launch); at most MAX_NAMES lines, the rest counted."""
    t0 = _t0(t)
    out = [f"replaced     {r.spare} replaced {r.host} at +{e.at - t0:.1f} s (attempt {e.attempt}"
           + (f"; spares left: {_names(e.spares) if e.spares else 'none'})" if e.spares is not None else ")")
           for e in t.events if e.kind == "relaunch" for r in e.replaced or ()]
    return out[:MAX_NAMES] + ([f"replaced     and {len(out) - MAX_NAMES} more"] if len(out) > MAX_NAMES else [])


def requeue_lines(t: "Timeline") -> list[str]:
    """``requeued     its batch host node1 was lost; Slurm requeued job 1 (restart 1), at +31.0 s;
    attempt 1 resumed``: a supervised Slurm job that requeued itself (hfscale.launch.recovery.requeue)."""
    from hfscale.launch.recovery.requeue import REQUEUED

    t0 = _t0(t)
    out = [f"requeued     {printable(e.what or '', 300)}, at +{e.at - t0:.1f} s; attempt {e.attempt + 1} resumed"
           for e in t.events if e.kind == "failure" and REQUEUED in (e.what or "")]
    return out[:MAX_NAMES]


def timeline_lines(t: "Timeline") -> list[str]:
    """One line per failure, relaunch, first step of a start (with its parts) and giving up, times
    from the first launch."""
    if not t.events and not t.skipped:
        return []
    t0 = _t0(t)
    trainings = _firsts(t.events, "training")
    out = [_event_line(e, t0, getattr(trainings.get(e.attempt), "resume_step", None)) for e in t.events
           if e.kind in ("failure", "relaunch", "gave_up", "in_process") or (e.kind == "training" and e.phases)]
    if t.skipped:
        out.append(f"({t.skipped} bad timeline line{'s' * (t.skipped != 1)} skipped)")
    if t.cut:
        out.append("(only the newest part of the timeline was read: it is over its size limit)")
    return out


def status_lines(run_dir: str | Path, now: float | None = None, last: tuple[float, int] | None = None) -> list[str]:
    """``hfscale status``'s lines for a job that recovers (none without a timeline): restarts,
    excluded hosts, goodput (``now``: the job still runs; ``last``: see ``goodput``)."""
    from hfscale.core.untrusted import Unreadable
    from hfscale.launch.recovery.timeline import read_timeline

    try:
        t = read_timeline(run_dir)
    except Unreadable as e:
        return [f"timeline     unreadable: {printable(str(e), 500)}"]
    g = goodput(t, now, last)
    if g is None:
        return []
    lost = ", ".join(f"{k} {_s(v)}" for k, v in g.lost.items() if round(v, 1) > 0) or "nothing"
    out = [f"restarts     {g.restarts}{_in_process(g)}" + (f"; excluded: {_names(g.excluded)}" if g.excluded else ""),
           f"goodput      {g.ratio:.1%} (productive {_s(g.productive)} of {_s(g.wall)}); lost: {lost}"]
    out += [f"rollback     {printable((e.what or '').removeprefix(LOSS_GUARD_SAID), 1000)}" for e in t.events
            if e.kind == "failure" and e.cause == "loss_spike"]
    sick = [e for e in t.events if e.kind == "failure" and e.cause == "unhealthy"]  # each node its gate kept out
    out += [f"unhealthy    attempt {e.attempt}: {printable(e.what or '', 1000)}" for e in sick[:MAX_NAMES]]
    slow = [e for e in t.events if e.kind == "failure" and e.cause == "slow"]  # each node replaced for its pace
    out += [f"slow         attempt {e.attempt}: {printable(e.what or '', 1000)}" for e in slow[:MAX_NAMES]]
    out += replacement_lines(t)
    out += requeue_lines(t)
    starts = [e for e in t.events if e.kind in ("training", "in_process") and e.phases]
    if starts:  # the newest start's parts: what the last restart (or the launch) spent where
        e = starts[-1]
        out.append(f"last start   attempt {e.attempt}, {in_process_text(e)}" if e.kind == "in_process" else
                   f"last start   attempt {e.attempt}, first step after {sum(e.phases.values()):.1f} s: "  # type: ignore[union-attr]
                   + start_parts_text(e.phases))  # type: ignore[arg-type]
    gave_up = [e for e in t.events if e.kind == "gave_up"]
    if gave_up:
        out.append(f"gave up      {printable(gave_up[-1].what or '', 1000)}")
    if t.skipped or t.cut:
        out.append(f"timeline     {t.skipped} bad line(s) skipped" + ("; only its newest part read" if t.cut else ""))
    return out
