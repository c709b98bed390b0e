"""What ``hfscale status`` prints of one run (files only): its state, and for a run whose launcher
died what its nodes did without it (hfscale.launch.beats), rank 0's numbers, each rank's step, the
hang report, the recovery lines (hfscale.runs.goodput) and the tail of each node log."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hfscale.core.untrusted import Unreadable, printable, read_bytes
from hfscale.launch.beats import launcher_silent, orphan
from hfscale.launch.run_dir import HANG_REPORT
from hfscale.launch.runners.keeper import LAUNCHER_LOST_S
from hfscale.runs.goodput import status_lines
from hfscale.runs.registry import RunInfo, _steps, _when, log_files, rank_progress
from hfscale.training.heartbeat import PROGRESS_DIR, read_progress


def _tail(path: Path, lines: int) -> list[str]:
    from hfscale.core.records import LOG_TAIL

    try:
        data = read_bytes(path, LOG_TAIL, path.parent.parent, tail=True)  # inside the run directory
    except Unreadable as e:
        return [f"({e})"]
    return data.decode("utf-8", "replace").splitlines()[-lines:]


def status_text(i: RunInfo, scheduler_state: str | None = None) -> str:
    """``hfscale status``: the run, rank 0's numbers, each rank's step, a hang report, log tails."""
    if i.state == "unreadable":
        return (f"run          {printable(i.name)} ({printable(str(i.path))})\n"
                f"state        unreadable: {printable(i.problem or '')}\n")
    slurm = (f"; Slurm job {i.slurm_job}: {printable(scheduler_state)}" if i.slurm_job and scheduler_state else
             f"; Slurm job {i.slurm_job}" if i.slurm_job else "")
    lines = [f"run          {printable(i.name)} ({printable(str(i.path))})", f"state        {i.state}"
             + (f" (exit code {i.exit_code})" if i.exit_code is not None else "") + slurm + _orphan_said(i),
             f"runner       {i.runner or '-'}; launched by pid {i.pid} on {i.host}",
             f"started      {_when(i.started)}" + (f"; ended {_when(i.ended)}" if i.ended else ""),
             f"step         {_steps(i)}" + (f"; loss {i.loss:.4f}" if i.loss is not None else "")
             + (f"; {i.tokens_per_s:.0f} tokens/s" if i.tokens_per_s is not None else "")]
    ranks, _ = rank_progress(i.path)
    ranks.sort(key=lambda p: p.rank)
    if ranks:
        lo, hi = min(p.step for p in ranks), max(p.step for p in ranks)
        behind = [f"rank {p.rank} ({p.host})" for p in ranks if p.step == lo < hi]
        lines.append(f"ranks        {len(ranks)} reporting; steps {lo}..{hi}"
                     + (f"; behind: {', '.join(behind[:8])}" if behind else ""))
    if (i.path / HANG_REPORT).is_file():
        lines.append(f"hang report  {printable(str(i.path / HANG_REPORT))}")
    lines += status_lines(i.path, time.time() if i.state == "running" else None,  # a job that recovers
                          last_step(i.path) if i.state == "died" else None)
    lines += [f"skipped      {printable(n, 500)}" for n in i.notes]
    for log in log_files(i.path):
        lines += ["", f"--- {printable(str(log))} (last lines)", *_tail(log, 5)]
    return "\n".join(lines) + "\n"


def _orphan_said(i: RunInfo) -> str:
    """``: launcher gone, job running on 2 nodes since ...`` or ``: stopped after its launcher died
    ...`` for a run whose launcher died (or, on another host, stopped beating: hfscale.launch.beats)."""
    now = time.time()
    if i.state not in ("died", "running"):
        return ""
    o = orphan(i.path, now)
    if o is None or (i.state == "running" and not launcher_silent(o, now)):
        return ""
    last = f"its last heartbeat {_when(o.launcher_last)}"
    if o.running:
        return (f": launcher gone ({last}), job running on {len(o.running)} node(s) ({', '.join(o.running[:8])}); "
                f"they stop it themselves {LAUNCHER_LOST_S} s after that heartbeat")
    if o.stopped:
        return (f": stopped after its launcher died ({last}); {len(o.stopped)} node(s) stopped the job themselves at "
                f"{_when(o.stopped_at)} ({', '.join(o.stopped[:8])})")
    return f": launcher gone ({last}); no node of its job beats"


def last_step(run: Path) -> tuple[float, int] | None:
    """(when, step) of rank 0's last progress (its progress file's time on this host's clock)."""
    path = run / PROGRESS_DIR / "rank-0"
    p = read_progress(path, run)
    try:
        return (os.lstat(path).st_mtime, p.step) if p is not None else None
    except OSError:
        return None
