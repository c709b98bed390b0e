#!/usr/bin/env python
"""Benchmark: the restart R after a lost rank, in process (hfscale.training.inprocess) against a relaunch
of every process, on the README's job (examples/tiny_cpu: GPT-2, DeepSpeed ZeRO-2 on the CPU, hfscale's
built-in entry point, 2 ranks).

In process, each process is started as torchrun starts a rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT), with
the store hosted here: the launcher's part of an in-process restart is not built yet. Both sides lose
rank 1 (SIGKILL) in the step after the checkpoint at step 20 is complete:

- in process: rank 0 stays, a standby started with the job (its imports done) takes rank 1;
- relaunch: the job runs under torchrun (one node); every rank is stopped and torchrun starts again at
  once (the least a relaunch costs: no launcher, no probes, no settling).

R is the time from the SIGKILL to the end of the first step trained after it, and its parts, from rank 0's
marks of that start (hfscale.training.heartbeat.PHASES; its 'first_step' mark ends R).
Every run's losses are compared with an uninterrupted run's.

    python bench/bench_inprocess_restart.py            # 3 faults each: about 4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfscale.training.heartbeat import METRICS_FILE, PHASES, PROGRESS_DIR, parts, read_progress  # noqa: E402

STEPS, SAVE, KILL_AFTER = 30, 10, 20


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(tmp: Path, name: str) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "tiny_cpu" / "config.yaml").read_text())
    doc["name"] = name
    doc["training"].update(max_steps=STEPS, save_steps=SAVE, logging_steps=1, save_total_limit=3,
                           output_dir=str(tmp / name / "out"))
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class Ranks:
    """Processes of the built-in entry point, started as torchrun starts ranks."""

    def __init__(self, tmp: Path, name: str, world: int, standbys: int, in_process: bool) -> None:
        import torch.distributed as dist

        self.dir = tmp / name
        (self.dir / "run").mkdir(parents=True, exist_ok=True)
        self.cfg, self.total = config(tmp, name), world + standbys
        self.env = {**os.environ, "DS_ACCELERATOR": "cpu", "HFSCALE_RUN_DIR": str(self.dir / "run"),
                    "PYTHONPATH": str(ROOT)}
        if in_process:  # the store the processes meet on, hosted here
            p = port()
            self.store = dist.TCPStore("127.0.0.1", p, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=60))
            self.env.update(WORLD_SIZE=str(self.total), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(p),
                            LOCAL_WORLD_SIZE=str(self.total), HFSCALE_INPROCESS_WORLD=str(world),
                            HFSCALE_INPROCESS_JOIN_S="3")
            self.procs = [self.start(u) for u in range(self.total)]
        else:
            self.procs = [self.torchrun()]

    def torchrun(self) -> subprocess.Popen:
        """The job as one node's torchrun starts it (its ranks meet on its own store)."""
        env = self.env
        log = open(self.dir / f"torchrun.{time.monotonic_ns()}.log", "w")
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                 str(self.total), "-m", "hfscale.training.train", "--config", str(self.cfg)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def kill_all(self) -> None:
        """torchrun and its ranks (each in a session of its own), SIGKILLed: a job that a relaunch stops."""
        ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
        for line in ps.splitlines():
            pid, _, args = line.strip().partition(" ")
            if str(self.cfg) in args:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()

    def start(self, uid: int) -> subprocess.Popen:
        log = open(self.dir / f"uid{uid}.log", "w")
        env = {**self.env, "RANK": str(uid), "LOCAL_RANK": str(uid)}
        return subprocess.Popen([sys.executable, "-m", "hfscale.training.train", "--config", str(self.cfg)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def step(self) -> int:
        p = read_progress(self.dir / "run" / PROGRESS_DIR / "rank-0", self.dir / "run")
        return p.step if p is not None else 0

    def wait(self) -> list[int]:
        return [p.wait(600) for p in self.procs]

    def losses(self) -> dict[int, float]:
        state = json.loads((self.dir / "out" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
        return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}

    def phases(self) -> dict[str, float]:
        try:
            marks = json.loads((self.dir / "run" / PROGRESS_DIR / METRICS_FILE).read_text()).get("phases") or {}
        except (OSError, ValueError):
            return {}
        return {k: float(v) for k, v in marks.items()}


def fault(tmp: Path, name: str, in_process: bool) -> tuple[float, dict[str, float], dict[int, float]]:
    r = Ranks(tmp, name, 2, 1 if in_process else 0, in_process)
    done = r.dir / "out" / f"checkpoint-{KILL_AFTER}" / "hfscale_complete.json"
    deadline = time.monotonic() + 300
    while not done.exists():
        assert time.monotonic() < deadline and r.procs[0].poll() is None, f"{name}: no checkpoint {KILL_AFTER}"
        time.sleep(0.02)
    while r.step() < KILL_AFTER + 1 and r.procs[0].poll() is None:  # into the step after the save
        time.sleep(0.01)
    if in_process:
        os.killpg(r.procs[1].pid, signal.SIGKILL)
        killed = time.time()
    else:  # every rank of the job stopped, and the job started again as it was: torchrun on this node
        r.kill_all()
        killed = time.time()
        shutil.rmtree(r.dir / "run" / PROGRESS_DIR, ignore_errors=True)
        r.procs = [r.torchrun()]
    while (marks := r.phases()).get("first_step", 0.0) < killed:  # rank 0 marks the start after the fault
        assert time.monotonic() < deadline + 300, f"{name}: no step after the fault"
        time.sleep(0.02)
    rcs = r.wait()
    assert rcs[0] == 0, (name, rcs)
    return marks["first_step"] - killed, parts(marks, killed), r.losses()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--faults", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_inprocess_restart_cpu.txt"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-inprocess-"))
    try:
        ref = Ranks(tmp, "ref", 2, 0, False)  # under torchrun
        assert ref.wait() == [0]
        expected = ref.losses()
        rows: dict[str, list[tuple[float, dict[str, float], bool]]] = {"in process": [], "relaunch": []}
        for i in range(a.faults):
            for mode, flag in (("in process", True), ("relaunch", False)):
                r, split, losses = fault(tmp, f"{mode.replace(' ', '-')}-{i}", flag)
                rows[mode].append((r, split, losses == expected))
                print(f"{mode:10} fault {i}: R {r:6.2f} s  {split}  losses equal: {losses == expected}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = ["# bench_inprocess_restart: R after a SIGKILLed rank, the README's job (2 ranks, ZeRO-2, CPU)", ""]
    lines.append(f"{'':12}" + "".join(f"{p:>12}" for p in (*PHASES, "R")) + "   losses equal")
    for mode, got in rows.items():
        med = {p: statistics.median(s.get(p, 0.0) for _, s, _ in got) for p in PHASES}
        lines.append(f"{mode:12}" + "".join(f"{med[p]:12.2f}" for p in PHASES)
                     + f"{statistics.median(r for r, _, _ in got):12.2f}   {sum(e for *_, e in got)}/{len(got)}")
    lines += ["", f"medians of {a.faults} faults each; R: SIGKILL to the end of step {KILL_AFTER + 1}; the parts: rank "
              "0's marks of that start (in process: 'process' is the failure seen, 'imports' the others' arrival "
              "(restart.QUIET_S once enough arrived) and the new process group)",
              f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs"]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
