"""The only module that starts processes: it runs launch plans and preflight probes.

A plan runs its ``prepare`` steps, then one local process (pdsh, docker, the launcher) whose output is logged
per node, shown (hfscale.launch.attempt.console) and watched: a failing node, a signal, that process killed by someone
else, or the hang watchdog (hfscale.launch.attempt.watchdog) runs the plan's cleanup on every node (TERM, then KILL
after a grace period). A host ssh cannot reach, or loses, shows up in the same stream (pdsh reports ssh's exit
code 255): exit code 3 naming the host. A detached launch (more hosts than runner.fanout) is followed through
the run directory (hfscale.launch.attempt.follow)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from hfscale.core import exitcodes
from hfscale.core.atomic_files import write_files
from hfscale.core.exitcodes import signal_name
from hfscale.core.shell import Command, Ran
from hfscale.launch.attempt.beats import LaunchBeats
from hfscale.launch.attempt.console import Console, show_progress, never_raises
from hfscale.launch.attempt.disk_full import told
from hfscale.launch.attempt.follow import follow_detached
from hfscale.launch.attempt.node_lines import no_restart_in_process
from hfscale.launch.attempt.output_lock import hold
from hfscale.launch.attempt.run_state import RunState
from hfscale.launch.run_dir import LOGS_DIR, STORE_ADDR, mark_stopping, move_aside, record_state, this_launcher, write_run_dir
from hfscale.launch.runners import scheduler
from hfscale.launch.node.stopping import STOP_GRACE_S
from hfscale.launch.spec import LaunchPlan, Outcome, HangWatch
from hfscale.launch.attempt.watchdog import DumpMarks, Watchdog, conclude

CLEANUP_TIMEOUT_S = 60  # the stop returns at once on a node; this bounds hosts that do not answer
CLEANUP_AGAIN_S = 3.0  # while main still waits for a node after a stop, the stop runs again this often
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WATCH_POLL_S = 5.0  # the ranks' progress is read this often (more often for a timeout under 20 s)
DUMP_TIMEOUT_S = 30  # py-spy per rank, all ranks of a node at once; this bounds nodes that do not answer
STORE_START_S = 60  # the in-process restarts' store imports torch before it listens


def _env(cmd: Command) -> dict[str, str]:
    return {**os.environ, **cmd.real_env()}


class _Run(RunState):
    """One running plan (hfscale.launch.attempt.run_state), and its stop: once, reaching every node."""

    def stop(self) -> None:
        """Run the cleanup (once, in the background), then end what is left of the main process."""
        with self._stop_lock:
            if self._stopping:
                return
            self._stopping, self._stopper = True, threading.Thread(target=self._cleanup, daemon=True)
            self._stopper.start()

    def finish(self) -> None:
        """Wait for a stop in progress: the cleanup must have reached every node before hfscale exits."""
        if self.signalled is not None:
            self.stop()  # the signal handler's thread may not have got to it yet
        with self._stop_lock:
            stopper = self._stopper
        if stopper is not None:
            stopper.join(CLEANUP_TIMEOUT_S + STOP_GRACE_S + 5)

    def _cleanup(self) -> None:
        """Write the stop marker (a node line that starts from now on exits at once), run the
        cleanup on every node, and, for plans whose node lines start remotely (they have a stop
        marker), run it again while ``main`` still waits for a node: a line that started meanwhile
        (a slow ssh, a loaded host) is stopped too. Then end what is left of main."""
        hung = self.hung and self.plan.kill is not None  # stuck ranks cannot save: no grace
        c, marker, grace = self.plan.kill if hung else self.plan.cleanup, self.plan.stop_marker, 0 if hung else STOP_GRACE_S
        why = mark_stopping(marker) if marker is not None else None
        if why:
            self.echo(f"hfscale: cannot write the stop marker {marker}: {why}")
        proc, deadline = self.proc, time.monotonic() + grace + 2
        again = CLEANUP_AGAIN_S if marker is not None else grace + 2  # remote lines can start late
        if c is None and proc is not None and not self.following:
            _signal_group(proc, signal.SIGTERM)
        while True:
            if c is not None:
                self._run_cleanup(c)
            if proc is None or self.following:
                return
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, min(again, deadline - time.monotonic())))
            if proc.poll() is not None or time.monotonic() >= deadline:
                break
        # whatever is left of main's group (ssh to a host that stopped answering, the children of a
        # killed pdsh) would hold its output open
        _signal_group(proc, signal.SIGKILL)

    def _run_cleanup(self, c: Command) -> None:
        try:
            # its own session: a second Ctrl-C in the terminal must not cut the stop short
            subprocess.run(c.real_argv(), env=_env(c), cwd=c.cwd, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=CLEANUP_TIMEOUT_S,
                           start_new_session=True)
        except subprocess.TimeoutExpired:
            self.echo(f"hfscale: the cleanup did not finish in {CLEANUP_TIMEOUT_S} s")
        except OSError as e:
            self.echo(f"hfscale: cannot run the cleanup: {e.strerror or e}")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def submit(plan: LaunchPlan, run_dir: Path, echo: Callable[[str], None]) -> int:
    """Hand the job to its scheduler (sbatch, kubectl apply); record and print what it answered."""
    runner, m = scheduler(plan.runner), plan.main
    missing = shutil.which(m.real_argv()[0], path=_env(m).get("PATH")) is None
    probe = runner.probe(plan)
    if not missing and probe is not None:
        missing = run_probe(probe, timeout=20)[0] != 0
    if missing:
        message, code = runner.unavailable(plan)
        echo(message)
        return code
    try:
        r = subprocess.run(m.real_argv(), env=_env(m), cwd=m.cwd, input=m.stdin.real if m.stdin else "",
                           capture_output=True, text=True, errors="replace")
    except OSError as e:
        echo(f"hfscale: cannot start {m.real_argv()[0]} in {m.cwd or '.'}: {e.strerror or e}")
        return exitcodes.BAD_INPUT
    for line in (r.stdout + r.stderr).splitlines():
        echo(line)
    if r.returncode == 0:
        files, message = runner.submitted(plan, r.stdout)
        write_files(run_dir, files)
        echo(message)
    return r.returncode


def execute(plan: LaunchPlan, record: str, echo: Callable[[str], None] | None = None) -> int:
    """Run ``plan``; return its exit code (the failing node's, or 128+N after signal N). ``echo``:
    each output line (a Console also gets rank 0's progress line).

    From the first line on, SIGINT, SIGTERM and SIGHUP stop the job: before ``main`` starts
    nothing is started; after, the plan's cleanup runs on every node."""
    return execute_attempt(plan, record, echo).rc


def execute_attempt(plan: LaunchPlan, record: str, echo: Callable[[str], None] | None = None,
                    attempt: int = 0) -> Outcome:
    """``execute``, saying how it ended. ``attempt`` > 0: a relaunch by hfscale.launch.recovery.supervisor
    into the same run directory (the previous attempt's files move to attempts/<n>/)."""
    runs: list[_Run] = []
    rc = _execute(plan, record, echo, attempt, runs)
    if not runs or runs[0].failure is None:
        return Outcome(rc, signalled=bool(runs and runs[0].signalled is not None))
    r = runs[0]
    return Outcome(rc, r.failure[0], r.what, r.hung, r.signalled is not None, r.failed_at)


def _execute(plan: LaunchPlan, record: str, echo: Callable[[str], None] | None, attempt: int, runs: list[_Run]) -> int:
    console = echo if isinstance(echo, Console) else None
    echo = never_raises(echo or (lambda s: print(s, flush=True)))
    if plan.mode == "done":
        return 0
    run: _Run | None = None
    signalled: list[int] = []

    def on_signal(signum, _frame):
        # only flags here: printing from a handler can re-enter a write the main thread is in
        if not signalled:
            signalled.append(signum)
            threading.Thread(target=_stop_for_signal, args=(signum,), daemon=True).start()

    def _stop_for_signal(signum: int) -> None:
        echo(f"hfscale: got {signal_name(signum)}; stopping the job on every node")
        if run is not None and run.proc is not None:  # else _stream stops it once main exists
            run.stop()

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    held = beat = None
    try:
        held = hold(plan, echo)  # before anything: --restart's moves would take a running job's checkpoints
        if signalled:
            return 128 + signalled[0]
        for line in plan.told:
            echo(f"hfscale: {line}")
        if not move_aside(plan.moves, echo):
            return 1
        try:
            run_dir = write_run_dir(plan, record, attempt)
        except OSError as e:
            echo(f"hfscale: cannot create the run directory {e.filename or plan.run_dir}: {e.strerror or e}; "
                 "nothing was started")
            return exitcodes.BAD_INPUT
        launcher = {k: v for k, v in this_launcher().items() if not (attempt and k == "started")}  # the run's start
        record_state(run_dir, **launcher, state="running", job_id=plan.job_id, runner=plan.runner)
        if plan.keeper is not None:  # while it beats, the nodes' keepers let their job run (hfscale.launch.attempt.beats)
            beat = LaunchBeats(run_dir, len(plan.nodes), bool(plan.keeper.beat_addr), echo)
        rc = 0
        for step in plan.prepare:
            if (rc := _prepare(step, run_dir, echo)) or signalled:
                break
        if rc or signalled:
            rc = 128 + signalled[0] if signalled else rc
        elif plan.mode == "submit":
            rc = submit(plan, run_dir, echo)
        else:
            store = _start_store(plan.store, run_dir, echo) if plan.store is not None else None
            if plan.store is not None and store is None:
                return _end_state(run_dir, exitcodes.BAD_INPUT, plan, signalled, None)
            run = _Run(plan, run_dir, echo, signalled, beat)
            runs.append(run)
            shower = threading.Thread(target=show_progress, daemon=True, args=(
                run_dir, run.ended, console.progress, console.tty)) if console and console.mode != "quiet" else None
            if shower is not None:  # rank 0 reports into <run dir>/progress, watchdog on or off
                shower.start()
            try:
                rc = _stream(run)
            finally:
                run.close()
                if store is not None:
                    _end_store(store)
                if shower is not None and console is not None:
                    shower.join(5)  # its last line, before the launch's own
                    console.close()
        if rc != 0 and run is not None and not signalled:
            for line in told(run.out.disk, plan.output_dir):
                echo(line)
        return _end_state(run_dir, rc, plan, signalled, run)
    finally:
        if beat is not None:  # the job has ended on every node (run.finish waited for the stop)
            beat.stop()
        if held is not None:  # before the handlers go: a second Ctrl-C must not leave the lock behind
            held.release()
        for s, h in previous.items():
            signal.signal(s, h)


def _end_state(run_dir: Path, rc: int, plan: LaunchPlan, signalled: list[int], run: _Run | None) -> int:
    record_state(run_dir, exit_code=rc, ended=time.time(), state=exitcodes.state_of(
        rc, submitted=plan.mode == "submit", signalled=bool(signalled), hung=run is not None and run.hung))
    return rc


def _start_store(c: Command, run_dir: Path, echo: Callable[[str], None]) -> subprocess.Popen | None:
    """The in-process restarts' store (hfscale.training.inprocess.store_host) once it listens: its port
    is in the run directory, where the nodes read it. None, said, when it does not start."""
    log = run_dir / LOGS_DIR / "_store.log"  # no host's: a host name begins with a letter or digit
    try:
        with open(log, "a", encoding="utf-8") as out:
            proc = subprocess.Popen(c.real_argv(), env=_env(c), cwd=c.cwd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        echo(f"hfscale: cannot start the in-process restarts' store: {e.strerror or e}; nothing was started")
        return None
    deadline = time.monotonic() + STORE_START_S
    while not (run_dir / STORE_ADDR).is_file():
        if proc.poll() is not None or time.monotonic() >= deadline:
            _signal_group(proc, signal.SIGKILL)
            echo(f"hfscale: the in-process restarts' store did not start within {STORE_START_S} s (its log: {log}); "
                 "nothing was started")
            return None
        time.sleep(0.1)
    return proc


def _end_store(store: subprocess.Popen) -> None:
    _signal_group(store, signal.SIGTERM)
    try:
        store.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _signal_group(store, signal.SIGKILL)
        store.wait()


def _prepare(step: Command, run_dir: Path, echo: Callable[[str], None]) -> int:
    """Run one of the plan's steps before the job (a checkpoint conversion); its output goes to
    logs/prepare.log. Its exit code (0: done)."""
    log = run_dir / LOGS_DIR / "prepare.log"
    echo(f"hfscale: {step.shell()}")
    t0 = time.monotonic()
    try:
        with open(log, "a", encoding="utf-8") as out:
            rc = subprocess.run(step.real_argv(), env=_env(step), cwd=step.cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT).returncode
    except OSError as e:
        echo(f"hfscale: cannot run {step.real_argv()[0]}: {e.strerror or e}; nothing was started")
        return exitcodes.BAD_INPUT
    if rc:
        echo(f"hfscale: that step failed (exit code {rc}); its output is in {log}; nothing was started")
    else:
        echo(f"hfscale: done in {time.monotonic() - t0:.1f} s")
    return rc


def _stream(run: _Run) -> int:
    m = run.plan.main
    try:
        run.proc = subprocess.Popen(
            m.real_argv(), env=_env(m), cwd=m.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1, start_new_session=True,
        )
    except OSError as e:
        run.echo(f"hfscale: cannot start {m.real_argv()[0]} in {m.cwd or '.'}: {e.strerror or e}")
        return exitcodes.BAD_INPUT
    if run.signalled is not None:  # came while main was starting (the handler stops it once run.proc is set)
        run.stop()
    watcher = threading.Thread(target=run.watch_main, daemon=True)
    watcher.start()
    if run.plan.watch is not None:
        threading.Thread(target=_watch_for_hang, args=(run, run.plan.watch), daemon=True).start()
    if run.healing is not None:
        threading.Thread(target=run.stop_the_rest, daemon=True).start()
    assert run.proc.stdout is not None
    for line in run.proc.stdout:
        run.route(line.rstrip("\n"))
    rc = run.proc.wait()
    watcher.join()  # it may be deciding on a stop right now: finish() must see it
    if run.signalled is None:
        run.out.first.settle(all_ended=True)  # every node has reported: one that only lost a peer is the failure
    if run.healing is not None and rc and run.failure is None and run.signalled is None and run.healing.healed:
        if run.healing.finished(run.out.nodes.succeeded):
            rc = 0  # the nodes the ranks healed around do not fail the job
        else:
            first = run.healing.healed[0]
            run.fail(first.where, first.rc, first.what)
    if rc > 0 and run.failure is None and run.signalled is None and run.plan.follow is None:
        # what main started may outlive it (a killed srun's step inside an allocation): stop it
        run.fail(run.plan.runner, rc, no_restart_in_process(f"the {run.plan.runner} launch", rc)
                 if rc == exitcodes.RELAUNCH and run.healing is not None
                 else f"the {run.plan.runner} launch ended with exit code {rc}")
    if run.plan.follow is not None and rc == 0 and run.failure is None and run.signalled is None:
        run.following = True  # main only started the nodes: its process group is gone
        follow_detached(run, run.plan.follow, run.beats.line if run.beats is not None else None)
        if run.signalled is None:
            run.out.first.settle(all_ended=True)
    run.finish()
    if run.signalled is not None:
        return 128 + run.signalled
    if run.failure is not None:
        return run.failure[1]
    return rc


def _watch_for_hang(run: _Run, watch: HangWatch) -> None:
    """The hang watchdog (hfscale.launch.attempt.watchdog): read the ranks' progress until the run ends; on a
    hang, have every rank's stack written, write the report, and stop the job (exit code 4)."""
    dog = Watchdog(watch, time.monotonic())
    while not run.ended.wait(min(WATCH_POLL_S, max(0.5, watch.timeout / 4))):
        if run.failure is not None or run.signalled is not None:
            return
        reason = dog.poll(time.monotonic())
        if reason is None:
            continue
        d = run.plan.dump
        before = DumpMarks.take(watch, dog.ranks) if d is not None else None  # no dump: no answers to wait for
        if d is not None:
            try:
                subprocess.run(d.real_argv(), env=_env(d), cwd=d.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=DUMP_TIMEOUT_S, start_new_session=True)
            except (subprocess.TimeoutExpired, OSError) as e:
                run.echo(f"hfscale: the stack dump did not finish: {e}")
        hang = conclude(dog, reason, time.monotonic(), run.echo, before)
        if run.failure is None and run.signalled is None:
            run.hung = True
            run.fail(hang.where, exitcodes.HUNG, hang.what)
        return


def run_probe(cmd: Command, timeout: float) -> Ran:
    """Run one probe command (its ``stdin`` fed to it); (exit code, stdout, stderr); 124 on timeout."""
    feed = {"input": cmd.stdin.real} if cmd.stdin is not None else {"stdin": subprocess.DEVNULL}
    try:
        r = subprocess.run(cmd.real_argv(), env=_env(cmd), cwd=cmd.cwd, capture_output=True, text=True,
                           errors="replace", timeout=timeout, **feed)
        return Ran(r.returncode, r.stdout, r.stderr)
    except subprocess.TimeoutExpired:
        return Ran(124, "", f"timed out after {timeout:g} s")
    except FileNotFoundError as e:
        return Ran(127, "", f"{e.filename}: not found")
    except (OSError, ValueError) as e:  # ValueError: a NUL in argv or env
        return Ran(126, "", f"{cmd.real_argv()[0]}: {getattr(e, 'strerror', None) or e}")


def run_probes(cmds: dict[str, Command], timeout: float | dict[str, float], workers: int = 64) -> dict[str, Ran]:
    """Run probes in parallel, one per key, at most ``workers`` at a time, each within ``timeout`` (or its own)."""
    if not cmds:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(cmds)))) as pool:
        futures = {k: pool.submit(run_probe, c, timeout[k] if isinstance(timeout, dict) else timeout)
                   for k, c in cmds.items()}
        return {k: f.result() for k, f in futures.items()}

