"""The only module that starts processes: it runs launch plans and preflight probes.

A plan runs as one local process (pdsh, docker, or the launcher itself). Its output is echoed,
split into one log per node, and watched: the first node that fails, or Ctrl-C / SIGTERM to
hfscale, runs the plan's cleanup on every node so no rank is left behind.
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

from .files import write_files
from .plan import EXIT_MARK, LaunchPlan
from .shell import Command

_EXIT = re.compile(rf"^(?P<host>[^\s:]+): {EXIT_MARK} rc=(?P<rc>\d+)$")
_PDSH_FAIL = re.compile(r"^pdsh@[^:]+: (?P<host>[^\s:]+): \S+ exited with exit code (?P<rc>\d+)$")
_PREFIXED = re.compile(r"^(?:pdsh@[^:]+: )?(?P<host>[^\s:]+): ")


def _env(cmd: Command) -> dict[str, str]:
    return {**os.environ, **dict(cmd.env)}


def write_run_dir(plan: LaunchPlan, record: str) -> Path:
    """Create the run directory with the generated files, the plan as text, and logs/."""
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True, exist_ok=False)
    write_files(run_dir, {**dict(plan.files), "plan.txt": record})
    (run_dir / "logs").mkdir()
    return run_dir


class _Run:
    """Bookkeeping for one running plan: logs, first failure, stopping once."""

    def __init__(self, plan: LaunchPlan, run_dir: Path, echo: Callable[[str], None], grace: float):
        self.plan = plan
        self.echo = echo
        self.grace = grace
        self.logs: dict[str, TextIO] = {h: open(run_dir / "logs" / f"{h}.log", "a", encoding="utf-8") for h in plan.hosts}
        self.failure: tuple[str, int] | None = None
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
        fail = _EXIT.match(line) or _PDSH_FAIL.match(line)
        if fail and int(fail["rc"]) != 0 and self.failure is None and self.signalled is None:
            self.failure = (fail["host"], int(fail["rc"]))
            self.echo(f"hfscale: {fail['host']} failed (exit code {fail['rc']}); stopping the job on every node")
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
                subprocess.run(list(c.argv), env=_env(c), cwd=c.cwd, stdin=subprocess.DEVNULL,
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
    m = plan.main
    missing = shutil.which(m.argv[0], path=_env(m).get("PATH")) is None
    if plan.runner == "kubernetes" and not missing:
        # "configured" means a current context; without one kubectl can only fail
        probe = run_probe(Command(("kubectl", "config", "current-context"), m.env, m.cwd), timeout=20)
        missing = probe[0] != 0
    if missing:
        if plan.runner == "kubernetes":
            echo(f"hfscale: no configured kubectl (no current context); the manifests are in {run_dir}/pytorchjob.yaml (secrets as ***: "
                 f"fill them in first). Apply them with:\n  kubectl apply -f {run_dir}/pytorchjob.yaml")
            return 0
        echo(f"hfscale: {m.argv[0]} not found on this machine; submit by hand with:\n  {m.shell()}")
        return 3
    r = subprocess.run(list(m.argv), env=_env(m), cwd=m.cwd, input=m.stdin or "", capture_output=True,
                       text=True, errors="replace")
    for line in (r.stdout + r.stderr).splitlines():
        echo(line)
    if r.returncode == 0 and plan.runner == "slurm":
        job = r.stdout.strip().split(";")[0]
        write_files(run_dir, {"slurm_job_id": job + "\n"})
        echo(f"hfscale: submitted Slurm job {job}; output in {run_dir}/slurm-{job}.out")
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
    run_dir = write_run_dir(plan, record)
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
        run.proc = subprocess.Popen(
            list(m.argv), env=_env(m), cwd=m.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1, start_new_session=True,
        )
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
        r = subprocess.run(list(cmd.argv), env=_env(cmd), cwd=cmd.cwd, stdin=subprocess.DEVNULL,
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

