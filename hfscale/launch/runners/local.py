"""Runner type local: the launcher on this node, started by a shell that first starts the node's
keeper (hfscale.launch.node.keeper) and then becomes the launcher (``exec``): the launcher's
pid and exit status are the main process's, and a killed ``hfscale launch`` leaves no job
training unwatched here either."""

from __future__ import annotations

from hfscale.core.shell import Assign, Command, Line, Sh, words
from hfscale.launch.context import Common, LaunchContext
from hfscale.launch.node.command import default_rendezvous, launcher_argv
from hfscale.launch.node.controls import controls
from hfscale.launch.node.keeper import HOST_VAR, LOCAL_REACH, keeper_line, keeper_of
from hfscale.launch.node.reach import here
from hfscale.launch.node.stopping import stop_script
from hfscale.launch.spec import LaunchPlan, NodeLaunch
from hfscale.rules.resolved import Job

RANK_DIR: str | None = None  # the ranks read the generated files in the run directory

LOG = "local"


def plan(job: Job, ctx: LaunchContext, c: Common) -> LaunchPlan:
    """``accelerate launch`` (or torchrun) with the generated config, in the working directory;
    stopping it is stopping this job's processes here (torchrun's workers leave its process group)."""
    argv = launcher_argv(job, c.python, c.rank_dir, ctx, default_rendezvous(job, "0"), reach="local")
    host = job.hosts[0].host if job.hosts else LOG
    keeper = keeper_line(keeper_of(c.run_dir, LOCAL_REACH), Line((Sh(stop_script(ctx.job_id)),)))
    line = Line.of(Sh("export"), Assign(HOST_VAR, host), Sh(";", glue=True), keeper, Sh("exec"), words(argv))
    main = Command(("bash", "-c", line), tuple(c.env.items()), c.workdir)  # type: ignore[arg-type]
    cleanup, dump, kill = controls(here, ctx.job_id, c.watch, c.python)
    return LaunchPlan(ctx.job_id, "local", c.run_dir, c.files, (NodeLaunch(host, 0, words(argv)),), (host,), main,
                      cleanup, c.mode, c.notes, moves=c.moves, watch=c.watch, dump=dump,  # type: ignore[arg-type]
                      keeper=keeper_of(c.run_dir, LOCAL_REACH), kill=kill)
