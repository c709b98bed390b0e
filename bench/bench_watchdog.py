#!/usr/bin/env python
"""Benchmark: the hang watchdog on injected hangs, and its cost per poll at scale.

1. N hangs (default 20) injected into local 2-rank torchrun jobs (tests/scripts/dist_probe.py):
   a rank that sleeps outside any collective at step k ("stall") or skips one all_reduce and ends
   in a barrier ("skip"), rank 0 or 1, k from 2 to 6, watchdog.timeout 5 s. For each: whether the
   named rank is the one injected and its stack shows the sleeping function, how long after the
   last step the verdict came (the report's table), the whole launch's time, and whether any of
   the job's processes were left.
2. One poll over 1,000 and 10,000 ranks' progress files (what hfscale reads every 5 s).

    python bench/bench_watchdog.py            # 20 hangs
    python bench/bench_watchdog.py --hangs 4
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROBE = str(ROOT / "tests" / "scripts" / "dist_probe.py")


def _job_pids(job: str) -> list[int]:
    want = f"HFSCALE_JOB_ID={job}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if want in (entry / "environ").read_bytes().split(b"\0"):
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def one(tmp: Path, mode: str, rank: int, step: int, port: int) -> dict:
    cfg = {"name": "wd", "cluster": {"nproc_per_node": 2, "master_port": port},
           "runner": {"type": "local", "launcher": "torchrun", "run_dir": str(tmp / "runs")},
           "distributed": {"backend": "ddp"}, "precision": "no", "batch": {"micro_batch_size": 1},
           "env": {"vars": {"OMP_NUM_THREADS": "1"}}, "watchdog": {"timeout": 5},
           "training": {"script": PROBE, "pass_args": "none",
                        "script_args": ["--mode", mode, "--rank", str(rank), "--step", str(step)]}}
    config = tmp / "job.yaml"
    config.write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    took = time.monotonic() - t0
    (run_dir,) = (tmp / "runs").iterdir()
    line = next((x for x in r.stdout.splitlines() if x.startswith("hfscale: hang: ")), "")
    named = re.findall(r"rank (\d+) on \S+ (?:stuck|at step)", line)
    report = (run_dir / "hang-report.txt").read_text() if (run_dir / "hang-report.txt").exists() else ""
    age = min((float(a) for a in re.findall(r"^\d+\s+\S+\s+\d+\s+\d+\s+(\d+)s", report, re.M)), default=-1)
    stack = report.split(f"--- rank {rank}\n", 1)[-1].split("--- rank", 1)[0]
    shows = "stuck_here" in stack if mode == "stall" else "barrier" in stack
    time.sleep(12)  # the stop's KILL pass runs 10 s after the TERM
    return {"mode": mode, "rank": rank, "step": step, "rc": r.returncode, "named": named, "age": age, "took": took,
            "right": r.returncode == 4 and named == [str(rank)] and shows,
            "left": len(_job_pids(run_dir.name.split("-", 1)[1]))}


def poll_cost(ranks: int) -> float:
    from hfscale.launch.spec import HangWatch
    from hfscale.launch.attempt.watchdog import Watchdog

    with tempfile.TemporaryDirectory() as d:
        folder = Path(d) / "progress"
        folder.mkdir()
        for r in range(ranks):
            (folder / f"rank-{r}").write_text(f"100 {1000 + r} node{r // 8}\n")
        dog = Watchdog(HangWatch(str(folder), "", "", 600, None, ranks), now=0)
        t0 = time.perf_counter()
        dog.poll(1)
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hangs", type=int, default=20)
    a = ap.parse_args()
    cases = [(("stall", "skip")[i % 2], (i // 2) % 2, 2 + i % 5) for i in range(a.hangs)]
    rows = []
    for i, (mode, rank, step) in enumerate(cases):
        with tempfile.TemporaryDirectory() as d:
            row = one(Path(d), mode, rank, step, 29800 + i)
        rows.append(row)
        print(f"{i + 1:>2} {mode:<5} rank {rank} step {step}: exit {row['rc']}, named {row['named']}, verdict "
              f"{row['age']:.0f} s after the last step, launch {row['took']:.1f} s, left {row['left']}, "
              f"{'right' if row['right'] else 'WRONG'}", flush=True)
    right = sum(r["right"] for r in rows)
    ages = sorted(r["age"] for r in rows)
    print(f"\n{right} of {len(rows)} hangs: the injected rank named (and its stack shows it); verdict after the last "
          f"step: median {ages[len(ages) // 2]:.0f} s, max {ages[-1]:.0f} s (timeout 5 s, poll 1.25 s); processes "
          f"left: {sum(r['left'] for r in rows)}")
    for n in (1000, 10000):
        print(f"one poll over {n:,} ranks' progress files: {poll_cost(n) * 1000:.0f} ms")
    return 0 if right == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
