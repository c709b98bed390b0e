"""One launch per ``training.output_dir``: ``<output_dir>/hfscale-lock.json`` names the launch that
trains into it, so a second launch of the same config cannot train from step 1 into the same
checkpoint folders.

The lock is a file, not ``flock`` (which NFS does not carry between hosts reliably): it is put in
place atomically (a hard link of a finished file, ``O_EXCL`` where links are not supported), holds
the holder's job id, host, pid and start time, and its launcher touches it every ``BEAT_S``
seconds while the job runs. A second launch finds it and asks whether its holder still runs:

- on the same host (and boot): the process recorded, by pid and start time (hfscale.pid_identity);
- on another host: the lock's modification time against the file system's own clock (the mtime
  of a file just written beside it), so hosts' clocks never enter: older than ``STALE_S``
  seconds is a launcher that died (killed -9, a lost login node).

A live holder refuses the launch (LockHeld, exit 2, naming its job, host and pid); a dead one's
lock is taken over, and the launch says so. Files only, no processes: hfscale.execute takes it,
touches it and releases it.
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

from .launch_plan import LOCK_FILE, LaunchPlan
from .pid_identity import ProcessIdentity, boot_id, liveness, this_process
from .untrusted import Unreadable, printable, read_bytes

if TYPE_CHECKING:
    from .records import OutputLock

BEAT_S = 10  # the holder touches the lock this often
STALE_S = 60  # a lock untouched this long (six beats) on another host: its launcher died
LOCK_CAP = 64 * 1024
ATTEMPTS = 5


class LockHeld(Exception):
    """The output_dir is in use by a running launch (or its lock cannot be judged); the message
    names it and what to do."""


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
                f"pid {h.pid}): {self.why}; if that job's nodes still run, stop them: hfscale stop "
                f"{printable(h.run_dir)}")


def _parse(raw: bytes, path: Path) -> "OutputLock":
    from .records import OutputLock
    from .untrusted import as_record, parse_json

    return as_record(parse_json(raw, path), OutputLock, path)


def _holder(rec: "OutputLock") -> ProcessIdentity:
    return ProcessIdentity(rec.pid, rec.proc_start, rec.boot_id, rec.host)


def judge(rec: "OutputLock | None", lock_mtime: float, fs_now: float, stale_s: float = STALE_S
          ) -> tuple[bool, str]:
    """(whether the holder still runs, how that was decided). ``rec`` None: a lock that cannot be
    read, judged by its age alone."""
    age = fs_now - lock_mtime
    if rec is not None and rec.host == socket.gethostname() and rec.boot_id in (None, boot_id()):
        alive = liveness(_holder(rec)) == "alive"
        return alive, ("its launcher runs" if alive else "its launcher is gone (no process with that pid and "
                       "start time)")
    if age > stale_s:
        return False, f"not touched for {age:.0f} s (a running launch touches it every {BEAT_S} s)"
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


def acquire(output_dir: str | os.PathLike[str], job_id: str, run_dir: str, stale_s: float = STALE_S) -> Taken:
    """Take the lock of ``output_dir`` (made if missing) for job ``job_id``. Raises LockHeld when a
    running launch holds it, OSError when the folder cannot be written."""
    from .records import OutputLock

    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_FILE
    me = this_process()
    rec = OutputLock(job_id=job_id, host=me.host, pid=me.pid, proc_start=me.start, boot_id=me.boot_id,
                     run_dir=run_dir, started=time.time())
    data = (json.dumps(rec.model_dump(), indent=1) + "\n").encode()
    tmp = folder / f".{LOCK_FILE}.{job_id}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    _write_new(tmp, data)
    took: OutputLock | None = None
    why = ""
    try:
        for _ in range(ATTEMPTS):
            if _install(tmp, lock, data):
                return Taken(str(lock), job_id, took, why)
            try:
                raw = read_bytes(lock, LOCK_CAP)
                held: OutputLock | None = _parse(raw, lock)
                reason = ""
            except Unreadable as e:
                raw, held, reason = None, None, e.reason
            try:
                mtime = os.lstat(lock).st_mtime
            except FileNotFoundError:
                continue  # released meanwhile
            os.utime(tmp)  # now, as the file system's clock tells it
            alive, how = judge(held, mtime, os.stat(tmp).st_mtime, stale_s)
            if alive:
                raise LockHeld(_held_message(lock, held, reason, how))
            aside = folder / f".{LOCK_FILE}.dead-{job_id}"
            try:
                os.rename(lock, aside)
            except FileNotFoundError:
                continue
            try:
                moved = read_bytes(aside, LOCK_CAP)
            except Unreadable:
                moved = None
            if raw is not None and moved != raw:  # another launch replaced it after we read it: put it back
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


def _held_message(lock: Path, held: "OutputLock | None", reason: str, how: str) -> str:
    where = printable(str(lock.parent))
    if held is None:
        return (f"training.output_dir {where} is locked by {printable(str(lock))}, which cannot be read ({reason}) "
                f"and was {how}; nothing was started. If no launch uses this output_dir, remove that file")
    return (f"training.output_dir {where} is in use by job {held.job_id} (host {held.host}, pid {held.pid}, "
            f"run directory {printable(held.run_dir)}; lock {how}); nothing was started. Stop it first "
            f"(hfscale stop {printable(held.run_dir)}), wait for it to end, or set another training.output_dir")


def _ours(path: Path, job_id: str) -> bool:
    try:
        return _parse(read_bytes(path, LOCK_CAP), path).job_id == job_id
    except Unreadable:
        return False


def touch(taken: Taken) -> bool:
    """The holder's heartbeat: touch the lock (its mtime, as the file system's clock tells it);
    False when it is no longer this job's (taken over: this launch was judged dead)."""
    path = Path(taken.path)
    if not _ours(path, taken.job_id):
        return False
    try:
        os.utime(path)
    except OSError:
        pass  # a full or read-only disk: the next beat tries again
    return True


def release(taken: Taken) -> None:
    """Remove the lock if it is still this job's."""
    path = Path(taken.path)
    if _ours(path, taken.job_id):
        with contextlib.suppress(OSError):
            path.unlink()


class Refused(Exception):
    """A launch that cannot start (its training.output_dir is in use); nothing was started."""


class Held:
    """The lock a running launch holds, with its heartbeat thread (touched every BEAT_S s)."""

    def __init__(self, taken: Taken, echo: Callable[[str], None]):
        self.taken, self._done = taken, threading.Event()
        threading.Thread(target=self._beat, args=(echo,), daemon=True, name="hfscale-lock").start()

    def _beat(self, echo: Callable[[str], None]) -> None:
        while not self._done.wait(BEAT_S):
            if not touch(self.taken):
                echo(f"hfscale: warning: the lock {self.taken.path} is no longer this job's: another launch judged "
                     "this one dead and took it; two jobs may now write the same checkpoints")
                return

    def release(self) -> None:
        self._done.set()
        release(self.taken)


def hold(plan: LaunchPlan, echo: Callable[[str], None]) -> Held | None:
    """Take ``plan``'s output_dir lock and keep it fresh until released (None: the plan takes none);
    says so when it took over a dead launch's lock. Raises Refused."""
    if plan.lock is None or plan.output_dir is None:
        return None
    try:
        taken = acquire(plan.output_dir, plan.job_id, plan.run_dir)
    except LockHeld as e:
        raise Refused(str(e)) from None
    except OSError as e:
        raise Refused(f"cannot take the lock {plan.lock}: {e.strerror or e}; nothing was started") from None
    said = taken.said()
    if said:
        echo(said)
    return Held(taken, echo)
