#!/usr/bin/env python
"""Benchmark: from a fault to training again, by phase (issue 23), on the namespace cluster.

A 3-node job (one rank per node, DeepSpeed ZeRO-2 on CPU, a tiny GPT-2, a checkpoint every
``--save-steps`` steps, ``recovery.max_restarts``) runs under ``hfscale launch``. The bench makes
``--faults`` faults of one ``--kind``, each once the previous relaunch trains again:

- ``kill``: a node's training processes SIGKILLed (a GPU fault, the OOM killer);
- ``freeze``: a node's frozen with SIGSTOP (found by the hang watchdog, ``--watchdog`` s);
- ``link``: a node's link cut (the watchdog or ssh's keep-alives; the node is then left out and the
  job goes on with 2 nodes, the checkpoint converted for 2 ranks).

The node is the last one of the running attempt (node2 first; node1 once node2 is left out).

Per fault, from the bench's own clock (the moment it injected the fault) and the run's
timeline.jsonl (hfscale.launch.recovery.timeline): detection (fault -> failure noticed), stop (-> every
node stopped), decision (-> relaunch: probes, the plan), retries (attempts that failed before
training again, e.g. the relaunch that finds a cut-off host unreachable), restart (the last
relaunch -> its first step: processes, model load, resharding) and recompute (the steps since the
resumed checkpoint x the step time). Then the run's goodput as ``hfscale status`` computes it.

    python bench/bench_recovery.py                     # 3 kill faults, about 3 min
    python bench/bench_recovery.py --kind freeze --faults 2 --watchdog 15
    python bench/bench_recovery.py --kind link --faults 1
    python bench/bench_recovery.py --spare-vs-shrink   # issue 29: the same fault healed both ways

``--spare-vs-shrink`` runs the job both ways in one invocation (``--repeat`` times each, alternating),
on a fresh 4-node cluster each time, global batch 24: a node's processes SIGKILLed once, with
``strikes: 1`` so that the node is left out at once. Both paths restart at world size 3, so that
they start as many processes on this machine's shared cores. The shrink path trains on 4 nodes and
goes on with 3 (accumulation 3 -> 4, the checkpoint converted to DeepSpeed's universal format). The
spare path trains on node0-node2 with node3 marked spare (``recovery.spares: 1``): node3 takes the
failed node's place, nothing converted. Each prints its phases; then the medians, and the
conversion alone (DeepSpeed's ds_to_universal run again on the shrink path's checkpoint).

Needs root (network namespaces, sshd, pdsh: tests/cluster). Prints one line per fault and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
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

from cluster import run_on, start_cluster, stop_cluster  # noqa: E402
from hfscale.launch.recovery.timeline import read_timeline  # noqa: E402
from hfscale.runs.goodput import goodput, lines  # noqa: E402

MODEL = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "n_positions": 64,
         "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def config(tmp: Path, hosts: list[str], args: argparse.Namespace, spares: list[str] = (), strikes: int = 2,
           min_nodes: int = 2) -> Path:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    listed = [{"host": h, "slots": 1} for h in hosts] + [{"host": h, "slots": 1, "spare": True} for h in spares]
    doc = {"name": "bench-recovery", "cluster": {"hosts": listed, "master_port": 29961},
           "runner": {"type": "pdsh", "launcher": "torchrun", "run_dir": str(tmp / "runs"), "connect_timeout": 5},
           "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}}, "precision": "no",
           "batch": {"micro_batch_size": 2, "global_batch_size": args.global_batch},
           "env": {"vars": {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"],
                            "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}},
           "watchdog": {"timeout": args.watchdog, "first_step": 240},
           "training": {"output_dir": str(tmp / "out"), "max_steps": args.steps, "save_steps": args.save_steps,
                        "logging_steps": 1, "learning_rate": 1.0e-3, "lr_scheduler_type": "constant", "seed": 3,
                        "model": {"config": MODEL}, "data": {"block_size": 32}},
           "recovery": {"max_restarts": args.faults + 2, "strikes": strikes, "min_nodes": min_nodes,
                        **({"spares": len(spares)} if spares else {})}}
    path = tmp / "bench-recovery.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def step_of(run: Path) -> int:
    try:
        return json.loads((run / "progress" / "metrics.json").read_text()).get("step") or 0
    except (OSError, ValueError):
        return 0


def wait(cond, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise SystemExit(f"hfscale ended (exit code {proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def victim(run: Path) -> str:
    """The last host of the running attempt (node0, rank 0's, is spared: its progress file is read)."""
    hosts = [e.hosts for e in read_timeline(run).events if e.kind in ("launch", "relaunch") and e.hosts]
    return hosts[-1][-1]


def inject(kind: str, cluster, host: str) -> None:
    if kind == "kill":
        run_on(cluster, host, "pkill -KILL '^python'", timeout=30)  # torchrun and its rank
    elif kind == "freeze":
        run_on(cluster, host, "pkill -STOP '^python'", timeout=30)
    else:
        subprocess.run(["ip", "link", "set", f"hfs{cluster.id}v{host.removeprefix('node')}", "down"], check=True)


def run_job(args: argparse.Namespace, nodes: int, spares: int, strikes: int, kind: str, min_nodes: int = 2):
    """One job under ``hfscale launch`` on a fresh cluster of ``nodes + spares`` nodes, with
    ``args.faults`` faults of ``kind``: (timeline events, [(fault time, step)], exit code, wall, output file)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    tmp.chmod(0o755)
    cluster = start_cluster(nodes + spares, tmp / "cluster")
    injected: list[tuple[float, int]] = []
    try:
        path = config(tmp, cluster.nodes[:nodes], args, cluster.nodes[nodes:], strikes, min_nodes)
        t0 = time.time()
        log = open(tmp / "hfscale.out", "w")
        proc = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(path)], cwd=ROOT, env=cluster.env(),
                                stdout=log, stderr=subprocess.STDOUT)
        runs = tmp / "runs"
        wait(lambda: runs.is_dir() and any(runs.iterdir()), proc, "the run directory")
        (run,) = list(runs.iterdir())
        for n in range(args.faults):
            wait(lambda: any(e.kind == "training" and e.attempt == n for e in read_timeline(run).events), proc,
                 f"attempt {n} training")
            at = step_of(run) + 4
            wait(lambda: step_of(run) >= at, proc, f"step {at}")
            host = victim(run)
            injected.append((time.time(), step_of(run)))
            inject(kind, cluster, host)
        rc = proc.wait(timeout=1800)
        wall = time.time() - t0
    finally:
        if kind == "link":
            for i in range(nodes + spares):
                subprocess.run(["ip", "link", "set", f"hfs{cluster.id}v{i}", "up"], check=False)
        stop_cluster(cluster)
    return read_timeline(run).events, injected, rc, wall, tmp / "hfscale.out"


def phases(events, injected) -> dict[str, list[float]]:
    """Per fault, from the bench's clock and the timeline: detection, stop, decision, retries, restart,
    recompute, total (printed one line per fault)."""
    out: dict[str, list[float]] = {k: [] for k in ("detection", "stop", "decision", "retries", "restart", "recompute",
                                                  "total")}
    for n, (fault_at, step) in enumerate(injected):
        failure = next((e for e in events if e.kind == "failure" and e.at >= fault_at), None)
        if failure is None:
            print(f"fault {n + 1}: no failure after it in the timeline")
            continue
        a = failure.attempt
        stopped = next((e for e in events if e.kind == "stopped" and e.attempt == a), None)
        training = next((e for e in events if e.kind == "training" and e.attempt > a), None)
        first = next((e for e in events if e.kind == "relaunch" and e.attempt == a + 1), None)
        if None in (stopped, training, first):
            print(f"fault {n + 1}: the timeline misses an event (stopped/relaunch/training)")
            continue
        last = [e for e in events if e.kind == "relaunch" and e.attempt <= training.attempt][-1]
        recompute = max(0, (failure.step or step) - (last.resume_step or 0)) * (failure.step_time or 0.0)
        got = {"detection": failure.at - fault_at, "stop": stopped.at - failure.at, "decision": first.at - stopped.at,
               "retries": last.at - first.at, "restart": training.at - last.at, "recompute": recompute}
        got["total"] = training.at - fault_at + recompute
        for k, v in got.items():
            out[k].append(v)
        causes = [e.cause for e in events if e.kind == "failure" and a <= e.attempt < training.attempt]
        swaps = "; ".join(f"{r.spare} replaced {r.host}" for r in last.replaced or ())
        print(f"fault {n + 1} at step {step}: {', then '.join(c or '?' for c in causes)} on {failure.host or '-'}; "
              + ", ".join(f"{k} {v:.1f} s" for k, v in got.items())
              + f"; relaunched on {', '.join(last.hosts or [])} from step {last.resume_step}, world {last.world_size}, "
              f"accumulation {last.accumulation}" + (f" ({swaps})" if swaps else ""))
    return out


def report(name: str, events, injected, rc: int, wall: float, output: Path) -> dict[str, list[float]]:
    converted = "ds_to_universal" in output.read_text(errors="replace")
    print(f"{name}: {len(injected)} fault(s), hfscale exit code {rc}, wall {wall:.1f} s, checkpoint converted: "
          f"{'yes' if converted else 'no'}, output in {output}")
    got = phases(events, injected)
    print("median: " + ", ".join(f"{k} {statistics.median(v):.1f} s" for k, v in got.items() if v))
    run = output.parent / "runs"
    g = goodput(read_timeline(next(run.iterdir())))
    if g is not None:
        print("; ".join(lines(g)))
    return got


def conversion_alone(output: Path) -> float | None:
    """Seconds DeepSpeed's ds_to_universal takes, run again on the checkpoint the shrink path converted
    (into a scratch folder): what the spare path does not pay."""
    converted = sorted((output.parent / "out").glob("checkpoint-*/global_step*_universal"))
    if not converted:
        return None
    source = converted[-1].with_name(converted[-1].name.removesuffix("_universal"))
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
                    "--output_folder", str(output.parent / "universal-again"), "--inject_missing_state"],
                   check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return time.perf_counter() - t


def spare_vs_shrink(args: argparse.Namespace) -> None:
    got: dict[str, dict[str, list[float]]] = {"shrink": {}, "spare": {}}
    converts: list[float] = []
    for n in range(args.repeat):
        for name in ("shrink", "spare"):
            nodes, spares, label = (4, 0, "shrink path (4 nodes -> 3)") if name == "shrink" else (
                3, 1, "spare path (3 nodes + 1 spare)")
            events, injected, rc, wall, output = run_job(args, nodes, spares, 1, "kill", min_nodes=3)
            for k, v in report(f"{label}, run {n + 1}", events, injected, rc, wall, output).items():
                got[name].setdefault(k, []).extend(v)
            if name == "shrink" and (c := conversion_alone(output)) is not None:
                converts.append(c)
    med = {name: {k: statistics.median(v) for k, v in phases.items() if v} for name, phases in got.items()}
    for name in ("shrink", "spare"):
        print(f"{name} (median of {args.repeat}): " + ", ".join(f"{k} {v:.1f} s" for k, v in med[name].items()))
    a, b = med["shrink"].get("restart", 0.0), med["spare"].get("restart", 0.0)
    conv = statistics.median(converts) if converts else float("nan")
    print(f"restart: shrink {a:.1f} s, spare {b:.1f} s: the spare path is {a - b:.1f} s shorter; "
          f"ds_to_universal alone on the shrink path's checkpoint: {conv:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--kind", choices=["kill", "freeze", "link"], default="kill")
    ap.add_argument("--faults", type=int, default=0, help="default: 3, or 1 with --spare-vs-shrink")
    ap.add_argument("--steps", type=int, default=0, help="max_steps (default: 12 per fault + 12)")
    ap.add_argument("--save-steps", type=int, default=4)
    ap.add_argument("--watchdog", type=int, default=20, help="watchdog.timeout, seconds")
    ap.add_argument("--spare-vs-shrink", action="store_true", help="the same kill healed by a spare and by shrinking")
    ap.add_argument("--repeat", type=int, default=2, help="with --spare-vs-shrink: runs of each path")
    args = ap.parse_args()
    args.faults = args.faults or (1 if args.spare_vs_shrink else 3)
    args.steps = args.steps or 12 * args.faults + 12
    args.global_batch = 24 if args.spare_vs_shrink else 12  # 24: kept at 4 and at 3 nodes
    if args.spare_vs_shrink:
        spare_vs_shrink(args)
    else:
        report(args.kind, *run_job(args, 3, 0, 2, args.kind))


if __name__ == "__main__":
    main()
