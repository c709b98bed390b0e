"""Following a detached job through its run directory (hfscale.launch.spec.Follow): the nodes'
output from ``logs/<host>.log`` and their heartbeats from ``alive/<host>``. Reads files only;
hfscale.launch.attempt.execute drives it.

Heartbeats are compared by content (a counter each node increments), timed by this host's clock:
nodes' clocks never enter, and opening the file (close-to-open on NFS) sees the node's latest
write. The logs' modification times only order the hosts within one poll (which node's exit line
came first); liveness never depends on them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable, Protocol

from hfscale.core import exitcodes
from hfscale.core.untrusted import Unreadable, open_regular, read_bytes
from hfscale.launch.attempt.beat_server import BeatServer
from hfscale.launch.spec import Follow, LaunchPlan

FOLLOW_POLL_S = 1.0  # a detached job's logs are read this often
READ_LIMIT = 1 << 20  # per host and round: one chatty host cannot stall the others
BEAT_CAP = 64  # a heartbeat file holds a counter
LOGS_PER_POLL = 256  # with the nodes on the heartbeat line: the logs looked at per poll, in turn, beside
# those whose line just closed (a node's line ends: its exit line is read within a poll)


class LogTail:
    """The lines appended to some files since the last call (``hfscale logs --follow`` and the
    follower of a detached job)."""

    def __init__(self, paths: dict[str, Path]):
        self._paths = paths
        self._offset = dict.fromkeys(paths, 0)
        self._partial = dict.fromkeys(paths, b"")

    def lines(self, names: Iterable[str] | None = None) -> list[tuple[str, str]]:
        """(name, line) for every complete line written since the last call (to ``names``' files
        only, when given); files in the order they last changed, so that of two nodes failing
        within one poll the one that failed first is named (its exit line is its log's last write)."""
        batches: list[tuple[int, str, list[tuple[str, str]]]] = []
        for name in self._paths if names is None else names:
            path = self._paths[name]
            try:  # one lstat per file and poll, as before: opened only when it grew
                if os.lstat(path).st_size <= self._offset[name]:
                    continue
            except OSError:
                continue  # not started yet
            try:  # a regular file only, no link followed: a FIFO in its place must not block the follower
                fd, st = open_regular(path)
            except Unreadable:
                continue
            try:
                size = st.st_size
                if size <= self._offset[name]:
                    continue
                os.lseek(fd, self._offset[name], os.SEEK_SET)
                data = os.read(fd, min(size - self._offset[name], READ_LIMIT))
            except OSError:
                continue
            finally:
                os.close(fd)
            self._offset[name] += len(data)
            *complete, self._partial[name] = (self._partial[name] + data).split(b"\n")
            if len(self._partial[name]) > READ_LIMIT:  # a line without end: shown in pieces, memory stays bounded
                complete.append(self._partial[name])
                self._partial[name] = b""
            batches.append((st.st_mtime_ns, name, [(name, line.decode("utf-8", "replace")) for line in complete]))
        return [pair for _, _, lines in sorted(batches) for pair in lines]

    def rest(self) -> list[tuple[str, str]]:
        """(name, text) of each file's last line that has no newline yet: once the writer is done."""
        return [(name, part.decode("utf-8", "replace")) for name, part in self._partial.items() if part]


class Follower:
    """New lines and silent hosts of a detached job, polled. ``line``: the launch's heartbeat line
    (hfscale.launch.attempt.beat_server): a node on it is heard there, and its log is read in turn
    (``LOGS_PER_POLL`` a poll) and as soon as its line closes; the others through the run
    directory's beat files, their logs every poll."""

    def __init__(self, follow: Follow, now: float, line: BeatServer | None = None):
        self.follow, self.line = follow, line
        self._tail = LogTail({h: Path(follow.logs_dir) / f"{h}.log" for h in follow.hosts})
        self._beats = {h: Path(follow.beats_dir) / h for h in follow.hosts}
        self._beat: dict[str, tuple[bytes | None, float]] = {h: (None, now) for h in follow.hosts}
        self._turn = 0

    def lines(self, every: bool = False, done: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, str]]:
        """(host, line) for every complete line the nodes wrote since the last call (LogTail.lines).
        ``done``: the hosts whose exit line was seen; a host whose line closed is read every poll
        until then (its keeper ends just before its exit line is written)."""
        hosts = self.follow.hosts
        if every or self.line is None or len(hosts) <= LOGS_PER_POLL:
            return self._tail.lines()
        on_line, closed = self.line.last_seen(), self.line.closed()
        turn = hosts[self._turn:self._turn + LOGS_PER_POLL]
        self._turn = (self._turn + LOGS_PER_POLL) % len(hosts)
        ending = [h for h in closed if h not in done and h in self._beats]
        off_line = [h for h in hosts if h not in on_line] if len(on_line) < len(hosts) else []
        return self._tail.lines(dict.fromkeys((*ending, *turn, *off_line)))

    def silent(self, now: float, done: set[str]) -> list[str]:
        """Hosts not in ``done`` not heard for ``lost_after_s`` seconds: on the line, no beat (or
        their line closed without their exit line); else, their beat file unchanged."""
        lost = []
        on_line = self.line.last_seen() if self.line is not None else {}
        closed = self.line.closed() if self.line is not None else {}
        for host, path in self._beats.items():
            if host in done:
                continue
            if host in on_line:
                if now - closed.get(host, on_line[host]) >= self.follow.lost_after_s:
                    lost.append(host)
                continue
            try:
                content: bytes | None = read_bytes(path, BEAT_CAP)
            except Unreadable:
                content = None
            last, since = self._beat[host]
            if content != last:
                self._beat[host] = (content, now)
            elif now - since >= self.follow.lost_after_s:
                lost.append(host)
        return lost

    def ever_beat(self, host: str) -> bool:
        """Whether ``host``'s heartbeat was ever seen (never: its line did not start there, or
        it cannot see the run directory)."""
        return self._beat[host][0] is not None or (self.line is not None and host in self.line.last_seen())


class Relay(Protocol):
    """What following a detached job reports to (hfscale.launch.attempt.execute's running launch)."""

    plan: LaunchPlan
    exited: set[str]
    failure: tuple[str, int] | None

    @property
    def signalled(self) -> int | None: ...

    def route(self, line: str) -> None: ...

    def fail(self, where: str, rc: int, what: str) -> None: ...

    def finish(self) -> None: ...


def follow_detached(run: Relay, follow: Follow, line: BeatServer | None = None) -> None:
    """Relay a detached job's output and exit lines from the run directory until every host has
    exited, one failed or went silent, or a signal came."""
    follower = Follower(follow, time.monotonic(), line)
    next_check = time.monotonic() + follow.beat_s / 2
    everyone = set(follow.hosts)
    while True:
        for host, text in follower.lines(done=run.exited):
            run.route(f"{host}: {text}")
        if run.failure is not None or run.signalled is not None:
            break
        if run.exited >= everyone:
            return
        now = time.monotonic()
        if now >= next_check:
            next_check = now + follow.beat_s / 2
            lost = follower.silent(now, run.exited)
            if lost:
                host, more = lost[0], (f" (and {len(lost) - 1} more host(s))" if len(lost) > 1 else "")
                what = (f"lost {host}: no heartbeat for {follow.lost_after_s} s" if follower.ever_beat(host) else
                        f"no heartbeat from {host} in {follow.lost_after_s} s: its line did not start, or it does not "
                        f"see the run directory {run.plan.run_dir} (it must be on a filesystem every node shares)")
                run.fail(host, exitcodes.UNREACHABLE, what + more)
                break
        time.sleep(FOLLOW_POLL_S)
    # once the stop is done, relay what the other nodes wrote meanwhile (their ends)
    run.finish()
    for host, text in follower.lines(every=True):
        run.route(f"{host}: {text}")
