"""An attempt the loss guard stopped: what the supervisor makes of it (reads the output_dir's record only).

The ranks stop at a loss spike or a NaN and rank 0 records the incident and its action in
``<output_dir>/hfscale_rollbacks.json`` (hfscale.checkpoints.rollbacks). An attempt that failed with
an incident recorded since it began is a ``loss_spike`` fault: ``replay`` and ``skip`` relaunch on the
same hosts (the next start rolls back: hfscale.launch.build), ``strike`` counts against the host its
ranks alone saw the NaN on (replaced by a spare, or left out, as the policy does for a failing host),
``stop`` gives up with the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hfscale.checkpoints.rollbacks import LOSS_GUARD_SAID, Incident, incident_line, read_rollbacks
from hfscale.core import exitcodes
from hfscale.core.untrusted import Unreadable


@dataclass(frozen=True)
class LossAlarm:
    """The incident the attempt ended with, as the supervisor uses it."""

    incident: Incident
    what: str  # one line: hfscale.checkpoints.rollbacks.incident_line
    host: str | None  # the host struck (None: no host's fault)
    verdict: str | None  # the job stops (too many rollbacks)


def incidents(output_dir: str | None) -> int:
    """How many incidents the record in ``output_dir`` holds (0: none, or unreadable): taken before an
    attempt, so that one added by the attempt is told apart without comparing clocks of two hosts."""
    if output_dir is None:
        return 0
    try:
        return len(read_rollbacks(output_dir).incidents)
    except Unreadable:
        return 0


def loss_alarm(output_dir: str | None, before: int) -> LossAlarm | None:
    """The incident the attempt added to the record in ``output_dir`` (it held ``before`` when the attempt
    began), or None."""
    if output_dir is None:
        return None
    try:
        record = read_rollbacks(output_dir)
    except Unreadable:
        return None
    if len(record.incidents) <= before:
        return None
    last = record.incidents[-1]
    host = last.strike[0] if last.action == "strike" and last.strike else None
    return LossAlarm(last, LOSS_GUARD_SAID + incident_line(last), host,
                     last.verdict if last.action == "stop" else None)


def told(output_dir: str | None, before: int, rc: int, say: Callable[[str], None]) -> int:
    """After a launch without recovery ended with ``rc``: when its ranks' loss guard stopped it, say so and
    what a relaunch does, and return ``exitcodes.LOSS_ALARM``; else ``rc``."""
    alarm = loss_alarm(output_dir, before) if rc else None
    if alarm is None:
        return rc
    i = alarm.incident
    say(f"hfscale: {alarm.verdict}" if alarm.verdict else f"hfscale: {alarm.what}; relaunch to roll back (it resumes "
        f"from {f'checkpoint-{i.rollback_to}' if i.rollback_to is not None else 'step 0'}) and "
        + ("skip those batches" if i.action == "skip" else "replay the same data"))
    return exitcodes.LOSS_ALARM
