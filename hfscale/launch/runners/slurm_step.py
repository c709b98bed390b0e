"""Runner slurm inside the job's own allocation, supervised (``recovery.max_restarts`` > 0): the batch
script (hfscale.launch.runners.slurm_script) runs ``hfscale launch`` on the batch host, which
supervises the job there (hfscale.launch.recovery.supervisor), and each attempt is one ``srun`` step over
that attempt's nodes (pure: the plan of one attempt, and the job on the allocation's hosts).

- The allocation's hosts (``scontrol show hostnames "$SLURM_JOB_NODELIST"``, which the batch script
  writes to a file in the run directory named by ``HFSCALE_SLURM_HOSTS_FILE``) become the job's
  hosts: the first ``cluster.num_nodes`` train, the next ``recovery.spares`` are its spares, so
  that the supervisor's decisions (strikes, probes, leaving a host out, a spare in place of a
  failed host) work on host names as they do for pdsh.
- An attempt is ``srun --nodelist=<run dir>/step_hosts --nodes=N --ntasks=N --ntasks-per-node=1
  --kill-on-bad-exit=0`` (a path: Slurm reads the hosts from the file, so no host list rides on a
  command line at 10,000 nodes): a failure ends the attempt, not the allocation (the batch script
  asks for ``--no-kill``, so a node Slurm loses leaves the allocation and the job goes on without it).
  The supervisor, not srun, ends the step after a task fails: srun's ``--kill-on-bad-exit=1`` would
  kill the node that failed first before it says so when a node whose ranks only lost a peer
  exited before it (hfscale.launch.attempt.first_failure holds such a failure for that node).
- Each node runs the node line (hfscale.launch.node.line): the stop marker, its rank by its own name
  (``$SLURMD_NODENAME``) from ``nodes.sh``, the environment from ``env.sh``, the keeper, the launcher
  and the exit line; its output goes through ``sed`` to get the ``<host>: `` prefix pdsh would
  give, so hfscale.launch.attempt.node_lines reads it alike.
- The keeper of each node watches the supervisor's heartbeat: when the batch host dies (the job
  runs on without its batch script under ``--no-kill``), the nodes requeue the job
  (``scontrol requeue``), which resumes from the newest complete checkpoint.
- The stop (cleanup) and the stack dump reach each node by a step of their own (``--overlap``),
  one per node, so that a node Slurm lost does not keep the stop from the others; at most
  ``runner.fanout`` of them at once.
- A probe of a host (hfscale.launch.preflight.probes) is ``srun --nodelist=<host> --nodes=1`` instead of ssh.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import replace
from typing import Mapping

from hfscale.config.errors import ConfigError, Problem
from hfscale.config.model import HostSpec
from hfscale.core.shell import Command, Line, Script, Sh, Var, Word, and_then, words
from hfscale.launch.context import Common, LaunchContext
from hfscale.launch.node.command import default_rendezvous, in_process, launcher_argv
from hfscale.launch.node.controls import controls
from hfscale.launch.node.keeper import HOST_VAR, SRUN_REACH, keeper_line, keeper_of
from hfscale.launch.node.line import ENV_FILE, NODES_FILE, RANK_VAR, health_gate, node_script, private_files
from hfscale.launch.node.stopping import JOB_ID_VAR, stop_script
from hfscale.launch.run_dir import STOP_MARKER, UNREACHED
from hfscale.launch.spec import LaunchPlan, NodeLaunch
from hfscale.rules.resolved import Job

HOSTS_FILE_VAR = "HFSCALE_SLURM_HOSTS_FILE"  # the file the batch script wrote the allocation's hosts to, a line each
HOSTS_VAR = "HFSCALE_SLURM_HOSTS"  # the same, comma-separated, as batch scripts written before the file set it
ALLOCATION_HOSTS_FILE = "allocation_hosts"  # in the run directory (hfscale.launch.runners.slurm_script)
STEP_HOSTS_FILE = "step_hosts"  # an attempt's hosts, a line each, in the run directory: srun --nodelist=<it>
HOSTS_TEXT_CAP = 8 << 20  # 10,000 host names of up to 253 characters are 2.5 MB
ALLOCATION_VAR = "SLURM_JOB_ID"
NODE_NAME_VAR = "SLURMD_NODENAME"  # Slurm's name of the node a task runs on
PREVIOUS_STEP_S = 60  # an attempt's step waits at most this long for the previous one to end
STEP_STOP_S = 20  # the stop's step on one node; a node Slurm cannot reach is given up on after this
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,252}$")


def in_supervised_script(env: Mapping[str, str]) -> bool:
    """Whether this runs in the batch script of a supervised job (it set the hosts' file or variable)."""
    return bool(env.get(ALLOCATION_VAR)) and (HOSTS_FILE_VAR in env or HOSTS_VAR in env)


def host_names(text: str) -> tuple[str, ...]:
    """The host names in ``text`` (a line or a comma between two), in order, each once. What is not a
    host name is left out: the text is read like any file (it could hold anything)."""
    names = (n.strip() for n in re.split(r"[,\n]", text[:HOSTS_TEXT_CAP]))
    return tuple(dict.fromkeys(n for n in names if _NAME.match(n)))


def allocation_hosts(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The allocation's hosts a batch script written before ``HFSCALE_SLURM_HOSTS_FILE`` put in
    ``HFSCALE_SLURM_HOSTS`` (None: not inside a supervised batch script, or one that wrote the file:
    hfscale.launch.recovery.requeue reads it)."""
    if not env.get(ALLOCATION_VAR) or HOSTS_VAR not in env or HOSTS_FILE_VAR in env:
        return None
    return host_names(env[HOSTS_VAR])


def in_allocation(job: Job, names: tuple[str, ...]) -> Job:
    """``job`` on the hosts of its allocation: the first ``num_nodes`` train (slots =
    ``nproc_per_node``), the next ``recovery.spares`` are its spares; the master is the first host.
    ConfigError when the allocation is smaller than the job (nodes plus spares)."""
    spares = job.config.recovery.spares or 0
    want = job.num_nodes + spares
    if len(names) < want:
        raise ConfigError(job.source, [Problem("cluster.num_nodes", f"the Slurm allocation has {len(names)} node(s) "
                                               f"({', '.join(names[:8]) or 'none'}{' ...' if len(names) > 8 else ''}), "
                                               f"the job needs {job.num_nodes}"
                                               + (f" and {spares} spare(s)" if spares else ""),
                                               job.line_of(("cluster", "num_nodes")))])
    slots = job.procs_per_node
    hosts = tuple(HostSpec(host=n, slots=slots) for n in names[:job.num_nodes])
    spare = tuple(HostSpec(host=n, slots=slots, spare=True) for n in names[job.num_nodes:want])
    return replace(job, hosts=hosts, spares=spare, master_addr=job.config.cluster.master_addr or hosts[0].host)


def srun_argv(hosts_file: str, n: int, heals: bool = False) -> list[str]:
    """The step of one attempt: one task on each of the ``n`` hosts listed in ``hosts_file`` (a path
    with a '/', which srun reads as a file of host names). ``--kill-on-bad-exit=0``: a task that fails
    does not end the others; the supervisor names the node that failed first, then stops the step
    (srun's kill would end that node's task before its exit line when a node whose ranks only lost
    it as a peer exited first). ``heals`` (recovery.in_process) adds ``--no-kill``: the step goes on
    without a node Slurm lost too, and a node whose ranks ask for a relaunch, exit 75, ends the
    attempt through hfscale.launch.attempt.in_process.
    ``--overlap``: the previous attempt's step keeps its CPUs until every node of it has answered,
    and a node whose link is cut answers only once Slurm sets it DOWN (``SlurmdTimeout``, 300 s by
    default): a step that waited for free CPUs would wait that long (the supervisor has made sure
    that the previous attempt's processes are gone: hfscale.launch.recovery.settle)."""
    return ["srun", "--overlap", f"--nodelist={hosts_file}", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
            *(["--no-kill"] if heals else []), "--kill-on-bad-exit=0", "--unbuffered"]


def still_allocated(hosts_file: str, wait: bool = True) -> str:
    """Shell text run before an attempt's step: a host of ``hosts_file`` Slurm took out of the
    allocation (set DOWN under ``--no-kill``) is named as lost (hfscale.launch.attempt.node_lines), exit 3,
    instead of srun's "Requested node configuration is not available", which names none. One grep
    over both lists (fixed strings, whole lines): no per-host loop, no host list on a command line.
    ``wait``: first wait (at most PREVIOUS_STEP_S) for the previous attempt's step to end; not when
    a host of that step did not answer after the stop (its step cannot end before Slurm notices)."""
    # the previous attempt's step still ending on a node (Slurm kills it when it loses a node): wait,
    # at most PREVIOUS_STEP_S: a step started meanwhile had its srun SIGKILLed on the test Slurm
    wait_text = (f'for i in $(seq {PREVIOUS_STEP_S}); do [ -z "$(squeue -h -s -j "$SLURM_JOB_ID" -o \'%i %j\' '
                 "2>/dev/null | grep -vE '[.](batch|extern) |hfscale-(watch|probe|stop)$')\" ] && break; sleep 1; done; "
                 if wait else "")
    return (wait_text + 'now=$(squeue -h -j "$SLURM_JOB_ID" -o %N 2>/dev/null); have=$(scontrol show hostnames "$now" '
            '2>/dev/null); if [ -n "$now" ] && [ -n "$have" ]; then h=$(printf \'%s\\n\' "$have" | grep -vxF -f - '
            + shlex.quote(hosts_file) + ' | head -n 1); if [ -n "$h" ]; then echo "hfscale: Slurm took $h out of the '
            'allocation (set DOWN: its slurmd stopped answering)"; exit 3; fi; fi;')


def on_each_node(hosts_file: str, line: Line, fanout: int, unreached: str) -> Command:
    """``line`` on each host of ``hosts_file``, a step of its own on each (``--overlap``: beside the
    job's step), at most ``fanout`` at once, each given up on after STEP_STOP_S: the stop, the stack dump.
    A host srun could not launch on (a cut link: "Communication connection failure" after Slurm's
    MessageTimeout, 10 s by default; a node Slurm set DOWN) is appended to ``unreached`` (the attempt's
    file in the run directory) and skipped by the later passes (the kill after the stack dump) and by
    the supervisor's settle (hfscale.launch.recovery.settle): each pass would wait that long on it again."""
    u = shlex.quote(unreached)
    skip = Sh(f'declare -A gone; while read -r u; do gone[$u]=1; done 2>/dev/null < {u}; n=0; while read -r h; do '
              '[ -n "$h" ] && [ -z "${gone[$h]}" ] || continue; {')
    each = Line.of(Sh(f'timeout {STEP_STOP_S} srun --overlap --job-name=hfscale-stop --nodelist="$h" --nodes=1 '
                      '--ntasks=1 --quiet bash -c'),
                   Script(line), Sh(f'</dev/null >/dev/null 2>&1 || [ $? = 124 ] || echo "$h" >> {u}; }} &'))
    line = Line.of(skip, each,
                   Sh(f'n=$((n + 1)); [ "$n" -lt {int(fanout)} ] || {{ wait -n; n=$((n - 1)); }}; done <'), hosts_file,
                   Sh("; wait; true", glue=True))
    return Command(("bash", "-c", line))


def requeue_and_stop(job_id: str) -> str:
    """What a node's keeper runs when the supervisor's heartbeat stopped (its batch host is gone):
    requeue the job (it resumes from its newest complete checkpoint), then stop this node's job."""
    return f'scontrol requeue "${ALLOCATION_VAR}" 2>/dev/null; {stop_script(job_id)}'


def node_line(job: Job, c: Common, job_id: str, launcher: list[Word]) -> Line:
    """What each node's task runs: a shell started with the job id in its environment whose output
    (prefixed ``<host>: ``) runs through sed, which the stop leaves alone so the last lines arrive."""
    setup = job.config.runner.setup
    before = and_then(Line.of(Sh("cd"), c.workdir), Line.of(Sh("."), posixpath.join(c.run_dir, ENV_FILE)),
                      Line.of(Sh("."), posixpath.join(c.run_dir, NODES_FILE)),
                      Line.of(Sh("{"), Sh(setup), Sh(";"), Sh("}")) if setup else Line(()), health_gate(job, c.python))
    keeper = keeper_line(keeper_of(c.run_dir, SRUN_REACH), Line((Sh(requeue_and_stop(job_id)),)))
    prefix = Line((Sh(f'export {HOST_VAR}="${NODE_NAME_VAR}"; exec > >(exec env -u {JOB_ID_VAR} sed -u '
                      f'"s/^/${HOST_VAR}: /") 2>&1;'),))
    node = node_script(before, launcher, posixpath.join(c.run_dir, STOP_MARKER), first=Line.of(prefix, keeper),
                       on_exit="kill $hb 2>/dev/null; ")
    return Line.of(Sh("exec env"), *(Sh(f"{JOB_ID_VAR}={job_id}"),), Sh("bash -c"), Script(node))


def plan(job: Job, ctx: LaunchContext, c: Common) -> LaunchPlan:
    """One attempt inside the allocation: an srun step over ``job.hosts``."""
    hosts = tuple(h.host for h in (*job.hosts, *(job.spares if in_process(job) else ())))  # spares: standbys
    listing, fanout = posixpath.join(c.run_dir, STEP_HOSTS_FILE), job.config.runner.fanout
    launcher = launcher_argv(job, c.python, c.rank_dir, ctx, default_rendezvous(job, Var(RANK_VAR)), "srun")
    step = srun_argv(listing, len(hosts), heals=in_process(job))
    main = Command(("bash", "-c", Line.of(Sh(still_allocated(listing, wait=not ctx.unreachable)), Sh("exec"),
                                          words(step), Sh("bash -c"),
                                          Script(node_line(job, c, ctx.job_id, launcher)))))
    unreached = posixpath.join(c.run_dir, UNREACHED)
    cleanup, dump, kill = controls(lambda line: on_each_node(listing, line, fanout, unreached), ctx.job_id, c.watch,
                                   c.python)
    nodes = tuple(NodeLaunch(h, i, words(launcher_argv(job, c.python, c.rank_dir, ctx,
                                                       default_rendezvous(job, str(i)), "srun")))
                  for i, h in enumerate(hosts))
    notes = c.notes + (f"inside Slurm allocation {dict(ctx.shell_env).get(ALLOCATION_VAR, '?')}: supervised here, "
                       f"each attempt one srun step over its nodes" + (f"; spares {', '.join(s.host for s in job.spares)}"
                                                                       if job.spares else ""),)
    files = (*c.files, (STEP_HOSTS_FILE, "".join(h + "\n" for h in hosts)))
    return LaunchPlan(ctx.job_id, "slurm", c.run_dir, files, nodes, hosts, main,
                      cleanup,
                      c.mode, notes, moves=c.moves, private=private_files(job, c, hosts),  # type: ignore[arg-type]
                      watch=c.watch, dump=dump, stop_marker=posixpath.join(c.run_dir, STOP_MARKER),
                      keeper=keeper_of(c.run_dir, SRUN_REACH), kill=kill)
