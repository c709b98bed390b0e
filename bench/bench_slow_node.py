#!/usr/bin/env python
"""Benchmark: a slow node replaced at the next checkpoint (issue 40), against the same job unthrottled, in one run.

The namespace cluster (tests/cluster), 4 nodes: node0-node2 train (one rank each, DeepSpeed ZeRO-2 on CPU,
the healing tests' tiny GPT-2, a checkpoint every ``--save-steps``), node3 is a spare. Two launches, each
on a fresh cluster:

- ``unthrottled``: the job as it is, ``--steps`` steps;
- ``throttled``: once it has trained ``--throttle-at`` steps, every process of node1 is held to
  ``--share`` of one CPU (a cgroup CPU quota), as a node with a throttled GPU trains slower than its
  peers. The ranks find it slow (``recovery.slow_nodes``), stop at the next checkpoint, and the spare
  takes its place.

Per launch, from MetricsCallback's step times (one a step) and the run's timeline: the median step time
before node1 was throttled, while it was, and after the spare took its place; the steps recomputed (the
failure's step - the step the relaunch resumed from); seconds from the throttle to the stop, and the
restart. The figure the issue asks for: the step time after the replacement over the unthrottled run's.

    python bench/bench_slow_node.py                 # about 4 min here
    python bench/bench_slow_node.py --share 0.2 --factor 2

Needs root (network namespaces, sshd, pdsh, a cgroup cpu controller).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from cluster import start_cluster, stop_cluster, throttled  # noqa: E402
from hfscale.launch.recovery.timeline import read_timeline  # noqa: E402
from test_recovery_cluster import _step, train_config  # noqa: E402
from test_slow_nodes_cluster import step_times  # noqa: E402


def median(times: dict[int, float], lo: int, hi: float) -> float:
    picked = [t for s, t in times.items() if lo <= s <= hi]
    return statistics.median(picked) if picked else float("nan")


def one(kind: str, a: argparse.Namespace, work: Path) -> dict:
    cluster = start_cluster(4, work / "cluster")
    try:
        out = work / "out"
        config = train_config(work, kind, out, 29951, cluster.nodes[:3],
                              {"max_restarts": 2, "strikes": 2, "spares": 1,
                               "slow_nodes": {"factor": a.factor, "window": a.window, "windows": a.windows}},
                              max_steps=a.steps)
        doc = yaml.safe_load(config.read_text())
        doc["cluster"]["hosts"].append({"host": cluster.nodes[3], "slots": 1, "spare": True})
        doc["training"]["save_steps"] = a.save_steps
        config.write_text(yaml.safe_dump(doc, sort_keys=False))
        log = open(work / "hfscale.out", "w")
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=ROOT, env=cluster.env(),
                                stdout=log, stderr=subprocess.STDOUT)
        runs = work / "runs"
        while not (runs.is_dir() and any(runs.iterdir())):
            time.sleep(0.2)
        (run,) = list(runs.iterdir())
        at = throttle_t = None
        if kind == "throttled":
            while _step(run) < a.throttle_at and proc.poll() is None:
                time.sleep(0.2)
            with throttled(cluster, "node1", a.share):
                at, throttle_t = _step(run), time.time()
                while proc.poll() is None and not any(e.kind == "training" and e.attempt == 1
                                                      for e in read_timeline(run).events):
                    time.sleep(0.5)
        rc = proc.wait(timeout=1200)
        wall = time.time() - t0
        events = read_timeline(run).events
        times = step_times(out)
        failure = next((e for e in events if e.kind == "failure"), None)
        relaunch = next((e for e in events if e.kind == "relaunch"), None)
        again = next((e for e in events if e.kind == "training" and e.attempt == 1), None)
        stop = failure.step if failure is not None else None
        row = {"kind": kind, "rc": rc, "wall_s": wall, "steps": a.steps}
        if kind == "unthrottled":
            row["step_s"] = median(times, 3, a.steps)
            row["failures"] = [e.cause for e in events if e.kind == "failure"]
        else:
            row.update(
                throttled_at=at, stopped_at=stop, cause=failure.cause if failure else None,
                host=failure.host if failure else None,
                replaced=[(r.host, r.spare) for r in (relaunch.replaced or ())] if relaunch else None,
                recomputed=(stop - relaunch.resume_step) if stop is not None and relaunch and relaunch.resume_step
                is not None else None,
                before_s=median(times, 3, at or 0), throttled_s=median(times, (at or 0) + 3, stop or 0),
                after_s=median(times, (stop or 0) + 3, a.steps),
                to_stop_s=failure.at - throttle_t if failure and throttle_t else None,
                restart_s=again.at - failure.at if again and failure else None)
        return row
    finally:
        stop_cluster(cluster)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=140)
    ap.add_argument("--save-steps", type=int, default=5)
    ap.add_argument("--throttle-at", type=int, default=30)
    ap.add_argument("--share", type=float, default=0.10)
    ap.add_argument("--factor", type=float, default=2.5)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    rows = []
    for kind in ("unthrottled", "throttled"):
        with tempfile.TemporaryDirectory(prefix=f"bench-slow-{kind}-") as tmp:
            rows.append(one(kind, a, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    base, slow = rows
    print(f"\nunthrottled: {base['step_s']:.3f} s a step over {a.steps} steps (failures: {base['failures'] or 'none'})")
    print(f"throttled:   node1 held to {a.share:.0%} of a CPU at step {slow['throttled_at']}: {slow['before_s']:.3f} s a "
          f"step before, {slow['throttled_s']:.3f} s while throttled ({slow['throttled_s'] / slow['before_s']:.1f}x)")
    print(f"             found slow and stopped at step {slow['stopped_at']}'s checkpoint "
          f"{slow['to_stop_s']:.1f} s after the throttle; {slow['replaced']}; steps recomputed: {slow['recomputed']}; "
          f"restart {slow['restart_s']:.1f} s")
    print(f"             after the replacement: {slow['after_s']:.3f} s a step = {slow['after_s'] / base['step_s']:.3f}x "
          "the unthrottled run's")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    ok = base["rc"] == 0 and slow["rc"] == 0 and slow["cause"] == "slow" and slow["recomputed"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
