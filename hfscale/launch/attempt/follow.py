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
from typing import Protocol

from hfscale.core import exitcodes
from hfscale.core.untrusted import Unreadable, open_regular, read_bytes
from hfscale.launch.spec import Follow, LaunchPlan

FOLLOW_POLL_S = 1.0  # a detached job's logs are read this often
READ_LIMIT = 1 << 20  # per host and round: one chatty host cannot stall the others
BEAT_CAP = 64  # a heartbeat file holds a counter


class LogTail:
    """The lines appended to some files since the last call (``hfscale logs --follow`` and the
    follower of a detached job)."""

    def __init__(self, paths: dict[str, Path]):
        self._paths = paths
        self._offset = dict.fromkeys(paths, 0)
        self._partial = dict.fromkeys(paths, b"")

    def lines(self) -> list[tuple[str, str]]:
        """(name, line) for every complete line written since the last call; files in the order
        they last changed, so that of two nodes failing within one poll the one that failed first
        is named (its exit line is its log's last write)."""
        batches: list[tuple[int, str, list[tuple[str, str]]]] = []
        for name, path in self._paths.items():
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
    """New lines and silent hosts of a detached job, polled."""

    def __init__(self, follow: Follow, now: float):
        self.follow = follow
        self._tail = LogTail({h: Path(follow.logs_dir) / f"{h}.log" for h in follow.hosts})
        self._beats = {h: Path(follow.beats_dir) / h for h in follow.hosts}
        self._beat: dict[str, tuple[bytes | None, float]] = {h: (None, now) for h in follow.hosts}

    def lines(self) -> list[tuple[str, str]]:
        """(host, line) for every complete line the nodes wrote since the last call (LogTail.lines)."""
        return self._tail.lines()

    def silent(self, now: float, done: set[str]) -> list[str]:
        """Hosts not in ``done`` whose heartbeat has not changed for ``lost_after_s`` seconds."""
        lost = []
        for host, path in self._beats.items():
            if host in done:
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
        """Whether ``host``'s heartbeat file was ever seen (never: its line did not start there, or
        it cannot see the run directory)."""
        return self._beat[host][0] is not None


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


def follow_detached(run: Relay, follow: Follow) -> None:
    """Relay a detached job's output and exit lines from the run directory until every host has
    exited, one failed or went silent, or a signal came."""
    follower = Follower(follow, time.monotonic())
    next_check = time.monotonic() + follow.beat_s / 2
    everyone = set(follow.hosts)
    while True:
        for host, line in follower.lines():
            run.route(f"{host}: {line}")
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
    for host, line in follower.lines():
        run.route(f"{host}: {line}")
