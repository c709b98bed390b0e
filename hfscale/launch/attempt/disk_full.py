"""A job that failed because the disk filled up, told plainly.

A rank that runs out of space while saving a checkpoint rarely says so: torch's serializer
reports ``RuntimeError: basic_ios::clear: iostream error`` or ``unexpected pos 4544 vs 4436``,
``PytorchStreamWriter failed writing file``; only Python's own writes say ``[Errno 28] No space
left on device``. hfscale.launch.attempt.execute feeds every output line to :class:`Signs`; when the job failed
and a sign was seen, :func:`told` gives the launch's last lines: what failed, the bytes free
where the checkpoints go, the newest complete checkpoint, and what a relaunch does. Files only
(statvfs and the checkpoint folders), no processes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from hfscale.checkpoints.local_room import size_text
from hfscale.core.untrusted import printable

# the operating system's word for it: a full disk or quota, whatever else the line says
_NO_SPACE = re.compile(r"No space left on device|\bENOSPC\b|\[Errno 28\]|Disk quota exceeded|\bEDQUOT\b|\[Errno 122\]")
# torch's serializer when a write fails (its C++ stream hides the reason)
_WRITE_FAILED = re.compile(r"basic_ios::clear|unexpected pos \d+ vs \d+|PytorchStreamWriter failed writing|"
                           r"file write failed|inline_container\.cc")
_QUOTA = re.compile(r"Disk quota exceeded|\bEDQUOT\b|\[Errno 122\]")
LOW = 1 << 30  # under this much free space a failed torch write counts as a full disk


@dataclass
class Signs:
    """The first line of the job's output that names a full disk (``no_space``) and the first of
    torch's failed writes (``write_failed``), with the host that printed it."""

    no_space: tuple[str, str] | None = None
    write_failed: tuple[str, str] | None = None

    def see(self, host: str, line: str) -> None:
        if self.no_space is None and _NO_SPACE.search(line):
            self.no_space = (host, line)
        elif self.write_failed is None and _WRITE_FAILED.search(line):
            self.write_failed = (host, line)


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged write can still use on the file system of ``path`` (or its nearest
    existing parent); None when it cannot be asked."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def told(signs: Signs, output_dir: str | None) -> list[str]:
    """The lines that say the job failed for lack of space (none when no sign says so). When the
    checkpoints' disk is the full one (its free space is low, or the line names it): the host and
    the line that showed it, the checkpoint being written, the bytes free in ``output_dir``, the
    newest complete checkpoint, and that a relaunch resumes there. When it is not (a full
    ``/dev/shm``, a cache or home directory), that the space ran out elsewhere."""
    free = free_bytes(output_dir) if output_dir else None
    low = free is not None and free < LOW
    seen = signs.no_space or (signs.write_failed if low else None)
    if seen is None:
        return []
    host, line = seen
    what = "the disk quota is exceeded" if _QUOTA.search(line) else "the disk is full"
    shown = f"{printable(host)} ({printable(line.strip(), 200)})"
    if not output_dir or not (low or output_dir in line):
        where = f"; {size_text(free)} free in {printable(output_dir)}: not there" if output_dir and free is not None else ""
        return [f"hfscale: a write failed for lack of space on {shown}{where} (a full /dev/shm, a cache or home "
                "directory?)"]
    from hfscale.checkpoints.resume import scan_output

    out = [f"hfscale: {what}: {printable(host)} failed writing in {printable(output_dir)} "
           f"({printable(line.strip(), 200)})"]
    scan = scan_output(output_dir, None)
    if scan.skipped and scan.resume is not None:  # newer than the newest complete one: the one being written
        name, why = scan.skipped[0]
        out.append(f"hfscale: {name} was being written and is incomplete ({why})")
    out.append(f"hfscale: {size_text(free) if free is not None else 'an unknown amount'} free in {printable(output_dir)}")
    if scan.resume is not None:
        out.append(f"hfscale: the newest complete checkpoint is {printable(scan.resume)}: a relaunch resumes there "
                   "once there is room (about one checkpoint's size more)")
    else:
        out.append("hfscale: no complete checkpoint: a relaunch starts from step 0 once there is room")
    return out
