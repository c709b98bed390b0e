"""The hang watchdog on real jobs: a rank stuck on purpose is found within the timeout plus 30 s,
named with its host, its stack in the report shows where it is, and the job is stopped (exit 4)
with no process left. Local torchrun with 2 ranks here; 2 network-namespace hosts in
test_launch_cluster.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, job_pids, same_ninja
from hfscale.launch.node.stopping import STOP_GRACE_S

PROBE = str(ROOT / "tests" / "scripts" / "dist_probe.py")
TIMEOUT = 5
pytestmark = pytest.mark.slow


def hang_config(tmp_path: Path, mode: str, rank: int, step: int, port: int, **runner) -> Path:
    cfg = {
        "name": "hang", "cluster": {"nproc_per_node": 2, "master_port": port},
        "runner": {"type": "local", "launcher": "torchrun", "run_dir": str(tmp_path / "runs"), **runner},
        "distributed": {"backend": "ddp"}, "precision": "no", "batch": {"micro_batch_size": 1},
        "env": {"vars": {"OMP_NUM_THREADS": "1"}}, "watchdog": {"timeout": TIMEOUT},
        "training": {"script": PROBE, "pass_args": "none",
                     "script_args": ["--mode", mode, "--rank", str(rank), "--step", str(step)]},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_hang(config: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float, Path]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=ROOT, capture_output=True,
                       text=True, timeout=180, env=env)
    took = time.monotonic() - t0
    (run_dir,) = (config.parent / "runs").iterdir()
    return r, took, run_dir


def last_step_age(report: str) -> float:
    """Seconds from the last step any rank reported to the verdict, from the report's table."""
    return min(float(m) for m in re.findall(r"^\d+\s+\S+\s+\d+\s+\d+\s+(\d+)s", report, re.M))


def assert_clean(run_dir: Path) -> None:
    job = run_dir.name.split("-", 1)[1]
    deadline = time.monotonic() + STOP_GRACE_S + 3
    while job_pids(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_pids(job) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_a_sleeping_rank_is_named_with_its_stack(tmp_path, rank):
    r, took, run_dir = run_hang(hang_config(tmp_path, "stall", rank, 3, 29681 + rank))
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("hfscale: hang: "))
    assert f"hang: rank {rank} on " in line and "stuck at step 2 in stuck_here (dist_probe.py:" in line
    assert "while the others wait in all_reduce" in line and "hang-report.txt" in line
    report = (run_dir / "hang-report.txt").read_text()
    stack = report.split(f"--- rank {rank}\n", 1)[1]
    assert "stuck_here" in stack.split("--- rank", 1)[0]  # py-spy's dump of that rank
    assert TIMEOUT <= last_step_age(report) <= TIMEOUT + 30
    print(f"detected and stopped in {took:.1f} s (timeout {TIMEOUT} s)")
    assert_clean(run_dir)


def test_a_rank_that_skips_a_collective_is_named(tmp_path):
    r, _, run_dir = run_hang(hang_config(tmp_path, "skip", 1, 4, 29683))
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("hfscale: hang: "))
    assert "hang: rank 1 on " in line and "at step 9 passed the all_reduce that rank 0 on" in line
    assert "a skipped collective" in line
    # the flight recorder (gloo's, TORCH_FR_BUFFER_SIZE): the same collective number is another collective
    report = (run_dir / "hang-report.txt").read_text()
    m = re.search(r"flight recorder, each rank's last collective: rank 0: #(\d+) gloo:all_reduce \(scheduled\), "
                  r"rank 1: #(\d+) gloo:barrier \(scheduled\)", report)
    assert m and m[1] == m[2], report[:2000]
    assert_clean(run_dir)


def test_without_py_spy_faulthandler_writes_the_stacks(tmp_path):
    """No py-spy beside the interpreter or on PATH: the ranks' faulthandler, signalled with SIGUSR2."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    same_ninja(bindir)
    env = {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin"}
    r, _, run_dir = run_hang(hang_config(tmp_path, "stall", 1, 3, 29684, python=str(bindir / "python")), env)
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-2000:]
    assert "hang: rank 1 on " in r.stdout and "stuck_here (dist_probe.py:" in r.stdout
    stacks = sorted(p.name for p in (run_dir / "stacks").iterdir() if not p.name.startswith("pid-"))
    assert stacks == ["rank-0.fh", "rank-0.fifo", "rank-1.fh", "rank-1.fifo"]  # no py-spy output
    # the ranks were forked by the warm launcher (runner.warm_start): each noted its rank under its pid
    assert sorted((run_dir / "stacks" / n).read_text().split()[0] for n in os.listdir(run_dir / "stacks")
                  if n.startswith("pid-")) == ["0", "1"]
    assert 'line' in (run_dir / "stacks" / "rank-1.fh").read_text()
    assert_clean(run_dir)
