"""Following a detached job through its run directory (hfscale.launch_plan.Follow): the nodes'
output from ``logs/<host>.log`` and their heartbeats from ``alive/<host>``. Reads files only;
hfscale.execute drives it.

Heartbeats are compared by content (a counter each node increments), timed by this host's clock:
nodes' clocks never enter, and opening the file (close-to-open on NFS) sees the node's latest
write. The logs' modification times only order the hosts within one poll (which node's exit line
came first); liveness never depends on them.
"""

from __future__ import annotations

import os
from pathlib import Path

from .launch_plan import Follow

READ_LIMIT = 1 << 20  # per host and round: one chatty host cannot stall the others


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
            try:
                st = os.stat(path)
            except OSError:
                continue  # not started yet
            size = st.st_size
            if size <= self._offset[name]:
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(self._offset[name])
                    data = f.read(min(size - self._offset[name], READ_LIMIT))
            except OSError:
                continue
            self._offset[name] += len(data)
            *complete, self._partial[name] = (self._partial[name] + data).split(b"\n")
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
                content: bytes | None = path.read_bytes()
            except OSError:
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
