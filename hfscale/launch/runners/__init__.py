"""The runners: one module each, one ``Runner`` object each (hfscale.launch.runners.shared), found by
``runner.type`` in ``RUNNERS``.

Every runner has ``plan(job, ctx, common) -> LaunchPlan`` (pure: it takes the job down through its
own renderers once) and ``rank_dir`` (where its ranks read the generated files; None: the run
directory). A ``Scheduler`` (a runner that hands the job to a scheduler, ``mode == "submit"``) also
knows that scheduler's answers: ``probe(plan)`` (a command asked first, or None),
``unavailable(plan) -> Unavailable`` (what to say and the exit code when the scheduler cannot be
reached) and ``submitted(plan, stdout) -> Submitted`` (files to record and what to say).

Part of the launch layer: may import hfscale.core, config, checkpoints, rules, render, training and
hfscale.launch.
"""

from __future__ import annotations

from hfscale.launch.runners.kubernetes import KubernetesRunner
from hfscale.launch.runners.local import LocalRunner
from hfscale.launch.runners.pdsh import PdshRunner
from hfscale.launch.runners.pdsh_docker import PdshDockerRunner
from hfscale.launch.runners.shared import Runner, Scheduler
from hfscale.launch.runners.slurm import SlurmRunner

RUNNERS: dict[str, Runner] = {r.name: r for r in (LocalRunner(), PdshRunner(), PdshDockerRunner(), SlurmRunner(),
                                                  KubernetesRunner())}


def scheduler(name: str) -> Scheduler:
    """The runner ``name``, which hands its job to a scheduler."""
    runner = RUNNERS[name]
    if not isinstance(runner, Scheduler):
        raise TypeError(f"runner {name!r} does not submit to a scheduler")
    return runner
