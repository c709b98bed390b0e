"""The byte stream of the local tier's buddy copy (hfscale.training.callbacks.local_tier): a node's
files, sorted by path, cut into uint8 tensors of ``CHUNK`` bytes for gloo's point-to-point sends,
and written back into the same files on the receiving node. Both sides know every file's size from
the listings, so a file that cannot be read is sent as zeros and a file that cannot be written is
read to its end: the stream always runs its full length and neither side waits for ever."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CHUNK = 64 << 20  # bytes per message of the buddy copy


def chunks(folder: Path, files: dict[str, int], failed: list[str], who: str):
    """The bytes of ``files`` (sorted by path) in CHUNK-sized uint8 tensors; a file that cannot be
    read is sent as zeros of its recorded size (the receiver expects that many bytes), and said in
    ``failed`` (prefixed with ``who``, this node's name)."""
    pending = bytearray()

    def blocks(rel: str, size: int):
        sent = 0
        try:
            with open(folder / rel, "rb") as f:
                while sent < size and (block := f.read(min(CHUNK, size - sent))):
                    sent += len(block)
                    yield block
        except OSError as e:
            failed.append(f"{who}: {e}")
        if sent < size:
            if not failed:
                failed.append(f"{who}: {folder / rel} shrank while it was copied")
            while sent < size:
                n = min(CHUNK, size - sent)
                sent += n
                yield bytes(n)

    for rel in sorted(files):
        for block in blocks(rel, files[rel]):
            while block:
                take = CHUNK - len(pending)
                pending += block[:take]
                block = block[take:]
                if len(pending) == CHUNK:
                    yield torch.frombuffer(pending, dtype=torch.uint8).clone()
                    pending = bytearray()
    if pending:
        yield torch.frombuffer(pending, dtype=torch.uint8).clone()


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
        data = buf.numpy().tobytes()
        self.done += len(data)
        while data or (self.index < len(self.order) and self.sizes[self.order[self.index]] == 0):
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
