"""Which process a pid read from a file is: a pid alone is not proof (the kernel reuses pids).

A process is identified by its host, the boot it runs in (``/proc/sys/kernel/random/boot_id``),
its pid and its start time (``/proc/<pid>/stat`` field 22, clock ticks after boot): no two
processes of one boot share a pid and a start time. hfscale records this identity when it
starts something it may later signal (the launcher in ``state.json``, the holder of an
output_dir lock) and signals a pid only through :func:`signal_recorded`, which checks the
identity on a pidfd: the check and the signal reach the same process even if it exits and its
pid is reused in between. Files only (``/proc``); Linux.
"""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from typing import Literal

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
# alive: provably the process recorded; gone: provably not running any more; elsewhere: on another
# host, or in another pid namespace (a container sharing the host's name): not checkable from here;
# unknown: a pid this process may not look at (hidepid, another user's): not checkable either
Liveness = Literal["alive", "gone", "elsewhere", "unknown"]


@dataclass(frozen=True)
class ProcessIdentity:
    """A process, provably: no two processes of one boot and pid namespace share a pid and a start time."""

    pid: int
    start: int  # /proc/<pid>/stat field 22
    boot_id: str | None
    host: str
    pid_ns: int | None = None  # the inode of /proc/<pid>/ns/pid: which pid namespace the pid counts in


def boot_id() -> str | None:
    try:
        with open(BOOT_ID_FILE, encoding="ascii") as f:
            return f.read(64).strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def pid_namespace() -> int | None:
    """The inode of this process's pid namespace (None: not on Linux, or not readable)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (None: no such process, one that has exited and is not yet
    reaped (a zombie), or not readable)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            data = f.read(4096)
        # the command name (field 2) is in parentheses and may hold spaces and ')': split after the last
        fields = data[data.rindex(b")") + 2:].split()
        if fields[0] in (b"Z", b"X"):  # field 3, the state: it has ended
            return None
        return int(fields[19])  # field 22
    except (OSError, ValueError, IndexError):
        return None


def this_process() -> ProcessIdentity:
    pid = os.getpid()
    return ProcessIdentity(pid, start_time(pid) or 0, boot_id(), socket.gethostname(), pid_namespace())


def _exists(pid: int) -> bool:
    """Whether some process has ``pid`` (one /proc does not show: EPERM)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def liveness(recorded: ProcessIdentity) -> Liveness:
    """Whether the process ``recorded`` still runs: alive only when this host, this boot, this pid
    namespace and the start time at that pid all match; gone only when that is provable."""
    if recorded.host != socket.gethostname():
        return "elsewhere"
    here = boot_id()
    if recorded.boot_id is None or here is None:
        return "unknown"  # a start time proves nothing across a reboot
    if recorded.boot_id != here:
        return "gone"  # the host rebooted since
    if recorded.pid_ns is not None and recorded.pid_ns != pid_namespace():
        return "elsewhere"
    if not recorded.start:
        return "unknown"
    start = start_time(recorded.pid)
    if start is not None:
        return "alive" if start == recorded.start else "gone"
    return "unknown" if _exists(recorded.pid) and not os.path.exists(f"/proc/{recorded.pid}") else "gone"


def job_processes(job_id: str) -> list[int]:
    """Processes on this host (as far as /proc shows) whose environment holds ``HFSCALE_JOB_ID=<job_id>``:
    what a launch started, which outlives a launcher killed -9 (hfscale.launch.node.stopping finds
    them the same way)."""
    want = f"HFSCALE_JOB_ID={job_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if want in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                continue
    return found


def signal_recorded(recorded: ProcessIdentity, sig: int = signal.SIGTERM) -> bool:
    """Send ``sig`` to the process ``recorded`` if it is still that process; False when it is not
    (gone, another process at its pid, another host), and nothing was sent."""
    if liveness(recorded) != "alive":
        return False
    try:
        fd = os.pidfd_open(recorded.pid)  # pins the process now at that pid
    except (OSError, AttributeError):
        return False
    try:
        # checked after the pidfd exists: if this is still the recorded process, the pidfd is it
        if liveness(recorded) != "alive":
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
