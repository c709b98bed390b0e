"""The lines a running job prints, as typed events, and what each host's lines mean (pure).

Every line is one ``Event``: ``NodeExit`` (a node's last line, ``<host>: HFSCALE_EXIT rc=N``),
``SshEnded`` (pdsh's report that a host's ssh ended: an exit code, or the signal that killed it)
or ``Output`` (anything else; ``host`` is the one its prefix names, if any). ``Nodes`` is the small
state machine over them: each host goes ``silent`` -> ``talking`` (it printed a line) ->
``exited`` (it printed its exit line), and ``Nodes.see`` says which event is the job's failure.
A failure is ``lost_peer`` when the host's ranks printed the error a collective raises when another
rank died (gloo's "Connection closed by peer", NCCL's remote error): most likely a victim, not the
cause. ``hfscale.launch.attempt.execute`` feeds it the lines and acts on the ``Failure``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Literal, Union

from hfscale.core import exitcodes
from hfscale.core.exitcodes import signal_name
from hfscale.launch.spec import EXIT_MARK

# "host: " as pdsh prefixes a node's lines (pdsh's own lines: "pdsh@launcher: host: ")
HOST_PREFIX = re.compile(r"^(?:pdsh@[^:]+: )?(?P<host>[A-Za-z0-9][\w.-]*): ")
_EXIT = re.compile(rf"^(?P<host>[^\s:]+): {EXIT_MARK} rc=(?P<rc>\d+)$")
# pdsh's report of a host's ssh: its exit code, or the signal that killed it
_PDSH_ENDED = re.compile(r"^pdsh@[^:]+: (?P<host>[^\s:]+): \S+ "
                         r"(?:exited with exit code (?P<rc>\d+)|killed by signal (?P<sig>\d+))$")
SSH_FAILED = 255  # ssh's own exit code when it could not connect, log in, or lost the connection
# what ssh itself prints when it cannot connect or loses the connection (its last line, through pdsh)
_SSH_SAID = re.compile(r"^(?:ssh: |ssh_|kex_|client_loop: |Connection (?:to|closed|reset|timed out)|Timeout, server"
                       r"|Read from remote host|packet_write_wait|Write failed|Broken pipe|Host key verification"
                       r"|Permission denied|Could not resolve)")
# srun's own report of a node Slurm lost (its slurmd stopped answering, its link cut) and of a task that
# ended: "srun: error: Node failure on node2", "srun: error: node3: task 2: Killed",
# "srun: error: node1: task 0: Exited with exit code 1" (hfscale.launch.runners.slurm_step)
_SRUN_LOST = re.compile(r"^(?:srun: error: Node failure on|hfscale: Slurm took) (?P<host>[A-Za-z0-9][\w.-]*)"
                        r"(?: out of the allocation.*)?$")
_SRUN_TASK = re.compile(r"^srun: error: (?P<host>[A-Za-z0-9][\w.-]*): tasks? [\d,\[\]-]+: "
                        r"(?:Exited with exit code (?P<rc>\d+)|(?P<how>[A-Z][\w ]*))$")
_SIGNALS = {"Killed": 9, "Terminated": 15, "Segmentation fault": 11, "Aborted": 6, "Bus error": 7, "Hangup": 1,
            "Interrupt": 2, "Quit": 3}
# what a rank prints when a collective fails because another rank went away (gloo, NCCL, sockets)
_PEER_LOST = re.compile(r"Connection closed by peer|caused by a remote worker crashing|Connection reset by peer"
                        r"|remote process exited|ncclRemoteError")


@dataclass(frozen=True)
class NodeExit:
    """A node's launcher ended with ``rc`` (the node's last line)."""

    host: str
    rc: int


@dataclass(frozen=True)
class SshEnded:
    """pdsh's ssh to ``host`` ended: with exit code ``rc``, or killed by ``signal``."""

    host: str
    rc: int | None
    signal: int | None


@dataclass(frozen=True)
class Output:
    """Any other line; ``host`` is the host its prefix names (``host: ...``), else None."""

    host: str | None
    text: str  # the line without its prefix
    from_pdsh: bool  # pdsh's own line (``pdsh@launcher: host: ...``)


@dataclass(frozen=True)
class SrunSaid:
    """srun's report on ``host``: Slurm lost it (``lost``), or its task ended with exit code ``rc`` or
    by ``signal`` (its line's own exit line may not have come: the task was killed)."""

    host: str
    lost: bool = False
    rc: int | None = None
    signal: int | None = None


Event = Union[NodeExit, SshEnded, SrunSaid, Output]
HostState = Literal["silent", "talking", "exited"]


def parse(line: str) -> Event:
    """The event one line of the job's output stands for."""
    if m := _EXIT.match(line):
        return NodeExit(m["host"], int(m["rc"]))
    if m := _PDSH_ENDED.match(line):
        return SshEnded(m["host"], int(m["rc"]) if m["rc"] else None, int(m["sig"]) if m["sig"] else None)
    if m := _SRUN_LOST.match(line):
        return SrunSaid(m["host"], lost=True)
    if (m := _SRUN_TASK.match(line)) and (m["rc"] is not None or m["how"] in _SIGNALS):
        return SrunSaid(m["host"], rc=int(m["rc"]) if m["rc"] is not None else None,
                        signal=_SIGNALS.get(m["how"] or ""))
    if m := HOST_PREFIX.match(line):
        return Output(m["host"], line[m.end():], line.startswith("pdsh@"))
    return Output(None, line, False)


@dataclass(frozen=True)
class Failure:
    """The first failure of a job: where, the exit code hfscale reports, and what to say."""

    where: str
    rc: int
    what: str
    lost_peer: bool = False  # likely not the cause (its ranks failed because another rank went away): held
    doubt: str = "its ranks lost a peer"  # why it is held (hfscale.launch.attempt.first_failure says it)


@dataclass
class Nodes:
    """Each host's state, the lines it printed, and its last line (ssh's complaint, for an unreachable one)."""

    state: dict[str, HostState] = field(default_factory=dict)
    _lines: dict[str, int] = field(default_factory=dict)
    _last: dict[str, str] = field(default_factory=dict)
    lost_peer: set[str] = field(default_factory=set)  # hosts whose ranks printed a peer's loss
    succeeded: set[str] = field(default_factory=set)  # hosts whose exit line said 0

    @property
    def exited(self) -> set[str]:
        """The hosts that printed their exit line."""
        return {h for h, s in self.state.items() if s == "exited"}

    def see(self, event: Event) -> Failure | None:
        """Take one event; the failure it shows, if any (the caller keeps only the first)."""
        if isinstance(event, NodeExit):
            self.state[event.host] = "exited"
            if not event.rc:
                self.succeeded.add(event.host)
            return self._failed(event.host, event.rc) if event.rc else None
        if isinstance(event, Output):
            if event.host is not None and not event.from_pdsh:
                self._lines[event.host] = self._lines.get(event.host, 0) + 1
                self._last[event.host] = event.text
                if _PEER_LOST.search(event.text):
                    self.lost_peer.add(event.host)
                if self.state.get(event.host, "silent") == "silent":
                    self.state[event.host] = "talking"
            return None
        if isinstance(event, SrunSaid):
            return self._srun(event)
        host = event.host
        if event.signal is not None:
            return Failure(host, 128 + event.signal, f"the ssh to {host} was killed ({signal_name(event.signal)})")
        assert event.rc is not None
        if event.rc == SSH_FAILED and self.state.get(host) != "exited":
            last = self._last.get(host)
            if last is not None and self._lines.get(host, 0) > 1 and not _SSH_SAID.match(last):
                # ssh said nothing: the node's line was cut (its processes killed) or its session dropped
                return Failure(host, exitcodes.UNREACHABLE, f"the line on {host} ended with no exit code and its ssh "
                                                            "session closed without ssh saying why: its processes were "
                                                            "killed (kill -9, the OOM killer) or its connection dropped")
            what = "lost the connection to" if self._lines.get(host, 0) > 1 else "cannot reach"
            return Failure(host, exitcodes.UNREACHABLE, f"{what} {host} over ssh ({last or 'ssh failed'})")
        return self._failed(host, event.rc) if event.rc else None

    def _srun(self, event: SrunSaid) -> Failure | None:
        host = event.host
        if event.lost:
            return Failure(host, exitcodes.UNREACHABLE, f"Slurm lost {host}: its slurmd stopped answering (stopped, "
                                                        "or its link cut)")
        if self.state.get(host) == "exited":  # its exit line said it first
            return None
        if event.signal is not None:
            # the stop ending the other tasks after one failed (TERM), or Slurm killing the
            # step when it lost a node (KILL, its "Node failure" line may come after): likely not the cause
            return Failure(host, 128 + event.signal, f"the task on {host} was killed ({signal_name(event.signal)}) "
                                                     "before its line ended", lost_peer=True,
                           doubt="the stop or Slurm may have killed it")
        if not event.rc:
            return None
        # srun can tell a task's end before the task's own last lines arrive (they come by another way):
        # held until its exit line, which says whether its ranks only lost a peer
        return replace(self._failed(host, event.rc), lost_peer=True, doubt="srun told its end before its own lines came")

    def _failed(self, host: str, rc: int) -> Failure:
        if rc == exitcodes.RELAUNCH:
            what = no_restart_in_process(host, rc)
        elif rc == exitcodes.UNHEALTHY:
            what = f"{host} failed its health gate (exit code {rc}): not admitted"
        else:
            what = f"{host} failed (exit code {rc})"
        return Failure(host, rc, what, lost_peer=host in self.lost_peer)


def no_restart_in_process(who: str, rc: int = exitcodes.RELAUNCH) -> str:
    """A node (or a local launch) whose ranks asked for a relaunch: they said why in its log
    (hfscale.training.inprocess.restart), which the supervisor reads as the error (policy.last_error)."""
    return f"{who}'s ranks could not restart in process (exit code {rc}): the job is relaunched"
