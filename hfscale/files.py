"""Writing generated files: each lands whole (temp file + rename) or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_files(out_dir: Path, files: dict[Path | str, str]) -> list[Path]:
    """Write ``files`` (paths relative to ``out_dir``) atomically; return the paths written."""
    written = []
    for rel, text in files.items():
        dest = out_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, dest)
        except BaseException:
            os.unlink(tmp)
            raise
        written.append(dest)
    return written
