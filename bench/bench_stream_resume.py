#!/usr/bin/env python
"""Benchmark: a streaming dataset's resume at a late step against an early one, with the position
saved in the checkpoint (hfscale's DataStateCallback) and with the Trainer's replay.

The job: tests/scripts/hf_clm_stream.py, an unchanged Trainer script on
``datasets.load_dataset("json", streaming=True)`` whose ``.map()`` costs ``--cost`` seconds an
example (a tokenizer's time; the issue's 4 ms), under ``hfscale launch``: 2 ranks, DeepSpeed ZeRO-2
on the CPU, a tiny GPT-2, 8 examples a step. Two uninterrupted runs save a checkpoint at
``--near`` and at ``--far`` steps and train ``--after`` steps past it; then each checkpoint is
resumed twice, once from the saved position and once with the position's file removed (the
Trainer's replay, what every resume did before), training the same ``--after`` steps. Reported:
each resume's start parts from rank 0's marks (hfscale.launch.recovery.timeline.start_parts: the
launch to the first new step's end, *data fast-forward* among them), the ratio far/near, and
whether every resumed step's loss equals the uninterrupted run's.

    python bench/bench_stream_resume.py                   # near 20, far 2000: about 10 min on 2 cores
    python bench/bench_stream_resume.py --far 400         # the issue's first observation
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfscale.launch.recovery.timeline import start_parts  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "hf_clm_stream.py"
MODEL = "n_layer=2,n_head=2,n_embd=64,vocab_size=256,n_positions=64,bos_token_id=0,eos_token_id=0"
PER_STEP = 8


def make_data(folder: Path, records: int) -> None:
    text = b"".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("*.py"))[:40])
    folder.mkdir(parents=True)
    per_file = -(-records // 8)
    for f in range(8):
        with open(folder / f"part-{f}.jsonl", "w") as out:
            for n in range(f * per_file, min(records, (f + 1) * per_file)):
                piece = text[(n * 64) % (len(text) - 64):][:64].decode("latin-1")
                out.write(json.dumps({"id": n, "text": piece}) + "\n")


def config(job: Path, data: Path, cost: float, max_steps: int, save_steps: int, port: int) -> Path:
    import yaml

    doc = {
        "name": "stream", "cluster": {"nproc_per_node": 2, "master_port": port},
        "runner": {"launcher": "accelerate"},
        "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2, "steps_per_print": 10 ** 9}},
        "precision": "no", "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
        "training": {"script": str(SCRIPT),
                     "script_args": ["--model_type", "gpt2", "--config_overrides", MODEL, "--data_dir", str(data),
                                     "--example_cost", str(cost), "--report_file", "report.json",
                                     "--disable_tqdm", "true"],
                     "output_dir": "out", "max_steps": max_steps, "save_steps": save_steps, "logging_steps": 1,
                     "learning_rate": 1.0e-3, "seed": 7},
    }
    job.mkdir(parents=True, exist_ok=True)
    path = job / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def launch(cfg: Path) -> tuple[float, dict[str, float], str]:
    """Run the job; (its wall seconds, its start parts, its output)."""
    runs = cfg.parent / "runs"
    before = set(runs.iterdir()) if runs.is_dir() else set()
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(cfg)], cwd=cfg.parent, capture_output=True,
                       text=True, timeout=3600)
    wall = time.time() - t0
    if r.returncode != 0:
        sys.exit(f"bench: the launch failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    (run,) = set(runs.iterdir()) - before
    return wall, start_parts(run, t0) or {}, r.stdout + r.stderr


def losses(job: Path) -> dict[int, float]:
    history = json.loads((job / "report.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--near", type=int, default=20)
    ap.add_argument("--far", type=int, default=2000)
    ap.add_argument("--after", type=int, default=10, help="steps trained past each checkpoint")
    ap.add_argument("--cost", type=float, default=0.004, help="seconds the map spends on an example")
    a = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    tmp = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    data = tmp / "data"
    make_data(data, (a.far + a.after + 2) * PER_STEP)
    rows, same = [], {}
    for at, port in ((a.near, 29641), (a.far, 29642)):
        job = tmp / f"at-{at}"
        cfg = config(job, data, a.cost, at + a.after, at, port)
        wall, _, _ = launch(cfg)
        full = losses(job)
        print(f"uninterrupted run to step {at + a.after}: {wall:.1f} s", flush=True)
        state = job / "out" / f"checkpoint-{at}" / "hfscale_data_state.json"
        kept = state.read_bytes()
        for how in ("saved position", "replay"):
            shutil.rmtree(job / "out" / f"checkpoint-{at + a.after}", ignore_errors=True)
            if how == "replay":
                state.unlink()
            wall, parts, said = launch(cfg)
            if how == "saved position":
                assert "(no replay)" in said, said[-2000:]
            else:
                assert "the Trainer replays the stream" in said, said[-2000:]
            got = losses(job)
            same[(at, how)] = all(got.get(s) == full[s] for s in range(at + 1, at + a.after + 1))
            rows.append((at, how, wall, parts))
        state.write_bytes(kept)
    names = ["process", "imports", "model", "engine", "checkpoint", "data", "first_step"]
    print()
    print(f"| resumed at | how | {' | '.join(names)} | launch to first new step | equal losses |")
    print("|" + " --- |" * (len(names) + 4))
    total = {}
    for at, how, wall, parts in rows:
        total[(at, how)] = sum(parts.values())
        cells = " | ".join(f"{parts[n]:.2f}" if n in parts else "-" for n in names)
        print(f"| {at} | {how} | {cells} | {total[(at, how)]:.2f} s | {same[(at, how)]} |")
    print()
    for how in ("saved position", "replay"):
        near, far = total[(a.near, how)], total[(a.far, how)]
        bound = 1.2 * near + 1.0
        print(f"{how}: step {a.far} {far:.2f} s vs step {a.near} {near:.2f} s: x{far / near:.2f} "
              f"(the bound 1.2x + 1 s = {bound:.2f} s: {'within' if far <= bound else 'over'})")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
