#!/usr/bin/env python
"""Benchmark: ranks started warm (runner.warm_start: forked from the node's launcher after it imported
what they need) against ranks started as new interpreters, in one run.

The README's main job (examples/tiny_cpu: the built-in entry, 2 local ranks, DeepSpeed ZeRO-2 on CPU),
``--steps`` steps, launched ``--rounds`` times each way, alternating (cold, warm, cold, warm, ...) so that
both see the same machine. Per launch: the CPU seconds of every process it started (getrusage of the
children), the wall time of the launch, and from rank 0's start marks (progress/metrics.json ``phases``)
how long after the launch began the first step ended and what its parts took. A fresh output folder each
time: no launch resumes another's checkpoint.

    python bench/bench_warm_start.py                    # about 3 min here
    python bench/bench_warm_start.py --rounds 3 --steps 40

Prints a line per launch and the medians; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("process", "imports", "model", "engine", "checkpoint", "data", "first_step")


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one(warm: bool, n: int, a: argparse.Namespace, tmp: Path) -> dict:
    work = tmp / f"{'warm' if warm else 'cold'}-{n}"
    work.mkdir()
    doc = yaml.safe_load((ROOT / "examples/tiny_cpu/config.yaml").read_text())
    doc["runner"]["warm_start"] = warm
    doc["cluster"]["master_port"] = a.port
    doc["training"].update(max_steps=a.steps, save_steps=a.steps, logging_steps=a.steps, output_dir=str(work / "out"))
    (work / "job.yaml").write_text(yaml.safe_dump(doc))
    cpu0, t0 = cpu_of_children(), time.time()
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(work / "job.yaml")], cwd=work,
                       capture_output=True, text=True, timeout=a.timeout)
    wall, cpu = time.time() - t0, cpu_of_children() - cpu0
    if r.returncode != 0:
        raise SystemExit(f"launch {work} failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
    (run,) = (work / "runs").iterdir()
    marks = json.loads((run / "progress" / "metrics.json").read_text()).get("phases") or {}
    parts, before = {}, t0
    for name in PARTS:
        if name in marks:
            parts[name] = marks[name] - before
            before = marks[name]
    out = {"warm": warm, "cpu_s": cpu, "wall_s": wall, "first_step_s": marks.get("first_step", t0) - t0, **parts}
    print(f"{'warm' if warm else 'cold'} {n}: CPU {cpu:6.1f} s  wall {wall:5.1f} s  first step after "
          f"{out['first_step_s']:5.1f} s  (" + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + ")", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
        for n in range(a.rounds):
            for warm in (False, True):
                runs.append(one(warm, n, a, Path(tmp)))
    med = {w: {k: statistics.median(r[k] for r in runs if r["warm"] == w) for k in ("cpu_s", "wall_s", "first_step_s")}
           for w in (False, True)}
    print(f"\nmedians over {a.rounds} launches each ({a.steps} steps, 2 ranks, ZeRO-2, the built-in entry):")
    for k, label in (("cpu_s", "CPU seconds of the launch"), ("wall_s", "wall seconds of the launch"),
                     ("first_step_s", "seconds to the first step")):
        print(f"  {label:28} cold {med[False][k]:6.1f}  warm {med[True][k]:6.1f}  warm/cold {med[True][k] / med[False][k]:.2f}")
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "medians": {str(k): v for k, v in med.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
