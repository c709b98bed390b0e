"""The runners: one module per ``runner.type``, found by it in ``RUNNERS`` (a module, as torchx's
``DEFAULT_SCHEDULER_MODULES`` names one per scheduler: no class forwards to it).

Every runner module has ``plan(job, ctx, common) -> LaunchPlan`` (pure: it takes the job down through
its own renderers once, stopping, dumping and killing its job through hfscale.launch.node.controls)
and ``RANK_DIR`` (where its ranks read the generated files; None: the run directory): the ``Runner``
Protocol (hfscale.launch.runners.shared). A ``Scheduler`` (a runner that hands the job to a
scheduler, ``mode == "submit"``) also knows that scheduler's answers: ``probe(plan)`` (a command
asked first, or None), ``unavailable(plan) -> Unavailable`` (what to say and the exit code when the
scheduler cannot be reached) and ``submitted(plan, stdout) -> Submitted`` (files to record and what to
say). ``slurm_script``, ``slurm_step`` and ``kubernetes_manifest`` are their runners' renderers.

May import the layers below hfscale.launch, hfscale.launch's top modules (spec, context, run_dir) and
node/; a runner imports no other runner but its own renderers (slurm: slurm_step and slurm_script;
kubernetes: kubernetes_manifest), and nothing of attempt/, preflight/ or recovery/
(tests/test_architecture.py holds this).
"""

from __future__ import annotations

from typing import cast

from hfscale.launch.runners import kubernetes, local, pdsh, pdsh_docker, slurm
from hfscale.launch.runners.shared import Runner, Scheduler

RUNNERS: dict[str, Runner] = {"local": local, "pdsh": pdsh, "pdsh_docker": pdsh_docker, "slurm": slurm,
                              "kubernetes": kubernetes}
SCHEDULERS = ("slurm", "kubernetes")  # the runners that hand the job to a scheduler (Scheduler)


def scheduler(name: str) -> Scheduler:
    """The runner ``name``, which hands its job to a scheduler."""
    if name not in SCHEDULERS:
        raise TypeError(f"runner {name!r} does not submit to a scheduler")
    return cast(Scheduler, RUNNERS[name])
