"""The buddy copy of the local tier (hfscale.training.callbacks.local_tier), behind training: each
node's first rank sends its node's part to the next node's first rank and receives the previous
node's, point to point over a gloo group of the buddy copy's own (NCCL carries only GPU tensors),
in a thread, so that the training loop does not wait for it.

The stream: a node's files, sorted by path, read straight into a uint8 tensor of ``CHUNK`` bytes
(``readinto``: the file's bytes are copied once, with the GIL released) and written back from it
into the same files on the receiving node. Both sides know every file's size from the listings, so
a file that cannot be read is sent as zeros and a file that cannot be written is read to its end:
the stream always runs its full length and neither side waits for ever. Both sides take each
file's CRC-32 on the way. A sender compares it with the one taken after the save (hfscale.training.
callbacks.local_tier): an own file that no longer matches (rot since) is sent all the same, but
the sender says it did not read its part whole (its own step is then dropped). After the stream
each sender sends whether it read every byte as saved, and each file's CRC-32 as sent: a receiver
keeps its copy only when the sender read it all and every file it wrote matches.
"""

from __future__ import annotations

import shutil
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

CHUNK = 64 << 20  # bytes per message of the buddy copy


def chunks(folder: Path, files: dict[str, int], failed: list[str], who: str, sums: dict[str, str] | None = None,
           sent: dict[str, str] | None = None) -> Iterator[torch.Tensor]:
    """The bytes of ``files`` (sorted by path) in CHUNK-sized uint8 tensors (views of one buffer,
    refilled for the next chunk: the caller is done with a chunk before it asks for the next); a file
    that cannot be read is sent as zeros of its recorded size (the receiver expects that many bytes),
    and said in ``failed`` (prefixed with ``who``, this node's name), as is one whose bytes no
    longer match its CRC-32 in ``sums``. ``sent`` gets the CRC-32 of each file as sent."""
    size = CHUNK
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    filled = 0
    for rel in sorted(files):
        want, got, crc = files[rel], 0, 0
        try:
            with open(folder / rel, "rb") as f:
                while got < want:
                    n = f.readinto(view[filled:filled + min(size - filled, want - got)])
                    if not n:
                        break
                    crc = zlib.crc32(view[filled:filled + n], crc)
                    got, filled = got + n, filled + n
                    if filled == size:
                        yield buf
                        filled = 0
        except OSError as e:
            failed.append(f"{who}: {e}")
        if sent is not None:
            sent[rel] = f"{crc:08x}" if got == want else "unread"
        if got < want and not failed:
            failed.append(f"{who}: {folder / rel} shrank while it was copied")
        elif sums is not None and got == want and sums.get(rel) != f"{crc:08x}":
            failed.append(f"{who}: {folder / rel} does not match its checksum (crc32 {crc:08x}, saved "
                          f"{sums.get(rel, 'none')})")
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

    def __init__(self, folder: Path, files: dict[str, int], sums: dict[str, str] | None = None) -> None:
        self.folder, self.order = folder, sorted(files)
        self.sizes = files
        self.sums = sums  # the CRC-32 each file must have (None: checked later, with ``check``)
        self.crcs: dict[str, str] = {}  # the CRC-32 of each file as received
        self.total = sum(files.values())
        self.done = 0
        self.index, self.offset, self.crc = 0, 0, 0
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
            self.crc = zlib.crc32(data[:take], self.crc)
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
                self.crcs[rel] = f"{self.crc:08x}"
                self.handle, self.index, self.offset, self.crc = None, self.index + 1, 0, 0
        if self.sums is not None and self.index == len(self.order):
            self.check(self.sums)

    def check(self, sums: dict[str, str]) -> None:
        """Every file received matches its CRC-32 in ``sums`` (the sender's), else ``error`` says the first that does not."""
        for rel in self.order:
            if rel in self.crcs and sums.get(rel) != self.crcs[rel] and self.error is None:
                self.error = (f"{self.folder / rel} as received does not match its checksum (crc32 {self.crcs[rel]}, "
                              f"sent {sums.get(rel, 'none')})")


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
    out_sums: dict[str, str] | None = None  # the CRC-32 of each file sent, taken after the save (None: unchecked)


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
    in_sums: dict[str, str] | None = None  # the CRC-32 of each file received (matching the sender's), when received
    out_sums: dict[str, str] | None = None  # the CRC-32 of each file of this node's own part, taken after the save


def exchange(x: Exchange, group: Any, who: str) -> Copied:
    """Both directions at once (an ``isend`` of each chunk beside the ``recv`` of the incoming one):
    no collective, only this node's two neighbours."""
    t0 = time.perf_counter()
    failed: list[str] = []
    sent: dict[str, str] = {}
    outgoing = chunks(x.own, x.out_files, failed, who, x.out_sums, sent)
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
    # then whether every byte was read as saved, and each file's CRC-32 as sent (sorted by path; -1: not read)
    mine = torch.tensor([int(sent_whole)] + [int(sent[r], 16) if sent.get(r, "unread") != "unread" else -1
                                            for r in sorted(x.out_files)], dtype=torch.int64)
    theirs = torch.zeros(1 + len(x.in_files), dtype=torch.int64)
    req = dist.isend(mine, dst=x.send_to, group=group)
    dist.recv(theirs, src=x.recv_from, group=group)
    req.wait()
    their_sums = {r: f"{v:08x}" if v >= 0 else "unread" for r, v in zip(sorted(x.in_files), theirs[1:].tolist())}
    incoming.check(their_sums)
    errors = list(failed)
    if incoming.error:
        errors.append(f"{who}: {incoming.error}")
    if not theirs[0].item():
        errors.append(f"{who}: the previous node could not read all of its part as it saved it")
    received = incoming.error is None and bool(theirs[0].item())
    return Copied(sent_whole, received, tuple(errors), time.perf_counter() - t0,
                  in_sums=dict(incoming.crcs) if received else None)


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
