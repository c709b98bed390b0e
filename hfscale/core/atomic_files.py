"""Writing generated files: a set of files lands whole, or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_files(out_dir: Path, files: dict[Path | str, str], mode: int = 0o644) -> list[Path]:
    """Write ``files`` (paths relative to ``out_dir``) atomically; return the paths written.

    Every file is first written to a temporary name beside its destination, and only when all of
    them are written are they renamed into place: a failure (OSError, naming its path) leaves no
    new file behind."""
    staged: list[tuple[str, Path]] = []
    try:
        for rel, text in files.items():
            dest = out_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
            staged.append((tmp, dest))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, mode)
        for tmp, dest in staged:
            os.replace(tmp, dest)
    except BaseException:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    return [dest for _, dest in staged]
