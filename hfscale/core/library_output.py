"""The libraries' own output kept off the terminal: what torch, DeepSpeed and transformers print or
log while a command works (progress bars, ``Detected checkpoint of type ...``) goes to a log file,
at the level of the process's file descriptors 1 and 2, so C++ output and logging handlers that
hold the original streams are caught too. The terminal shows hfscale's lines and errors.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def library_output_to(log: Path) -> Iterator[Path]:
    """Inside the block, everything written to this process's stdout and stderr goes to ``log``
    (appended, made private: 0600); both are put back after it, also when it raises. A ``log`` that
    cannot be opened leaves the output where it was."""
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield log
        return
    saved: list[int] = []
    try:
        for stream, target in ((sys.stdout, 1), (sys.stderr, 2)):
            with contextlib.suppress(Exception):
                stream.flush()
            saved.append(os.dup(target))
            os.dup2(fd, target)
        yield log
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for target, old in zip((1, 2), saved):
            os.dup2(old, target)
            os.close(old)
        os.close(fd)
