"""The typed records hfscale reads back from run directories, checkpoints and output_dirs (pydantic,
read through hfscale.core.untrusted): what a value may be, so that a wrong type, a NaN, a timestamp
in the year 5000 or a huge number is refused where it is read, not where it is used.

Records hfscale writes itself are checked as strictly as the ones training writes: any process
of the user, a crash mid-write or another user of a shared file system may have changed them.
Unknown keys are ignored (a newer hfscale may write more).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from hfscale.core.untrusted import KiB, MiB

# size caps per kind of file (hfscale.core.untrusted refuses longer ones or reads their tail)
STATE_CAP = 1 * MiB  # state.json
METRICS_CAP = 1 * MiB  # rank 0's progress/metrics.json
METRICS_LINE_CAP = 16 * MiB  # one line of hfscale_metrics.jsonl: a straggler report of 100,000+ ranks
METRICS_LINES_CAP = 1 << 30  # hfscale_metrics.jsonl: its newest GiB, read in pieces (run_history compacts)
CLEANUP_CAP = 1 * MiB  # cleanup.json (argv and env of the stop)
ID_CAP = 256  # the Slurm job id file, DeepSpeed's 'latest'
MANIFEST_CAP = 8 * MiB  # pytorchjob.yaml (its ConfigMap carries the generated files)
TEXT_CAP = 4 * MiB  # plan.txt, config.yaml, a hang report, one rank's stack
TRAINER_STATE_CAP = 64 * MiB  # trainer_state.json: its log_history grows with the run
MARKER_CAP = 16 * MiB  # hfscale_complete.json lists every file of a checkpoint
INDEX_CAP = 64 * MiB  # model.safetensors.index.json
FLIGHT_CAP = 64 * MiB  # a rank's flight recorder dump
LOG_TAIL = 64 * KiB  # what status shows of each node log
TIMELINE_CAP = 64 * MiB  # <run dir>/timeline.jsonl: its newest 64 MiB
TIMELINE_LINE_CAP = METRICS_LINE_CAP  # one event: three lists of up to 10,000 hosts

# 2000-01-01 .. 2200-01-01: a clock gone wrong or a forged record, not a time a run had
TIME_MIN, TIME_MAX = 946_684_800.0, 7_258_118_400.0
PID_MAX = 1 << 22  # Linux's highest pid_max
BIG = 10 ** 15  # steps, counts: beyond any run
JOB_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
SLURM_JOB_ID = re.compile(r"[0-9]{1,12}(?:_[0-9]{1,12})?")  # a job, or an array task (fullmatch)
# Kubernetes object names: RFC 1123 subdomains (labels for namespaces), at most 253 (63) characters.
# Python's $ also matches before a final newline: these are used with fullmatch
RFC1123_NAME = re.compile(r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
RFC1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
HOST = re.compile(r"^[A-Za-z0-9_.:-]{1,255}$")
RunState = Literal["running", "finished", "failed", "stopped", "hung", "preempted", "submitted"]
Runner = Literal["local", "pdsh", "pdsh_docker", "slurm", "kubernetes"]
# why an attempt of a job failed (hfscale.launch.recovery.policy); port_busy: the master port was still held on
# node 0 when the attempt started (the job's own earlier attempt, or another process): no host's fault
# loss_spike: the loss guard stopped training (hfscale.checkpoints.rollbacks): a rollback, no host's fault unless struck
# unhealthy: a node failed its health gate (hfscale.launch.node.health_gate): a spare takes its place, or it is left out
# slow: the ranks found a node slow and stopped at a checkpoint (hfscale.training.slow_nodes): a planned replacement
Cause = Literal["rank_failed", "host_lost", "hang", "ssh_killed", "launch_failed", "port_busy", "loss_spike", "unhealthy",
                "slow"]


def _no_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("a number is expected, not true/false")
    return v


def _in_range(v: float) -> float:
    if not TIME_MIN <= v <= TIME_MAX:
        raise ValueError(f"a time between 2000 and 2200 is expected, got {v:g}")
    return v


def _finite_or_none(v: Any) -> Any:
    """NaN and infinities become None (hfscale writes NaN for a step time it could not measure)."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


Timestamp = Annotated[float, BeforeValidator(_no_bool), Field(allow_inf_nan=False), AfterValidator(_in_range)]
Count = Annotated[int, BeforeValidator(_no_bool), Field(ge=0, le=BIG)]
Pid = Annotated[int, BeforeValidator(_no_bool), Field(ge=1, le=PID_MAX)]
Number = Annotated[float | None, BeforeValidator(_no_bool), BeforeValidator(_finite_or_none)]
Finite = Annotated[float, BeforeValidator(_no_bool), Field(allow_inf_nan=False)]
Text = Annotated[str, Field(max_length=4096)]
NoNul = Annotated[str, Field(pattern=r"^[^\x00]*$")]  # a process cannot take a NUL in argv or env
NoNulText = Annotated[NoNul, Field(max_length=4096)]
Host = Annotated[str, Field(pattern=HOST.pattern)]
# a start's parts (hfscale.training.heartbeat.PHASES): rank 0's marks, and a restart's parts in seconds
Phase = Literal["process", "imports", "model", "engine", "checkpoint", "data", "first_step"]
PhaseMarks = Annotated[dict[Phase, Timestamp], Field(max_length=7)]
Seconds = Annotated[float, BeforeValidator(_no_bool), Field(ge=0, le=1e7, allow_inf_nan=False)]
PhaseSeconds = Annotated[dict[Phase, Seconds], Field(max_length=7)]
JobId = Annotated[str, Field(pattern=JOB_ID.pattern)]
BootId = Annotated[str, Field(pattern=r"^[0-9a-f-]{36}$")]  # /proc/sys/kernel/random/boot_id


class Record(BaseModel):
    # hide_input_in_errors: an error never echoes the file (50 MB of it, or a secret); pydantic would
    # also copy a large input to build that message
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True, allow_inf_nan=True, hide_input_in_errors=True,
                              defer_build=True)


class LauncherState(Record):
    """``<run dir>/state.json`` (hfscale.launch.run_dir.record_state): who launched the run, and how it ended."""

    job_id: JobId | None = None
    runner: Runner | None = None
    state: RunState | None = None
    pid: Pid | None = None
    proc_start: Count | None = None  # /proc/<pid>/stat field 22 of the launcher (hfscale.core.pid_identity)
    boot_id: BootId | None = None
    pid_ns: Count | None = None  # the launcher's pid namespace (/proc/self/ns/pid inode)
    host: Host | None = None
    cwd: Text | None = None
    started: Timestamp | None = None
    ended: Timestamp | None = None
    exit_code: Annotated[int, BeforeValidator(_no_bool), Field(ge=-255, le=1023)] | None = None
    stop_requested: Timestamp | None = None


class Rank0Metrics(Record):
    """``<run dir>/progress/metrics.json``: rank 0's latest numbers (hfscale.training.heartbeat.report)."""

    step: Count | None = None
    max_steps: Count | None = None
    loss: Number = None  # the last logged loss (the Trainer's mean over its logging window)
    train_loss: Number = None  # the mean over the run's steps, reported when training ended
    learning_rate: Number = None
    tokens_per_s: Number = None
    eta_s: Number = None
    preempted: bool | None = None
    time: Timestamp | None = None
    # rank 0's start within its launch (torchrun's TORCHELASTIC_RESTART_COUNT): the progress line's
    # rate and ETA start again with each
    restart: Count | None = None
    # the step rank 0 resumed from at its start (the Trainer's global_step at train begin): a local
    # checkpoint restored by the ranks may be newer than the one the launch planned
    resumed: Count | None = None
    phases: PhaseMarks | None = None  # when each part of this start ended (hfscale.training.heartbeat.phase)
    # an in-process restart's attempt (hfscale.training.heartbeat.begin_attempt): its number, why the one
    # before ended, and the last step rank 0 did before it (none: rank 0 is a standby that took its rank)
    in_process: Count | None = None
    in_process_why: Annotated[str, Field(max_length=500)] | None = None
    failed_step: Count | None = None
    # a node the ranks found slow (hfscale.training.callbacks.slow_nodes): why, and which; the job stops at its
    # next checkpoint to replace it
    slow: Annotated[str, Field(max_length=500)] | None = None
    slow_host: Host | None = None


class CleanupRecord(Record):
    """``<run dir>/cleanup.json``: the stop a launch recorded, run by ``hfscale stop`` when its launcher died."""

    argv: Annotated[list[Annotated[NoNul, Field(max_length=256 * KiB)]], Field(min_length=1, max_length=4096)]
    env: Annotated[dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")], NoNulText],
                   Field(max_length=4096)]
    cwd: NoNulText | None = None


class MetricsLine(Record):
    """One line of ``<output_dir>/hfscale_metrics.jsonl`` (hfscale.training.callbacks: MetricsCallback,
    StragglerCallback). NaN and infinities read as None; lists of ranks at most a million long."""

    model_config = ConfigDict(**{**Record.model_config, "extra": "allow"})

    event: Literal["metrics", "straggler"]
    step: Count
    job: JobId | None = None
    time: Timestamp | None = None
    world_size: Annotated[int, BeforeValidator(_no_bool), Field(ge=1, le=1 << 20)] | None = None
    step_time_s: Number = None
    tokens_per_s: Number = None
    mfu: Number = None
    mem_peak_mb: Number = None
    mem_peak_mb_per_rank: Annotated[list[Number], Field(max_length=1 << 20)] | None = None
    forward_s_per_rank: Annotated[list[Number], Field(max_length=1 << 20)] | None = None
    step_time_s_per_rank: Annotated[list[Number], Field(max_length=1 << 20)] | None = None
    hosts: Annotated[list[Annotated[str, Field(max_length=255)]], Field(max_length=1 << 20)] | None = None
    slowest_rank: Annotated[int, BeforeValidator(_no_bool), Field(ge=0, le=1 << 20)] | None = None
    slowest_host: Annotated[str, Field(max_length=255)] | None = None
    ratio: Number = None
    median_forward_s: Number = None
    threshold: Number = None
    straggler: bool | None = None


class TrainerState(Record):
    """``trainer_state.json`` as hfscale reads it: the step it was saved at and the logged history
    (entries are checked one by one where they are used)."""

    global_step: Count
    max_steps: Count | None = None
    num_train_epochs: Finite | None = None
    log_history: Annotated[list[Any], Field(max_length=10_000_000)] = []


class TrainerStep(Record):
    """The step a ``trainer_state.json`` was saved at: all the checkpoint checks read of it."""

    global_step: Count


class LogEntry(Record):
    """One entry of a Trainer's ``log_history`` (the report plots these)."""

    model_config = ConfigDict(**{**Record.model_config, "extra": "allow"})

    step: Count
    loss: Number = None
    learning_rate: Number = None
    grad_norm: Number = None


class CompleteMarker(Record):
    """``hfscale_complete.json`` (hfscale.checkpoints.resume.write_marker): every file of a checkpoint and its size."""

    format: Annotated[int, BeforeValidator(_no_bool), Field(ge=1, le=1000)] = 1
    global_step: Count
    world_size: Annotated[int, BeforeValidator(_no_bool), Field(ge=0, le=1 << 24)] = 0
    files: Annotated[dict[Annotated[str, Field(max_length=4096)], Count], Field(max_length=1_000_000)]


class WeightIndex(Record):
    """``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``: parameter -> shard file."""

    weight_map: dict[Annotated[str, Field(max_length=4096)], Annotated[str, Field(max_length=4096)]]


class OutputLock(Record):
    """``<output_dir>/_hfscale-lock.json`` (hfscale.launch.attempt.output_lock): the launch that trains into it."""

    job_id: JobId
    host: Host
    pid: Pid
    proc_start: Count
    boot_id: BootId | None = None
    pid_ns: Count | None = None
    run_dir: Text
    started: Timestamp
    runner: Runner | None = None
    # the job's nodes stop themselves within this many seconds of its launcher's last heartbeat
    # (hfscale.launch.node.keeper); None: they do not (a lock of an older hfscale)
    stops_within_s: Annotated[int, BeforeValidator(_no_bool), Field(ge=0, le=3600)] | None = None


Hosts = Annotated[list[Host], Field(max_length=10_000)]


class Replaced(Record):
    """``spare`` took ``host``'s place at a relaunch (hfscale.launch.recovery.policy.Replacement)."""

    host: Host
    spare: Host


class TimelineEvent(Record):
    """One line of ``<run dir>/timeline.jsonl`` (hfscale.launch.recovery.timeline): what happened to the attempts
    of a job that recovers from failures (hfscale.launch.recovery.supervisor); hfscale.runs.goodput reads them."""

    kind: Literal["launch", "failure", "stopped", "relaunch", "training", "gave_up", "finished", "in_process"]
    attempt: Count
    at: Timestamp
    cause: Cause | None = None
    host: Host | None = None
    what: Annotated[str, Field(max_length=1000)] | None = None
    error: Annotated[str, Field(max_length=300)] | None = None
    hosts: Hosts | None = None
    excluded: Hosts | None = None
    readmitted: Hosts | None = None
    replaced: Annotated[list[Replaced], Field(max_length=10_000)] | None = None  # relaunch: spares put in place
    spares: Hosts | None = None  # relaunch: the spares still free (a job with spares)
    step: Count | None = None  # failure: the last step reported; training: the first step done after a (re)launch
    # relaunch: the checkpoint step it resumes from; training: the step the ranks resumed from, as rank 0 said
    resume_step: Count | None = None
    world_size: Count | None = None
    accumulation: Count | None = None
    step_time: Annotated[float, BeforeValidator(_no_bool), Field(ge=0, allow_inf_nan=False)] | None = None  # s/step
    phases: PhaseSeconds | None = None  # training: this start's parts, from its launch to its first step
    # in_process: a restart the ranks made in their processes (at: when the attempt before it ended; step,
    # resume_step, phases as for training): its attempt's number, and the last step before the failure
    in_process: Count | None = None
    failed_step: Count | None = None
