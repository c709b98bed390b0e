"""Runner type pdsh: one ``pdsh -R ssh`` fan-out to every host, each running the node line
(hfscale.launch.node.line: ``env.sh``, ``nodes.sh``, the prelude, the keeper, the launcher, the exit
line), attached up to ``runner.fanout`` hosts, detached and followed through the run directory beyond.
The cleanup stops exactly this job's processes on every host (hfscale.launch.node.stopping), at most
``runner.fanout`` hosts at a time."""

from __future__ import annotations

import posixpath

from hfscale.core.shell import Command, Line, Sh, Var, words
from hfscale.launch.context import Common, LaunchContext
from hfscale.launch.node.command import default_rendezvous, in_process, launcher_argv
from hfscale.launch.node.controls import controls
from hfscale.launch.node.keeper import keeper_of
from hfscale.launch.node.line import HOSTS_FILE, RANK_VAR, hosts_file, launch, prelude, private_files
from hfscale.launch.node.reach import pdsh_argv
from hfscale.launch.node.stopping import stop_script
from hfscale.launch.run_dir import STOP_MARKER
from hfscale.launch.spec import LaunchPlan, NodeLaunch
from hfscale.rules.resolved import Job

RANK_DIR: str | None = None  # the ranks read the generated files in the run directory


def plan(job: Job, ctx: LaunchContext, c: Common) -> LaunchPlan:
    hosts = tuple(h.host for h in (*job.hosts, *(job.spares if in_process(job) else ())))  # spares: standbys
    launcher = launcher_argv(job, c.python, c.rank_dir, ctx, default_rendezvous(job, Var(RANK_VAR)))
    listing = posixpath.join(c.run_dir, HOSTS_FILE)
    main, logs, follow = launch(job, c, ctx.job_id, hosts, prelude(job, c), launcher, Line((Sh(stop_script(ctx.job_id)),)))
    stop, stop_env = pdsh_argv(job, listing, min(len(hosts), job.config.runner.fanout))
    cleanup, dump, kill = controls(lambda line: Command((*stop, Line(line.items, pdsh=True)), stop_env), ctx.job_id,
                                   c.watch, c.python)
    nodes = tuple(NodeLaunch(h, i, words(launcher_argv(job, c.python, c.rank_dir, ctx,
                                                       default_rendezvous(job, str(i)))))
                  for i, h in enumerate(hosts))
    return LaunchPlan(ctx.job_id, "pdsh", c.run_dir, (*c.files, hosts_file(hosts)), nodes, logs, main, cleanup,
                      c.mode, c.notes, moves=c.moves, private=private_files(job, c, hosts),  # type: ignore[arg-type]
                      follow=follow, watch=c.watch, dump=dump, stop_marker=posixpath.join(c.run_dir, STOP_MARKER),
                      keeper=keeper_of(c.run_dir), kill=kill)
