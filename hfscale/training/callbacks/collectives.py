"""What the callbacks share: rank and world, the nodes (which rank is on which host), where
collectives' tensors live, the exit hook, memory and parameter counts, JSON lines. Callbacks call
these through the module (``collectives.all_gather``), so a test can count the gathers."""

from __future__ import annotations

import atexit
import json
import logging
import os
import resource
import socket
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("hfscale.callbacks")  # the name users configure (the package moved to hfscale.training)

METRICS_FILE = "hfscale_metrics.jsonl"
LOG_PREFIX = "hfscale/"


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def host() -> str:
    """This node's name: the one hfscale's node line exported (HFSCALE_HOST), else the host name."""
    return os.environ.get("HFSCALE_HOST") or socket.gethostname()


@dataclass(frozen=True)
class Nodes:
    """The nodes in order (by their lowest rank): this rank's node, whether this rank is its node's
    first (the one that lists, sends and receives its node's part), each node's first rank, and the
    ranks on this rank's node (in order)."""

    node: int
    first: bool
    leaders: tuple[int, ...]
    members: tuple[int, ...] = (0,)


def nodes() -> Nodes:
    """One collective: every rank's host."""
    rank, _ = rank_world()
    me = host()
    hosts = gather_objects(me)
    order = list(dict.fromkeys(hosts))
    return Nodes(order.index(me), hosts.index(me) == rank, tuple(hosts.index(h) for h in order),
                 tuple(r for r, h in enumerate(hosts) if h == me))


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order. One collective (none alone)."""
    _, world = rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if rank_world()[1] > 1:
        dist.barrier()


def add_ahead_of_marker(trainer: Any, cb: Any) -> None:
    """Add ``cb`` to ``trainer`` ahead of any CheckpointCompleteCallback, so that a file ``cb`` writes into a
    checkpoint at ``on_save`` is there when the completeness marker lists the checkpoint's files."""
    callbacks = trainer.callback_handler.callbacks
    marker = next((i for i, c in enumerate(callbacks) if type(c).__name__ == "CheckpointCompleteCallback"), None)
    if marker is None:
        trainer.add_callback(cb)
    else:
        callbacks.insert(marker, cb)


def comm_device() -> torch.device:
    """Where a tensor for a collective must live: the current GPU with NCCL, else the CPU."""
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_exit_hook_registered = False


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave_process_group_at_exit() -> None:
    """Register (once per process) the atexit hook described in the module docstring."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_destroy_process_group)
        _exit_hook_registered = True


def all_gather(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (same length everywhere), in rank order. One collective."""
    _, world = rank_world()
    if world == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank: CUDA allocator peak on a GPU, else the process's peak RSS."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def append_jsonl(path: str, record: dict[str, Any]) -> None:
    """Append ``record`` as one line. A file whose last line was torn (a job killed mid-append) gets
    a newline first, so this record starts a line of its own instead of being glued to the torn
    one (readers skip and count the torn line: hfscale.core.untrusted.read_json_lines)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    line = json.dumps(record) + "\n"
    with open(path, "ab") as f:
        if f.tell() > 0:
            with open(path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                torn = r.read(1) != b"\n"
            if torn:
                line = "\n" + line
        f.write(line.encode("utf-8"))


def count_params(model: Any) -> int:
    # ZeRO-3 leaves empty placeholders in p.data; the real size is p.ds_numel.
    return sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in model.parameters())
