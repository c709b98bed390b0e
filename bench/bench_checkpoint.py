#!/usr/bin/env python
"""Benchmark: the training time lost per checkpoint, asynchronous saves vs the synchronous save.

The same HF Trainer job (a GPT-2 built from a config, nothing downloaded; byte-level blocks of the
Python standard library's ``.py`` files, as in tests/scripts/trainer_run.py; CPU, DeepSpeed ZeRO on
``--ranks`` processes under torchrun, gloo) runs ``--steps`` optimizer steps three ways: saving
nothing (the baseline), saving every ``--save-steps`` with ``training.async_save: false``
(DeepSpeed's torch.save engine: every rank waits until every shard is written), and with ``true``
(DeepSpeed's decoupled writer fed a snapshot, hfscale.training.async_save); the three interleaved
``--repeat`` times inside ONE torchrun launch (fresh model with the same seed, fresh Trainer and
DeepSpeed engine per run). The saving variants run hfscale's CheckpointCompleteCallback (the
marker, and rotation with ``save_total_limit`` 2).

Three measures of the pause per checkpoint, on rank 0 (timer callbacks record
``time.perf_counter()`` at every ``on_step_begin`` and ``on_step_end``):

- gap: the interval that follows a step with a save holds the save (the Trainer saves after
  ``on_step_end``) and the next step; the gap is that interval minus the median of the plain
  intervals around it (two before, two after). The last step saves nothing (``--steps`` is not a
  multiple of ``--save-steps``), so every save measured is followed by a full step.
- lost: the time the run took from the end of step ``--warmup`` to its last save, minus the time
  the no-save run of the same round took for the same steps, per save in that stretch. It holds
  what the gap may leave out (writers that slow the steps after the one with the save) and the
  run-to-run noise of a shared machine (two runs' step times differ by a few per cent, over
  every step of the stretch).
- direct, measured inside: the save itself (step end to the next step's begin), the commit calls
  at the step that follows (the ranks' agreement, or the wait for the writers) and the
  asynchronous marker.

What stays synchronous with ``async_save``: the Trainer's own files, written before the save returns
(``model.safetensors`` by rank 0 under ZeRO-1/2, not under ZeRO-3 unless gather_16bit_weights_on_model_save;
RNG states, ``trainer_state.json``, the scheduler), and the snapshot of the state handed to the
writer (a copy into shared memory, into buffers reused from save to save).

    python bench/bench_checkpoint.py                               # ZeRO-2, 2 ranks
    python bench/bench_checkpoint.py --ranks 1 --precision bf16    # a core left to the writer, as on a GPU node
    python bench/bench_checkpoint.py --stage 3 --ranks 1
    python bench/bench_checkpoint.py --layers 12 --width 768 --repeat 3
    python bench/bench_checkpoint.py --tier local --ranks 1 --precision bf16   # the local tier's saves

With ``--tier local`` the saves are the local tier's (``training.local_checkpoints`` every
``--save-steps``, hfscale.training.callbacks.local_tier; no durable save): the Trainer's save
without the whole model file, and with ``--rank-per-node`` the buddy copy, in its thread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = "BENCH_CKPT "


NAMES = {None: "none", False: "sync", True: "async"}  # no saves (the baseline), synchronous, asynchronous


def job_yaml(a: argparse.Namespace, out: str, asynchronous: bool | None, world: int) -> str:
    return f"""\
name: bench-checkpoint
cluster: {{nproc_per_node: {world}}}
distributed:
  backend: deepspeed
  deepspeed: {{stage: {a.stage}, steps_per_print: 100000}}
precision: "{a.precision}"
batch: {{micro_batch_size: {a.micro_batch}, gradient_accumulation_steps: 1}}
training:
  output_dir: {json.dumps(out)}
  max_steps: {a.steps}
  learning_rate: 1.0e-4
  seed: 1234
  logging_steps: 1000
  save_steps: {a.save_steps if asynchronous is not None and a.tier == "durable" else a.steps + 1}
  save_total_limit: 2
  async_save: {json.dumps(bool(asynchronous))}
"""


def worker(a: argparse.Namespace) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, set_seed

    sys.path.insert(0, str(ROOT))
    from hfscale.render.deepspeed import render_deepspeed
    from hfscale.rules.config_file import load_text
    from hfscale.rules.trainer_args import training_arguments
    from hfscale.training import async_save
    from hfscale.training.callbacks import CheckpointCompleteCallback
    from hfscale.training.callbacks.local_tier import LocalCheckpointCallback
    from hfscale.training.train import stdlib_bytes

    torch.set_num_threads(a.threads)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if a.rank_per_node:  # the local tier's nodes: each rank one, so that each part goes to a buddy
        os.environ["HFSCALE_HOST"] = f"node{rank}"
    block = 128
    n = 512
    data = torch.tensor(list(stdlib_bytes(n * block)), dtype=torch.long).view(n, block)

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    class Timer(TrainerCallback):
        """Step-end times (``t``), and with ``begin`` the step-begin times (``b``, by the step it begins)."""

        def __init__(self):
            self.t: dict[int, float] = {}
            self.b: dict[int, float] = {}

        def on_step_begin(self, args, state, control, **kw):
            self.b[state.global_step + 1] = time.perf_counter()
            STEP[0] = state.global_step + 1

        def on_step_end(self, args, state, control, **kw):
            self.t[state.global_step] = time.perf_counter()

    STEP = [0]
    commits: dict[int, float] = {}
    async_save.install()  # before the timer wraps its commit (each optimizer step's, and the one a save waits for)
    commit = async_save.commit

    def timed_commit(engine, wait):  # the ranks' agreement on the writers, or the wait for them, at a step
        t0 = time.perf_counter()
        pending = engine.checkpoint_engine.get_commit_info() is not None
        done = commit(engine, wait)
        if pending:
            commits[STEP[0]] = commits.get(STEP[0], 0.0) + time.perf_counter() - t0
        return done

    async_save.commit = timed_commit

    base = Path(a.scratch)
    orders = ([None, False, True], [True, None, False], [False, True, None])
    for i in range(a.repeat + 1):
        for variant in orders[i % 3]:
            out = str(base / f"run{i}-{NAMES[variant]}")
            job = load_text(job_yaml(a, out, variant, world), "bench.yaml", ROOT)
            os.makedirs(out, exist_ok=True)
            ds_path = os.path.join(out, f".ds.rank{rank}.json")
            Path(ds_path).write_text(render_deepspeed(job))
            args = training_arguments(job, ds_path, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                                      report_to=[])
            set_seed(1234)
            model = GPT2LMHeadModel(GPT2Config(n_layer=a.layers, n_head=a.width // 64, n_embd=a.width,
                                               vocab_size=256, n_positions=block))
            before, timer = Timer(), Timer()
            commits.clear()
            trainer = Trainer(model=model, args=args, train_dataset=Blocks())
            trainer.add_callback(before)  # before the marker's on_step_end, timer after it
            trainer.add_callback(CheckpointCompleteCallback(async_save=bool(variant)))
            if a.tier == "local" and variant is not None:  # the local tier instead of the durable saves
                trainer.add_callback(LocalCheckpointCallback(trainer, a.save_steps, str(base / "local" / "{host}"),
                                                             keep=2, buddy=True, lineage="0123456789abcdef"))
            trainer.add_callback(timer)
            trainer.train()
            where = Path(out) if a.tier == "durable" else base / "local"
            ckpts = sorted((p for p in where.rglob("checkpoint-*") if p.is_dir() and "buddy" not in p.parts),
                           key=lambda p: int(p.name.split("-")[1]))
            size = sum(f.stat().st_size for f in ckpts[-1].rglob("*") if f.is_file()) if ckpts else 0
            if rank == 0:
                shutil.rmtree(base / "local", ignore_errors=True)
            async_save.stop_writers()
            if rank == 0:
                print(RESULT + json.dumps({"run": i, "async": variant, "t": timer.t, "b": timer.b, "a": before.t,
                                           "commits": commits, "bytes": size,
                                           "params": sum(p.numel() for p in model.parameters())}), flush=True)
            del trainer, model
            if rank == 0:
                shutil.rmtree(out, ignore_errors=True)


def pauses(r: dict, save_steps: int, warmup: int) -> tuple[list[float], list[dict[str, float]], float]:
    """(the step-time gap of each save, its direct parts, the median plain step) of one run.

    gap: the interval that holds the save minus the median of the plain intervals around it (two
    before, two after: the load of a shared machine drifts). Direct parts, measured inside: "save",
    from the end of the step that saves to the start of the next (the Trainer's save, the hand-off
    or the synchronous write, the synchronous marker and rotation); "commit", DeepSpeed's wait for
    the writers at the next optimizer step; "marker", the asynchronous marker at that step's end."""
    t = {int(k): v for k, v in r["t"].items()}
    b = {int(k): v for k, v in r["b"].items()}
    a = {int(k): v for k, v in r["a"].items()}
    commits = {int(k): v for k, v in r["commits"].items()}
    steps = sorted(t)
    gaps = {s: t[s] - t[p] for p, s in zip(steps, steps[1:])}
    after_save = {s for s in gaps if (s - 1) % save_steps == 0 and s > 1}
    plain = {s: g for s, g in gaps.items() if s > warmup and s not in after_save}
    out, parts = [], []
    for s in sorted(after_save):
        near = [plain[x] for x in (s - 2, s - 1, s + 1, s + 2) if x in plain]
        out.append(gaps[s] - statistics.median(near))
        parts.append({"save": b[s] - t[s - 1], "commit": commits.get(s, 0.0), "marker": t[s] - a[s]})
    return out, parts, statistics.median(plain.values())


def lost_per_save(r: dict, none: dict, save_steps: int, warmup: int, steps: int) -> float:
    """The time lost per save in one run: from step ``warmup``'s end to the end of the step of its last
    save (so every save counted has had its writers' time inside the stretch: the last save, whose
    writes the end of training waits for, is left out), the run's time over the no-save run's for
    the same steps, divided by the saves made in the stretch."""
    last = max(s for s in range(save_steps, steps, save_steps))
    saves = sum(1 for s in range(warmup, last) if s > 0 and s % save_steps == 0)
    t = {int(k): v for k, v in r["t"].items()}
    n = {int(k): v for k, v in none["t"].items()}
    return ((t[last] - t[warmup]) - (n[last] - n[warmup])) / saves


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    ap.add_argument("--precision", choices=["no", "bf16"], default="no")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=33)
    ap.add_argument("--save-steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved pairs after the first pair")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tier", choices=["durable", "local"], default="durable",
                    help="durable: the Trainer's saves every --save-steps; local: training.local_checkpoints "
                         "every --save-steps instead (no durable save)")
    ap.add_argument("--rank-per-node", action="store_true",
                    help="with --tier local: each rank a node of its own (HFSCALE_HOST), so parts go to buddies")
    ap.add_argument("--scratch", default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    scratch = a.scratch or tempfile.mkdtemp(prefix="bench_ckpt_")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.ranks),
            __file__, "--worker", "--scratch", scratch] + [x for x in sys.argv[1:] if x != "--worker"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(a.threads), "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    shutil.rmtree(scratch, ignore_errors=True)
    lines = [json.loads(ln[len(RESULT):]) for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode or not lines:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
        return 1
    runs = [r for r in lines if r["run"] > 0] or lines  # the first round warms up (imports, the writers' start)
    by: dict[bool, list[float]] = {False: [], True: []}
    direct: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    steps: dict[bool, list[float]] = {False: [], True: []}
    lost: dict[bool, list[float]] = {False: [], True: []}
    for i in sorted({r["run"] for r in runs}):
        trio = {r["async"]: r for r in runs if r["run"] == i}
        if set(trio) != {None, False, True}:
            continue
        for variant in (False, True):
            p, parts, step = pauses(trio[variant], a.save_steps, a.warmup)
            by[variant] += p
            direct[variant] += parts
            steps[variant].append(step)
            lost[variant].append(lost_per_save(trio[variant], trio[None], a.save_steps, a.warmup, a.steps))
    size = next(r["bytes"] for r in lines if r["bytes"])
    print(f"model: GPT-2 {a.layers} layers x {a.width}, {lines[0]['params'] / 1e6:.1f} M parameters, precision "
          f"{a.precision}; ZeRO-{a.stage} on {a.ranks} CPU rank(s), {a.threads} thread(s) each; one checkpoint "
          f"{size / 1e6:.0f} MB on disk")
    print(f"{a.steps} steps, a {a.tier} save every {a.save_steps}; {len(lost[True])} timed round(s) of no saves, sync and async "
          f"after the first; {time.monotonic() - t0:.0f} s in all\n")
    print("pause per checkpoint, s (medians; lost = the time a stretch of steps with saves took over the same steps "
          "without saves, per save; gap = the interval holding the save over its neighbours; direct = save + commit "
          "+ marker)")
    print(f"{'variant':<8} {'saves':>5} {'step':>7} {'lost':>7} {'gap':>7} {'direct':>7} {'save':>7} {'commit':>7} "
          f"{'marker':>7}  lost per round")
    med: dict[bool, dict[str, float]] = {}
    for variant, name in ((False, "sync"), (True, "async")):
        d = direct[variant]
        m = {k: statistics.median(x[k] for x in d) for k in ("save", "commit", "marker")}
        m["direct"] = statistics.median(x["save"] + x["commit"] + x["marker"] for x in d)
        m["gap"] = statistics.median(by[variant])
        m["lost"] = statistics.median(lost[variant])
        med[variant] = m
        print(f"{name:<8} {len(d):>5} {statistics.median(steps[variant]):>7.3f} {m['lost']:>7.3f} {m['gap']:>7.3f} "
              f"{m['direct']:>7.3f} {m['save']:>7.3f} {m['commit']:>7.3f} {m['marker']:>7.3f}  "
              f"{' '.join(f'{x:.2f}' for x in lost[variant])}")
    ratio = med[True]["lost"] / med[False]["lost"]
    gap = med[True]["gap"] / med[False]["gap"]
    inside = med[True]["direct"] / med[False]["direct"]
    print(f"\nratio async/sync pause: {ratio:.3f} by the time lost, {gap:.3f} by the step-time gap, {inside:.3f} "
          f"measured inside; target <= 0.2: {'met' if ratio <= 0.2 else 'NOT met'} by the time lost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
