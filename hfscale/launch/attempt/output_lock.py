"""One launch per ``training.output_dir``: ``<output_dir>/_hfscale-lock.json`` names the launch that
trains into it, so a second launch of the same config cannot train from step 1 into the same
checkpoint folders. (Its name starts with ``_``: the Trainer's ``push_to_hub`` leaves such files out.)

The lock is a file, not ``flock`` (which NFS does not carry between hosts reliably): it is put in
place atomically (a hard link of a finished file, ``O_EXCL`` where links are not supported), holds
the holder's job id, host, pid, start time, pid namespace, run directory and runner, and its
launcher touches it every ``BEAT_S`` seconds while the job runs. The lock follows the job, not
only its launcher: a second launch asks whether anything of the holder's job still runs.

- Its launcher, on the same host, boot and pid namespace: the process recorded, by pid and start
  time (hfscale.core.pid_identity). Elsewhere (another login node, a container): whether its
  heartbeat in the run directory changes (hfscale.launch.attempt.beats), read on this host's clock.
- Its nodes: whether their heartbeats (``<run dir>/alive/<host>``, from each node's keeper) change,
  and the job's processes on this host. A job whose launcher is gone stops itself within the
  lock's ``stops_within_s`` (hfscale.launch.node.keeper): ``settle`` waits for that, saying so,
  before a launch plans its resume.
- When the run directory cannot be read from here (or the lock is an older hfscale's): the lock's
  modification time against the file system's own clock (the mtime of a file just written beside
  it), so hosts' clocks never enter: untouched for ``STALE_S`` seconds is a launch that died, and
  whose nodes have stopped themselves by then.

A live holder refuses the launch (LockHeld, exit 2, naming its job, host and pid, and the hosts
where its job still runs); a dead one's lock is taken over, one taker at a time
(``_hfscale-lock.json.take``, made with ``O_EXCL``), and the launch says so. Files only, no
processes: hfscale.launch.attempt.execute takes it, touches it, releases it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hfscale.core.pid_identity import ProcessIdentity, job_processes, liveness, this_process
from hfscale.core.untrusted import Unreadable, parse_record, printable, read_bytes
from hfscale.launch.attempt.beats import OBSERVE_S, observe
from hfscale.launch.spec import LOCK_FILE, LaunchPlan

if TYPE_CHECKING:
    from hfscale.core.records import OutputLock

BEAT_S = 10  # the holder touches the lock this often
STALE_S = 60  # a lock untouched this long (six beats), not checkable otherwise: its launcher died, its job stopped
PROVEN_S = 60.0  # a holder ``settle`` saw dead counts as dead for this long (no second look by acquire)
MAX_SHOWN = 8  # hosts named in a message; the rest are counted
TAKE_STALE_S = 30  # a take file this old was left by a taker that died
LOCK_CAP = 64 * 1024
ATTEMPTS = 5


class LockHeld(Exception):
    """The output_dir is in use by a running launch or its job (or its lock cannot be judged); the
    message names it, the hosts where its job still runs, and what to do."""


class Refused(Exception):
    """A launch that cannot start (its training.output_dir is in use); nothing was started."""


@dataclass(frozen=True)
class Taken:
    """A lock this launch holds; ``took_over``: the record of a dead launch whose lock it replaced
    (None: the output_dir was free), ``why`` how it was found dead."""

    path: str
    job_id: str
    took_over: "OutputLock | None" = None
    why: str = ""

    def said(self) -> str | None:
        """The line a launch prints when it took over a dead launch's lock."""
        if self.took_over is None:
            return None
        h = self.took_over
        return (f"hfscale: took over the lock of {self.path} from job {h.job_id} (launched on {h.host}, "
                f"pid {h.pid}): {self.why}")


def _parse(raw: bytes, path: Path) -> "OutputLock":
    from hfscale.core.records import OutputLock

    return parse_record(raw, OutputLock, path)


@dataclass(frozen=True)
class Verdict:
    """Whether a lock's holder still runs, how that was decided, and, for a job whose launcher is
    gone but whose nodes still run and stop themselves (``stops_within_s``), those hosts."""

    alive: bool
    how: str
    stopping: tuple[str, ...] = ()


def _hosts(hosts: tuple[str, ...] | list[str]) -> str:
    shown = ", ".join(printable(h, 255) for h in hosts[:MAX_SHOWN])
    return shown + (f" and {len(hosts) - MAX_SHOWN} more" if len(hosts) > MAX_SHOWN else "")


def judge(rec: "OutputLock | None", lock_mtime: float, fs_now: float, stale_s: float = STALE_S,
          watch_s: float = OBSERVE_S) -> Verdict:
    """Whether the holder ``rec`` (None: a lock that cannot be read, judged by its age alone) still
    runs: its launcher, or any node of its job (the module's docstring)."""
    if rec is None:
        return _by_age(None, lock_mtime, fs_now, stale_s)
    who = ProcessIdentity(rec.pid, rec.proc_start, rec.boot_id, rec.host, rec.pid_ns)
    state = liveness(who)
    if state == "alive":
        return Verdict(True, "its launcher runs")
    here = job_processes(rec.job_id) if state == "gone" else []
    stop = f"hfscale stop {printable(rec.run_dir)}"
    dead_here = "its launcher is gone (no process with that pid and start time) and nothing of its job runs here"
    if state == "gone" and not here and rec.runner in ("local", None):
        return Verdict(False, dead_here)
    seen = observe(rec.run_dir, watch_s, launcher=state != "gone") if rec.stops_within_s is not None else None
    if seen is None:  # the run directory is not visible here, or an older launch's (its nodes never stop themselves)
        if here:
            return Verdict(True, f"its launcher is gone, but its job's processes still run here (pids "
                                 f"{', '.join(map(str, here[:MAX_SHOWN]))}): stop them first, {stop}")
        return Verdict(False, dead_here) if state == "gone" else _by_age(rec, lock_mtime, fs_now, stale_s)
    if seen.launcher_beats:
        return Verdict(True, f"its launcher's heartbeat in {printable(rec.run_dir)} changed {seen.seconds:.0f} s ago")
    running = seen.running or ((socket.gethostname(),) if here else ())  # a local job's beat says "local"
    gone = "is gone" if state == "gone" else f"on {rec.host} does not beat ({seen.seconds:.0f} s)"
    if running:
        return Verdict(True, f"its launcher {gone}, but its job still runs on {_hosts(running)} (their heartbeats): it "
                             f"stops itself within {rec.stops_within_s} s of losing its launcher; launch again then, or "
                             f"stop it now: {stop}", stopping=running)
    themselves = (f"; {_hosts(seen.stopped_themselves)} stopped the job themselves" if seen.stopped_themselves
                  else "")
    return Verdict(False, f"its launcher {gone} and none of its nodes' heartbeats changed for {seen.seconds:.0f} s"
                          f"{themselves}")


def _by_age(rec: "OutputLock | None", lock_mtime: float, fs_now: float, stale_s: float) -> Verdict:
    age = fs_now - lock_mtime
    if age > stale_s:
        return Verdict(False, f"not touched for {age:.0f} s (a running launch touches it every {BEAT_S} s); if that "
                              f"job's nodes still run, stop them: hfscale stop {printable(rec.run_dir) if rec else 'RUN'}")
    return Verdict(True, f"touched {max(0.0, age):.0f} s ago")


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(tmp: Path, lock: Path, data: bytes) -> bool:
    """Put ``tmp`` in place as ``lock`` unless a lock exists; False when one does."""
    try:
        os.link(tmp, lock)  # atomic, also on NFS: the lock is never seen half written
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links
        try:
            _write_new(lock, data)
            return True
        except FileExistsError:
            return False


@contextlib.contextmanager
def _one_taker(folder: Path, probe: Path):
    """Held while a launch replaces a dead holder's lock: one taker at a time. Yields False when
    another launch is taking it right now (the caller looks again)."""
    take = folder / f"{LOCK_FILE}.take"
    try:
        _write_new(take, b"")
    except FileExistsError:
        with contextlib.suppress(OSError):  # left by a taker that died: removed once it is old
            if os.stat(probe).st_mtime - os.lstat(take).st_mtime > TAKE_STALE_S:
                take.unlink()
        yield False
        return
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            take.unlink()


def acquire(output_dir: str | os.PathLike[str], job_id: str, run_dir: str, stale_s: float = STALE_S,
            make_parents: bool = True, runner: str | None = None, stops_within_s: int | None = None) -> Taken:
    """Take the lock of ``output_dir`` for job ``job_id`` (the folder is made, with its parents when
    ``make_parents``); ``stops_within_s``: this job's nodes stop themselves within that many seconds
    of its launcher's last heartbeat. Raises LockHeld when a running launch (or its job) holds it,
    OSError when the folder cannot be made or written."""
    from hfscale.core.records import OutputLock

    folder = Path(output_dir)
    folder.mkdir(parents=make_parents, exist_ok=True)
    lock = folder / LOCK_FILE
    me = this_process()
    rec = OutputLock(job_id=job_id, host=me.host, pid=me.pid, proc_start=me.start, boot_id=me.boot_id,
                     pid_ns=me.pid_ns, run_dir=run_dir, started=time.time(), runner=runner,  # type: ignore[arg-type]
                     stops_within_s=stops_within_s)
    data = (json.dumps(rec.model_dump(), indent=1) + "\n").encode()
    tmp = folder / f"{LOCK_FILE}.{job_id}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    _write_new(tmp, data)
    took: OutputLock | None = None
    why = ""
    try:
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(0.2 * attempt)
            if _install(tmp, lock, data):
                return Taken(str(lock), job_id, took, why)
            with _one_taker(folder, tmp) as mine:
                if not mine:
                    continue
                found = _judged(lock, tmp, stale_s)
                if found is None:
                    continue  # released meanwhile
                held, ino, how = found
                aside = folder / f"{LOCK_FILE}.dead-{job_id}"
                try:
                    os.rename(lock, aside)
                except FileNotFoundError:
                    continue
                moved = os.lstat(aside)
                if (moved.st_dev, moved.st_ino) != ino:
                    # another lock than the one judged (its holder released it, a new launch linked one):
                    # put it back; a link never replaces a lock that appeared meanwhile
                    with contextlib.suppress(OSError):
                        os.link(aside, lock)
                else:
                    took, why = held, how
                with contextlib.suppress(OSError):
                    os.unlink(aside)
        raise LockHeld(f"{printable(str(lock))}: other launches keep taking it; nothing was started")
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _judged(lock: Path, probe: Path, stale_s: float) -> "tuple[OutputLock | None, tuple[int, int], str] | None":
    """(the holder's record, the lock file's (device, inode), how it was judged dead) of a lock whose
    holder no longer runs; None when the lock went away. Raises LockHeld when the holder runs."""
    try:
        st = os.lstat(lock)
    except FileNotFoundError:
        return None
    try:
        held: OutputLock | None = _parse(read_bytes(lock, LOCK_CAP), lock)
        reason = ""
    except Unreadable as e:
        held, reason = None, e.reason
    proven = _proven_dead.get((str(lock), held.job_id)) if held is not None else None
    if proven is not None and time.monotonic() - proven[0] < PROVEN_S:
        return held, (st.st_dev, st.st_ino), proven[1]
    os.utime(probe)  # now, as the file system's clock tells it
    v = judge(held, st.st_mtime, os.stat(probe).st_mtime, stale_s)
    if v.alive:
        raise LockHeld(_held_message(lock, held, reason, v.how))
    return held, (st.st_dev, st.st_ino), v.how


# (lock path, job id) -> (when, how): holders settle() saw dead in this process, so that the acquire
# right after it does not watch their heartbeats a second time
_proven_dead: dict[tuple[str, str], tuple[float, str]] = {}


def settle(output_dir: str | os.PathLike[str], echo: Callable[[str], None], sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.monotonic, watch_s: float = OBSERVE_S) -> None:
    """Before a launch plans its resume: when ``output_dir``'s lock is held by a job whose launcher
    is gone and whose nodes still run and stop themselves (hfscale.launch.node.keeper), wait for
    them to stop (at most their ``stops_within_s`` and one look), saying so; the checkpoint they save
    on the way is then the one this launch resumes from. Returns at once otherwise: ``acquire``
    refuses a live holder and takes a dead one's lock. Takes nothing, writes nothing."""
    lock = Path(output_dir) / LOCK_FILE
    since = deadline = None
    while True:
        try:
            st = os.lstat(lock)
            held = _parse(read_bytes(lock, LOCK_CAP), lock)
        except (OSError, Unreadable):
            return
        if held.stops_within_s is None:
            return
        v = judge(held, st.st_mtime, time.time(), watch_s=watch_s)
        if not v.stopping:
            if not v.alive:
                _proven_dead[(str(lock), held.job_id)] = (clock(), v.how)
                if since is not None:
                    echo(f"hfscale: job {held.job_id} stopped itself ({clock() - since:.0f} s); its output_dir is free")
            return
        if deadline is None:
            since, deadline = clock(), clock() + held.stops_within_s + watch_s
            echo(f"hfscale: training.output_dir {printable(str(lock.parent))} is in use by job {held.job_id}, whose "
                 f"launcher (host {held.host}, pid {held.pid}) is gone; its job still runs on {_hosts(v.stopping)} and "
                 f"stops itself within {held.stops_within_s} s of losing its launcher (the ranks save a checkpoint "
                 "first): waiting for it, Ctrl-C to give up")
        if clock() > deadline:
            return  # acquire refuses, naming the hosts
        sleep(1.0)


def _held_message(lock: Path, held: "OutputLock | None", reason: str, how: str) -> str:
    where = printable(str(lock.parent))
    if held is None:
        return (f"training.output_dir {where} is locked by {printable(str(lock))}, which cannot be read ({reason}) "
                f"and was {how}; nothing was started. If no launch uses this output_dir, remove that file")
    return (f"training.output_dir {where} is in use by job {held.job_id} (host {held.host}, pid {held.pid}, "
            f"run directory {printable(held.run_dir)}; {how}); nothing was started. Stop it first "
            f"(hfscale stop {printable(held.run_dir)}), wait for it to end, or set another training.output_dir")


def _owner(path: Path) -> str | None:
    """The job id the lock names; None when there is no lock or it names no job; raises
    Unreadable when it cannot be read now (an NFS hiccup: not proof that it changed hands)."""
    try:
        return _parse(read_bytes(path, LOCK_CAP), path).job_id
    except Unreadable as e:
        if e.reason == "is missing":
            return None
        raise


def touch(taken: Taken) -> bool:
    """The holder's heartbeat: touch the lock (its mtime, as the file system's clock tells it);
    False only when the lock provably is no longer this job's (taken over: this launch was
    judged dead). A read that fails is retried at the next beat."""
    path = Path(taken.path)
    try:
        if _owner(path) != taken.job_id:
            return False
    except Unreadable:
        pass
    with contextlib.suppress(OSError):  # a full or read-only disk: the next beat tries again
        os.utime(path)
    return True


def release(taken: Taken) -> None:
    """Remove the lock if it is still this job's."""
    path = Path(taken.path)
    with contextlib.suppress(Unreadable):
        if _owner(path) == taken.job_id:
            with contextlib.suppress(OSError):
                path.unlink()


class Held:
    """The lock a running launch holds, with its heartbeat thread (touched every BEAT_S s)."""

    def __init__(self, taken: Taken, echo: Callable[[str], None]):
        self.taken, self._done = taken, threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(echo,), daemon=True, name="hfscale-lock")
        self._thread.start()

    def _beat(self, echo: Callable[[str], None]) -> None:
        while not self._done.wait(BEAT_S):
            if not touch(self.taken) and not self._done.is_set():
                echo(f"hfscale: warning: the lock {self.taken.path} is no longer this job's: another launch judged "
                     "this one dead and took it; two jobs may now write the same checkpoints")
                return

    def release(self) -> None:
        self._done.set()
        self._thread.join(5)
        release(self.taken)


def hold(plan: LaunchPlan, echo: Callable[[str], None]) -> Held | None:
    """Take ``plan``'s output_dir lock and keep it fresh until released (None: the plan takes none,
    or the folder cannot be made here: said, the launch goes on); says so when it took over a dead
    launch's lock. Raises Refused when a running launch holds it."""
    if plan.lock is None or plan.output_dir is None:
        return None
    local = plan.runner == "local"  # a remote runner's output_dir may be the nodes' own: no folders made for it
    try:
        taken = acquire(plan.output_dir, plan.job_id, plan.run_dir, make_parents=local, runner=plan.runner,
                        stops_within_s=plan.keeper.stops_within_s if plan.keeper is not None else None)
    except LockHeld as e:
        raise Refused(str(e)) from None
    except OSError as e:
        echo(f"hfscale: warning: no lock taken in {plan.output_dir} ({e.strerror or e}): a second launch into this "
             "output_dir would not be refused")
        return None
    said = taken.said()
    if said:
        echo(said)
    return Held(taken, echo)
