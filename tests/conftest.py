"""Shared test helpers: the repo root, the CLI as a real subprocess, CPU DeepSpeed settings."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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
