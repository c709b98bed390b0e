"""A job that heals itself (``recovery.max_restarts`` > 0): run the plan; on a rank failure, a lost
node or a hang (the stop on every node is ``execute``'s, as for any launch), decide
(hfscale.launch.recovery) whether to retry on the same hosts, exclude the host that failed, or give
up; probe the excluded hosts again (ssh + preflight) and admit a healthy one back; relaunch from
the newest complete checkpoint (converted for another world size by the plan's own step), into the
same run directory. Every failure, stop, relaunch and first step after it goes to the run's
timeline (hfscale.launch.timeline), which ``hfscale status`` and ``report`` read.

Starts no process itself: each attempt and each probe is ``hfscale.launch.execute``'s.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from hfscale.config.errors import ConfigError
from hfscale.core import exitcodes
from hfscale.core.records import LOG_TAIL, TimelineEvent
from hfscale.core.untrusted import Unreadable, read_bytes
from hfscale.launch.build import build_plan
from hfscale.launch.execute import execute_attempt, run_probes
from hfscale.launch.node_command import LaunchContext
from hfscale.launch.preflight import evaluate, probes
from hfscale.launch.recovery import Cause, Fault, GiveUp, History, Policy, decide, last_error, probe_targets
from hfscale.launch.run_dir import LOGS_DIR, read_metrics
from hfscale.launch.spec import LaunchPlan, Outcome
from hfscale.launch.timeline import append_event
from hfscale.rules.relaunch import job_on
from hfscale.rules.resolved import Job

WATCH_STEPS_S = 0.5  # rank 0's step is read this often during an attempt (one small file)
PROBE_TIMEOUT_S = 30.0  # per excluded host, ssh + preflight


@dataclass
class Steps:
    """Rank 0's steps as one attempt saw them: the first after the start, and the latest."""

    first: tuple[int, float] | None = None  # (step, time)
    last: tuple[int, float] | None = None

    @property
    def step_time(self) -> float | None:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])


def _watch_attempt(run_dir: str, steps: Steps, done: threading.Event, ready: Callable[[], None],
                   started: Callable[[int, float], None]) -> None:
    """Until the attempt ends: ``ready`` once its run directory exists (an attempt's first writes
    it), then rank 0's latest step, read every WATCH_STEPS_S; ``started`` at its first step."""
    while not os.path.isdir(os.path.join(run_dir, LOGS_DIR)):
        if done.wait(WATCH_STEPS_S):
            return
    ready()
    while not done.wait(WATCH_STEPS_S):
        try:
            m = read_metrics(run_dir)
        except (Unreadable, OSError):
            continue
        if m.step is None or m.time is None or (steps.last is not None and m.step <= steps.last[0]):
            continue
        if steps.first is None:
            steps.first = (m.step, m.time)
            started(m.step, m.time)
        steps.last = (m.step, m.time)


def _cause(o: Outcome, hosts: set[str]) -> Cause:
    if o.hung:
        return "hang"
    if o.rc == exitcodes.UNREACHABLE:
        return "host_lost"
    if o.where in hosts and o.what.startswith("the ssh to"):
        return "ssh_killed"
    return "rank_failed" if o.where in hosts or not hosts else "launch_failed"  # no hosts: this machine


def _error_of(run_dir: str, host: str | None) -> str:
    """The failing host's last error line (its log's tail; "" when there is none or it is unreadable)."""
    if host is None:
        return ""
    try:
        data = read_bytes(Path(run_dir) / LOGS_DIR / f"{host}.log", LOG_TAIL, run_dir, tail=True)
    except (Unreadable, OSError):
        return ""
    return last_error(data.decode("utf-8", "replace").splitlines())


def healthy_again(job: Job, hosts: tuple[str, ...], python: str) -> frozenset[str]:
    """The hosts among ``hosts`` that answer ssh and pass preflight's checks now."""
    if not hosts:
        return frozenset()
    cmds = {k: c for k, c in probes(job, python).items() if k.split("/")[0] in hosts}
    specs = tuple(h for h in job.hosts if h.host in hosts)
    reports = evaluate(replace(job, hosts=specs, num_nodes=len(specs)), run_probes(cmds, PROBE_TIMEOUT_S))
    return frozenset(r.host for r in reports if not r.problems)


def _resume_step(ctx: LaunchContext) -> int | None:
    scan = ctx.output
    if scan is None or scan.resume is None:
        return None
    return scan.state.global_step if scan.state is not None else None


def supervise(job: Job, context: Callable[[Job, int], LaunchContext], echo_for: Callable[[LaunchPlan], Callable[[str], None]],
              say: Callable[[str], None]) -> int:
    """Run ``job`` until it ends, relaunching it after failures as ``job.config.recovery`` allows.
    ``context(job, attempt)``: the launch context of an attempt (the checkpoints scanned anew, the
    same job id); ``echo_for(plan)``: the output of one attempt; ``say``: hfscale's own lines.
    Returns the exit code of the last attempt (0: finished). A signal during an attempt stops it
    as any launch's; Ctrl-C between attempts (nothing runs then) ends the supervision."""
    try:
        return _supervise(job, context, echo_for, say)
    except KeyboardInterrupt:
        say("hfscale: interrupted between attempts (nothing was running); not relaunched")
        return 130


def _supervise(job: Job, context: Callable[[Job, int], LaunchContext],
               echo_for: Callable[[LaunchPlan], Callable[[str], None]], say: Callable[[str], None]) -> int:
    policy = Policy.of(job.config.recovery, tuple(h.host for h in job.hosts))
    history = History([], {}, [], set(), [])
    current, attempt, python = job, 0, job.config.runner.python or ""
    ctx = context(current, attempt)
    while True:
        try:
            plan = build_plan(current, ctx)
        except ConfigError as e:
            say(f"error: {e.render()}")
            return exitcodes.BAD_INPUT
        run_dir = plan.run_dir
        if plan.mode == "done":
            say(f"hfscale: attempt {attempt}: nothing left to train; the job is finished")
            _event(run_dir, kind="finished", attempt=attempt)
            return 0
        if attempt == 0:
            say(f"hfscale: recovery on: up to {policy.max_restarts} restart(s)"
                + (f" in {policy.window} s" if policy.window else "") + f", a host excluded after {policy.strikes} "
                f"failure(s)" + (f", down to {policy.min_nodes} node(s)" if policy.min_nodes else ", never shrinking"))
        launch = dict(kind="launch", attempt=0, hosts=[h.host for h in current.hosts], world_size=current.world_size,
                      accumulation=current.gradient_accumulation_steps, resume_step=_resume_step(ctx))
        steps, done, n = Steps(), threading.Event(), attempt
        watcher = threading.Thread(target=_watch_attempt, daemon=True, args=(
            run_dir, steps, done, (lambda: _event(run_dir, **launch)) if attempt == 0 else (lambda: None),
            lambda s, t: _event(run_dir, kind="training", attempt=n, at=t, step=s)))
        watcher.start()
        outcome = execute_attempt(plan, plan.render(), echo_for(plan), attempt)
        stopped = time.time()
        done.set()
        watcher.join(5)
        if outcome.rc == 0:
            _event(run_dir, kind="finished", attempt=attempt, at=stopped, step=steps.last[0] if steps.last else None,
                   step_time=steps.step_time)
            return 0
        if outcome.signalled or outcome.where is None:  # stopped by hand, or nothing ran (no node failed)
            return outcome.rc
        hosts = {h.host for h in current.hosts}
        cause = _cause(outcome, hosts)
        host = outcome.where if outcome.where in hosts else None
        log = host or (next(iter(plan.logs)) if len(plan.logs) == 1 else None)  # a local job's one log
        what = outcome.what
        if cause == "host_lost" and host is not None and host in healthy_again(job, (host,), python or _python()):
            # ssh's session ended (its remote command killed, a dropped connection) but the host answers
            cause, what = "rank_failed", f"{what}; {host} answers ssh and passes preflight: counted as a failure"
        fault = Fault(cause, host, outcome.rc, what, _error_of(run_dir, log), outcome.failed_at or stopped,
                      steps.first is not None)
        _event(run_dir, kind="failure", attempt=attempt, at=fault.at, cause=cause, host=host, what=what[:1000],
               error=fault.error[:300], step=steps.last[0] if steps.last else None, step_time=steps.step_time)
        _event(run_dir, kind="stopped", attempt=attempt, at=stopped)
        targets = probe_targets(policy, history) if job.config.recovery.probe_excluded else ()
        healthy = healthy_again(job, targets, python or _python()) if targets else frozenset()
        decision = decide(policy, history, fault, healthy, time.time())
        if isinstance(decision, GiveUp):
            say(f"hfscale: {decision.reason}")
            _event(run_dir, kind="gave_up", attempt=attempt, what=decision.reason[:1000])
            return outcome.rc
        try:
            current = job_on(job, tuple(h for h in job.hosts if h.host in decision.hosts))
        except ConfigError as e:
            say(f"hfscale: cannot relaunch on {', '.join(decision.hosts)}: {e.render()}")
            _event(run_dir, kind="gave_up", attempt=attempt, what=f"cannot relaunch on {', '.join(decision.hosts)}")
            return outcome.rc
        attempt += 1
        say(f"hfscale: restart {attempt} of at most {policy.max_restarts}: {decision.reason}")
        ctx = context(current, attempt)  # the checkpoints as they are now
        _event(run_dir, kind="relaunch", attempt=attempt, hosts=list(decision.hosts),
               excluded=list(decision.excluded), readmitted=list(decision.readmitted),
               resume_step=_resume_step(ctx), world_size=current.world_size,
               accumulation=current.gradient_accumulation_steps)


def _python() -> str:
    import sys

    return sys.executable


def _event(run_dir: str, **fields: object) -> None:
    """Append one event to the run's timeline; ``at`` defaults to now. A write that fails is
    skipped (the job goes on; its timeline then misses the event)."""
    fields.setdefault("at", time.time())
    try:
        event = TimelineEvent.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValueError:
        return
    if os.path.isdir(run_dir):
        append_event(run_dir, event)
