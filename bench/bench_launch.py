#!/usr/bin/env python
"""Benchmark: ``hfscale launch`` start-up on 1 vs N hosts, and its overhead over ``accelerate launch``.

Part 1 (needs root: a real multi-host cluster of network namespaces with one sshd each, made by
tests/cluster; skipped with a message when it cannot be created). One N-node cluster is started;
the 1-host runs use node0 of it, the N-host runs node0..node{N-1} (1 slot per host, pdsh runner).
Each row is timed ``--repeat`` times, 1-host and N-host runs interleaved, and the medians are shown
with the ratio N/1. The issue's target: all ranks initialized on 8 hosts within 1.5x of 1 host.

On a small box (2 cores here) N ranks that each import torch compete for the same cores, which a
real cluster never does. So the table separates:
  (a) hfscale's own fan-out path, no torch anywhere: raw ``pdsh -R ssh -S -w HOSTS true``; and
      ``hfscale launch`` (which has no ssh round of its own before pdsh: an unreachable host is
      found by the fan-out itself) whose per-node interpreter (runner.python) is a tiny shell
      script standing in for ``python -m torch.distributed.run``: the very same plan, pdsh command,
      per-host rank switch, exit markers and log routing, but nothing imports torch.
  (b) the cost of starting Python/torch ranks: N concurrent ``python -c 'import torch'`` on this
      box (no ssh, no launcher); ``hfscale launch`` with torchrun and a non-torch script (the
      launcher still imports torch); and the real thing: tests/scripts/dist_probe.py --mode ok,
      timed from starting ``hfscale launch`` until every rank's PROBE_READY line (process group
      formed) is seen on hfscale's stdout, with torchrun and (optionally) accelerate as launcher.

Part 2 (no root needed): wall time to exit of ``hfscale launch CONFIG`` (local runner, accelerate,
2 processes, dist_probe.py --mode ok) against ``accelerate launch --config_file <generated>`` on the
config ``hfscale config CONFIG --out DIR`` writes for the same job; same environment, interleaved,
one untimed warm-up each, a fresh free master port for every run. Target: overhead <= 3 %.

Targets are reported, never enforced: the exit code is non-zero only when a command fails.

    python bench/bench_launch.py                    # both parts, 3 cluster / 5 local repeats
    python bench/bench_launch.py --repeat 5 --local-repeat 9 --launchers torchrun
    python bench/bench_launch.py --skip-cluster     # part 2 only (no root needed)
    python bench/bench_launch.py --skip-cluster --backend ddp   # part 2 without deepspeed installed
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/cluster is importable as "cluster"

PROBE = str(ROOT / "tests" / "scripts" / "dist_probe.py")
TARGET_RATIO = 1.5
TARGET_OVERHEAD_PCT = 3.0
EXTENSIONS = str(ROOT / ".cache" / "torch_extensions")

# Everything started here, so that Ctrl-C / SIGTERM / an error never leaves a process or a cluster.
_live: set[subprocess.Popen] = set()
_clusters: list = []


class BenchError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- helpers

def base_env() -> dict[str, str]:
    """The environment of every command of both parts (and the values every rank gets)."""
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=EXTENSIONS, OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def rank_vars(cluster: bool) -> dict[str, str]:
    v = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": EXTENSIONS, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if cluster:
        v["GLOO_SOCKET_IFNAME"] = "eth0"  # each node's only non-loopback interface
    return v


def hfscale(*args: str) -> list[str]:
    return [sys.executable, "-m", "hfscale", *args]


def free_port() -> int:
    """A TCP port free right now in the root namespace (away from the tests' 295xx/296xx)."""
    for _ in range(200):
        port = random.randint(31000, 39000)
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    raise BenchError("no free TCP port found in 31000-39000")


def popen(cmd: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, **kw)
    _live.add(p)
    return p


def finish(p: subprocess.Popen, timeout: float = 10.0) -> None:
    """Ask a child to stop (hfscale then cleans up its nodes), kill it if it will not."""
    if p.poll() is None:
        try:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    _live.discard(p)


class Timed:
    """One timed command: wall seconds to exit, and to chosen output lines.

    Output (stdout and stderr merged) is read line by line as it arrives; ``marks`` counts lines
    containing ``marker`` and notes when the ``expect``-th one arrived; ``job_line`` is when
    hfscale said "hfscale: job ... on ..." (printed right before it starts pdsh or the launcher).
    """

    def __init__(self, cmd: list[str], env: dict[str, str], marker: str | None = None, expect: int = 0,
                 timeout: float = 300.0, label: str = ""):
        self.label = label or " ".join(cmd)
        lines: list[str] = []
        t_marks: list[float] = []
        t_job = None
        c0 = cpu_sample()
        t0 = time.perf_counter()
        p = popen(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
        timer = threading.Timer(timeout, lambda: p.poll() is None and p.send_signal(signal.SIGTERM))
        timer.start()
        try:
            assert p.stdout is not None
            for line in p.stdout:
                now = time.perf_counter()
                lines.append(line)
                if t_job is None and line.startswith("hfscale: job "):
                    t_job = now
                if marker:  # ranks sharing a pipe can land on one line: count occurrences
                    t_marks += [now] * line.count(marker)
            rc = p.wait()
            t_exit = time.perf_counter()
            self.busy = busy_pct(c0, cpu_sample())
        finally:
            timer.cancel()
            finish(p)
        self.rc, self.out, self.exit = rc, "".join(lines), t_exit - t0
        self.job_line = None if t_job is None else t_job - t0
        self.ready = t_marks[expect - 1] - t0 if marker and len(t_marks) >= expect else None
        if rc != 0 or (marker and self.ready is None):
            why = f"exit code {rc}" if rc != 0 else f"{len(t_marks)} of {expect} '{marker}' lines"
            raise BenchError(f"{self.label}: {why}\n--- last output ---\n{self.out[-3000:]}")


def cpu_sample() -> tuple[int, int]:
    """(all jiffies, idle jiffies) of the whole box, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v), v[3] + v[4]


def busy_pct(a: tuple[int, int], b: tuple[int, int]) -> float | None:
    """Share of all cores busy between two samples (any process, ours or not), in %."""
    total = b[0] - a[0]
    return None if total <= 0 else 100.0 * (total - (b[1] - a[1])) / total


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:7.3f}"


def load() -> str:
    a, b, c = os.getloadavg()
    return f"{a:.2f} {b:.2f} {c:.2f}"


# ----------------------------------------------------------------------------- part 1

NOOP_PY = """import os
print("NOOP_READY rank=" + os.environ.get("RANK", "?"), flush=True)
"""

FAKE_PY = """#!/bin/sh
# stands in for "python -m torch.distributed.run ...": no Python, no torch; one line per node
echo "FAKE_READY host=$(uname -n) node_rank=${HFSCALE_NODE_RANK:-?}"
"""

def cluster_config(path: Path, tmp: Path, hosts: list[str], *, launcher: str, script: str,
                   script_args: list[str], python: str | None = None) -> Path:
    runner = {"type": "pdsh", "launcher": launcher, "run_dir": str(tmp / "runs"), "connect_timeout": 5}
    if python:
        runner["python"] = python
    cfg = {
        "name": "bench",
        # every node has its own network namespace, so one port serves every run
        "cluster": {"hosts": [{"host": h, "slots": 1} for h in hosts], "master_port": 29650},
        "runner": runner,
        "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}},
        "precision": "no",
        "batch": {"micro_batch_size": 2},
        "env": {"vars": rank_vars(cluster=True)},
        "training": {"script": script, "script_args": script_args, "pass_args": "none"},  # not Trainer scripts
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def part1(args, tmp: Path) -> dict | None:
    print(f"== Part 1: hfscale launch on a 1-host vs {args.hosts}-host cluster "
          f"(namespaces + sshd per node, pdsh, 1 slot per host)", flush=True)
    try:
        from cluster import (
            ClusterUnavailable,
            leftover_processes,
            start_cluster,
            stop_cluster,
        )
    except ImportError as e:
        print(f"SKIPPED part 1: cannot import tests/cluster ({e})")
        return None
    t = time.perf_counter()
    try:
        cl = start_cluster(args.hosts, tmp / "cluster")
    except ClusterUnavailable as e:
        print(f"SKIPPED part 1: no test cluster on this machine ({e.kind}): {e}")
        return None
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        print(f"SKIPPED part 1: starting a {args.hosts}-node cluster failed: {e}")
        return {"error": str(e)}
    _clusters.append((cl, stop_cluster))
    print(f"cluster of {args.hosts} nodes up in {time.perf_counter() - t:.1f}s ({cl.dir}); load avg {load()}",
          flush=True)
    env = base_env()
    cenv = cl.env(env)
    sizes = (1, args.hosts)
    hostsets = {n: cl.nodes[:n] for n in sizes}

    (tmp / "noop.py").write_text(NOOP_PY)
    fake = tmp / "fake-python"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)

    configs: dict[tuple[str, int], Path] = {}
    for n in sizes:
        def mk(name: str, n: int = n, **kw) -> Path:
            return cluster_config(tmp / f"{name}-{n}.yaml", tmp, hostsets[n], **kw)

        configs["fake", n] = mk("fake", launcher="torchrun", script=PROBE, script_args=[], python=str(fake))
        configs["noop", n] = mk("noop", launcher="torchrun", script=str(tmp / "noop.py"), script_args=[])
        for launcher in args.launchers:
            configs[launcher, n] = mk(launcher, launcher=launcher, script=PROBE, script_args=["--mode", "ok"])

    def settle() -> None:
        left = leftover_processes(cl, timeout=15)
        if left:
            print(f"  warning: processes still on the nodes after a run: {left}", flush=True)

    def launch(key: str, n: int, marker: str) -> Timed:
        r = Timed(hfscale("launch", str(configs[key, n])), cenv, marker=marker, expect=n,
                  timeout=args.timeout, label=f"hfscale launch ({key}, {n} host(s))")
        settle()
        return r

    def raw_pdsh(n: int) -> tuple[float, float | None]:
        r = Timed(["pdsh", "-R", "ssh", "-S", "-w", ",".join(hostsets[n]), "true"], cenv,
                  timeout=60, label=f"pdsh true on {n} host(s)")
        return r.exit, r.busy

    def import_torch(n: int) -> tuple[float, float | None]:
        c0 = cpu_sample()
        t0 = time.perf_counter()
        ps = [popen([sys.executable, "-c", "import torch"], env, stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE) for _ in range(n)]
        for p in ps:
            _, err = p.communicate(timeout=args.timeout)
            _live.discard(p)
            if p.returncode:
                raise BenchError(f"python -c 'import torch' failed: {err[-2000:]}")
        return time.perf_counter() - t0, busy_pct(c0, cpu_sample())

    # key -> {hosts: [seconds]}; key + "%" -> {hosts: [CPU busy % of the box during that run]}
    res: dict[str, dict[int, list[float]]] = {}

    def add(key: str, n: int, x: float | None, busy: float | None = None) -> None:
        if x is not None:
            res.setdefault(key, {}).setdefault(n, []).append(x)
        if busy is not None:
            res.setdefault(key + "%", {}).setdefault(n, []).append(busy)

    def add_launch(key: str, n: int, r: Timed) -> None:
        add(f"{key}.job", n, r.job_line)
        add(f"{key}.ready", n, r.ready, r.busy)
        add(f"{key}.exit", n, r.exit)

    if args.warmup:
        print(f"warm-up (untimed): pdsh, a fake-interpreter launch and a torchrun launch on {args.hosts} hosts ...",
              flush=True)
        raw_pdsh(args.hosts)
        launch("fake", args.hosts, "FAKE_READY")
        launch("torchrun", args.hosts, "PROBE_READY")
    # Rounds: every row once per round (cheap rows 3 times), 1 and N hosts back to back, so that
    # other work on this box (load drifts) hits every row alike.
    for i in range(args.repeat):
        for n in sizes:
            for _ in range(3):
                add("pdsh", n, *raw_pdsh(n))
            add_launch("fake", n, launch("fake", n, "FAKE_READY"))
            add("import", n, *import_torch(n))
            add_launch("noop", n, launch("noop", n, "NOOP_READY"))
            for launcher in args.launchers:
                r = launch(launcher, n, "PROBE_READY")
                ranks = sorted(json.loads(j)["rank"] for j in re.findall(r"PROBE_READY (\{[^{}]*\})", r.out))
                if ranks != list(range(n)):
                    raise BenchError(f"{launcher} on {n} host(s): PROBE_READY from ranks {ranks}")
                add_launch(launcher, n, r)
        print(f"  round {i + 1}/{args.repeat} done; load avg {load()}", flush=True)

    _clusters.remove((cl, stop_cluster))
    stop_cluster(cl)
    return {"res": res, "sizes": sizes, "cheap": 3 * args.repeat}


def report1(args, p1: dict) -> None:
    res, (one, many) = p1["res"], p1["sizes"]
    w = 66
    print()
    print(f"Part 1: medians in seconds ({p1['cheap']} runs for the pdsh row, {args.repeat} for the others); "
          f"{os.cpu_count()} cpus. 'CPU busy': share of all cores busy during the run (any process).")
    head = (f"{'':<{w}} {'1 host':>8} {f'{many} hosts':>8} {f'{many}/1':>7} {'delta':>7}  "
            f"{'CPU busy 1/' + str(many):>14}")
    print(head)
    print("-" * len(head))

    def row(label: str, key: str) -> tuple[float, float] | None:
        s = res.get(key)
        if not s or one not in s or many not in s:
            print(f"{label:<{w}} {'-':>8} {'-':>8}")
            return None
        a, b = med(s[one]), med(s[many])
        u = res.get(key + "%", {})
        busy = f"{med(u[one]):5.0f}% /{med(u[many]):4.0f}%" if u.get(one) and u.get(many) else ""
        print(f"{label:<{w}} {a:8.3f} {b:8.3f} {b / a:6.2f}x {b - a:+7.3f}  {busy:>14}")
        return a, b

    print("(a) hfscale's own fan-out path (no torch anywhere)")
    pdsh = row("  raw `pdsh -R ssh -S -w HOSTS true`", "pdsh")
    row("  hfscale launch, fake interpreter: to its 'job' line", "fake.job")
    fan = row("  hfscale launch, fake interpreter: to every node's output", "fake.ready")
    row("  hfscale launch, fake interpreter: to exit", "fake.exit")
    print("(b) starting Python/torch ranks on this box")
    imp = row("  N concurrent `python -c 'import torch'`, local, no ssh", "import")
    row("  hfscale launch torchrun + non-torch script: to all ranks' output", "noop.ready")
    full: dict[str, tuple[float, float] | None] = {}
    for launcher in args.launchers:
        row(f"  hfscale launch {launcher} + dist_probe: to its 'job' line", f"{launcher}.job")
        full[launcher] = row(f"  hfscale launch {launcher} + dist_probe: to ALL PROBE_READY", f"{launcher}.ready")
        row(f"  hfscale launch {launcher} + dist_probe: to exit", f"{launcher}.exit")
    print("-" * len(head))

    def verdict(ratio: float) -> str:
        return "met" if ratio <= TARGET_RATIO else "NOT met"

    for launcher, ab in full.items():
        if ab is not None:
            a, b = ab
            print(f"target {many}-host/1-host <= {TARGET_RATIO}x, all ranks initialized ({launcher}): "
                  f"{b / a:.2f}x ({b - a:+.2f}s) -> {verdict(b / a)} on this box")
    if fan is not None:
        a, b = fan
        print(f"same target, hfscale's fan-out path alone (fake interpreter, to every node's output): "
              f"{b / a:.2f}x ({b - a:+.2f}s) -> {verdict(b / a)}")
        if pdsh is not None:
            print(f"  of that {b - a:+.2f}s: raw pdsh itself {pdsh[1] - pdsh[0]:+.2f}s ({pdsh[1] / pdsh[0]:.2f}x)")
    if imp is not None:
        a, b = imp
        print(f"CPU contention: {many} concurrent torch imports take {b / a:.1f}x one import here: "
              f"{os.cpu_count()} cores shared by all {many} 'hosts' (a real cluster has cores per host)")


# ----------------------------------------------------------------------------- part 2

def local_config(path: Path, tmp: Path, port: int, backend: str) -> Path:
    engine = {"backend": "deepspeed", "deepspeed": {"stage": 2}} if backend == "deepspeed" else {"backend": backend}
    cfg = {
        "name": "benchlocal",
        "cluster": {"nproc_per_node": 2, "master_port": port},
        "runner": {"type": "local", "launcher": "accelerate", "run_dir": str(tmp / "runs")},
        "distributed": engine,
        "precision": "no",
        "batch": {"micro_batch_size": 2},
        "env": {"vars": rank_vars(cluster=False)},
        "training": {"script": PROBE, "script_args": ["--mode", "ok"], "pass_args": "none"},
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def part2(args, tmp: Path) -> dict:
    print(f"\n== Part 2: hfscale launch vs accelerate launch on the generated config "
          f"(local, 2 processes, {args.backend}); load avg {load()}", flush=True)
    env = base_env()
    d = tmp / "local"
    d.mkdir()
    hf: list[float] = []
    acc: list[float] = []
    dry: list[float] = []
    bare: list[float] = []
    busy: list[float] = []
    total = args.local_repeat + 1
    for i in range(total):
        cfg_h = local_config(d / f"h{i}.yaml", d, free_port(), args.backend)
        cfg_a = local_config(d / f"a{i}.yaml", d, free_port(), args.backend)
        gen = d / f"gen{i}"
        Timed(hfscale("config", str(cfg_a), "--out", str(gen)), env, label="hfscale config")

        def run_h(cfg_h: Path = cfg_h) -> Timed:
            return Timed(hfscale("launch", str(cfg_h)), env, marker="PROBE_DONE", expect=2,
                         timeout=args.timeout, label="hfscale launch (local)")

        def run_a(gen: Path = gen) -> Timed:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(gen / "accelerate_config.yaml"), PROBE, "--mode", "ok"]
            return Timed(cmd, env, marker="PROBE_DONE", expect=2, timeout=args.timeout,
                         label="accelerate launch (direct)")

        # alternate which goes first, so a drift in background load hits both alike
        if i % 2 == 0:
            h, a = run_h(), run_a()
        else:
            a, h = run_a(), run_h()
        if i == 0:
            print("  warm-up pair done (not counted)", flush=True)
            continue
        hf.append(h.exit)
        acc.append(a.exit)
        busy += [x for x in (h.busy, a.busy) if x is not None]
        dry.append(Timed(hfscale("launch", str(cfg_h), "--dry-run"), env, label="hfscale launch --dry-run").exit)
        bare.append(Timed([sys.executable, "-c", "pass"], env, label="python -c pass").exit)
        print(f"  pair {i}/{args.local_repeat}: hfscale {h.exit:.3f}s  accelerate {a.exit:.3f}s", flush=True)
    return {"hf": hf, "acc": acc, "dry": dry, "bare": bare, "busy": busy}


def report2(args, p2: dict) -> None:
    hf, acc, dry, bare = p2["hf"], p2["acc"], p2["dry"], p2["bare"]
    w = 58
    print()
    print(f"Part 2: wall time to exit, {len(hf)} interleaved runs each (+1 warm-up), seconds")
    head = f"{'command':<{w}} {'median':>8} {'min':>8} {'max':>8}"
    print(head)
    print("-" * len(head))
    print(f"{'hfscale launch CONFIG (local, accelerate, 2 procs)':<{w}} {med(hf):8.3f} {min(hf):8.3f} {max(hf):8.3f}")
    print(f"{'accelerate launch --config_file <generated>':<{w}} {med(acc):8.3f} {min(acc):8.3f} {max(acc):8.3f}")
    print(f"{'hfscale launch --dry-run (start-up + load + plan only)':<{w}} {med(dry):8.3f} {min(dry):8.3f} {max(dry):8.3f}")
    print(f"{'python -c pass (bare interpreter start)':<{w}} {med(bare):8.3f} {min(bare):8.3f} {max(bare):8.3f}")
    print("-" * len(head))
    over = (med(hf) - med(acc)) / med(acc) * 100
    paired = med([h - a for h, a in zip(hf, acc)])
    over_min = (min(hf) - min(acc)) / min(acc) * 100
    print(f"overhead on medians: {over:+.1f}%  (median of paired differences {paired:+.3f}s = "
          f"{paired / med(acc) * 100:+.1f}%; on minima {over_min:+.1f}%)")
    spread = (max(acc) - min(acc)) / med(acc) * 100
    if p2["busy"]:
        print(f"CPU busy during these runs (whole box, any process): median {med(p2['busy']):.0f}%")
    verdict = "met" if over <= TARGET_OVERHEAD_PCT else "NOT met"
    print(f"target overhead <= {TARGET_OVERHEAD_PCT:.0f}% (on medians): {over:+.1f}% -> {verdict}"
          f"  [run-to-run spread of the direct runs: {spread:.0f}%]")
    print(f"  hfscale's fixed pre-launch work (--dry-run, {med(dry):.2f}s) alone is {med(dry) / med(acc) * 100:.1f}% "
          f"of this {med(acc):.1f}s job; 3% of it is {0.03 * med(acc):.2f}s")


# ----------------------------------------------------------------------------- main

def _cleanup() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the teardown
    for p in list(_live):
        finish(p)
    for cl, stop in _clusters:
        print(f"stopping cluster {cl.id} ...", file=sys.stderr, flush=True)
        stop(cl)
    _clusters.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per part-1 row and host count (default 3)")
    ap.add_argument("--local-repeat", type=int, default=5, help="timed runs of each part-2 command (default 5)")
    ap.add_argument("--hosts", type=int, default=8, help="hosts of the big cluster (default 8)")
    ap.add_argument("--launchers", default="torchrun,accelerate",
                    help="comma-separated launchers for the dist_probe rows (default torchrun,accelerate)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip part 1's untimed warm-up launch")
    ap.add_argument("--timeout", type=float, default=300, help="seconds allowed per launch (default 300)")
    ap.add_argument("--skip-cluster", action="store_true", help="part 2 only")
    ap.add_argument("--backend", default="deepspeed", choices=["deepspeed", "ddp"],
                    help="part 2's distributed.backend (ddp where deepspeed is not installed; default deepspeed)")
    ap.add_argument("--skip-local", action="store_true", help="part 1 only")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (configs, run dirs, logs)")
    args = ap.parse_args(argv)
    args.launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    if args.repeat < 1 or args.local_repeat < 1 or args.hosts < 2:
        ap.error("--repeat and --local-repeat must be >= 1, --hosts >= 2")
    if not set(args.launchers) <= {"torchrun", "accelerate"}:
        ap.error("--launchers: torchrun and/or accelerate")

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where started with SIGINT ignored
    tmp = Path(tempfile.mkdtemp(prefix="bench_launch_"))
    print(f"python {sys.version.split()[0]} ({sys.executable}), {os.cpu_count()} cpus, load avg {load()}; "
          f"work dir {tmp}", flush=True)
    p1 = p2 = None
    rc = 0
    try:
        if not args.skip_cluster:
            p1 = part1(args, tmp)
            if p1 is not None and "error" in p1:
                rc, p1 = 1, None
        if not args.skip_local:
            p2 = part2(args, tmp)
    except BenchError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        rc = 1
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        rc = 130
    finally:
        _cleanup()
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n" + "=" * 100)
    if p1:
        report1(args, p1)
    elif not args.skip_cluster:
        print("Part 1: no results (skipped, failed or interrupted; see above)")
    if p2:
        report2(args, p2)
    print(f"load avg at the end: {load()} (other processes on this box add noise to every number)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
