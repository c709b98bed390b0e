"""What ``hfscale launch`` prints when its run ended well: a short summary read from the run directory
(state.json's start and end, rank 0's ``progress/metrics.json``, the newest complete checkpoint in
training.output_dir) and the next commands, with this run's name::

    hfscale: tiny_cpu-20261126-193505-6d0a29 finished in 1m48s: step 300/300, loss 2.3473 (the last logged; mean over the run 2.6382), 8.6k tokens/s
    hfscale: newest checkpoint output/tiny_cpu/checkpoint-300
    next:
      hfscale status tiny_cpu-20261126-193505-6d0a29
      hfscale report tiny_cpu-20261126-193505-6d0a29
      hfscale export tiny_cpu-20261126-193505-6d0a29 --out tiny_cpu-model

The last logged loss is what the progress line showed (the Trainer's mean over its last logging
window); the mean over the run is the Trainer's ``train_loss``. A file that cannot be read leaves
its part out (files only; no process).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from hfscale.checkpoints.resume import checkpoint_problem, checkpoints
from hfscale.core.records import LauncherState, Rank0Metrics
from hfscale.core.untrusted import Unreadable, printable
from hfscale.launch.attempt.console import count_text, duration_text
from hfscale.launch.run_dir import read_metrics, read_state
from hfscale.runs.registry import RunError, run_output_dir


def _shown_path(path: Path, cwd: Path) -> str:
    """``path`` relative to ``cwd`` when inside it, as a shell word."""
    try:
        path = path.resolve().relative_to(cwd.resolve())
    except ValueError:
        pass
    return shlex.quote(printable(str(path)))


def newest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint folder in ``output_dir`` (incomplete ones skipped silently)."""
    return next((c.path for c in reversed(checkpoints(output_dir)) if checkpoint_problem(c.path) is None), None)


def run_reference(run_dir: Path, cwd: Path) -> str:
    """How the commands about runs name this run from ``cwd``: its name when it lies in ./runs (their
    default ``--runs-dir``), else its directory."""
    if run_dir.parent.resolve() == (cwd / "runs").resolve():
        return shlex.quote(printable(run_dir.name))
    return _shown_path(run_dir, cwd)


def summary_line(run: str, state: LauncherState, m: Rank0Metrics, resumed_at: int | None) -> str:
    """``hfscale: <run> finished in 1m48s: step 300/300, loss 2.3473 (...), 8.6k tokens/s``."""
    took = f" in {duration_text(state.ended - state.started)}" if state.started and state.ended else ""
    parts = []
    if m.step is not None:
        steps = f"step {m.step}/{m.max_steps}" if m.max_steps else f"step {m.step}"
        parts.append(steps + (f" (resumed at {resumed_at})" if resumed_at is not None else ""))
    if m.loss is not None:
        mean = f"; mean over the run {m.train_loss:.4f}" if m.train_loss is not None else ""
        parts.append(f"loss {m.loss:.4f} (the last logged{mean})")
    elif m.train_loss is not None:
        parts.append(f"mean loss {m.train_loss:.4f}")
    if m.tokens_per_s is not None:
        parts.append(f"{count_text(m.tokens_per_s)} tokens/s")
    # a preempted rank saves, and the job ends with exit code 0: say so, a relaunch goes on from there
    how = "was preempted (its checkpoint saved; a relaunch resumes)" if m.preempted else "finished"
    return f"hfscale: {run} {how}{took}" + (": " + ", ".join(parts) if parts else "")


def finish_lines(run_dir: str | Path, job_name: str, resumed_at: int | None = None, cwd: str | Path | None = None
                 ) -> list[str]:
    """The summary of the finished run in ``run_dir`` and the next commands (``resumed_at``: the
    step this launch resumed from; ``cwd``: where the user runs them, default this process's)."""
    run_dir, here = Path(run_dir), Path(cwd or os.getcwd())
    try:
        state = read_state(run_dir)
    except Unreadable:
        state = LauncherState()
    try:
        metrics = read_metrics(run_dir)
    except Unreadable:
        metrics = Rank0Metrics()
    lines = [summary_line(printable(run_dir.name), state, metrics, resumed_at)]
    try:
        newest = newest_checkpoint(run_output_dir(run_dir))
    except RunError:
        newest = None
    if newest is not None:
        lines.append(f"hfscale: newest checkpoint {_shown_path(newest, here)}")
    ref = run_reference(run_dir, here)
    lines += ["next:", f"  hfscale status {ref}", f"  hfscale report {ref}"]
    if newest is not None:
        lines.append(f"  hfscale export {ref} --out {shlex.quote(job_name + '-model')}")
    return lines
