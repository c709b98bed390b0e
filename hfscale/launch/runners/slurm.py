"""Runner type slurm: an sbatch script (hfscale.launch.runners.slurm_script), submitted with ``sbatch
--parsable``, or run directly with srun inside an existing allocation (``SLURM_JOB_ID`` set).

Secret values never go into the script file: sbatch passes them on from the environment
``hfscale launch`` gives it. This module also knows what sbatch answers.
"""

from __future__ import annotations

import posixpath

from hfscale.core.shell import Command, Line, Secret, words
from hfscale.launch.context import Common, LaunchContext
from hfscale.launch.node.command import default_rendezvous, launcher_argv
from hfscale.launch.node.controls import controls
from hfscale.launch.run_dir import SLURM_JOB_ID_FILE
from hfscale.launch.runners import slurm_step
from hfscale.launch.runners.shared import Submitted, Unavailable
from hfscale.launch.runners.slurm_script import MASTER, NODE_RANK, SCRIPT, render_sbatch, render_supervised
from hfscale.launch.spec import LaunchPlan, NodeLaunch
from hfscale.rules.resolved import Job

RANK_DIR: str | None = None  # the ranks read the generated files in the run directory

EXIT_NO_SCHEDULER = 3  # sbatch is not installed here: the job could not be handed over


def supervised(job: Job) -> bool:
    """Whether hfscale supervises the job inside its allocation (``recovery.max_restarts`` > 0):
    the batch script runs ``hfscale launch`` there (hfscale.launch.runners.slurm_step)."""
    return bool(job.config.recovery.max_restarts)


def plan(job: Job, ctx: LaunchContext, c: Common) -> LaunchPlan:
    if job.hosts:  # inside the allocation, its hosts known: one attempt, an srun step (slurm_step.in_allocation)
        return slurm_step.plan(job, ctx, c)
    if supervised(job) and not dict(ctx.shell_env).get("SLURM_JOB_ID"):
        return _submit_supervised(job, ctx, c)
    launcher = launcher_argv(job, c.python, c.rank_dir, ctx, default_rendezvous(job, NODE_RANK, master=MASTER))
    plain = {k: v for k, v in c.env.items() if not isinstance(v, Secret)}
    secret = tuple((k, v) for k, v in c.env.items() if isinstance(v, Secret))
    files = (*c.files, (SCRIPT, render_sbatch(job, c.run_dir, c.workdir, plain, launcher)))  # type: ignore[arg-type]
    script = posixpath.join(c.run_dir, SCRIPT)
    inside = dict(ctx.shell_env).get("SLURM_JOB_ID")
    notes = c.notes
    cleanup = dump = watch = kill = None
    if inside:
        main, mode = Command(("bash", script), secret), "stream"  # the script changes to the workdir itself
        notes += (f"inside Slurm allocation {inside}: the script runs here with srun, not submitted",)
        watch = c.watch
        cleanup, dump, kill = controls(lambda line: on_every_node(job.num_nodes, line), ctx.job_id, c.watch, c.python)
    else:
        main, mode = Command(("sbatch", "--parsable", script), secret), "submit"  # the workdir is the nodes\' one
    return LaunchPlan(ctx.job_id, "slurm", c.run_dir, files, (NodeLaunch(None, None, words(launcher)),), ("slurm",),
                      main, cleanup, "done" if c.done else mode, notes, show=(SCRIPT,),  # type: ignore[arg-type]
                      moves=c.moves, watch=watch, dump=dump, kill=kill)


def _submit_supervised(job: Job, ctx: LaunchContext, c: Common) -> LaunchPlan:
    """sbatch of a script that runs hfscale's supervisor on the batch host (secrets: from sbatch's
    environment, as for any submitted job)."""
    secret = tuple((k, v) for k, v in c.env.items() if isinstance(v, Secret))
    config = posixpath.join(ctx.cwd, job.source)
    script = render_supervised(job, c.run_dir, c.workdir, c.python, config, ctx.run_id or ctx.job_id, ctx.extra_args)
    files = (*c.files, (SCRIPT, script))
    notes = c.notes + (f"supervised inside the allocation: the batch script runs hfscale launch on the batch host, "
                       f"each attempt one srun step; up to {job.config.recovery.max_restarts} restart(s); "
                       "the job requeues itself when its batch host is lost",)
    main = Command(("sbatch", "--parsable", posixpath.join(c.run_dir, SCRIPT)), secret)
    return LaunchPlan(ctx.job_id, "slurm", c.run_dir, files, (NodeLaunch(None, None, words(["hfscale", "launch", config])),),
                      ("slurm",), main, None, "done" if c.done else "submit", notes, show=(SCRIPT,),  # type: ignore[arg-type]
                      moves=c.moves)


def on_every_node(nodes: int, line: Line) -> Command:
    """A shell line run on every node of the allocation, as a step beside the job's own (``--overlap``):
    the stop, the stack dump.

    A batch job's steps end with the job, but inside an allocation that outlives the launch (an
    interactive ``salloc``) a step whose srun was killed keeps running until the allocation ends:
    measured on the test Slurm, torchrun and its ranks were still there 40 s later."""
    return Command(("srun", "--overlap", f"--nodes={nodes}", "--ntasks-per-node=1", "--quiet", "bash", "-c", line))


def probe(plan: LaunchPlan) -> None:
    """Nothing to ask before submitting: a missing sbatch is found by its absence."""
    return None


def unavailable(plan: LaunchPlan) -> Unavailable:
    """What to say when sbatch is not installed here, and the exit code."""
    return Unavailable(f"hfscale: sbatch not found on this machine; submit by hand with:\n  {plan.main.shell()}",
                       EXIT_NO_SCHEDULER)


def submitted(plan: LaunchPlan, stdout: str) -> Submitted:
    """(files to record, what to say) after sbatch --parsable printed ``<job id>[;cluster]``."""
    job = stdout.strip().split(";")[0]
    return Submitted({SLURM_JOB_ID_FILE: job + "\n"}, f"hfscale: submitted Slurm job {job}; output in {plan.run_dir}/slurm-{job}.out")
