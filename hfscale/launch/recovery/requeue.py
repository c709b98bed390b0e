"""A supervised Slurm job that Slurm requeued (its batch host was lost: the nodes' keepers requeue
it, hfscale.launch.runners.slurm_step): the batch script runs ``hfscale launch`` again, into the same
run directory, and the supervisor goes on from the attempts already made there, resuming from the
newest complete checkpoint. This module finds the number of its first attempt and writes what
happened to the run's timeline (a failure of the previous attempt, ``host_lost`` on the batch host,
dated when a watch requeued, with rank 0's last step; and the relaunch), which ``hfscale status``
and ``report`` show. Files only, no processes; the files read back (state.json, the attempts
folder, rank 0's progress, the timeline) are treated as untrusted.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Callable, Mapping

from hfscale.core.records import TimelineEvent
from hfscale.core.untrusted import Unreadable, read_text
from hfscale.launch.run_dir import ATTEMPTS_DIR, LAUNCHER_BEAT, read_state
from hfscale.launch.runners.slurm_step import (ALLOCATION_VAR, HOSTS_FILE_VAR, HOSTS_TEXT_CAP, allocation_hosts,
                                              host_names, in_allocation, in_supervised_script)
from hfscale.launch.recovery.timeline import append_event, read_timeline
from hfscale.launch.runners.slurm_script import REQUEUE_LOG
from hfscale.rules.resolved import Job
from hfscale.training.heartbeat import rank0_last_step

RESTART_VAR = "SLURM_RESTART_COUNT"  # how often Slurm requeued the job (unset or 0: the first run)
MAX_ATTEMPTS = 100_000
REQUEUED = "Slurm requeued job"  # in the failure event's 'what' (hfscale.runs.goodput shows it)


def restart_count(env: Mapping[str, str]) -> int:
    """Slurm's requeue count of the job this runs in (0: first run, or not in a supervised batch script)."""
    text = env.get(RESTART_VAR, "0").strip()
    if not in_supervised_script(env) or not text.isdigit() or len(text) > 6:
        return 0
    return int(text)


def attempts_made(run_dir: str | Path) -> int:
    """How many attempts ``run_dir`` moved aside (``attempts/<n>/``, n = 0, 1, ...)."""
    try:
        names = os.listdir(Path(run_dir) / ATTEMPTS_DIR)
    except OSError:
        return 0
    numbers = {int(n) for n in names if n.isdigit() and len(n) <= 6}
    n = 0
    while n in numbers and n < MAX_ATTEMPTS:
        n += 1
    return n


def _last_beat(run_dir: str, now: float) -> float:
    """When the lost supervisor last beat (its heartbeat file's modification time), or ``now``."""
    try:
        at = os.stat(Path(run_dir) / LAUNCHER_BEAT).st_mtime
    except OSError:
        return now
    return at if 0 < now - at < 86_400 else now


def _requeued_at(run_dir: str, lost_at: float, now: float) -> float:
    """When a watch requeued the job (it appends its line to requeue.log, then requeues: the file's
    modification time), if that is after the supervisor's last beat; else that beat (the keepers
    requeued it, or the log is one of an earlier requeue)."""
    try:
        st = os.lstat(Path(run_dir) / REQUEUE_LOG)
    except OSError:
        return lost_at
    return st.st_mtime if stat.S_ISREG(st.st_mode) and lost_at <= st.st_mtime <= now else lost_at


def _last_step(run_dir: str, attempt: int, now: float) -> tuple[int, float | None] | None:
    """Rank 0's last step of ``attempt`` (its progress file, still in place) and the attempt's time
    per step, from its first step in the timeline to that one (None when it cannot be told)."""
    last = rank0_last_step(Path(run_dir))
    if last is None or not 0 < now - last[0] < 86_400:
        return None
    when, step = last
    try:
        first = next((e for e in read_timeline(run_dir).events
                      if e.kind == "training" and e.attempt == attempt and e.step is not None), None)
    except Unreadable:
        first = None
    if first is None or first.step is None or step <= first.step or when <= first.at:
        return step, None
    return step, (when - first.at) / (step - first.step)


def first_attempt(job: Job, run_dir: str, say: Callable[[str], None], env: Mapping[str, str] | None = None) -> int:
    """The number of the supervisor's first attempt: 0, or after a requeue the attempt after the
    last one made (whose files are still in place: the next attempt moves them aside). A requeue is
    recorded in the timeline as the previous attempt's failure (its batch host lost) and a relaunch."""
    env = os.environ if env is None else env
    restart = restart_count(env)
    if restart == 0 or job.config.runner.type != "slurm":
        return 0
    first = attempts_made(run_dir) + 1
    try:
        host = read_state(run_dir).host
    except (Unreadable, OSError):
        host = None
    where = f"its batch host {host}" if host else "its batch host"
    what = f"{where} was lost; {REQUEUED} {env.get(ALLOCATION_VAR)} (restart {restart})"
    say(f"hfscale: {what}; attempt {first} resumes from the newest complete checkpoint")
    now = time.time()
    # the failure is dated when a watch noticed it and requeued, with rank 0's last step and the step
    # time, so that status and report count the time to notice as detection, the steps since the
    # checkpoint as recompute, and only Slurm's own requeue and start as the stop
    lost_at = _requeued_at(run_dir, _last_beat(run_dir, now), now)
    step, step_time = _last_step(run_dir, first - 1, now) or (None, None)
    for event in (dict(kind="failure", attempt=first - 1, at=lost_at, cause="host_lost", host=host, what=what,
                       step=step, step_time=step_time),
                  dict(kind="stopped", attempt=first - 1, at=now),
                  dict(kind="relaunch", attempt=first, at=now, hosts=[h.host for h in job.hosts],
                       world_size=job.world_size, accumulation=job.gradient_accumulation_steps)):
        try:
            append_event(run_dir, TimelineEvent.model_validate({k: v for k, v in event.items() if v is not None}))
        except ValueError:
            continue
    return first


def in_allocation_of(job: Job, env: Mapping[str, str] | None = None) -> Job:
    """``job`` on the hosts of its Slurm allocation when the batch script of a supervised job runs
    this launch (hfscale.launch.runners.slurm_step), else ``job``; ConfigError when the allocation
    is smaller than the job."""
    env = os.environ if env is None else env
    if job.config.runner.type != "slurm" or not job.config.recovery.max_restarts or not in_supervised_script(env):
        return job
    path = env.get(HOSTS_FILE_VAR)
    try:
        names = host_names(read_text(path, HOSTS_TEXT_CAP)) if path else allocation_hosts(env)
    except Unreadable as e:  # a ValueError: exit 2, naming the file
        raise Unreadable(e.path, f"{e.reason} (the allocation's hosts, which the batch script writes; "
                                 f"{HOSTS_FILE_VAR} names it)") from None
    return in_allocation(job, names or ())
