"""The node line: what every node's shell runs around its launcher, and pdsh's fan-out of it (pure).
Runner pdsh sends it to every host (hfscale.launch.runners.pdsh), pdsh_docker with a container
for the launcher, and a supervised Slurm job's step runs its ``node_script`` on each node.

Per-host data never rides on a command line (one argument may hold 128 KiB, and ``ps`` shows
every argument to every user): the hosts are read by pdsh from ``pdsh_hosts`` (``-w ^file``), the
ranks' environment from ``env.sh`` and each host's rank and own variables from ``nodes.sh``, both
in the run directory (which every node sees) and readable by you only (mode 0600: they hold the
secret values). Every host runs the same short line: change to the working directory, source the
environment (so the job id is set before anything else runs), take its rank from ``nodes.sh`` by
its own name (pdsh's ``%h``: ranks never depend on pdsh's order), run ``runner.setup``, run the
launcher, print ``HFSCALE_EXIT rc=N``. Literal values are quoted and their ``%`` doubled for pdsh;
only ``runner.setup`` runs as written. The line runs in a shell started with the job id in its
environment; the cleanup stops exactly the processes whose environment holds it (TERM, then KILL
after a grace period: hfscale.launch.node.stopping), at most ``runner.fanout`` hosts at a time.

Up to ``runner.fanout`` hosts, the launch holds one ssh per host for the whole run and streams
the output (attached). Beyond, one launch host cannot hold thousands of ssh sessions: pdsh
starts each node's line detached, ``runner.fanout`` hosts at a time, each node writes its output
and a heartbeat into the run directory, and hfscale follows those files (``Follow``).
"""

from __future__ import annotations

import posixpath
from typing import NamedTuple

from hfscale.config.envvars import host_env, host_secret
from hfscale.launch.run_dir import BEATS_DIR, LOGS_DIR, STOP_MARKER
from hfscale.launch.spec import EXIT_MARK, Follow
from hfscale.rules.resolved import Job
from hfscale.core.shell import (Assign, Cat, Command, Line, PdshHost, Script, Secret, Sh, Text, Var, Word, and_then, exports,
                     render, words)
from hfscale.launch.context import Common
from hfscale.launch.node.health_gate import gate_argv
from hfscale.launch.node.keeper import HOST_VAR, NODE_BEAT_S, keeper_line, keeper_of
from hfscale.launch.node.reach import pdsh_argv
from hfscale.launch.node.stopping import JOB_ID_VAR

RANK_VAR = "HFSCALE_NODE_RANK"
UNKNOWN_HOST_EXIT = 97
STOPPED_EXIT = 143  # a node whose line started after the stop: as if it had been stopped
ENV_FILE = "env.sh"
NODES_FILE = "nodes.sh"
HOSTS_FILE = "pdsh_hosts"
LOST_AFTER_S = 40  # four heartbeats missed (NODE_BEAT_S): noticed 40-45 s after a node died


def env_file(c: Common) -> Text:
    """``env.sh``: ``export K='v'`` for every variable of the ranks (real and shown forms)."""
    line = exports(c.env)
    head = "# The ranks' environment, sourced on every node by hfscale's launch line (mode 0600: secrets).\n"
    return Text(real=head + render(line, shown=False) + "\n", shown=head + render(line) + "\n")


def nodes_file(job: Job, hosts: tuple[str, ...]) -> Text:
    """``nodes.sh``: each host's rank and per-host variables, picked by ``$HFSCALE_HOST`` (host names
    are validated: they are shell syntax here)."""
    def block(shown: bool) -> str:
        out = ["# Each node's rank and own variables, by host name; sourced after env.sh.", f'case "${HOST_VAR}" in']
        for i, h in enumerate(hosts):
            extra = {k: (Secret(k, v) if host_secret(job.config, k) else v) for k, v in host_env(job.config, h).items()}
            assigns = Line.of(Sh("export"), Assign(RANK_VAR, str(i)), *(Assign(k, v) for k, v in extra.items()))
            out.append(f"  {h}) {render(assigns, shown)} ;;")
        out.append(f'  *) echo "hfscale: host ${HOST_VAR} is not in the plan" >&2; exit {UNKNOWN_HOST_EXIT} ;;')
        out.append("esac")
        return "\n".join(out) + "\n"

    return Text(real=block(False), shown=block(True))


def private_files(job: Job, c: Common, hosts: tuple[str, ...]) -> tuple[tuple[str, Text], ...]:
    return ((ENV_FILE, env_file(c)), (NODES_FILE, nodes_file(job, hosts)))


def prelude(job: Job, c: Common, gate: bool = True) -> Line:
    """``cd <workdir> && . env.sh && export HFSCALE_HOST=%h && . nodes.sh && { setup ; } && <health gate>``:
    what every host does before its launcher (the job id is in the environment before ``runner.setup`` runs).
    ``gate``: False where hfscale lives in the container, not on the host (runner pdsh_docker): no gate yet."""
    setup = job.config.runner.setup
    return and_then(Line.of(Sh("cd"), c.workdir),
                    Line.of(Sh("."), posixpath.join(c.run_dir, ENV_FILE)),
                    Line.of(Sh(f"export {HOST_VAR}="), PdshHost(glue=True)),
                    Line.of(Sh("."), posixpath.join(c.run_dir, NODES_FILE)),
                    Line.of(Sh("{"), Sh(setup), Sh(";"), Sh("}")) if setup else Line(()),
                    health_gate(job, c.python) if gate else Line(()))


def health_gate(job: Job, python: str) -> Line:
    """The node's health gate after ``runner.setup``, before its launcher (hfscale.launch.node.health_gate):
    a node that fails it exits 69 and starts no rank."""
    return words(gate_argv(python, job.procs_per_node, job.config.recovery.health_check))


def node_script(before: Line, launcher: list[Word], marker: str, first: Line = Line(()), on_exit: str = "") -> Line:
    """``[ ! -e marker ] || exit 143; [first] before && launcher; rc=$?; [on_exit]echo "HFSCALE_EXIT
    rc=$rc"; exit $rc``: what a node's shell runs, ending with the exit line hfscale watches for.
    The stop writes ``marker`` (on the shared file system) before it stops the job's processes, so
    a line that starts after the stop (a slow ssh, a loaded host) starts nothing."""
    check = Line.of(Sh("[ ! -e"), marker, Sh(f"] || {{ echo 'hfscale: the job was stopped before this node started'; "
                                             f"exit {STOPPED_EXIT}; }};"))
    tail = Sh(f'; rc=$?; {on_exit}echo "{EXIT_MARK} rc=$rc"; exit $rc', glue=True)
    return Line.of(check, first, and_then(before, words(launcher)), tail)


def fan_out(job_id: str, before: Line, launcher: list[Word], marker: str, keeper: Line) -> Line:
    """The one line pdsh sends to every host: a shell started with the job id in its environment
    (so that the stop finds it, and with it whatever ``runner.setup`` runs in it) starts the node's
    keeper (hfscale.launch.node.keeper), runs ``before`` and the launcher, and ends by printing the
    launcher's exit code."""
    first = Line.of(Sh(f"export {HOST_VAR}="), PdshHost(glue=True), Sh(";", glue=True), keeper)
    node = node_script(before, launcher, marker, first=first, on_exit="kill $hb 2>/dev/null; ")
    return Line((Sh("exec env"), Assign(JOB_ID_VAR, job_id), Sh("bash -c"), Script(node)), pdsh=True)


def detached(job_id: str, before: Line, launcher: list[Word], run_dir: str, keeper: Line) -> Line:
    """The line pdsh sends when the launch is detached: start the node's line (``fan_out``'s) in a
    new session with its output appended to ``logs/<host>.log``, its keeper rewriting
    ``alive/<host>`` while it runs (the follower's heartbeat), then return at once."""
    log_file = Cat((posixpath.join(run_dir, LOGS_DIR) + "/", Var(HOST_VAR), ".log"))
    node = node_script(before, launcher, posixpath.join(run_dir, STOP_MARKER), first=keeper,
                       on_exit="kill $hb 2>/dev/null; ")
    # ";" not "&&": "a && b &" would background a subshell holding the ssh session's output open
    return Line((Sh(f"export {HOST_VAR}="), PdshHost(glue=True), Sh("; env", glue=True), Assign(JOB_ID_VAR, job_id),
                 Sh("setsid bash -c"), Script(node), Sh("</dev/null >>"), log_file, Sh("2>&1 &")), pdsh=True)


class Fanout(NamedTuple):
    """The process that launches, the logs hfscale writes from its output, what it follows after."""

    main: Command
    logs: tuple[str, ...]
    follow: Follow | None


def launch(job: Job, c: Common, job_id: str, hosts: tuple[str, ...], before: Line, launcher: list[Word], stop: Line
           ) -> Fanout:
    """How pdsh reaches the hosts: attached up to ``runner.fanout`` hosts, detached beyond. ``stop``:
    the runner's stop of this job on a node, which a node's keeper runs when its launcher is gone."""
    listing = posixpath.join(c.run_dir, HOSTS_FILE)
    fanout = job.config.runner.fanout
    keeper = keeper_line(keeper_of(c.run_dir), stop)
    if len(hosts) <= fanout:
        argv, env = pdsh_argv(job, listing, len(hosts))
        marker = posixpath.join(c.run_dir, STOP_MARKER)
        return Fanout(Command((*argv, fan_out(job_id, before, launcher, marker, keeper)), env), hosts, None)
    argv, env = pdsh_argv(job, listing, fanout)
    follow = Follow(hosts, posixpath.join(c.run_dir, LOGS_DIR), posixpath.join(c.run_dir, BEATS_DIR), NODE_BEAT_S,
                    LOST_AFTER_S)
    return Fanout(Command((*argv, detached(job_id, before, launcher, c.run_dir, keeper)), env), (), follow)


def hosts_file(hosts: tuple[str, ...]) -> tuple[str, str]:
    return HOSTS_FILE, "".join(h + "\n" for h in hosts)
