"""The heartbeats that tie a job to its launcher, and what they say about a job whose launcher died.

- The launcher's: ``<run dir>/launcher.beat``, a counter the launching ``hfscale`` rewrites in place
  every ``LAUNCHER_BEAT_S`` seconds while its job runs (``LauncherBeat``). In place, fixed width:
  no new block is needed, so a full disk does not silence it.
- The nodes': ``<run dir>/alive/<host>``, a counter each node's keeper rewrites every
  ``NODE_BEAT_S`` seconds while the node's line runs (hfscale.launch.node.keeper, which holds these timings). The keeper
  also reads the launcher's beat: unchanged for ``LAUNCHER_LOST_S`` seconds, it stops its node's
  job (TERM: the ranks save a checkpoint at their next step; KILL after the grace period) and
  writes ``<run dir>/orphaned/<host>``. A job whose launcher died (killed -9, its login node
  rebooted) therefore ends by itself within ``SELF_STOP_S`` seconds instead of training unwatched.

Beats are compared by content on the reader's clock (nodes' clocks never enter, and opening a file
on NFS sees the writer's latest write). ``observe`` looks at a run directory for a while and says
whether its launcher still beats, which nodes still beat, and which stopped themselves: what
hfscale.launch.attempt.output_lock asks before it takes over a dead launch's lock, and what ``hfscale
status`` shows. Files only, no processes; the run directory is read as untrusted (regular files,
no link followed, capped).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hfscale.core.untrusted import Unreadable, read_bytes, real_dir
from hfscale.launch.attempt.beat_server import BeatServer, remove_addr
from hfscale.launch.run_dir import BEATS_DIR, LAUNCHER_BEAT, ORPHANED_DIR
from hfscale.launch.node.keeper import LAUNCHER_BEAT_S, LAUNCHER_LOST_S, NODE_BEAT_S

OBSERVE_S = 2 * NODE_BEAT_S  # a node that did not beat for this long has stopped
BEAT_CAP = 64
MAX_NODES = 100_000  # beat files read from one alive/ folder; more are not looked at
_HOST_FILE = re.compile(r"^[A-Za-z0-9_.:-]{1,255}$")


class LauncherBeat:
    """The launcher's heartbeat, written now and then every ``LAUNCHER_BEAT_S`` seconds by a thread
    until ``stop()``. A file that cannot be written is said once (the nodes then stop themselves
    after LAUNCHER_LOST_S: a launcher that cannot write its run directory cannot watch its job)."""

    WIDTH = 20

    def __init__(self, run_dir: str | Path, echo: Callable[[str], None], every: float = LAUNCHER_BEAT_S):
        self.path = Path(run_dir) / LAUNCHER_BEAT
        self._echo, self._every, self._n = echo, every, 0
        self._done = threading.Event()
        self._fd: int | None = None
        self._told = False
        self._write()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hfscale-launcher-beat")
        self._thread.start()

    def _write(self) -> None:
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                                   0o644)
            self._n += 1
            os.pwrite(self._fd, b"%0*d\n" % (self.WIDTH, self._n), 0)
        except OSError as e:
            if not self._told:
                self._told = True
                self._echo(f"hfscale: warning: cannot write {self.path} ({e.strerror or e}); the nodes stop their job "
                           f"when it has not changed for {LAUNCHER_LOST_S} s")

    def _loop(self) -> None:
        while not self._done.wait(self._every):
            self._write()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class LaunchBeats:
    """The launcher's side of its job's heartbeats while the job runs: ``file`` (launcher.beat, for a
    later launch and the nodes off the line) and ``line`` (hfscale.launch.attempt.beat_server; None when the
    plan's keepers have no line or no socket could be opened here)."""

    def __init__(self, run_dir: str | Path, hosts: int, with_line: bool, echo: Callable[[str], None]):
        self.run_dir = run_dir
        self.file = LauncherBeat(run_dir, echo)
        self.line = BeatServer.start(run_dir, hosts, echo) if with_line else None

    def stop(self) -> None:
        if self.line is not None:  # the nodes' keepers hear the line close: their job has ended by now
            remove_addr(self.run_dir)
            self.line.stop()
        self.file.stop()


@dataclass(frozen=True)
class Seen:
    """One look at a run directory's beats: the launcher's (None: no such file), each node's, and
    the nodes that stopped themselves."""

    launcher: bytes | None
    nodes: dict[str, bytes]
    orphaned: tuple[str, ...]


def _names(folder: Path) -> list[str]:
    if not real_dir(folder):
        return []
    out = []
    try:
        with os.scandir(folder) as it:
            for e in it:
                if len(out) >= MAX_NODES:
                    break
                if _HOST_FILE.match(e.name) and not e.name.startswith("."):
                    out.append(e.name)
    except OSError:
        return out
    return out


def _content(path: Path, root: Path) -> bytes | None:
    try:
        return read_bytes(path, BEAT_CAP, root)
    except Unreadable:
        return None


def look(run_dir: str | Path, nodes: bool = True) -> Seen | None:
    """The beats in ``run_dir`` now (None: it is not a directory this host can read)."""
    root = Path(run_dir)
    if not real_dir(root):
        return None
    launcher = _content(root / LAUNCHER_BEAT, root)
    beats: dict[str, bytes] = {}
    if nodes:
        for name in _names(root / BEATS_DIR):
            c = _content(root / BEATS_DIR / name, root)
            if c is not None:
                beats[name] = c
    return Seen(launcher, beats, tuple(sorted(_names(root / ORPHANED_DIR))))


@dataclass(frozen=True)
class Observed:
    """What ``observe`` saw: whether the launcher's beat changed, the hosts whose beat changed (their
    job runs there), and those that stopped their job themselves (``orphaned/``)."""

    launcher_beats: bool
    running: tuple[str, ...]
    stopped_themselves: tuple[str, ...]
    seconds: float  # how long it looked


def observe(run_dir: str | Path, seconds: float = OBSERVE_S, launcher: bool = True,
          sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic
          ) -> Observed | None:
    """Look at ``run_dir``'s beats for up to ``seconds`` (the launcher's every second, the nodes'
    every ``NODE_BEAT_S / 2``), returning as soon as the launcher's or a node's beat changes.
    ``launcher`` False: the launcher is known to be gone, only the nodes are watched. None when the
    run directory cannot be read from here."""
    t0 = clock()
    first = look(run_dir)
    if first is None:
        return None
    last_nodes = clock()
    while True:
        now = clock()
        if now - t0 >= seconds:
            break
        sleep(min(1.0, seconds - (now - t0)))
        read_nodes = clock() - last_nodes >= NODE_BEAT_S / 2 or clock() - t0 >= seconds
        seen = look(run_dir, nodes=read_nodes)
        if seen is None:
            return None
        if launcher and seen.launcher is not None and seen.launcher != first.launcher:
            return Observed(True, (), seen.orphaned, clock() - t0)
        if read_nodes:
            last_nodes = clock()
            moved = tuple(sorted(h for h, c in seen.nodes.items() if first.nodes.get(h) != c))
            if moved:
                return Observed(False, moved, seen.orphaned, clock() - t0)
    final = look(run_dir, nodes=False)
    return Observed(False, (), final.orphaned if final else first.orphaned, clock() - t0)


@dataclass(frozen=True)
class Orphan:
    """What a run directory tells of a job whose launcher died (``hfscale status``), by modification
    times on this host's clock (shown, never acted on): the launcher's last beat, the hosts whose beat
    is newer than ``3 * NODE_BEAT_S`` (the job still runs there), and those that stopped the job
    themselves, with the newest such stop."""

    launcher_last: float | None
    running: tuple[str, ...]
    stopped: tuple[str, ...]
    stopped_at: float | None


def _mtime(path: Path) -> float | None:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return None


def orphan(run_dir: str | Path, now: float) -> Orphan | None:
    """``run_dir``'s beats as an ``Orphan`` (None: no launcher beat there: a launch without keepers)."""
    root = Path(run_dir)
    last = _mtime(root / LAUNCHER_BEAT)
    if last is None or not real_dir(root):
        return None
    running = tuple(sorted(h for h in _names(root / BEATS_DIR)
                           if now - (_mtime(root / BEATS_DIR / h) or 0.0) < 3 * NODE_BEAT_S))
    stopped = tuple(sorted(_names(root / ORPHANED_DIR)))
    times = [t for h in stopped if (t := _mtime(root / ORPHANED_DIR / h)) is not None]
    return Orphan(last, running, stopped, max(times) if times else None)


def launcher_silent(o: Orphan, now: float) -> bool:
    """Whether the launcher's beat is older than the nodes wait before they stop the job."""
    return o.launcher_last is not None and now - o.launcher_last > LAUNCHER_LOST_S + LAUNCHER_BEAT_S
