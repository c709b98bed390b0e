"""Room on a node's own disk for the local tier (``training.local_checkpoints``): a full local disk is a
reason to skip local steps, said with the node and its folder, never to fail a rank, strike a node or keep
a host out. The ranks ask before each local step (:func:`short_of_room`, hfscale.training.callbacks.local_tier),
the host probe before a host is admitted (hfscale.launch.preflight.probes, with :func:`step_need`'s estimate).
No torch, no process group.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Short:
    """A node whose local folder has no room for a local step: a reason to skip local steps, never to
    fail or strike the node (the durable tier and the steps kept before carry the job meanwhile)."""

    host: str
    folder: str
    free: int | None  # bytes a write can still use there; None: nothing can be written there
    need: int  # bytes a local step takes on this node (its own part and its buddy copy), 0: not known yet
    why: str = ""  # what a write said, when one failed

    def line(self) -> str:
        """``node1's local folder /nvme/ckpt/node1 has 0.9 MiB free, a local step needs 6.2 MiB there``."""
        if self.free is None:
            return f"{self.host}'s local folder {self.folder} cannot be written ({self.why})"
        return (f"{self.host}'s local folder {self.folder} has {size_text(self.free)} free, a local step needs "
                f"{size_text(self.need)} there")


def size_text(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} bytes"


PROBE_FILE = ".hfscale-room"
STEP_NEED_FILES = 100_000  # a durable checkpoint's files looked at for the estimate, at most


def step_need(durable: Path | None, nodes: int, buddy: bool) -> int:
    """About the bytes a local step takes on one node, from the durable checkpoint ``durable``: its
    DeepSpeed folders (``global_step*``: what a local step keeps of it, the whole model file left
    out) over the nodes, twice with a buddy copy. 0 when there is none to go by."""
    if durable is None or nodes < 1:
        return 0
    total, seen = 0, 0
    try:
        tags = [d for d in os.scandir(durable) if d.name.startswith("global_step") and d.is_dir(follow_symlinks=False)]
    except OSError:
        return 0
    for tag in tags:
        for dirpath, dirs, names in os.walk(tag.path):
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(dirpath, d))]
            for name in names:
                seen += 1
                if seen > STEP_NEED_FILES:
                    break
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total // nodes * (2 if buddy and nodes > 1 else 1)


def short_of_room(folder: Path, need: int, host: str) -> Short | None:
    """Whether ``folder`` (a node's local folder) can take a local step of ``need`` bytes: a small file
    written and removed there (a full or read-only file system fails it, whatever statvfs says), then
    the bytes free against ``need``. None: there is room."""
    probe = folder / f"{PROBE_FILE}.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:  # a full file system refuses the write (no fsync: it is in every local step's pause)
            f.write(b"\0" * 4096)
            f.flush()
    except OSError as e:
        return Short(host, str(folder), None, need, e.strerror or str(e))
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    try:
        st = os.statvfs(folder)
    except OSError as e:
        return Short(host, str(folder), None, need, e.strerror or str(e))
    free = st.f_bavail * st.f_frsize
    return Short(host, str(folder), free, need) if free < need else None
