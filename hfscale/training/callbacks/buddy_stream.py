"""The buddy copy of the local tier (hfscale.training.callbacks.local_tier), behind training: each
node's first rank sends its node's part to the next node's first rank and receives the previous
node's, point to point over a gloo group of the buddy copy's own (NCCL carries only GPU tensors),
in a thread, so that the training loop does not wait for it.

The stream: a node's files, sorted by path, read straight into a uint8 tensor of ``CHUNK`` bytes
(``readinto``: the file's bytes are copied once, with the GIL released) and written back from it
into the same files on the receiving node. Both sides know every file's size from the listings, so
a file that cannot be read is sent as zeros and a file that cannot be written is read to its end:
the stream always runs its full length and neither side waits for ever. After the stream each
sender sends one more number, whether it read every byte: a receiver keeps its copy only then.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

CHUNK = 64 << 20  # bytes per message of the buddy copy


def chunks(folder: Path, files: dict[str, int], failed: list[str], who: str) -> Iterator[torch.Tensor]:
    """The bytes of ``files`` (sorted by path) in CHUNK-sized uint8 tensors (views of one buffer,
    refilled for the next chunk: the caller is done with a chunk before it asks for the next); a file
    that cannot be read is sent as zeros of its recorded size (the receiver expects that many bytes),
    and said in ``failed`` (prefixed with ``who``, this node's name)."""
    size = CHUNK
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    filled = 0
    for rel in sorted(files):
        want, got = files[rel], 0
        try:
            with open(folder / rel, "rb") as f:
                while got < want:
                    n = f.readinto(view[filled:filled + min(size - filled, want - got)])
                    if not n:
                        break
                    got, filled = got + n, filled + n
                    if filled == size:
                        yield buf
                        filled = 0
        except OSError as e:
            failed.append(f"{who}: {e}")
        if got < want and not failed:
            failed.append(f"{who}: {folder / rel} shrank while it was copied")
        while got < want:  # zeros for what could not be read
            n = min(size - filled, want - got)
            view[filled:filled + n] = bytes(n)
            got, filled = got + n, filled + n
            if filled == size:
                yield buf
                filled = 0
    if filled:
        yield buf[:filled]


class Writer:
    """Writes the received stream into the files it is made of (sizes known from the listings); a
    write that fails (a full disk) is kept in ``error`` and the rest of the stream is read all the same."""

    def __init__(self, folder: Path, files: dict[str, int]) -> None:
        self.folder, self.order = folder, sorted(files)
        self.sizes = files
        self.total = sum(files.values())
        self.done = 0
        self.index, self.offset = 0, 0
        self.handle: Any = None
        self.error: str | None = None

    def next_size(self) -> int:
        return min(CHUNK, self.total - self.done)

    def finish(self) -> None:
        """The empty files after the last byte."""
        self.write(torch.empty(0, dtype=torch.uint8))
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def write(self, buf: torch.Tensor) -> None:
        data = memoryview(buf.numpy())  # written from the tensor itself, no copy
        self.done += len(data)
        while len(data) or (self.index < len(self.order) and self.sizes[self.order[self.index]] == 0):
            rel = self.order[self.index]
            take = min(len(data), self.sizes[rel] - self.offset)
            if self.error is None:
                try:
                    if self.handle is None:
                        target = self.folder / rel
                        target.parent.mkdir(parents=True, exist_ok=True)
                        self.handle = open(target, "wb")
                    self.handle.write(data[:take])
                except OSError as e:
                    self.error = str(e)
            data, self.offset = data[take:], self.offset + take
            if self.offset == self.sizes[rel]:
                if self.handle is not None:
                    try:
                        self.handle.close()
                    except OSError as e:
                        self.error = self.error or str(e)
                self.handle, self.index, self.offset = None, self.index + 1, 0


@dataclass(frozen=True)
class Exchange:
    """One node's side of one step's buddy copy: send ``out_files`` from ``own`` to rank ``send_to``,
    receive ``in_files`` from rank ``recv_from`` into ``into``."""

    step: int
    send_to: int
    recv_from: int
    own: Path
    out_files: dict[str, int]
    into: Path
    in_files: dict[str, int]


@dataclass(frozen=True)
class Copied:
    """How the exchange went: whether every byte of this node's own part could be read (if not, the
    own part on this node's disk is not whole either), whether the previous node's part was received
    whole (its sender read every byte, every byte written), what failed on either side, and the
    seconds it took."""

    read: bool
    received: bool
    errors: tuple[str, ...]
    seconds: float
    cut: bool = False  # the transfer itself failed: a peer that died (its job is being stopped), gloo's error


def exchange(x: Exchange, group: Any, who: str) -> Copied:
    """Both directions at once (an ``isend`` of each chunk beside the ``recv`` of the incoming one):
    no collective, only this node's two neighbours."""
    t0 = time.perf_counter()
    failed: list[str] = []
    outgoing = chunks(x.own, x.out_files, failed, who)
    incoming = Writer(x.into, x.in_files)
    shutil.rmtree(x.into, ignore_errors=True)  # what a save cut short left there
    try:
        x.into.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        incoming.error = str(e)
    buf = torch.empty(min(CHUNK, incoming.total), dtype=torch.uint8)
    while True:
        chunk = next(outgoing, None)
        req = dist.isend(chunk, dst=x.send_to, group=group) if chunk is not None else None
        size = incoming.next_size()
        if size:
            dist.recv(buf[:size], src=x.recv_from, group=group)
            incoming.write(buf[:size])
        if req is not None:
            req.wait()
        if chunk is None and not size:
            break
    incoming.finish()
    sent_whole = not failed
    mine, theirs = torch.tensor([int(sent_whole)]), torch.zeros(1, dtype=torch.int64)
    req = dist.isend(mine, dst=x.send_to, group=group)
    dist.recv(theirs, src=x.recv_from, group=group)
    req.wait()
    errors = list(failed)
    if incoming.error:
        errors.append(f"{who}: {incoming.error}")
    if not theirs.item():
        errors.append(f"{who}: the previous node could not read all of its part")
    return Copied(sent_whole, incoming.error is None and bool(theirs.item()), tuple(errors),
                  time.perf_counter() - t0)


class Behind:
    """One buddy copy at a time, in a thread (daemon: a job that fails does not wait for it);
    ``then`` runs in the thread with the result (the holding, the rotation, the record)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def start(self, work: Callable[[], Copied], then: Callable[[Copied], None]) -> None:
        self.join()

        def run() -> None:
            try:
                result = work()
            except Exception as e:  # said, never lost in the thread: a peer that died mid-copy (the job is
                # stopping), the transport's error. This node's own part was listed whole: it stays
                result = Copied(True, False, (f"{type(e).__name__}: {e}",), 0.0, cut=True)
            then(result)

        self.thread = threading.Thread(target=run, name="hfscale-buddy-copy", daemon=True)
        self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()
