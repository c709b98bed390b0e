"""The commands the documentation shows: every ``hfscale ...`` line of a ```bash block in README.md
and docs/*.md, with the exit code the doc states (``# exit N`` in its comment; else 0).

tests/test_docs.py runs those that can run here; tests/test_examples.py runs the ones that need the
README's main job (its run, its checkpoints) after training it; NOT_HERE says why the rest cannot."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^\s*```(\S*)\s*$")
_EXIT = re.compile(r"#.*\bexit (\d+)\b")

MAIN_JOB = "hfscale launch examples/tiny_cpu/config.yaml"
MAIN_RUN = "tiny_cpu"  # the main job's run, by name
RUN_COMMANDS = {"runs", "status", "logs", "report", "export", "stop"}

# what cannot run on this machine, and why (the command as the doc writes it, without its comment)
NOT_HERE = {
    "hfscale stop runs/tiny_cpu-*": "needs the main job while it trains: test_runs.py::test_stop_ends_a_running_run_on_every_rank "
                             "stops a running run",
    "hfscale preflight examples/two_nodes/config.yaml": "needs the hosts node0 and node1 over ssh: test_preflight.py "
                                                        "and the namespace cluster tests run preflight",
    "hfscale launch examples/two_nodes/config.yaml": "needs two GPU nodes; test_launch_cluster.py launches on the "
                                                     "namespace cluster",
    "hfscale status /shared/work/runs/two-nodes-*": "needs the two-node run",
    "hfscale report /shared/work/runs/two-nodes-*": "needs the two-node run",
    "hfscale preflight examples/multinode_infiniband/config.yaml": "needs the 4 InfiniBand hosts over ssh",
    "hfscale preflight examples/multinode_infiniband/config.yaml --network --seconds 2":
        "needs the 4 hosts over ssh: test_network.py and the namespace cluster measure links",
    "hfscale launch examples/slurm/config.yaml": "needs sbatch and a Slurm cluster: test_slurm.py submits to one",
    "hfscale status /shared/llama/runs/llama-sft-slurm-*": "needs the submitted Slurm job",
    "hfscale stop /shared/llama/runs/llama-sft-slurm-*": "needs the submitted Slurm job",
    "hfscale launch examples/kubernetes/config.yaml": "needs kubectl and a cluster with the training operator: "
                                                      "test_kubernetes_launch.py applies to a stand-in kubectl",
    "hfscale stop runs/llama-k8s-*": "needs the applied Kubernetes job",
}


@dataclass(frozen=True)
class Command:
    page: str  # README.md, docs/launch.md
    line: int
    text: str  # the hfscale command as written, without its comment
    expect: int  # the exit code the doc states

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def after_main_job(self) -> bool:
        """Needs the README's main job to have trained here (its run, its checkpoints)."""
        w = self.words
        return w[1] in RUN_COMMANDS and (w[1:] == ["runs"] or any(MAIN_RUN in x for x in w[2:]))

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced block."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m and lang is None:
            lang, start, body = m.group(1), n + 1, []
        elif line.strip() == "```" and lang is not None:
            out.append((lang, start, body))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"a block opened at line {start - 1} is never closed"
    return out


def commands_of(path: Path) -> list[Command]:
    page = path.relative_to(ROOT).as_posix()
    found = []
    for lang, start, body in blocks(path.read_text(encoding="utf-8")):
        if lang not in SHELL_BLOCKS:
            continue
        for n, line in enumerate(body, start):
            m = _EXIT.search(line)
            code = line.split(" #", 1)[0] if " #" in line else line
            for part in code.split("&&"):
                part = part.strip().removeprefix("$ ")
                if part.startswith("hfscale "):
                    found.append(Command(page, n, " ".join(part.split()), int(m.group(1)) if m else 0))
    return found


def commands() -> list[Command]:
    return [c for p in pages() for c in commands_of(p)]


def run_as_written(c: Command, cwd: Path, tmp: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``c`` run by bash in ``cwd`` as a user types it (globs, redirections), with ``hfscale`` this
    checkout's command (a wrapper in ``tmp``/bin running this interpreter); ``env``: variables added."""
    bin_dir = tmp / "bin"
    if not (bin_dir / "hfscale").is_file():
        bin_dir.mkdir(parents=True, exist_ok=True)
        (bin_dir / "hfscale").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m hfscale "$@"\n')
        (bin_dir / "hfscale").chmod(0o755)
    env = {**os.environ, **(env or {}), "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", "-c", c.text], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
