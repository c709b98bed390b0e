"""Runner type pdsh: one ``pdsh -R ssh`` fan-out to every host.

Each host runs the same line: change to the working directory, run ``runner.setup``, export the
job's variables, take its node rank and per-host variables from a ``case %h`` on its own name (so
ranks never depend on pdsh's host order), run the launcher, and print ``HFSCALE_EXIT rc=N``.
Every literal value is quoted and has its ``%`` doubled for pdsh; only ``runner.setup`` runs as
written. The cleanup signals exactly the processes whose environment holds this job's id.
"""

from __future__ import annotations

from ..envvars import host_env, is_secret
from ..job import Job
from ..launch_plan import EXIT_MARK, LaunchPlan, NodeLaunch
from ..launcher import LaunchContext, default_rendezvous, launcher_argv
from ..shell import Assign, Command, Item, Line, PdshHost, Secret, Sh, Var, Word, and_then, exports, words
from ..ssh import pdsh_argv
from .common import Common

RANK_VAR = "HFSCALE_NODE_RANK"
UNKNOWN_HOST_EXIT = 97


def prelude(job: Job, c: Common) -> Line:
    """``cd <workdir> && { setup ; } && export ...``: what every host does before its launcher."""
    setup = job.config.runner.setup
    return and_then(Line.of(Sh("cd"), c.workdir),
                    Line.of(Sh("{"), Sh(setup), Sh(";"), Sh("}")) if setup else Line(()),
                    exports(c.env))


def _assigns(job: Job, i: int, host: str) -> Line:
    extra = {k: (Secret(k, v) if is_secret(k) else v) for k, v in host_env(job.config, host).items()}
    return Line.of(Sh("export"), Assign(RANK_VAR, str(i)), *(Assign(k, v) for k, v in extra.items()))


def rank_switch(job: Job, hosts: tuple[str, ...]) -> Line:
    """Each host's rank and per-host variables, picked by pdsh's ``%h`` (host names are validated)."""
    if len(hosts) == 1:
        return _assigns(job, 0, hosts[0])
    items: list[Item] = [Sh("case"), PdshHost(), Sh("in")]
    for i, h in enumerate(hosts):
        items += [Sh(f"{h})"), _assigns(job, i, h), Sh(";;")]
    items += [Sh("*) echo 'hfscale: host"), PdshHost(),
              Sh(f"is not in the plan' >&2; exit {UNKNOWN_HOST_EXIT} ;; esac")]
    return Line(tuple(items))


def fan_out(job: Job, hosts: tuple[str, ...], before: Line, launcher: list[Word]) -> Line:
    """The one line pdsh sends to every host; it ends by printing the launcher's exit code."""
    tail = Sh(f'; rc=$?; echo "{EXIT_MARK} rc=$rc"; exit $rc', glue=True)
    return Line((and_then(before, rank_switch(job, hosts), words(launcher)), tail), pdsh=True)


def kill_line(job_id: str) -> Line:
    """Signal only processes whose environment carries this job's id: never a match on names."""
    probe = (f"for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -qx 'HFSCALE_JOB_ID={job_id}' "
             "&& kill -{sig} ${{p#/proc/}} 2>/dev/null; done")
    return Line((Sh(f"{probe.format(sig='TERM')}; sleep 3; {probe.format(sig='KILL')}; true"),), pdsh=True)


def plan(job: Job, ctx: LaunchContext, c: Common) -> LaunchPlan:
    hosts = tuple(h.host for h in job.hosts)
    launcher = launcher_argv(job, c.python, c.rank_dir, ctx, default_rendezvous(job, Var(RANK_VAR)))
    pdsh, pdsh_env = pdsh_argv(job, hosts)
    main = Command((*pdsh, fan_out(job, hosts, prelude(job, c), launcher)), pdsh_env)
    cleanup = Command((*pdsh, kill_line(ctx.job_id)), pdsh_env)
    nodes = tuple(NodeLaunch(h, i, words(launcher_argv(job, c.python, c.rank_dir, ctx,
                                                       default_rendezvous(job, str(i)))))
                  for i, h in enumerate(hosts))
    return LaunchPlan(ctx.job_id, "pdsh", c.run_dir, c.files, nodes, hosts, main, cleanup, c.mode,  # type: ignore[arg-type]
                      c.notes, moves=c.moves)
