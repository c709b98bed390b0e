#!/usr/bin/env python
"""Benchmark: ``hfscale check`` and ``hfscale launch --dry-run`` on pdsh configs of 1, 300 and
3,000 hosts (fully qualified names, two per-host variables each), and the longest argument of the
launch and clean-up commands (Linux refuses one longer than 128 KiB).

Target (issue 12): a 3,000-host config checks, plans and dry-runs in under 2 s. Reported, never
enforced; the exit code is non-zero only when a command fails. Interleaved runs, medians.

    python bench/bench_scale.py                  # 5 runs each
    python bench/bench_scale.py --repeat 9 --hosts 1,3000,10000
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 2.0


def config(tmp: Path, n: int) -> Path:
    hosts = [{"host": f"gpu-node-{i:05d}.rack-{i // 32:03d}.cluster.example.com", "slots": 8} for i in range(n)]
    per_host = {h["host"]: {"NCCL_SOCKET_IFNAME": f"ens{i % 4}f0", "NCCL_IB_HCA": f"mlx5_{i % 8}"}
                for i, h in enumerate(hosts)}
    doc = {"name": f"scale{n}", "cluster": {"hosts": hosts}, "runner": {"type": "pdsh", "run_dir": str(tmp / "runs")},
           "env": {"per_host": per_host}, "batch": {"micro_batch_size": 1},
           "training": {"script": "train.py", "pass_args": "none"}}
    path = tmp / f"scale{n}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def timed(cmd: list[str], cwd: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode:
        print(r.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return dt


def longest_argument(path: Path, tmp: Path) -> tuple[int, int]:
    sys.path.insert(0, str(ROOT))
    from hfscale.launch.context import LaunchContext
    from hfscale.rules.config_file import load_job
    from hfscale.launch.build import build_plan

    plan = build_plan(load_job(path), LaunchContext.of(str(tmp), sys.executable, "20261123-000000-abcdef", {}))
    argvs = [plan.main.real_argv()] + ([plan.cleanup.real_argv()] if plan.cleanup else [])
    return max(len(a) for argv in argvs for a in argv), max(sum(len(a) + 1 for a in argv) for argv in argvs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--hosts", default="1,300,3000")
    args = ap.parse_args()
    sizes = [int(x) for x in args.hosts.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as t:
        tmp = Path(t)
        paths = {n: config(tmp, n) for n in sizes}
        runs: dict[tuple[int, str], list[float]] = {}
        for n in sizes:  # warm-up
            timed([sys.executable, "-m", "hfscale", "check", str(paths[n])], tmp)
        for _ in range(args.repeat):
            for n in sizes:
                runs.setdefault((n, "check"), []).append(
                    timed([sys.executable, "-m", "hfscale", "check", str(paths[n])], tmp))
                runs.setdefault((n, "dry-run"), []).append(
                    timed([sys.executable, "-m", "hfscale", "launch", str(paths[n]), "--dry-run"], tmp))
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, {args.repeat} interleaved runs each, medians")
        print(f"{'hosts':>7} {'config KB':>10} {'check s':>9} {'dry-run s':>10} {'longest arg':>12} {'argv bytes':>11}")
        for n in sizes:
            arg, total = longest_argument(paths[n], tmp)
            print(f"{n:>7} {paths[n].stat().st_size / 1024:>10.0f} {statistics.median(runs[n, 'check']):>9.3f} "
                  f"{statistics.median(runs[n, 'dry-run']):>10.3f} {arg:>12} {total:>11}")
        big = max(sizes)
        worst = max(statistics.median(runs[big, "check"]), statistics.median(runs[big, "dry-run"]))
        print(f"target: {big} hosts check and dry-run < {TARGET_S:.0f} s: {'met' if worst < TARGET_S else 'NOT met'} "
              f"({worst:.2f} s); one argument < 128 KiB: {'met' if longest_argument(paths[big], tmp)[0] < 131072 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
