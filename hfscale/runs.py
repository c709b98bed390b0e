"""The runs in a runs directory, as ``hfscale runs``/``status``/``logs``/``stop`` show them (files
only: the run directory's state.json, rank 0's progress/metrics.json, the ranks' progress files,
the logs; stopping and scheduler queries go through hfscale.execute).

A run's state: ``running`` while the launching hfscale process lives (checked when it runs on
this host), ``died`` when it is gone without a word (killed -9, a lost login node), ``submitted``
for scheduler jobs, else what its exit code says (hfscale.exitcodes.state_of) or ``preempted``
when rank 0 reported a preemption save.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .progress import PROGRESS_DIR, read_metrics, read_progress
from .rundir import (CLEANUP_FILE, CONFIG_COPY, HANG_REPORT, LOGS_DIR, PLAN_FILE, SLURM_JOB_ID_FILE, read_cleanup,
                     read_state, record_state)


class RunError(ValueError):
    """A run that cannot be found or used; the message names it."""


@dataclass(frozen=True)
class RunInfo:
    """One run directory, read."""

    path: Path
    job_id: str
    runner: str
    state: str
    step: int | None
    max_steps: int | None
    loss: float | None
    started: float | None
    ended: float | None
    exit_code: int | None
    pid: int | None
    host: str | None
    slurm_job: str | None = None

    @property
    def name(self) -> str:
        return self.path.name


def launcher_alive(pid: object, host: object) -> bool | None:
    """Whether the launching hfscale process still runs (None: it runs on another host)."""
    if not isinstance(pid, int) or host != socket.gethostname():
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"hfscale" in cmdline  # a recycled pid belongs to something else


def run_info(path: str | Path) -> RunInfo:
    """What ``path`` (a run directory) says about its run."""
    path = Path(path)
    doc, m = read_state(path), read_metrics(path)
    step = m.get("step") if isinstance(m.get("step"), int) else None
    if step is None:  # rank 0 reported no step (a plain loop without progress.report): the ranks' files
        steps = [p.step for f in (path / PROGRESS_DIR).glob("rank-*") if (p := read_progress(f)) is not None]
        step = max(steps) if steps else None
    state = _state(doc, m)
    try:
        slurm = (path / SLURM_JOB_ID_FILE).read_text().strip() or None
    except OSError:
        slurm = None
    loss = m.get("loss")
    return RunInfo(path, str(doc.get("job_id", "")), str(doc.get("runner", "")), state, step,
                   m.get("max_steps") if isinstance(m.get("max_steps"), int) else None,
                   float(loss) if isinstance(loss, (int, float)) else None,
                   doc.get("started"), doc.get("ended"), doc.get("exit_code"), doc.get("pid"), doc.get("host"), slurm)


def _state(doc: dict, metrics: dict) -> str:
    """The run's state from its state.json (``doc``) and rank 0's metrics."""
    state = doc.get("state", "unknown")
    if state == "running" and launcher_alive(doc.get("pid"), doc.get("host")) is False:
        state = "died"
    if metrics.get("preempted") and state in ("finished", "stopped", "failed") and not doc.get("stop_requested"):
        state = "preempted"
    return state


def _launch_cwd(run_dir: Path, run_dir_setting: str) -> Path | None:
    """The directory ``hfscale launch`` ran in: run_dir is ``<cwd>/<runner.run_dir>/<name>-<id>``."""
    if os.path.isabs(run_dir_setting):
        return None  # the cwd is not part of the path
    parts = tuple(p for p in Path(os.path.normpath(run_dir_setting)).parts if p != ".")
    base = run_dir.resolve().parent.parts
    if ".." in parts or (parts and base[-len(parts):] != parts):
        return None
    return Path(*base[:len(base) - len(parts)])


def output_dir_of(run_dir: Path, cfg: dict[str, Any], launch_cwd: str | None = None) -> Path:
    """training.output_dir as the ranks saw it: relative to runner.workdir, itself relative to the
    launch directory (hfscale.launcher.output_dir_to_scan): ``launch_cwd`` where state.json
    recorded it, else inferred from the run directory's path, else this process's. The first
    candidate that exists wins, else the most likely one."""
    out = str((cfg.get("training") or {}).get("output_dir") or "output")
    runner = cfg.get("runner") or {}
    workdir = str(runner.get("workdir") or "")
    rel = os.path.join(workdir, out)
    if os.path.isabs(rel):
        return Path(rel)
    bases = [Path(launch_cwd) if launch_cwd else None, _launch_cwd(run_dir, str(runner.get("run_dir") or "runs")),
             Path.cwd()]
    candidates = [b / rel for b in bases if b is not None]
    return next((c for c in candidates if c.is_dir()), candidates[0])


def read_config_copy(run: Path) -> tuple[str, dict[str, Any]]:
    """(text, mapping) of run directory ``run``'s resolved config copy; RunError when unusable."""
    import yaml

    try:
        text = (run / CONFIG_COPY).read_text(encoding="utf-8")
        cfg = yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise RunError(f"{run / CONFIG_COPY}: cannot read the run's config ({e})") from None
    if not isinstance(cfg, dict):
        raise RunError(f"{run / CONFIG_COPY}: not a YAML mapping, not the config copy hfscale launch writes")
    return text, cfg


def run_output_dir(run: Path) -> Path:
    """The training.output_dir of run directory ``run`` (its config copy and state.json)."""
    cwd = read_state(run).get("cwd")
    return output_dir_of(run, read_config_copy(run)[1], cwd if isinstance(cwd, str) else None)


def is_run_dir(path: Path) -> bool:
    return (path / PLAN_FILE).is_file() and (path / LOGS_DIR).is_dir()


def list_runs(root: str | Path) -> list[RunInfo]:
    """The runs under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        raise RunError(f"{root} is not a directory of runs (runner.run_dir; default: runs)")
    infos = [run_info(p) for p in root.iterdir() if p.is_dir() and is_run_dir(p)]
    return sorted(infos, key=lambda i: (i.started or 0, i.name))


def find_run(ref: str, root: str | Path = "runs") -> Path:
    """A run directory: ``ref`` itself, or the one run under ``root`` whose name or job id is or
    ends with ``ref``."""
    if is_run_dir(Path(ref)):
        return Path(ref)
    root = Path(root)
    if not root.is_dir():
        raise RunError(f"no run directory {ref!r}, and no runs directory {root}")
    found = [p for p in root.iterdir() if p.is_dir() and is_run_dir(p) and (p.name == ref or p.name.endswith(ref))]
    if len(found) == 1:
        return found[0]
    if not found:
        raise RunError(f"no run {ref!r} in {root} (hfscale runs {root} lists them)")
    raise RunError(f"{ref!r} matches {len(found)} runs in {root}: {', '.join(sorted(p.name for p in found))}")


def _when(t: object) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "-"


def _steps(i: RunInfo) -> str:
    if i.step is None:
        return "-"
    return f"{i.step}/{i.max_steps}" if i.max_steps else str(i.step)


def runs_table(infos: list[RunInfo]) -> str:
    """One line per run: name, runner, state, steps, last loss, started."""
    rows = [["run", "runner", "state", "steps", "loss", "started"]]
    rows += [[i.name, i.runner or "-", i.state, _steps(i), f"{i.loss:.4f}" if i.loss is not None else "-",
              _when(i.started)] for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows) + "\n"


def log_files(path: Path) -> list[Path]:
    """The node logs of a run, in name order."""
    return sorted((path / LOGS_DIR).glob("*.log"))


def pick_log(path: Path, node: str | None) -> list[Path]:
    """The logs ``--node`` names (a host name or its index in name order); all without it."""
    logs = log_files(path)
    if node is None:
        return logs
    names = [p.stem for p in logs]
    if node in names:
        return [logs[names.index(node)]]
    if node.isdigit() and int(node) < len(logs):
        return [logs[int(node)]]
    raise RunError(f"no log of node {node!r} in {path / 'logs'}; there are: {', '.join(names) or 'none'}")


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return f.read().decode("utf-8", "replace").splitlines()[-lines:]
    except OSError:
        return []


def status_text(i: RunInfo, scheduler_state: str | None = None) -> str:
    """``hfscale status``: the run, rank 0's numbers, each rank's step, a hang report, log tails."""
    m = read_metrics(i.path)
    lines = [f"run          {i.name} ({i.path})", f"state        {i.state}"
             + (f" (exit code {i.exit_code})" if i.exit_code is not None else "")
             + (f"; Slurm job {i.slurm_job}: {scheduler_state}" if i.slurm_job and scheduler_state else
                f"; Slurm job {i.slurm_job}" if i.slurm_job else ""),
             f"runner       {i.runner or '-'}; launched by pid {i.pid} on {i.host}",
             f"started      {_when(i.started)}" + (f"; ended {_when(i.ended)}" if i.ended else ""),
             f"step         {_steps(i)}" + (f"; loss {i.loss:.4f}" if i.loss is not None else "")
             + (f"; {m['tokens_per_s']:.0f} tokens/s" if isinstance(m.get("tokens_per_s"), (int, float)) else "")]
    ranks = sorted((p for f in (i.path / PROGRESS_DIR).glob("rank-*") if (p := read_progress(f))), key=lambda p: p.rank)
    if ranks:
        lo, hi = min(p.step for p in ranks), max(p.step for p in ranks)
        behind = [f"rank {p.rank} ({p.host})" for p in ranks if p.step == lo < hi]
        lines.append(f"ranks        {len(ranks)} reporting; steps {lo}..{hi}"
                     + (f"; behind: {', '.join(behind[:8])}" if behind else ""))
    if (i.path / HANG_REPORT).is_file():
        lines.append(f"hang report  {i.path / HANG_REPORT}")
    for log in log_files(i.path):
        lines += ["", f"--- {log} (last lines)", *_tail(log, 5)]
    return "\n".join(lines) + "\n"


STOP_WAIT_S = 120  # the launcher's stop: TERM, a grace period, KILL, on every node


def scheduler_command(i: RunInfo, action: str):
    """The scheduler command that stops (``stop``) or asks about (``state``) a submitted run."""
    from .runners.kubernetes import MANIFESTS
    from .shell import Command

    if i.slurm_job:
        return Command(("scancel", i.slurm_job)) if action == "stop" else \
            Command(("squeue", "-h", "-j", i.slurm_job, "-o", "%T"))
    if i.runner == "kubernetes" and action == "stop":
        return Command(("kubectl", "delete", "--ignore-not-found", "-f", str(i.path / MANIFESTS)))
    return None


def stop(i: RunInfo, say) -> int:
    """Stop run ``i`` on every host: its launcher gets SIGTERM (it runs the cleanup everywhere)
    and is waited for; a submitted run is cancelled through its scheduler; a run whose launcher
    died gets the cleanup that launcher recorded. The exit code."""
    if i.state == "submitted":
        cmd = scheduler_command(i, "stop")
        if cmd is None:
            raise RunError(f"{i.name}: submitted to {i.runner or 'a scheduler'}; hfscale does not know how to cancel it")
        _run_stop(i, cmd, cmd.shell(), 60)
        say(f"hfscale: {cmd.shell()}: done; {i.name} stopped")
        return 0
    if i.state == "died":
        cmd = read_cleanup(i.path)
        if cmd is None:
            raise RunError(f"{i.name}: its launcher (pid {i.pid}) died and {i.path / CLEANUP_FILE} is missing, "
                           "unreadable or writable by others; stop its processes by hand")
        what = f"the recorded cleanup ({os.path.basename(cmd.argv[0])})"
        say(f"hfscale: {i.name}: its launcher (pid {i.pid}) died; running {what} on every host")
        _run_stop(i, cmd, what, STOP_WAIT_S)
        say(f"hfscale: {i.name} stopped")
        return 0
    if i.state != "running":
        raise RunError(f"{i.name} is not running (state {i.state})")
    alive = launcher_alive(i.pid, i.host)
    if alive is None:
        raise RunError(f"{i.name} was launched on {i.host} (pid {i.pid}): run hfscale stop there")
    assert isinstance(i.pid, int)
    say(f"hfscale: stopping {i.name}: SIGTERM to its launcher (pid {i.pid}), which stops every node")
    record_state(i.path, stop_requested=time.time())  # the ranks' preemption save then reads as stopped
    os.kill(i.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        doc = read_state(i.path)
        if doc.get("state") != "running" or launcher_alive(i.pid, i.host) is False:
            say(f"hfscale: {i.name} {doc.get('state', 'ended')} (exit code {doc.get('exit_code')})")
            return 0
        time.sleep(0.5)
    raise RunError(f"{i.name}: the launcher (pid {i.pid}) did not end within {STOP_WAIT_S} s")


def _run_stop(i: RunInfo, cmd, what: str, timeout: float) -> None:
    """Run the command that stops ``i`` (a scheduler's cancel, or the cleanup a launcher that died
    recorded: it stops the job's processes on every host), then record the run as stopped."""
    from .execute import run_probe

    record_state(i.path, stop_requested=time.time())
    rc, out, err = run_probe(cmd, timeout=timeout)
    if rc != 0:
        raise RunError(f"{i.name}: {what} failed (exit code {rc}): {(err or out).strip()[:300]}")
    record_state(i.path, state="stopped", ended=time.time())


def follow_logs(run: Path, logs: list[Path], write, poll_s: float = 0.5) -> None:
    """Write what ``logs`` hold, then what is appended, until the run is no longer running."""
    from .follow import LogTail

    tail = LogTail({str(p): p for p in logs})
    prefix = {str(p): f"[{p.stem}] " if len(logs) > 1 else "" for p in logs}
    while True:
        running = _state(read_state(run), {}) == "running"  # read first: what was written before it ended is drained below
        while batch := tail.lines():  # a long log comes in pieces of follow.READ_LIMIT
            for name, line in batch:
                write(prefix[name] + line)
        if not running:
            for name, line in tail.rest():
                write(prefix[name] + line)
            return
        time.sleep(poll_s)
