"""One launch per ``training.output_dir``: ``<output_dir>/_hfscale-lock.json`` names the launch that
trains into it, so a second launch of the same config cannot train from step 1 into the same
checkpoint folders. (Its name starts with ``_``: the Trainer's ``push_to_hub`` leaves such files out.)

The lock is a file, not ``flock`` (which NFS does not carry between hosts reliably): it is put in
place atomically (a hard link of a finished file, ``O_EXCL`` where links are not supported), holds
the holder's job id, host, pid, start time and pid namespace, and its launcher touches it every
``BEAT_S`` seconds while the job runs. A second launch finds it and asks whether its holder
still runs:

- on the same host, boot and pid namespace: the process recorded, by pid and start time
  (hfscale.core.pid_identity); a holder whose launcher is gone but whose job's processes still run
  here (a launcher killed -9 leaves them) still holds it;
- elsewhere (another host, a container), or when that cannot be checked: the lock's modification
  time against the file system's own clock (the mtime of a file just written beside it), so
  hosts' clocks never enter: untouched for ``STALE_S`` seconds is a launcher that died.

A live holder refuses the launch (LockHeld, exit 2, naming its job, host and pid); a dead one's
lock is taken over, one taker at a time (``_hfscale-lock.json.take``, made with ``O_EXCL``), and
the launch says so. Files only, no processes: hfscale.launch.execute takes it, touches it, releases it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hfscale.core.pid_identity import ProcessIdentity, job_processes, liveness, this_process
from hfscale.core.untrusted import Unreadable, parse_record, printable, read_bytes
from hfscale.launch.spec import LOCK_FILE, LaunchPlan

if TYPE_CHECKING:
    from hfscale.core.records import OutputLock

BEAT_S = 10  # the holder touches the lock this often
STALE_S = 60  # a lock untouched this long (six beats), not checkable by pid: its launcher died
TAKE_STALE_S = 30  # a take file this old was left by a taker that died
LOCK_CAP = 64 * 1024
ATTEMPTS = 5


class LockHeld(Exception):
    """The output_dir is in use by a running launch (or its lock cannot be judged); the message
    names it and what to do."""


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


def judge(rec: "OutputLock | None", lock_mtime: float, fs_now: float, stale_s: float = STALE_S
          ) -> tuple[bool, str]:
    """(whether the holder still runs, how that was decided). ``rec`` None: a lock that cannot be
    read, judged by its age alone."""
    if rec is not None:
        who = ProcessIdentity(rec.pid, rec.proc_start, rec.boot_id, rec.host, rec.pid_ns)
        state = liveness(who)
        if state == "alive":
            return True, "its launcher runs"
        if state == "gone":
            left = job_processes(rec.job_id)
            if left:
                shown = ", ".join(map(str, left[:8]))
                return True, (f"its launcher is gone, but its job's processes still run here (pids {shown}): stop "
                              f"them first, hfscale stop {printable(rec.run_dir)}")
            return False, ("its launcher is gone (no process with that pid and start time) and nothing of its job "
                           "runs here")
    age = fs_now - lock_mtime
    if age > stale_s:
        return False, (f"not touched for {age:.0f} s (a running launch touches it every {BEAT_S} s); if that job's "
                       f"nodes still run, stop them: hfscale stop {printable(rec.run_dir) if rec else 'RUN'}")
    return True, f"touched {max(0.0, age):.0f} s ago"


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
            make_parents: bool = True) -> Taken:
    """Take the lock of ``output_dir`` for job ``job_id`` (the folder is made, with its parents when
    ``make_parents``). Raises LockHeld when a running launch holds it, OSError when the folder
    cannot be made or written."""
    from hfscale.core.records import OutputLock

    folder = Path(output_dir)
    folder.mkdir(parents=make_parents, exist_ok=True)
    lock = folder / LOCK_FILE
    me = this_process()
    rec = OutputLock(job_id=job_id, host=me.host, pid=me.pid, proc_start=me.start, boot_id=me.boot_id,
                     pid_ns=me.pid_ns, run_dir=run_dir, started=time.time())
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
    os.utime(probe)  # now, as the file system's clock tells it
    alive, how = judge(held, st.st_mtime, os.stat(probe).st_mtime, stale_s)
    if alive:
        raise LockHeld(_held_message(lock, held, reason, how))
    return held, (st.st_dev, st.st_ino), how


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
        taken = acquire(plan.output_dir, plan.job_id, plan.run_dir, make_parents=local)
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
