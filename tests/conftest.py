"""Shared test helpers: the repo root, the CLI as a real subprocess, CPU DeepSpeed settings."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/cluster/ is importable as "cluster"
pytest_plugins = ["cluster.fixtures"]  # fixtures: cluster2 (session, 2 nodes), make_cluster(n)

ROOT = Path(__file__).resolve().parents[1]

# DeepSpeed on this CPU-only machine: CPU accelerator, and one build of its C++ op per checkout.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def job_of(text: str, name: str = "job.yaml"):
    """The validated Job of an (indented) YAML text, as ``hfscale`` loads a file called ``name``."""
    from hfscale.load import load_text

    return load_text(textwrap.dedent(text), name, Path("."))


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def job_pids(job: str) -> list[int]:
    """Processes on this machine whose environment holds ``HFSCALE_JOB_ID=<job>`` (read from /proc
    here, independently of the stop script's own search)."""
    want = f"HFSCALE_JOB_ID={job}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if want in environ.split(b"\0"):
                found.append(int(entry.name))
    return found


def read_until(proc: subprocess.Popen, marker: str, count: int, timeout: float = 120) -> list[str]:
    """Read ``proc``'s output until ``count`` lines containing ``marker`` were seen; the lines read."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while sum(marker in line for line in seen) < count:
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, "".join(seen)[-3000:]
        seen.append(line)
    return seen


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m hfscale ARGS`` as users do; capture text output."""
    return subprocess.run(
        [sys.executable, "-m", "hfscale", *args],
        cwd=cwd or ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
