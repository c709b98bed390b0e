"""The only module that starts processes: it runs launch plans and preflight probes.

A plan runs as one local process (pdsh, docker, or the launcher itself). Its output is echoed,
split into one log per node, and watched: the first node that fails, or Ctrl-C / SIGTERM to
hfscale, runs the plan's cleanup on every node so no rank is left behind. A host ssh cannot reach
shows up in the same stream (pdsh reports ssh's exit code 255 for a host that never printed its
exit line), so there is no separate reachability round before the launch: that host's job ends
the launch with exit code 3 and the host named. Submitting plans hand the job to a scheduler,
with what each runner knows about its scheduler's answers (hfscale.runners).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, TextIO

from . import exitcodes
from .files import write_files
from .launch_plan import EXIT_MARK, LaunchPlan
from .runners import RUNNERS
from .shell import Command

_EXIT = re.compile(rf"^(?P<host>[^\s:]+): {EXIT_MARK} rc=(?P<rc>\d+)$")
_PDSH_FAIL = re.compile(r"^pdsh@[^:]+: (?P<host>[^\s:]+): \S+ exited with exit code (?P<rc>\d+)$")
_PREFIXED = re.compile(r"^(?:pdsh@[^:]+: )?(?P<host>[^\s:]+): ")
SSH_FAILED = 255  # ssh's own exit code when it could not connect or log in


def _env(cmd: Command) -> dict[str, str]:
    return {**os.environ, **cmd.real_env()}


def write_run_dir(plan: LaunchPlan, record: str) -> Path:
    """Create the run directory with the generated files, the plan as text, logs/, and the private
    files (real secret values) readable by this user only."""
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True, exist_ok=False)
    write_files(run_dir, {**dict(plan.files), "plan.txt": record})
    write_files(run_dir, {name: text.real for name, text in plan.private}, mode=0o600)
    (run_dir / "logs").mkdir()
    return run_dir


class _Run:
    """Bookkeeping for one running plan: logs, first failure, stopping once."""

    def __init__(self, plan: LaunchPlan, run_dir: Path, echo: Callable[[str], None], grace: float):
        self.plan = plan
        self.echo = echo
        self.grace = grace
        self.logs: dict[str, TextIO] = {h: open(run_dir / "logs" / f"{h}.log", "a", encoding="utf-8") for h in plan.logs}
        self.failure: tuple[str, int] | None = None
        self.unreachable: dict[str, str] = {}  # host -> what ssh said
        self._exited: set[str] = set()  # hosts that printed their exit line
        self._last: dict[str, str] = {}  # each host's last line (ssh's complaint, for an unreachable one)
        self.signalled: int | None = None
        self._stop_lock = threading.Lock()
        self._stopping = False
        self.proc: subprocess.Popen | None = None

    def route(self, line: str) -> None:
        m = _PREFIXED.match(line)
        host = m["host"] if m and m["host"] in self.logs else None
        if host is None and len(self.logs) == 1:
            host = next(iter(self.logs))
        if host is not None:
            self.logs[host].write(line + "\n")
            self.logs[host].flush()
        self.echo(line)
        done, fail = _EXIT.match(line), _PDSH_FAIL.match(line)
        if done:
            self._exited.add(done["host"])
        elif m and not fail and not line.startswith("pdsh@"):
            self._last[m["host"]] = line[m.end():]
        found = done or fail
        if not found or int(found["rc"]) == 0 or self.failure is not None or self.signalled is not None:
            return
        host, rc = found["host"], int(found["rc"])
        if fail and rc == SSH_FAILED and host not in self._exited:
            self.unreachable[host] = self._last.get(host, "ssh failed")
            self.failure = (host, exitcodes.UNREACHABLE)
            self.echo(f"hfscale: cannot reach {host} over ssh ({self.unreachable[host]}); stopping the job on every node")
        else:
            self.failure = (host, rc)
            self.echo(f"hfscale: {host} failed (exit code {rc}); stopping the job on every node")
        self.stop()

    def stop(self) -> None:
        """Run the cleanup (once, in the background), then end the main process if still alive."""
        with self._stop_lock:
            if self._stopping:
                return
            self._stopping = True
        threading.Thread(target=self._cleanup, daemon=True).start()

    def _cleanup(self) -> None:
        c = self.plan.cleanup
        if c is not None:
            try:
                subprocess.run(c.real_argv(), env=_env(c), cwd=c.cwd, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=self.grace)
            except subprocess.TimeoutExpired:
                self.echo("hfscale: cleanup timed out")
        proc = self.proc
        if proc is None:
            return
        if c is None:  # local launcher: its whole process group is this job
            _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=self.grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)

    def close(self) -> None:
        for f in self.logs.values():
            f.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def submit(plan: LaunchPlan, run_dir: Path, echo: Callable[[str], None]) -> int:
    """Hand the job to its scheduler (sbatch, kubectl apply); record and print what it answered."""
    runner = RUNNERS[plan.runner]
    m = plan.main
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


def _move_aside(moves: tuple[tuple[str, str], ...], echo: Callable[[str], None]) -> bool:
    """Do the plan's moves (--restart's checkpoints); False, said, when one fails."""
    for src, dst in moves:
        try:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.rename(src, dst)
        except OSError as e:
            echo(f"hfscale: cannot move {src} to {dst}: {e.strerror or e}; nothing was started")
            return False
    if moves:
        echo(f"hfscale: moved {len(moves)} checkpoint(s) to {os.path.dirname(moves[0][1])}")
    return True


def execute(plan: LaunchPlan, record: str, echo: Callable[[str], None] | None = None, grace: float = 30.0) -> int:
    """Run ``plan``; return its exit code (the failing node's, or 128+signal when stopped)."""
    echo = echo or (lambda s: print(s, flush=True))
    if plan.mode == "done":
        return 0
    if not _move_aside(plan.moves, echo):
        return 1
    try:
        run_dir = write_run_dir(plan, record)
    except OSError as e:
        echo(f"hfscale: cannot create the run directory {e.filename or plan.run_dir}: {e.strerror or e}; "
             "nothing was started")
        return exitcodes.BAD_INPUT
    if plan.mode == "submit":
        return submit(plan, run_dir, echo)
    run = _Run(plan, run_dir, echo, grace)

    def on_signal(signum, _frame):
        if run.signalled is None:
            run.signalled = signum
            echo(f"hfscale: got {signal.Signals(signum).name}; stopping the job on every node")
            run.stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        m = plan.main
        try:
            run.proc = subprocess.Popen(
                m.real_argv(), env=_env(m), cwd=m.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1, start_new_session=True,
            )
        except OSError as e:
            echo(f"hfscale: cannot start {m.real_argv()[0]} in {m.cwd or '.'}: {e.strerror or e}")
            return exitcodes.BAD_INPUT
        if run.signalled is not None:
            run.stop()
        assert run.proc.stdout is not None
        for line in run.proc.stdout:
            run.route(line.rstrip("\n"))
        rc = run.proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        run.close()
    if run.signalled is not None:
        return 128 + run.signalled
    if run.failure is not None:
        return run.failure[1]
    return rc


def run_probe(cmd: Command, timeout: float) -> tuple[int, str, str]:
    """Run one probe command; (exit code, stdout, stderr); 124 on timeout."""
    try:
        r = subprocess.run(cmd.real_argv(), env=_env(cmd), cwd=cmd.cwd, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, errors="replace", timeout=timeout)
        return r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout:g} s"
    except FileNotFoundError as e:
        return 127, "", f"{e.filename}: not found"


def run_probes(cmds: dict[str, Command], timeout: float) -> dict[str, tuple[int, str, str]]:
    """Run probes in parallel, one per key."""
    if not cmds:
        return {}
    with ThreadPoolExecutor(max_workers=min(64, len(cmds))) as pool:
        futures = {k: pool.submit(run_probe, c, timeout) for k, c in cmds.items()}
        return {k: f.result() for k, f in futures.items()}

