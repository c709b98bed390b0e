"""What Slurm says of a submitted job, queued, running or ended (``squeue`` forgets a job once it
ends), read from Slurm's own words (pure: the commands are hfscale.runs.stop's, run by
hfscale.launch.attempt.execute):

* ``scontrol show job --oneliner <id>``: the controller's record, kept MinJobAge after the job
  ended (300 s by default; the test Slurm keeps it an hour). Pending, running and ended jobs alike.
* ``sacct``: the accounting database, where a site has one (``AccountingStorageType`` not none).
* the job's output file (``slurm-<id>.out``, appended across requeues): the batch script's exit line
  (``HFSCALE_EXIT rc=N time=T``, hfscale.launch.runners.slurm_script), slurmstepd's
  ``*** JOB N ON node CANCELLED AT <time> [DUE TO ...] ***`` and the script's start line.

Everything here is text hfscale did not write (or a job could have overwritten): each input is
capped, lines that do not read as what they should are skipped, and what is kept is checked by
shape (digits, Slurm's upper-case state words, ISO times). Times are Slurm's, printed in the
local time zone of the machine that printed them.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Literal

# what hfscale status says of the job
Outcome = Literal["pending", "running", "requeued", "finished", "failed", "cancelled", "unknown"]
Source = Literal["scontrol", "sacct", "output file"]

TEXT_CAP = 256 * 1024  # scontrol prints about 1.5 KB a job; an array job prints one line a task
LINE_CAP = 16 * 1024
MAX_LINES = 4096
SACCT_FIELDS = ("JobID", "State", "ExitCode", "Submit", "Start", "End")

_RUNNING = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "RESIZING",
                      "STAGE_OUT", "POWER_UP_NODE", "UPDATE_DB"})
_REQUEUED = frozenset({"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT"})
_FAILED = frozenset({"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
_CANCELLED = frozenset({"CANCELLED", "REVOKED"})
_STATE = re.compile(r"[A-Z][A-Z_]{0,31}")
_ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
_EXIT = re.compile(r"(\d{1,3}):(\d{1,3})")
_JOB = re.compile(r"[0-9]{1,12}(?:_[0-9]{1,12})?")


@dataclass(frozen=True)
class SlurmJob:
    """One job as Slurm (or its output file) tells it. ``state``: Slurm's own word (COMPLETED,
    FAILED, CANCELLED, TIMEOUT, NODE_FAIL, PENDING, ...; empty from the output file);
    ``exit_code``/``signal``: the batch script's exit status and the signal that ended it (Slurm's
    ``ExitCode=137:0``); ``ended``: the real end (None while it runs or is queued); ``restarts``:
    how often Slurm requeued it; ``reason``: Slurm's reason, or what slurmstepd said."""

    job_id: str
    outcome: Outcome
    state: str
    source: Source
    exit_code: int | None = None
    signal: int | None = None
    submitted: float | None = None
    started: float | None = None
    ended: float | None = None
    restarts: int = 0
    reason: str | None = None


def outcome_of(state: str, restarts: int = 0) -> Outcome:
    """Slurm's state word as finished, failed, cancelled, requeued, running or pending."""
    if state == "COMPLETED":
        return "finished"
    if state in _FAILED:
        return "failed"
    if state in _CANCELLED:
        return "cancelled"
    if state in _REQUEUED or (state == "PENDING" and restarts > 0):
        return "requeued"
    if state == "PENDING":
        return "pending"
    return "running" if state in _RUNNING else "unknown"


def slurm_time(text: str | None) -> float | None:
    """``2026-11-26T23:09:03`` (local time) as a Unix time; ``Unknown``, ``None``, ``N/A`` -> None."""
    if text is None or not _ISO.fullmatch(text):
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return None


def _lines(text: str) -> list[str]:
    return [line[:LINE_CAP] for line in text[:TEXT_CAP].splitlines()[:MAX_LINES]]


def _exit(text: str | None) -> tuple[int | None, int | None]:
    m = _EXIT.fullmatch(text or "")
    return (int(m[1]), int(m[2])) if m else (None, None)


def _ended(outcome: Outcome, text: str | None) -> float | None:
    # a running job's EndTime is when its time limit would end it, not an end
    return slurm_time(text) if outcome in ("finished", "failed", "cancelled") else None


def parse_scontrol(text: str, job_id: str) -> SlurmJob | None:
    """Job ``job_id`` in ``scontrol show job --oneliner`` output: one line per job (per task of an
    array), ``Key=Value`` words. None when no line is that job or its state does not read.

    The fields are read after ``UserId=``: the job name comes before it and may hold any word
    (a name ``x JobState=COMPLETED`` must not decide the state)."""
    array, _, task = job_id.partition("_")
    for line in _lines(text):
        head, sep, rest = line.partition(" UserId=")
        if not sep:
            continue
        ids = dict(re.findall(r"(?:^| )(JobId)=(\S+)", head))
        fields: dict[str, str] = {}
        for key, value in re.findall(r" ([A-Za-z]+)=(\S*)", " UserId=" + rest):
            fields.setdefault(key, value)
        mine = ids.get("JobId") == job_id if not task else \
            (fields.get("ArrayJobId") == array and fields.get("ArrayTaskId") == task)
        state = fields.get("JobState", "")
        if not mine or not _STATE.fullmatch(state):
            continue
        restarts = int(fields["Restarts"]) if re.fullmatch(r"\d{1,6}", fields.get("Restarts", "")) else 0
        outcome = outcome_of(state, restarts)
        code, sig = _exit(fields.get("ExitCode"))
        reason = fields.get("Reason")
        return SlurmJob(job_id, outcome, state, "scontrol", code, sig, slurm_time(fields.get("SubmitTime")),
                        slurm_time(fields.get("StartTime")), _ended(outcome, fields.get("EndTime")), restarts,
                        reason if reason and reason != "None" and re.fullmatch(r"[\w.:,()-]{1,64}", reason) else None)
    return None


def sacct_argv(job_id: str) -> tuple[str, ...]:
    """``sacct`` for one job's allocation (``-X``), fields as ``SACCT_FIELDS``, ``|``-separated, no
    header. Without ``--duplicates`` a requeued job shows its latest run only."""
    return ("sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={job_id}",
            f"--format={','.join(SACCT_FIELDS)}")


def parse_sacct(text: str, job_id: str) -> SlurmJob | None:
    """Job ``job_id`` in the output of ``sacct_argv``: ``JobID|State|ExitCode|Submit|Start|End``,
    State ``CANCELLED by <uid>`` for a cancelled job. None when no line is that job."""
    for line in _lines(text):
        parts = line.split("|")
        if len(parts) != len(SACCT_FIELDS) or parts[0] != job_id:
            continue
        state = parts[1].split(" ")[0]
        if not _STATE.fullmatch(state):
            continue
        outcome = outcome_of(state)
        code, sig = _exit(parts[2])
        by = parts[1][len(state):].strip()
        return SlurmJob(job_id, outcome, state, "sacct", code, sig, slurm_time(parts[3]), slurm_time(parts[4]),
                        _ended(outcome, parts[5]), reason=by if re.fullmatch(r"by \d{1,10}", by) else None)
    return None


_EXIT_LINE = re.compile(r"HFSCALE_EXIT rc=(\d{1,3})(?: time=(\d{1,12}))?")
_START_LINE = re.compile(r"hfscale: job (\S+) on \S+, master \S+, restart (\d{1,6})")
_STEPD = re.compile(r"slurmstepd(?:-[\w.-]+)?: error: \*\*\* JOB (\S+) ON \S+ CANCELLED AT (\S+)"
                    r"(?: DUE TO ([A-Z ]{1,40}))?(?: \*\*\*)?")
_DUE = {"TIME LIMIT": ("TIMEOUT", "failed"), "NODE FAILURE": ("NODE_FAIL", "failed"),
        "PREEMPTION": ("PREEMPTED", "failed"), "JOB REQUEUE": ("REQUEUED", "requeued")}


def parse_output(text: str, job_id: str) -> SlurmJob | None:
    """How the job's last run ended, from the end of its output file (``text``: its tail): the
    last of the batch script's exit line, its ``requeueing`` line and slurmstepd's CANCELLED line
    decides. None when the last run left none of them (it started, then nothing said how it
    ended) or the file holds none."""
    last: SlurmJob | None = None
    restarts = 0
    requeueing = False
    for line in _lines(text):
        line = line.strip()
        if m := _START_LINE.fullmatch(line):
            if m[1] == job_id:
                last, restarts, requeueing = None, int(m[2]), False
        elif m := _EXIT_LINE.fullmatch(line):
            rc = int(m[1])
            when = float(m[2]) if m[2] else None
            if last is not None and last.outcome == "cancelled":  # the script's own end, after slurmstepd's
                last = SlurmJob(**{**last.__dict__, "exit_code": rc})
                continue
            outcome: Outcome = "requeued" if requeueing else "finished" if rc == 0 else "failed"
            last = SlurmJob(job_id, outcome, "", "output file", rc, 0,
                            ended=None if requeueing else when, restarts=restarts)
        elif line == "hfscale: requeueing":
            requeueing = True
        elif (m := _STEPD.fullmatch(line)) and m[1] == job_id:
            state, outcome = _DUE.get(m[3] or "", ("CANCELLED", "cancelled"))
            when = slurm_time(m[2])
            last = SlurmJob(job_id, outcome, state, "output file", ended=when if outcome != "requeued" else None,
                            restarts=restarts, reason=f"DUE TO {m[3]}" if m[3] else None)
    return last
