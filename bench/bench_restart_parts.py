#!/usr/bin/env python
"""Benchmark: a restart's parts, in process against a full relaunch, on the namespace cluster (issue 38).

One run of this script, on one fresh 4-node namespace cluster (tests/cluster: real sshd, pdsh,
``hfscale launch``): node0-node2 train, one rank each, DeepSpeed ZeRO-2 on CPU, the built-in entry
point; node3 is the spare. For each model (``tiny``: the healing tests' 2-layer GPT-2, 36K
parameters; ``large``: a GPT-2 of ``--large-layers`` x 1024, about 200M parameters, so that building
the model, DeepSpeed's engine and reading the checkpoint back show) and each way of healing:

- ``in process`` (``recovery.in_process: true``): the others keep their processes, node3's standby
  (imports done) takes the lost rank;
- ``relaunch`` (``recovery.in_process: false``): hfscale stops every node and starts the job again on
  the same three (the failed host is not struck out at its first failure);

the job trains until the checkpoint at step ``--save`` is complete and a step after it is done, then
node1's rank is SIGKILLed. R runs from the SIGKILL to the end of the first step trained after it.
Its parts come from the run's timeline (hfscale.launch.recovery.timeline): for a relaunch, detection
(the kill to the failure the launch saw), the stop, the decision (probes, the plan) and the new
start's parts from its launch; in process, the failure seen (the kill to the end of the attempt, as
the ranks saw it) and the new attempt's parts. A part a start does not mark is inside the next one.

    python bench/bench_restart_parts.py                 # tiny and large: about 10 min on 2 cores
    python bench/bench_restart_parts.py --models tiny

Needs root (tests/cluster). Prints a line per run and a table; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench_recovery import MODEL, wait  # noqa: E402
from cluster import run_on, start_cluster, stop_cluster  # noqa: E402
from hfscale.launch.recovery.timeline import read_timeline  # noqa: E402
from hfscale.runs.goodput import PART_NAMES  # noqa: E402

# a rank's command line (torchrun's ranks run python -u; an in-process node agent's holds it further in)
RANK = r"'^\S+( -u)? -m hfscale\.training\.train '"
PARTS = ("detection", "stop", "decision", *PART_NAMES)
SHOWN = (*PARTS, "other")


def model(name: str, layers: int) -> dict:
    """``tiny``: the healing tests' GPT-2 (bench_recovery.MODEL); ``large``: ``layers`` x 1024 of it."""
    return MODEL if name == "tiny" else {**MODEL, "n_layer": layers, "n_head": 16, "n_embd": 1024}


def config(tmp: Path, nodes: list[str], name: str, in_process: bool, args: argparse.Namespace) -> Path:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    hosts = [{"host": h, "slots": 1} for h in nodes[:3]] + [{"host": nodes[3], "slots": 1, "spare": True}]
    doc = {"name": f"parts-{name}-{'inproc' if in_process else 'relaunch'}",
           "cluster": {"hosts": hosts, "master_port": 29981},
           "runner": {"type": "pdsh", "launcher": "torchrun", "run_dir": str(tmp / "runs"), "connect_timeout": 5},
           "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}}, "precision": "no",
           "batch": {"micro_batch_size": 1, "global_batch_size": 3},
           "env": {"vars": {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"],
                            "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}},
           "watchdog": {"timeout": 600, "first_step": 1200},
           "training": {"output_dir": str(tmp / "out"), "max_steps": args.save + (60 if name == "tiny" else 3),
                        "save_steps": args.save,
                        "logging_steps": 1, "learning_rate": 1.0e-3, "lr_scheduler_type": "constant", "seed": 3,
                        "model": {"config": model(name, args.large_layers)}, "data": {"block_size": 64}},
           "recovery": {"max_restarts": 2, "strikes": 2, "spares": 1, "in_process": in_process}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def one(cluster, name: str, in_process: bool, args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"parts-{name}-", dir=args.tmp))
    path = config(tmp, cluster.nodes, name, in_process, args)
    proc = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(path)], cwd=tmp, env=cluster.env(),
                            stdout=open(tmp / "launch.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait(lambda: (tmp / "runs").is_dir() and any((tmp / "runs").iterdir()), proc, "the run directory", 120)
        (run,) = (tmp / "runs").iterdir()
        marker = tmp / "out" / f"checkpoint-{args.save}" / "hfscale_complete.json"
        step = lambda: _json(run / "progress" / "metrics.json").get("step") or 0  # noqa: E731
        wait(lambda: marker.exists() and step() > args.save, proc, f"checkpoint {args.save} and a step after it",
             args.timeout)
        run_on(cluster, cluster.nodes[1], f"pkill -KILL -f {RANK}", timeout=30)
        killed = time.time()
        phases = lambda: _json(run / "progress" / "metrics.json").get("phases") or {}  # noqa: E731
        wait(lambda: phases().get("first_step", 0.0) > killed, proc, "the first step after the kill", args.timeout)
        first = phases()["first_step"]
        proc.wait(timeout=args.timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
    out = {"size": name, "way": "in process" if in_process else "relaunch", "R": first - killed,
           "rc": proc.returncode, **restart_parts(read_timeline(run).events, killed)}
    out["other"] = out["R"] - sum(out.get(k, 0.0) for k in PARTS)  # between the parts (the relaunch to its start)
    out["params"] = params(model(name, args.large_layers))
    print(f"{name:5} ({_count(out['params'])}) {out['way']:10} R {out['R']:6.2f} s  " + "  ".join(
        f"{k} {out[k]:.2f}" for k in SHOWN if k in out), flush=True)
    return out


def restart_parts(events, failed_at: float) -> dict[str, float]:
    """A restart's parts from its run's timeline, counted from ``failed_at`` (the fault): in process, the
    failure seen (to the end of the attempt) and the ``in_process`` event's parts; a relaunch, detection
    (to the failure the launch saw), the stop, the decision and the new start's parts."""
    healed = [e for e in events if e.kind == "in_process"]
    if healed:
        return {"detection": healed[0].at - failed_at, **(healed[0].phases or {})}
    failure, stopped, relaunch = (next(e for e in events if e.kind == k) for k in ("failure", "stopped", "relaunch"))
    training = next((e for e in events if e.kind == "training" and e.attempt == relaunch.attempt), None)
    return {"detection": failure.at - failed_at, "stop": stopped.at - failure.at, "decision": relaunch.at - stopped.at,
            **((training.phases or {}) if training is not None else {})}


def _count(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def params(m: dict) -> int:
    """A GPT-2's parameters (tied embeddings): per layer 12 d^2 + 13 d, the embeddings, the last norm."""
    d = m["n_embd"]
    return m["n_layer"] * (12 * d * d + 13 * d) + (m["vocab_size"] + m["n_positions"]) * d + 2 * d


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--models", default="tiny,large")
    p.add_argument("--large-layers", type=int, default=16)
    p.add_argument("--save", type=int, default=2, help="the checkpoint the restart resumes from")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--tmp", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cluster = start_cluster(4, Path(tempfile.mkdtemp(prefix="parts-cluster-")))
    rows = []
    try:
        for name in args.models.split(","):
            for in_process in (True, False):
                rows.append(one(cluster, name, in_process, args))
    finally:
        stop_cluster(cluster)
    print("\n| model | way | " + " | ".join(PART_NAMES.get(k, k) for k in SHOWN) + " | **R** |")
    print("| --- | --- | " + " | ".join("---" for _ in SHOWN) + " | --- |")
    for r in rows:
        print(f"| {r['size']} ({_count(r['params'])}) | {r['way']} | "
              + " | ".join(f"{r[k]:.2f} s" if k in r else "-" for k in SHOWN) + f" | **{r['R']:.2f} s** |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
