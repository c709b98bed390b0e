"""What ``hfscale status`` prints of one run: its state, and for a run whose launcher died what its
nodes did without it (hfscale.launch.attempt.beats), rank 0's numbers, each rank's step, the hang report,
the recovery lines (hfscale.runs.goodput) and the tail of each node log (files only); for a run
submitted to Slurm, how the job is doing or how it ended (``ask_slurm``: scontrol, sacct, its output
file; the commands run through hfscale.launch.attempt.execute)."""

from __future__ import annotations

import time
from pathlib import Path

from hfscale.core.untrusted import Unreadable, printable, read_bytes
from hfscale.launch.attempt.beats import launcher_silent, orphan
from hfscale.launch.node.keeper import LAUNCHER_LOST_S
from hfscale.launch.run_dir import HANG_REPORT
from hfscale.runs.goodput import status_lines
from hfscale.runs.registry import RunError, RunInfo, _steps, _when, log_files, rank_progress
from hfscale.runs.slurm_state import SlurmJob, parse_output, parse_sacct, parse_scontrol
from hfscale.training.heartbeat import rank0_last_step


def _tail(path: Path, lines: int) -> list[str]:
    from hfscale.core.records import LOG_TAIL

    try:
        data = read_bytes(path, LOG_TAIL, path.parent.parent, tail=True)  # inside the run directory
    except Unreadable as e:
        return [f"({e})"]
    return data.decode("utf-8", "replace").splitlines()[-lines:]


def status_text(i: RunInfo, scheduler: SlurmJob | str | None = None) -> str:
    """``hfscale status``: the run, rank 0's numbers, each rank's step, a hang report, log tails.
    ``scheduler``: what the scheduler said of a submitted run (``ask_slurm``), or why it said nothing."""
    if i.state == "unreadable":
        return (f"run          {printable(i.name)} ({printable(str(i.path))})\n"
                f"state        unreadable: {printable(i.problem or '')}\n")
    if isinstance(scheduler, SlurmJob):
        state, when = _slurm_state(i, scheduler), _slurm_times(i, scheduler)
    else:
        slurm = (f"; Slurm job {i.slurm_job}: {printable(scheduler)}" if i.slurm_job and scheduler else
                 f"; Slurm job {i.slurm_job}" if i.slurm_job else "")
        state = f"{i.state}" + (f" (exit code {i.exit_code})" if i.exit_code is not None else "") + slurm
        # a submitted run's record ends when sbatch answered: that is no end of the job
        when = f"started      {_when(i.started)}" + (
            f"; submitted {_when(i.ended)}" if i.state == "submitted" and i.ended else
            f"; ended {_when(i.ended)}" if i.ended else "")
    lines = [f"run          {printable(i.name)} ({printable(str(i.path))})", f"state        {state}" + _orphan_said(i),
             f"runner       {i.runner or '-'}; launched by pid {i.pid} on {i.host}", when,
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
                          rank0_last_step(i.path) if i.state == "died" else None)
    lines += [f"skipped      {printable(n, 500)}" for n in i.notes]
    for log in log_files(i.path):
        lines += ["", f"--- {printable(str(log))} (last lines)", *_tail(log, 5)]
    return "\n".join(lines) + "\n"


def _orphan_said(i: RunInfo) -> str:
    """``: launcher gone, job running on 2 nodes since ...`` or ``: stopped after its launcher died
    ...`` for a run whose launcher died (or, on another host, stopped beating: hfscale.launch.attempt.beats)."""
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


def _slurm_state(i: RunInfo, j: SlurmJob) -> str:
    """``failed (exit code 137); Slurm job 3: FAILED (NonZeroExitCode), from scontrol``."""
    code = f" (exit code {j.exit_code})" if j.exit_code is not None and j.outcome in ("finished", "failed") else \
        f" (signal {j.signal})" if j.signal and j.outcome in ("failed", "cancelled") else ""
    said = ", ".join(x for x in (
        f"{j.state}" + (f" ({j.reason})" if j.reason else "") if j.state else (j.reason or ""),
        f"restart {j.restarts}" if j.restarts else "",
        f"from {j.source}" + (" (Slurm no longer knows the job)" if j.source == "output file" else "")) if x)
    return f"{j.outcome}{code}; Slurm job {i.slurm_job}: {printable(said)}"


def _slurm_times(i: RunInfo, j: SlurmJob) -> str:
    """``started ...; ended ...`` as Slurm tells them (the launch record's times are sbatch's)."""
    if j.started is not None and j.outcome != "pending":
        line = f"started      {_when(j.started)} (Slurm)"
    else:
        line = f"started      {_when(i.started)} (hfscale launch)"
    if j.submitted is not None:
        line += f"; submitted {_when(j.submitted)}"
    if j.ended is not None:
        line += f"; ended {_when(j.ended)}"
    elif j.outcome in ("finished", "failed", "cancelled"):
        line += "; ended (its time unknown)"
    return line


def ask_slurm(i: RunInfo) -> SlurmJob | str:
    """What Slurm says of submitted run ``i``: the controller's record (``scontrol show job``),
    else the accounting (``sacct``), else the job's own output file (its exit line, slurmstepd's
    CANCELLED line); hfscale.runs.slurm_state reads them. A string says why none told.
    The commands are hfscale.runs.stop's, run by hfscale.launch.attempt.execute."""
    from hfscale.core.records import LOG_TAIL
    from hfscale.launch.attempt.execute import run_probe
    from hfscale.runs.stop import scheduler_command

    job = i.slurm_job
    try:
        asks = [scheduler_command(i, "state"), scheduler_command(i, "accounting")]
    except RunError as e:
        return f"not asked: {e}"
    said = []
    for cmd, parse in zip(asks, (parse_scontrol, parse_sacct)):
        if cmd is None or job is None:
            return "no Slurm job id recorded"
        rc, out, err = run_probe(cmd, timeout=20)
        if rc == 0 and (found := parse(out, job)) is not None:
            return found
        said.append(f"{cmd.real_argv()[0]}: " + ((err or out).strip().splitlines() or ["no such job"])[-1][:200])
    path = i.path / f"slurm-{job}.out"
    try:  # the job writes it: its tail, inside the run directory
        found = parse_output(read_bytes(path, LOG_TAIL, i.path, tail=True).decode("utf-8", "replace"), job)
        said.append(f"{path.name} says nothing of how it ended")
    except Unreadable as e:
        found = None
        said.append(str(e))
    return found if found is not None else f"unknown: {'; '.join(said)}"
