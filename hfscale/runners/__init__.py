"""The runners: one module each, dispatched by ``runner.type`` through ``RUNNERS``.

Every runner module has ``plan(job, ctx, common) -> LaunchPlan`` (pure: it takes the job down
through its own renderers once) and may set ``RANK_DIR`` (where its ranks read the generated
files, when not the run directory). Runners that hand the job to a scheduler (``mode ==
"submit"``) also know that scheduler's answers: ``probe(plan)`` (a command asked first, or None),
``unavailable(plan)`` (what to say and the exit code when the scheduler cannot be reached) and
``submitted(plan, stdout)`` (files to record and what to say after it took the job).
"""

from __future__ import annotations

from types import ModuleType

from . import kubernetes, local, pdsh, pdsh_docker, slurm

RUNNERS: dict[str, ModuleType] = {
    "local": local,
    "pdsh": pdsh,
    "pdsh_docker": pdsh_docker,
    "slurm": slurm,
    "kubernetes": kubernetes,
}
