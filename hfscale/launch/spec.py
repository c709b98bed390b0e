"""The launch plan: what ``hfscale launch`` will do, as one immutable value.

The same object is printed by ``--dry-run`` (and written to ``plan.txt``) and run by
``hfscale.launch.attempt.execute``: it holds real values once, and its ``render`` shows secrets as ``***``.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Literal

from hfscale.core.shell import Command, Line, Text, render

RunnerName = Literal["local", "pdsh", "pdsh_docker", "slurm", "kubernetes"]
# stream: run ``main`` and relay its output per node; submit: ``main`` hands the job to a scheduler
# and returns; done: nothing to train (the newest checkpoint is at max_steps), nothing is started
Mode = Literal["stream", "submit", "done"]
LOCK_FILE = "_hfscale-lock.json"  # hfscale.launch.attempt.output_lock ("_": push_to_hub leaves it out)
EXIT_MARK = "HFSCALE_EXIT"  # every node's last line: "HFSCALE_EXIT rc=<launcher exit code>"
NOTHING_TO_TRAIN = "nothing to train"


@dataclass(frozen=True)
class NodeLaunch:
    """What one node runs: the host (None: one the scheduler picks), its node rank (None: found
    on the node, from the scheduler), and the launcher's command line there."""

    host: str | None
    rank: int | None
    command: Line


@dataclass(frozen=True)
class Follow:
    """A detached launch (more hosts than ``runner.fanout``): ``main`` only starts every node, at
    most ``runner.fanout`` at a time, and returns; each node appends its output to
    ``logs_dir/<host>.log`` and rewrites ``beats_dir/<host>`` every ``beat_s`` seconds, on the
    run directory's shared filesystem. hfscale then follows those files (hfscale.launch.attempt.follow): a host
    whose heartbeat has not changed for ``lost_after_s`` seconds is lost."""

    hosts: tuple[str, ...]
    logs_dir: str
    beats_dir: str
    beat_s: int
    lost_after_s: int


@dataclass(frozen=True)
class Keeper:
    """Each node's watch over its launcher (hfscale.launch.node.keeper, hfscale.launch.attempt.beats): while
    the node's line runs, it beats and hears its launcher over a TCP line to the launch
    (``beat_addr``, hfscale.launch.attempt.beat_server) every ``check_s`` seconds, or, where that line cannot
    be had, rewrites ``beats_dir/<host>`` every ``beat_s`` seconds and reads ``launcher_beat``
    (which the launch rewrites every ``launcher_beat_s`` seconds) every ``check_s``. When the line
    closes, or the launcher is silent for ``lost_after_s`` seconds (the launcher was killed, its
    host lost), the node stops its job as the cleanup would (TERM, then KILL) and writes
    ``orphaned_dir/<host>``. A job whose launcher died ends within ``stops_within_s`` seconds."""

    launcher_beat: str
    beats_dir: str
    orphaned_dir: str
    logs_dir: str
    launcher_beat_s: int
    beat_s: int
    check_s: int
    lost_after_s: int
    stops_within_s: int
    beat_addr: str = ""  # the launcher's heartbeat line (hfscale.launch.attempt.beat_server): "" none, the file only
    reach: str = ""  # shell text: the launcher's address as the node sees it ("" the address in beat_addr)


@dataclass(frozen=True)
class HangWatch:
    """The hang watchdog (hfscale.launch.attempt.watchdog): each rank rewrites ``progress_dir/rank-<RANK>`` after
    every optimizer step (hfscale.training.heartbeat). When no rank has finished a step for ``timeout``
    seconds (``first_step``: none at all since the start), hfscale runs the plan's ``dump`` on
    every node (each rank's Python stack into ``stacks_dir``), writes ``report`` naming the stuck
    rank(s), and stops the job (exit code 4)."""

    progress_dir: str
    stacks_dir: str
    report: str
    timeout: int
    first_step: int | None
    world_size: int


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch does, in order: ``moves`` (``--restart``), the ``files`` of the run
    directory (``private`` ones, which hold secret values, readable by you only: mode 0600),
    ``main`` (the one process hfscale starts), and on failure or Ctrl-C ``cleanup``.

    ``nodes`` describes what each node runs (for people: ``main`` is what starts them); ``logs``
    names the streams ``main``'s output is split into (one per host, or one; none when the nodes
    write their own logs: ``follow``, what hfscale watches once ``main`` started a detached job);
    ``show`` the files
    printed in full by ``render`` (the sbatch script, the manifests; the private files always are,
    with their secrets masked)."""

    job_id: str
    runner: RunnerName
    run_dir: str
    files: tuple[tuple[str, str], ...]
    nodes: tuple[NodeLaunch, ...]
    logs: tuple[str, ...]
    main: Command
    cleanup: Command | None
    mode: Mode = "stream"
    notes: tuple[str, ...] = field(default=())
    show: tuple[str, ...] = ()
    moves: tuple[tuple[str, str], ...] = ()
    private: tuple[tuple[str, Text], ...] = ()
    follow: Follow | None = None
    watch: HangWatch | None = None
    dump: Command | None = None  # writes every rank's stack into watch.stacks_dir, on every node
    # the cleanup after a hang: the same stop with no grace (stuck ranks cannot save); None: ``cleanup``
    kill: Command | None = None
    prepare: tuple[Command, ...] = ()  # run here, in order, after the run directory is made and before main
    # training.output_dir as this host sees it (None: not visible here); a streamed launch holds its
    # lock (hfscale.launch.attempt.output_lock) from before anything starts to its end
    output_dir: str | None = None
    stop_marker: str | None = None  # written before the cleanup runs: a node line that starts later exits at once
    told: tuple[str, ...] = ()  # lines the launch shows on the terminal before it starts (what resuming skipped)
    keeper: Keeper | None = None  # each node stops its job when the launcher's heartbeat stops
    # in-process restarts (recovery.in_process): the ranks' store, run here from before main to after it; a
    # node's failure is theirs to heal unless it asks for a relaunch (exit code 75)
    store: Command | None = None

    @property
    def line_hosts(self) -> frozenset[str]:
        """The host names that may prefix the lines of ``main``'s output ("host: ", pdsh's and the
        follower's): anything else before a colon (``ValueError: ...``) is the line's own text."""
        return frozenset(self.logs) | frozenset(self.follow.hosts if self.follow else ())

    @property
    def lock(self) -> str | None:
        """The output_dir lock this launch takes (hfscale.launch.attempt.output_lock), or None."""
        if self.output_dir is None or self.mode != "stream":
            return None
        return posixpath.join(self.output_dir, LOCK_FILE)

    def where(self) -> str:
        """Where the job runs, for one line of output."""
        hosts = [n.host for n in self.nodes if n.host]
        return ", ".join(hosts) if hosts else f"the nodes {self.runner} allocates"

    def render(self) -> str:
        """The plan as text, secrets as ``***``: moves, files, per-node commands, the process
        hfscale starts, cleanup, notes."""
        out = [f"# hfscale launch plan: job {self.job_id}, runner {self.runner}", f"run directory: {self.run_dir}"]
        if self.lock is not None:
            out.append(f"lock: {self.lock} (one launch per training.output_dir: refused while a running job holds it)")
        if self.told:
            out += [f"resume: {t}" for t in self.told]
        if self.moves:
            out.append("first, move:")
            out += [f"  {a} -> {b}" for a, b in self.moves]
        out.append("files:")
        out += [f"  {posixpath.join(self.run_dir, name)} ({len(text.splitlines())} lines)" for name, text in self.files]
        out += [f"  {posixpath.join(self.run_dir, name)} ({len(text.shown.splitlines())} lines, mode 0600: secrets)"
                for name, text in self.private]
        out.append("nodes:")
        for n in self.nodes:
            rank = "?" if n.rank is None else str(n.rank)
            out.append(f"  [{rank}] {n.host or 'picked by ' + self.runner}: {render(n.command)}")
        shown = [(name, dict(self.files)[name]) for name in self.show] + [(n, t.shown) for n, t in self.private]
        for name, text in shown:
            out += [f"--- {posixpath.join(self.run_dir, name)}", text.rstrip("\n"), "---"]
        if self.prepare:
            out.append("first, run here:")
            out += [f"  {c.shell()}" for c in self.prepare]
        if self.store is not None:
            out += ["in-process restarts: the ranks' store, here, from before the nodes start to after they end:",
                    f"  {self.store.shell()}",
                    "  a node that fails or is lost does not stop the others: they restart in process, a standby in "
                    "its ranks' place; a node that ends with exit code 75 (no restart in process possible) stops the "
                    "job, as a failure does without in-process restarts"]
        out += ["run:", f"  {self.main.shell()}"]
        if self.follow is not None:
            f = self.follow
            out += ["then follow (the nodes run detached):",
                    f"  output: {posixpath.join(f.logs_dir, '<host>.log')}",
                    f"  heartbeat every {f.beat_s} s: {posixpath.join(f.beats_dir, '<host>')}; "
                    f"a host silent for {f.lost_after_s} s is lost"]
        if self.keeper is not None:
            k = self.keeper
            out += [f"launcher heartbeat: {k.launcher_beat}, every {k.launcher_beat_s} s"]
            if k.beat_addr:
                out += [f"  each node: a beat every {k.check_s} s on the launcher's heartbeat line (a TCP connection "
                        f"to this host, its port in {k.beat_addr}); when it closes, or the launcher has not answered "
                        f"for {k.lost_after_s} s, the node stops its job (as on failure). A node that cannot reach it:"]
            out += [f"  each node: heartbeat every {k.beat_s} s into {posixpath.join(k.beats_dir, '<host>')}; when the "
                    f"launcher's has not changed for {k.lost_after_s} s, the node stops its job (as on failure) and "
                    f"writes {posixpath.join(k.orphaned_dir, '<host>')}: a job whose launcher died ends within "
                    f"{k.stops_within_s} s"]
        if self.watch is not None:
            w = self.watch
            first = f", or none in the first {w.first_step} s" if w.first_step else ""
            out += [f"watchdog: no rank finishing a step for {w.timeout} s{first} is a hang: every rank's stack into "
                    f"{w.stacks_dir}, the report into {w.report}, then the job stops (exit 4)"]
            if self.dump is not None:
                out.append(f"  {self.dump.shell()}")
            if self.kill is not None:
                out.append(f"  then, no grace (stuck ranks cannot save): {self.kill.shell()}")
        if self.cleanup is not None:
            out.append("on failure or Ctrl-C:")
            if self.stop_marker is not None:
                out.append(f"  touch {self.stop_marker}  (a node whose line starts after this exits at once)")
            out.append(f"  {self.cleanup.shell()}")
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out) + "\n"


@dataclass(frozen=True)
class Outcome:
    """How one run of a plan ended: its exit code, and the first failure (where, what was said)."""

    rc: int
    where: str | None = None  # the host (or the runner's program) that failed first
    what: str = ""
    hung: bool = False  # the hang watchdog stopped it
    signalled: bool = False  # a signal (Ctrl-C, the scheduler's TERM) stopped it
    failed_at: float | None = None  # when the failure was noticed (time.time())
