"""A job that heals itself (``recovery.max_restarts`` > 0): run the plan; on a rank failure, a lost
node or a hang (the stop on every node is ``execute``'s, as for any launch), decide
(hfscale.launch.recovery.policy) whether to retry on the same hosts, exclude the host that failed, or give
up; probe the excluded hosts again (ssh + preflight) and admit a healthy one back; relaunch from
the newest complete checkpoint (converted for another world size by the plan's own step), into the
same run directory. Every failure, stop, relaunch and first step after it goes to the run's
timeline (hfscale.launch.recovery.timeline), the first step with its start's parts, which ``hfscale
status`` and ``report`` read; so does each restart the ranks make in their processes (recovery.in_process:
hfscale.launch.recovery.in_process_events). Starts no process: each attempt and probe is execute's."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from hfscale.config.errors import ConfigError
from hfscale.config.model import HostSpec
from hfscale.core import exitcodes
from hfscale.core.records import LOG_TAIL
from hfscale.core.untrusted import Unreadable, read_bytes
from hfscale.launch.attempt.beats import LauncherBeat
from hfscale.launch.attempt.execute import execute_attempt, run_probe, run_probes
from hfscale.launch.build import build_plan
from hfscale.launch.context import LaunchContext
from hfscale.launch.node.health_gate import gate_verdict
from hfscale.launch.preflight.probes import bound_s, evaluate, health_problems, local_need, probes
from hfscale.launch.recovery import in_process_events, settle
from hfscale.launch.recovery.loss_alarms import incidents, loss_alarm
from hfscale.launch.recovery.policy import (Cause, Fault, GiveUp, History, Policy, Relaunch, decide, last_error,
                                     probe_targets)
from hfscale.launch.recovery.slow_stops import slow_stop
from hfscale.launch.attempt.output_lock import Refused
from hfscale.launch.node.stopping import STOP_GRACE_S
from hfscale.launch.run_dir import (ATTEMPTS_DIR, LOGS_DIR, PLAN_FILE, read_metrics, read_state, read_unreached,
                                   record_state)
from hfscale.launch.recovery.timeline import record_event as _event, start_parts
from hfscale.launch.spec import LaunchPlan, Outcome
from hfscale.rules.relaunch import job_on
from hfscale.rules.resolved import Job
from hfscale.training.heartbeat import PROGRESS_DIR, read_progress

WATCH_STEPS_S = 0.5  # rank 0's step is read this often during an attempt (its one-line progress file)
PROBE_TIMEOUT_S = 30.0  # per excluded host, ssh + preflight (and the health checks at their own bounds)


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


def _ready(run_dir: str, attempt: int) -> bool:
    """Whether this attempt's run directory is in place: made (the first), or the previous attempt's
    files moved aside (its plan is the last thing moved: rank 0's old progress is gone by then)."""
    if attempt == 0:
        return os.path.isdir(os.path.join(run_dir, LOGS_DIR))
    return os.path.lexists(os.path.join(run_dir, ATTEMPTS_DIR, str(attempt - 1), PLAN_FILE))


def _time_steps(run_dir: str, attempt: int, after: int, steps: Steps, done: threading.Event,
                   ready: Callable[[], None], started: Callable[[int, float, int | None], None]) -> None:
    """Until the attempt ends: ``ready`` once its run directory is in place, then rank 0's step
    (progress/rank-0, written at every step), read every WATCH_STEPS_S and timed on this host's
    clock when seen; ``started`` at the first step done after the step the ranks resumed from:
    ``after`` (the checkpoint this attempt was launched to resume from), or the newer one rank 0
    says it resumed from (``resumed`` in progress/metrics.json, written before its progress file
    at train begin: a local checkpoint restored by the ranks, hfscale.training.callbacks.local_tier)."""
    while not _ready(run_dir, attempt):
        if done.wait(WATCH_STEPS_S):
            return
    ready()
    rank0 = Path(run_dir) / PROGRESS_DIR / "rank-0"
    resumed: int | None = None
    while not done.wait(WATCH_STEPS_S):
        p = read_progress(rank0, Path(run_dir))
        if p is None or p.step <= after or (steps.last is not None and p.step <= steps.last[0]):
            continue
        if steps.first is None and resumed is None:
            try:
                resumed = read_metrics(run_dir).resumed
            except Unreadable:
                resumed = None
            if resumed is not None and resumed > after:
                after = resumed
                if p.step <= after:
                    continue
        now = time.time()
        if steps.first is None:
            steps.first = (p.step, now)
            started(p.step, now, resumed)
        steps.last = (p.step, now)


def _cause(o: Outcome, hosts: set[str]) -> Cause:
    if o.hung:
        return "hang"
    if o.rc == exitcodes.UNREACHABLE:
        return "host_lost"
    if o.rc == exitcodes.UNHEALTHY and o.where in hosts:
        return "unhealthy"
    if o.where in hosts and o.what.startswith("the ssh to"):
        return "ssh_killed"
    return "rank_failed" if o.where in hosts or not hosts else "launch_failed"  # no hosts: this machine


def _log_tail(run_dir: str, host: str | None) -> list[str]:
    """The failing host's log's last lines ([] when there is none or it is unreadable)."""
    if host is None:
        return []
    try:
        data = read_bytes(Path(run_dir) / LOGS_DIR / f"{host}.log", LOG_TAIL, run_dir, tail=True)
    except (Unreadable, OSError):
        return []
    return data.decode("utf-8", "replace").splitlines()


def healthy_again(job: Job, hosts: tuple[str, ...], python: str, notes: list[str]) -> frozenset[str]:
    """The hosts among ``hosts`` (the job's, its spares') that answer ssh and pass preflight now (``notes``: its notes)."""
    specs = tuple(_as(h, spare=False) for h in job.hosts + job.spares if h.host in hosts)
    probed = replace(job, hosts=specs, num_nodes=len(specs))
    cmds = {k: c for k, c in probes(probed, python).items() if k.split("/")[0] in hosts}
    reports = evaluate(probed, run_probes(cmds, bound_s(job, PROBE_TIMEOUT_S)), local_need(job)) if hosts else []
    notes.extend(f"{r.host}: {n}" for r in reports if not r.problems for n in r.notes)
    notes.extend(f"{r.host}: not admitted: {'; '.join(r.problems)}"[:1000] for r in reports
                 if any(p in r.problems for p in health_problems(job, r.facts)))  # its health gate: said, not silent
    return frozenset(r.host for r in reports if not r.problems)


def _resume_step(ctx: LaunchContext) -> int | None:
    scan = ctx.output
    if scan is None or scan.resume is None:
        return None
    return scan.state.global_step if scan.state is not None else None


class _Stopped(Exception):
    """A stop signal between attempts (``hfscale stop``, a scheduler's TERM, a closed terminal)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_between_attempts(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def supervise(job: Job, context: Callable[[Job, int], LaunchContext], echo_for: Callable[[LaunchPlan], Callable[[str], None]],
              say: Callable[[str], None], first: int = 0) -> int:
    """Run ``job`` until it ends, relaunching it after failures as ``job.config.recovery`` allows.
    ``context(job, attempt)``: the launch context of an attempt (the checkpoints scanned anew, the
    run's job id); ``echo_for(plan)``: the output of one attempt; ``say``: hfscale's own lines.
    Returns the exit code of the last attempt (0: finished). A signal during an attempt stops it
    as any launch's (``execute`` holds the handlers then); between attempts (nothing runs) it ends
    the supervision: no relaunch. ``first``: the number of the first attempt (a requeued Slurm job
    goes on from its previous attempts, hfscale.launch.recovery.requeue)."""
    previous = {s: signal.signal(s, _stop_between_attempts) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    runs: list[str] = []
    gap: list[LauncherBeat] = []
    try:
        return _supervise(job, context, echo_for, say, runs, gap, first)
    except _Stopped as e:
        say(f"hfscale: got {signal.Signals(e.signum).name} between attempts (nothing was running); not relaunched")
        if runs:
            record_state(runs[0], state="stopped", exit_code=128 + e.signum, ended=time.time())
            _event(runs[0], kind="gave_up", attempt=0, what=f"stopped by {signal.Signals(e.signum).name} between attempts")
        return 128 + e.signum
    finally:
        _end_gap(gap)
        for s, h in previous.items():
            signal.signal(s, h)


def _end_gap(gap: list[LauncherBeat]) -> None:
    while gap:
        gap.pop().stop()


def _say_policy(policy: Policy, nodes: int, say: Callable[[str], None]) -> None:
    if policy.min_nodes is None:
        shrink = ", never shrinking (a failed host is retried)"
    elif policy.min_nodes >= nodes:
        shrink = f", never shrinking (min_nodes {policy.min_nodes}: a host at its strikes ends the job)"
    else:
        shrink = f", down to {policy.min_nodes} node(s)"
    say(f"hfscale: recovery on: up to {policy.max_restarts} restart(s)" + (f" in {policy.window} s" if policy.window
        else "") + f", a host left out after {policy.strikes} failure(s)" + shrink + _spares_said(policy.spares))


def _spares_said(spares: tuple[str, ...]) -> str:
    """``; spare node3 takes a failed host's place first`` (at most 8 named)."""
    if not spares:
        return ""
    names = ", ".join(spares[:8]) + (f" and {len(spares) - 8} more" if len(spares) > 8 else "")
    return f"; spare {names} takes a failed host's place first" if len(spares) == 1 else \
        f"; spares {names} take a failed host's place first"


def _supervise(job: Job, context: Callable[[Job, int], LaunchContext],
               echo_for: Callable[[LaunchPlan], Callable[[str], None]], say: Callable[[str], None],
               runs: list[str], gap: list[LauncherBeat], first: int = 0) -> int:
    """``gap``: the heartbeat the supervisor writes between two attempts (each attempt's launch writes
    its own): the nodes that watch it (a supervised Slurm job's, hfscale.launch.runners.slurm_script)
    then see a live supervisor through its probes and decisions, and a lost one within a minute."""
    policy = Policy.of(job.config.recovery, tuple(h.host for h in job.hosts), tuple(h.host for h in job.spares))
    history = History()
    current, attempt, python = job, first, job.config.runner.python or ""
    ctx = context(current, attempt)
    _say_policy(policy, job.num_nodes, say)
    while True:
        try:
            plan = build_plan(current, ctx)
        except ConfigError as e:
            if not runs:
                say(f"error: {e.render()}")
                return exitcodes.BAD_INPUT
            return _give_up(runs[0], attempt - 1, exitcodes.BAD_INPUT, f"cannot relaunch: {e.render()}", say)
        run_dir = plan.run_dir
        runs[:] = [run_dir]
        if plan.mode == "done":  # a relaunch after the last checkpoint: a rank failed as the job ended
            say(f"hfscale: nothing left to train after attempt {attempt - 1}: the job is finished")
            record_state(run_dir, state="finished", exit_code=0, ended=time.time())
            _event(run_dir, kind="finished", attempt=attempt)
            return 0
        resume, known = _resume_step(ctx), incidents(plan.output_dir)
        launch = dict(kind="launch", attempt=0, hosts=[h.host for h in current.hosts], world_size=current.world_size,
                      accumulation=current.gradient_accumulation_steps, resume_step=resume)
        steps, done, n, launched, began = Steps(), threading.Event(), attempt, threading.Event(), time.time()

        def ready() -> None:
            if n == 0:
                _event(run_dir, **launch)
            launched.set()

        watcher = threading.Thread(target=_time_steps, daemon=True, args=(
            run_dir, attempt, resume or 0, steps, done, ready,
            lambda s, t, r: _event(run_dir, kind="training", attempt=n, at=t, step=s, resume_step=r,
                                   phases=start_parts(run_dir, began))))
        watcher.start()
        restarts = in_process_events.follow(run_dir, attempt, done) if job.config.recovery.in_process else None
        _end_gap(gap)
        try:
            outcome = execute_attempt(plan, plan.render(), echo_for(plan), attempt)
        except Refused as e:  # another launch took the output_dir between two attempts
            say(f"error: {e}; not relaunched")
            _event(run_dir, kind="gave_up", attempt=attempt, what=f"not relaunched: {str(e)[:900]}")
            return exitcodes.BAD_INPUT
        finally:
            done.set()
            for thread in (watcher, restarts) if restarts else (watcher,):
                thread.join(5)
        stopped = time.time()
        if attempt == 0 and not launched.is_set() and os.path.isdir(run_dir):  # it ended before the watcher looked
            _event(run_dir, **launch, at=_started(run_dir) or stopped)
        if outcome.rc == 0:
            _event(run_dir, kind="finished", attempt=attempt, at=stopped, step=steps.last[0] if steps.last else None,
                   step_time=steps.step_time)
            return 0
        if outcome.signalled or outcome.where is None:  # stopped by hand, or nothing ran (no node failed)
            return outcome.rc
        record_state(run_dir, state="running", exit_code=None, ended=None)  # deciding: hfscale stop still applies
        if plan.keeper is not None and os.path.isdir(run_dir):
            gap.append(LauncherBeat(run_dir, say))
        order = tuple(h.host for h in current.hosts)
        cause = _cause(outcome, set(order))
        host = outcome.where if outcome.where in order else None
        log = host or (next(iter(plan.logs)) if len(plan.logs) == 1 else None)  # a local job's one log
        tail = _log_tail(run_dir, log)
        what, error = outcome.what, last_error(tail)
        if cause == "unhealthy" and (verdict := gate_verdict(tail)):  # as the gate said it (status shows it)
            what = f"{host} failed its health gate: {verdict}"
        alarm = loss_alarm(plan.output_dir, known)  # the loss guard stopped it: a rollback (and a strike?)
        if alarm is not None:
            cause, host, what, error = "loss_spike", alarm.host, alarm.what, ""
        elif (slow := slow_stop(run_dir, order)) is not None:  # stopped at a checkpoint to replace a slow node
            cause, host, what, error = "slow", slow.host, slow.what, ""
            steps.last = (slow.step, stopped) if slow.step is not None else steps.last
        targets = probe_targets(policy, history, excluded=job.config.recovery.probe_excluded)
        grace = 0 if outcome.hung and plan.kill is not None else STOP_GRACE_S  # after a hang: killed, no grace
        answers, healthy = _after_stop(job, current, plan, grace, targets + ((host,) if host and cause ==
                                       "host_lost" else ()), python or sys.executable, say)
        silent = tuple(h for h in order if answers.get(h) is None)
        if cause == "host_lost" and host is not None and host in healthy:
            # ssh's session ended (its remote command killed, a dropped connection) but the host answers
            cause, what = "rank_failed", f"{what}; {host} answers ssh and passes preflight: counted as a failure"
        elif cause == "hang" and host is None and silent:  # every rank waited on a peer: the one that is cut off
            host, cause, what = silent[0], "host_lost", f"{what}; {silent[0]} did not answer after the stop"
        elif order and host == order[0] and port_held(error):
            cause = "port_busy"
        fault = Fault(cause, host, outcome.rc, what, error, outcome.failed_at or stopped, steps.first is not None)
        _event(run_dir, kind="failure", attempt=attempt, at=fault.at, cause=cause, host=host, what=what[:1000],
               error=fault.error[:300], step=steps.last[0] if steps.last else None, step_time=steps.step_time)
        _event(run_dir, kind="stopped", attempt=attempt, at=stopped)
        for line in settle.told(answers, grace):
            say(f"hfscale: {line}")
        if alarm is not None and alarm.verdict is not None:
            return _give_up(run_dir, attempt, exitcodes.LOSS_ALARM, alarm.verdict, say)
        decision = decide(policy, history, fault, healthy - {host}, time.time(),
                          lost=tuple(h for h in silent if h != host))
        if isinstance(decision, GiveUp):
            return _give_up(run_dir, attempt, outcome.rc, decision.reason, say)
        try:
            current = job_on(job, *_specs(job, decision))
        except ConfigError as e:
            return _give_up(run_dir, attempt, outcome.rc, f"cannot relaunch on {', '.join(decision.hosts)}: "
                            f"{e.render()}", say)
        _master_port(current, order, answers, decision.hosts, python or sys.executable, say)
        attempt += 1
        within = f" within {policy.window} s" if policy.window else ""
        say(f"hfscale: restart {attempt} (at most {policy.max_restarts}{within}): {decision.reason}; attempt "
            f"{attempt - 1}'s logs and reports move to {os.path.join(run_dir, ATTEMPTS_DIR, str(attempt - 1))}")
        ctx = replace(context(current, attempt), unreachable=silent)  # the checkpoints as they are now
        _event(run_dir, kind="relaunch", attempt=attempt, hosts=list(decision.hosts),
               excluded=list(decision.excluded), readmitted=list(decision.readmitted),
               replaced=[{"host": r.host, "spare": r.spare} for r in decision.replaced] or None,
               spares=list(decision.spares) if job.spares else None,
               resume_step=_resume_step(ctx), world_size=current.world_size,
               accumulation=current.gradient_accumulation_steps)


def port_held(error: str) -> bool:
    """Whether a rank's last error is its store failing to bind the master port (torch's
    ``DistNetworkError ... name: EADDRINUSE, message: address already in use``)."""
    return "EADDRINUSE" in error or "address already in use" in error.lower()


def _after_stop(job: Job, current: Job, plan: LaunchPlan, grace: int, targets: tuple[str, ...], python: str,
                say: Callable[[str], None] = lambda _: None) -> tuple[dict[str, settle.Settled | None], frozenset[str]]:
    """At once: each host of the stopped attempt (``current``'s) settled (hfscale.launch.recovery.settle: its
    processes gone, node 0's master port free; None: it did not answer, or the attempt's stop or stack
    dump could not reach it already), and ``targets`` (the job's spares, excluded hosts) probed."""
    order = tuple(h.host for h in current.hosts)
    gone = read_unreached(plan.run_dir, order)
    cmds = {k: c for k, c in settle.probes(current, order, plan.job_id, grace, python).items() if k not in gone}
    bounds = {k: settle.bound_s(grace, k == (order or (settle.LOCAL,))[0]) for k in cmds}
    healthy: list[frozenset[str]] = []
    notes: list[str] = []
    prober = threading.Thread(target=lambda: healthy.append(healthy_again(job, targets, python, notes)), daemon=True)
    prober.start()
    ran = run_probes(cmds, bounds, workers=job.config.runner.fanout)
    prober.join()
    for note in notes[:20]:  # a host admitted with its local folder full, or kept out by its health gate
        say(f"hfscale: {note}")
    answers = {k: settle.Settled.read(r) for k, r in ran.items()}
    return {**answers, **dict.fromkeys(gone)}, healthy[0] if healthy else frozenset()


def _master_port(job: Job, before: tuple[str, ...], answers: dict[str, settle.Settled | None],
                 hosts: tuple[str, ...], python: str, say: Callable[[str], None]) -> None:
    """Before the relaunch: node 0's master port free (its settle waited for it), or, when node 0 is a
    new host (a spare in its place), that host waited for it. A port still held is said: the attempt
    then fails with EADDRINUSE, which counts against no host (``port_busy``)."""
    master = hosts[0] if hosts else settle.LOCAL
    was = answers.get(master) if master == (before[0] if before else settle.LOCAL) else settle.Settled.read(
        run_probe(settle.port_probe(job, master, python), settle.bound_s(0, True)))
    if was is not None and was.port == "busy":
        say(f"hfscale: the master port {job.config.cluster.master_port} on {master} is still in use after "
            f"{settle.PORT_WAIT_S} s; relaunching anyway (a store that cannot bind it counts against no host)")


def _specs(job: Job, decision: Relaunch) -> tuple[tuple[HostSpec, ...], tuple[HostSpec, ...]]:
    """The hosts of a relaunch (in node-rank order: a spare trains as itself, not marked) and the
    spares still free (marked), from the job's own host entries."""
    by_name = {h.host: h for h in job.hosts + job.spares}
    return (tuple(_as(by_name[h], spare=False) for h in decision.hosts),
            tuple(_as(by_name[h], spare=True) for h in decision.spares))


def _as(h: HostSpec, spare: bool) -> HostSpec:
    return h if h.spare == spare else h.model_copy(update={"spare": spare})


def _give_up(run_dir: str, attempt: int, rc: int, reason: str, say: Callable[[str], None]) -> int:
    say(f"hfscale: {reason}")
    record_state(run_dir, state="failed", exit_code=rc, ended=time.time())
    _event(run_dir, kind="gave_up", attempt=attempt, what=reason[:1000])
    return rc


def _started(run_dir: str) -> float | None:
    try:
        return read_state(run_dir).started
    except (Unreadable, OSError):
        return None
