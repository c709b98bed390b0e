#!/usr/bin/env python
"""Benchmark: training throughput with and without hfscale's Trainer callbacks.

The same HF Trainer run (tiny GPT-2 built from a config, nothing downloaded; byte-level blocks of
the Python standard library's ``.py`` files, as in tests/scripts/trainer_run.py; CPU; no
checkpoint saving: ``save_strategy="no"``; ``logging_steps`` 10) is timed WITHOUT and WITH
``MetricsCallback(trainer=)``, ``StragglerCallback(trainer=)``, ``PreemptionCallback`` and
``CheckpointCompleteCallback`` (as hfscale/training/train.py adds them). The issue's target: overhead <= 1 %.

How it is measured:

  * A minimal timer callback, added first in BOTH variants, records ``time.perf_counter()`` at
    every ``on_step_end``. "window" steps/s of one run = ``--steps`` / (time from the end of step
    ``--warmup`` to the end of step ``--warmup + --steps``); the warm-up steps are left out. Both
    numbers are multiples of ``--logging-steps`` so the window holds the same number of log and
    report steps in both variants. "robust" steps/s = ``--logging-steps`` / the median time of the
    window's ``--logging-steps``-step blocks: each block holds exactly one log step and one
    report step, and blocks hit by a burst of load from other processes drop out.
  * One untimed run of each variant first (the first Trainer run in a process is slower), then
    the two variants interleaved (without, with; then with, without; ...) ``--repeat`` times in
    one process, each run with a fresh model (same seed) and a fresh Trainer. The table shows the
    median of each, min/max, the overhead 1 - with/without (of the medians), the per-pair
    overheads, and the noise floor: how far single WITHOUT runs stray from their own median.
  * Direct cost, below that noise floor: ``--direct-repeat`` more WITH and WITHOUT runs
    (interleaved) in which every hook method of the four callbacks (``on_*``, including the
    inherited no-ops the Trainer still dispatches to) and StragglerCallback's two forward hooks
    are wrapped with a timer, and the Trainer's ``callback_handler.call_event`` too. Shown per
    optimizer step over the same window, as a mean and as the median over the blocks: the time
    inside each callback's hooks (nested ``trainer.log()`` calls are charged once, to the
    callback that made them), and the whole callback dispatch WITH minus WITHOUT. A callback with
    empty hooks, timed the same way and present in both instrumented variants, shows the floor of
    the method (about 1 us per call: a cold Python call after the training step).

Modes:

  * single process (always): plain Trainer, no DeepSpeed, ``--threads`` torch threads (default 1:
    on a small shared box, 2 intra-op threads make the runs vary by up to 10x; 1 is stable).
  * ``--ranks 2``: additionally ``torchrun --nproc_per_node 2`` + DeepSpeed ZeRO-2 on the CPU
    (``DS_ACCELERATOR=cpu``, gloo; ``--threads`` per rank, default 1). All variants and the
    direct measurement run inside ONE torchrun launch (fresh Trainer + DeepSpeed engine per run).
    PreemptionCallback's documented per-step cost, one 1-element ``all_reduce``, is isolated by a
    third interleaved variant with the other three callbacks only, shows in its ``on_step_end``
    row of the direct cost, and a bare 1-element gloo ``all_reduce`` is timed on its own.

Targets are reported, never enforced: the exit code is non-zero only when a run fails.

    python bench/bench_callbacks.py                      # single process, 5 interleaved repeats
    python bench/bench_callbacks.py --ranks 2            # + 2-rank torchrun + DeepSpeed ZeRO-2
    python bench/bench_callbacks.py --repeat 9 --steps 400
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

ROOT = Path(__file__).resolve().parents[1]
TARGET_OVERHEAD_PCT = 1.0
BLOCK = 64
N_BLOCKS = 1024
MICRO_BATCH = 4
SEED = 1234
CALLBACKS = ("MetricsCallback", "StragglerCallback", "PreemptionCallback", "CheckpointCompleteCallback")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# ---- worker: runs inside the training process(es) ------------------------------------------------


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        set_seed,
    )

    from hfscale.training.callbacks import (
        CheckpointCompleteCallback,
        MetricsCallback,
        PreemptionCallback,
        StragglerCallback,
    )
    from hfscale.rules.config_file import load_text
    from hfscale.render.deepspeed import render_deepspeed
    from hfscale.rules.trainer_args import training_arguments
    from hfscale.training.train import stdlib_bytes

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    work = Path(a.work_dir)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    max_steps = a.warmup + a.steps

    # byte-level data: the stdlib's .py files, sorted, packed into BLOCK-token blocks
    blocks = torch.tensor(list(stdlib_bytes(N_BLOCKS * BLOCK)), dtype=torch.long).view(N_BLOCKS, BLOCK)

    class Blocks(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(blocks)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": blocks[i], "labels": blocks[i]}

    ds = f"  deepspeed: {{stage: {a.zero}, steps_per_print: 1000000}}\n" if a.zero else ""
    yaml_text = f"""\
name: bench-callbacks
cluster: {{nproc_per_node: {world}}}
distributed:
  backend: {"deepspeed" if a.zero else "ddp"}
{ds}precision: "no"
batch: {{micro_batch_size: {MICRO_BATCH}, gradient_accumulation_steps: 1}}
training:
  output_dir: {json.dumps(str(work / "out"))}
  max_steps: {max_steps}
  learning_rate: 1.0e-3
  seed: {SEED}
  logging_steps: {a.logging_steps}
  save_steps: {max_steps}
  save_total_limit: null
"""
    job = load_text(yaml_text, "bench_callbacks.yaml", ROOT)
    ds_path = None
    if job.deepspeed is not None:
        ds_path = str(work / f"ds_config.rank{rank}.json")
        Path(ds_path).write_text(render_deepspeed(job))

    # timing state shared by the timer callback and the wrappers (one run at a time)
    window = {"on": False, "block": 0}

    class StepTimer(TrainerCallback):
        """Callback-free clock: perf_counter at every on_step_end; opens/closes the window."""

        def __init__(self) -> None:
            self.stamps: dict[int, float] = {}

        def on_step_end(self, args, state, control, **kw):
            self.stamps[state.global_step] = time.perf_counter()
            # block b = steps warmup+b*L+1 .. warmup+(b+1)*L, from the end of the step before
            window["block"] = (state.global_step - a.warmup) // a.logging_steps
            if state.global_step == a.warmup:
                window["on"] = True
            elif state.global_step == max_steps:
                window["on"] = False

    def instrument_callbacks(cbs: list) -> dict[str, list]:
        """Wrap every on_* hook (and the straggler forward hooks) with a timer; outermost only."""
        acc: dict[str, list] = {}
        depth = [0]

        def wrap(fn, key):
            cell = acc.setdefault(key, [0.0, 0, [], {}])  # total s, calls, each call's s, s per block

            def timed(*args, **kwargs):
                if depth[0]:
                    return fn(*args, **kwargs)
                depth[0] += 1
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    dt = time.perf_counter() - t0
                    depth[0] -= 1
                    if window["on"]:
                        cell[0] += dt
                        cell[1] += 1
                        cell[2].append(dt)
                        b = window["block"]
                        cell[3][b] = cell[3].get(b, 0.0) + dt

            return timed

        for cb in cbs:
            name = type(cb).__name__
            for attr in dir(cb):
                if attr.startswith("on_") and callable(getattr(cb, attr)):
                    setattr(cb, attr, wrap(getattr(cb, attr), f"{name}.{attr}"))
            if isinstance(cb, StragglerCallback):
                cb._before_forward = wrap(cb._before_forward, f"{name}.forward_pre_hook")
                cb._after_forward = wrap(cb._after_forward, f"{name}.forward_hook")
        return acc

    def instrument_handler(trainer) -> dict[str, list]:
        """Time the Trainer's callback dispatch (outermost call_event), per event."""
        acc: dict[str, list] = {}
        handler = trainer.callback_handler
        original = handler.call_event
        depth = [0]

        def call_event(event, *args, **kwargs):
            if depth[0]:
                return original(event, *args, **kwargs)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return original(event, *args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                depth[0] -= 1
                if window["on"]:
                    cell = acc.setdefault(event, [0.0, 0, [], {}])
                    cell[0] += dt
                    cell[1] += 1
                    b = window["block"]
                    cell[3][b] = cell[3].get(b, 0.0) + dt

        handler.call_event = call_event
        return acc

    class Empty(TrainerCallback):
        """Control for the direct measurement: hooks that do nothing, timed like the others."""

        def on_step_begin(self, args, state, control, **kw):
            return None

        def on_step_end(self, args, state, control, **kw):
            return None

    def one_run(variant: str, instrument: bool) -> dict:
        with_callbacks = variant != "without"
        window["on"], window["block"] = False, 0
        args = training_arguments(job, ds_path, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                                  save_strategy="no", report_to="none")
        set_seed(SEED)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=BLOCK))
        trainer = Trainer(model=model, args=args, train_dataset=Blocks())
        timer = StepTimer()
        trainer.add_callback(timer)
        cbs = []
        if with_callbacks:
            cbs = [MetricsCallback(seq_len=BLOCK, peak_flops_per_device=1e12, trainer=trainer),
                   StragglerCallback(trainer=trainer), PreemptionCallback(), CheckpointCompleteCallback()]
            if variant == "no_preempt":
                cbs = [cb for cb in cbs if not isinstance(cb, PreemptionCallback)]
        if instrument:  # in both variants, so the dispatch difference stays fair
            cbs.append(Empty())
        hooks = instrument_callbacks(cbs) if instrument else {}
        for cb in cbs:
            trainer.add_callback(cb)
        handler = instrument_handler(trainer) if instrument else {}
        trainer.train()
        s = timer.stamps
        if world > 1:
            dist.barrier()
        steps_s = a.steps / (s[max_steps] - s[a.warmup])
        step_times = [s[k] - s[k - 1] for k in range(a.warmup + 1, max_steps + 1)]
        # blocks of logging_steps steps, each with exactly one log and one report step in it
        L = a.logging_steps
        blocks_s = [s[k + L] - s[k] for k in range(a.warmup, max_steps, L)]
        out = {"steps_per_s": steps_s, "median_step_s": statistics.median(step_times),
               "block_steps_per_s": L / statistics.median(blocks_s),
               "hooks": hooks, "handler": handler}
        if with_callbacks:
            reports = [h for h in trainer.state.log_history if "hfscale/step_time_s" in h]
            out["reports"] = len(reports)
        # free the (DeepSpeed) engine before the next run
        del trainer, model
        import gc

        gc.collect()
        return out

    # with several ranks also "no_preempt": the other three, to isolate PreemptionCallback's all_reduce
    variants = ["without", "with"] + (["no_preempt"] if world > 1 else [])
    result: dict = {"world": world, "threads": torch.get_num_threads(), "runs": {v: [] for v in variants},
                    "torch": torch.__version__}
    import transformers

    result["transformers"] = transformers.__version__
    if a.zero:
        import deepspeed

        result["deepspeed"] = deepspeed.__version__
    # one untimed run of each first: the first Trainer run in a process is slower (lazy init)
    for variant in variants:
        one_run(variant, instrument=False)
    for rep in range(a.repeat):
        k = rep % len(variants)  # rotate the order, and reverse it every other time round
        order = variants[k:] + variants[:k]
        if (rep // len(variants)) % 2:
            order = order[::-1]
        for variant in order:
            r = one_run(variant, instrument=False)
            result["runs"][variant].append(r)
            if rank == 0:
                print(f"  [{world} rank{'s' if world > 1 else ''}] rep {rep + 1}/{a.repeat} {variant:<10} "
                      f"{r['steps_per_s']:8.2f} steps/s", flush=True)
    # direct measurement: instrumented runs, interleaved too
    result["direct"] = {"without": [], "with": []}
    for rep in range(a.direct_repeat):
        order = ("without", "with") if rep % 2 == 0 else ("with", "without")
        for variant in order:
            result["direct"][variant].append(one_run(variant, instrument=True))
        if rank == 0:
            print(f"  [{world} rank{'s' if world > 1 else ''}] instrumented pair {rep + 1}/{a.direct_repeat} done",
                  flush=True)
    if world > 1:
        # PreemptionCallback's per-step collective, bare: 1-element int32 all_reduce(MAX) + .item()
        t = torch.zeros(1, dtype=torch.int32)
        times = []
        for i in range(a.allreduce_iters + 20):
            dist.barrier()
            t0 = time.perf_counter()
            x = t.clone()
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            bool(x.item())
            if i >= 20:
                times.append(time.perf_counter() - t0)
        result["allreduce_s"] = {"median": statistics.median(times), "min": min(times), "max": max(times),
                                 "n": len(times)}
        # PreemptionCallback.on_step_end per rank (its all_reduce also waits for the later rank)
        mine = statistics.median(run["hooks"]["PreemptionCallback.on_step_end"][0] / a.steps
                                 for run in result["direct"]["with"])
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        result["preempt_per_rank_s"] = every
        result["backend"] = str(dist.get_backend())
    if rank == 0:
        Path(a.result).write_text(json.dumps(result))


# ---- driver: launches the workers and prints the tables ------------------------------------------


def _launch(a: argparse.Namespace, ranks: int, work: Path) -> dict:
    result = work / "result.json"
    script = [str(Path(__file__).resolve()), "--worker", "--work-dir", str(work), "--result", str(result),
              "--repeat", str(a.repeat), "--direct-repeat", str(a.direct_repeat), "--warmup", str(a.warmup),
              "--steps", str(a.steps), "--logging-steps", str(a.logging_steps),
              "--allreduce-iters", str(a.allreduce_iters), "--threads", str(a.threads)]
    if ranks > 1:
        script += ["--zero", "2"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               *script]
    else:
        cmd = [sys.executable, *script]
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.lstrip().startswith("[") and " rep " in line or "instrumented pair" in line:
            print(line.rstrip(), flush=True)
    rc = proc.wait()
    if rc != 0 or not result.exists():
        print(f"FAILED ({ranks} rank(s), exit {rc}): {' '.join(cmd)}", file=sys.stderr)
        print("".join(lines)[-6000:], file=sys.stderr)
        raise SystemExit(1)
    out = json.loads(result.read_text())
    out["wall_s"] = time.perf_counter() - t0
    out["load"] = (load_before, os.getloadavg()[0])
    return out


def _fmt_us(s: float) -> str:
    return f"{s * 1e6:9.1f}"


def _report(a: argparse.Namespace, label: str, r: dict) -> None:
    runs = r["runs"]
    backend = f", process group backend {r['backend']}" if "backend" in r else ""
    print()
    print(f"== {label}: {r['world']} process(es), {r['threads']} torch thread(s) each{backend}")
    print(f"   {a.steps} timed steps after {a.warmup} warm-up, logging_steps {a.logging_steps}, {a.repeat} "
          f"interleaved repeats; {r['wall_s']:.0f} s wall; 1-min load average {r['load'][0]:.2f} before, "
          f"{r['load'][1]:.2f} after, on {os.cpu_count()} cpus")
    w = 30
    print(f"{'':<{w}} {'window steps/s':^29} | {'robust steps/s (median block)':^29}")
    print(f"{'variant':<{w}} {'median':>9} {'min':>9} {'max':>9} | {'median':>9} {'min':>9} {'max':>9}")
    print("-" * (w + 62))
    meds = {}
    names = [("without", "without hfscale callbacks"), ("with", "with the 4 hfscale callbacks"),
             ("no_preempt", "with 3 (no PreemptionCallback)")]
    for key, name in [x for x in names if x[0] in runs]:
        win = [x["steps_per_s"] for x in runs[key]]
        blk = [x["block_steps_per_s"] for x in runs[key]]
        meds[key] = (statistics.median(win), statistics.median(blk))
        print(f"{name:<{w}} {meds[key][0]:>9.2f} {min(win):>9.2f} {max(win):>9.2f} | "
              f"{meds[key][1]:>9.2f} {min(blk):>9.2f} {max(blk):>9.2f}")
    print("-" * (w + 62))
    over = [(1 - meds["with"][i] / meds["without"][i]) * 100 for i in (0, 1)]
    print(f"{'overhead 1 - with/without':<{w}} {over[0]:>8.2f}% {'':>19} | {over[1]:>8.2f}%")
    if "no_preempt" in runs:
        o3 = [(1 - meds["no_preempt"][i] / meds["without"][i]) * 100 for i in (0, 1)]
        op = [(1 - meds["with"][i] / meds["no_preempt"][i]) * 100 for i in (0, 1)]
        print(f"{'overhead of the 3 others':<{w}} {o3[0]:>8.2f}% {'':>19} | {o3[1]:>8.2f}%")
        print(f"{'PreemptionCallback: 1-with/3':<{w}} {op[0]:>8.2f}% {'':>19} | {op[1]:>8.2f}%")
    for i, field in enumerate(("steps_per_s", "block_steps_per_s")):
        wo = [x[field] for x in runs["without"]]
        pairs = [(1 - b[field] / x) * 100 for x, b in zip(wo, runs["with"])]
        noise = max(abs(x / meds["without"][i] - 1) for x in wo) * 100
        what = "window" if i == 0 else "robust"
        print(f"  {what}: per-pair overheads % " + " ".join(f"{p:+.2f}" for p in pairs)
              + f"; median of pairs {statistics.median(pairs):+.2f}%; noise floor (max |run/median - 1| "
              f"of the WITHOUT runs) {noise:.2f}%")
    verdict = "met" if over[0] <= TARGET_OVERHEAD_PCT else "NOT met"
    noise0 = max(abs(x["steps_per_s"] / meds["without"][0] - 1) for x in runs["without"]) * 100
    print(f"target overhead <= {TARGET_OVERHEAD_PCT:.0f}% (window medians): {verdict}"
          + ("  (but the difference is within the noise floor)" if abs(over[0]) <= noise0 else ""))
    print("  window = steps / wall time over the timed steps; robust = logging_steps / median time of the "
          f"{a.logging_steps}-step blocks (each block holds one log and one report step; contention bursts "
          "drop out)")

    # direct measurement
    d = r["direct"]
    n, L = a.steps, a.logging_steps
    n_blocks = n // L

    def mean_us(runs_acc: list[dict], keys: list[str]) -> float:
        """Median over runs of (time in these hooks / timed steps)."""
        return statistics.median(sum(acc[k][0] for k in keys if k in acc) / n for acc in runs_acc)

    def robust_us(runs_acc: list[dict], keys: list[str]) -> float:
        """Median over all blocks of all runs of (time in these hooks in the block / L)."""
        sums = [sum(acc[k][3].get(str(b), 0.0) for k in keys if k in acc) / L
                for acc in runs_acc for b in range(n_blocks)]
        return statistics.median(sums)

    hw = [run["hooks"] for run in d["with"]]
    first = hw[0]
    calls_per_step = {key: v[1] / n for key, v in first.items()}
    step_wo = statistics.median(1 / x["block_steps_per_s"] for x in runs["without"])
    print()
    print(f"direct cost per optimizer step (instrumented runs: {len(d['with'])} with, {len(d['without'])} without, "
          f"interleaved). mean = hook time / {n} steps (median over runs); robust = median over the "
          f"{L}-step blocks of hook time / {L} (drops the blocks where the OS descheduled us):")
    print(f"  {'callback.hook':<48} {'mean us':>9} {'robust us':>10} {'us/call med':>12} {'calls/step':>11}")
    keys_of: dict[str, list[str]] = {cb: [] for cb in CALLBACKS}
    for key in sorted(first):
        cb = key.split(".")[0]
        if cb in keys_of:
            keys_of[cb].append(key)
        if calls_per_step.get(key, 0) < 0.05 or cb not in CALLBACKS:
            continue
        pc = [t for acc in hw for t in acc[key][2]]
        print(f"  {key:<48} {_fmt_us(mean_us(hw, [key]))} {robust_us(hw, [key]) * 1e6:>10.1f} "
              f"{statistics.median(pc) * 1e6:>12.1f} {calls_per_step[key]:>11.2f}")
    print(f"  {'-' * 93}")
    for cb in CALLBACKS:
        print(f"  {'total ' + cb + ' (all its hooks)':<48} {_fmt_us(mean_us(hw, keys_of[cb]))} "
              f"{robust_us(hw, keys_of[cb]) * 1e6:>10.1f}")
    every = [k for cb in CALLBACKS for k in keys_of[cb]]
    tm, tr = mean_us(hw, every), robust_us(hw, every)
    print(f"  {'total, all four callbacks':<48} {_fmt_us(tm)} {tr * 1e6:>10.1f}   = {tm / step_wo * 100:.2f}% / "
          f"{tr / step_wo * 100:.2f}% of a {step_wo * 1e3:.2f} ms step (robust, WITHOUT runs)")
    print(f"  {'floor: an empty on_step_end, timed the same way':<48} {_fmt_us(mean_us(hw, ['Empty.on_step_end']))} "
          f"{robust_us(hw, ['Empty.on_step_end']) * 1e6:>10.1f}")
    disp = {}
    for key in ("with", "without"):
        acc = [run["handler"] for run in d[key]]
        events = sorted({e for x in acc for e in x})
        disp[key] = (mean_us(acc, events), robust_us(acc, events))
        print(f"  {'Trainer callback dispatch (all events), ' + key:<48} {_fmt_us(disp[key][0])} "
              f"{disp[key][1] * 1e6:>10.1f}")
    dm, dr = disp["with"][0] - disp["without"][0], disp["with"][1] - disp["without"][1]
    print(f"  {'dispatch difference, with - without':<48} {_fmt_us(dm)} {dr * 1e6:>10.1f}   = "
          f"{dm / step_wo * 100:.2f}% / {dr / step_wo * 100:.2f}% of a step")
    if "allreduce_s" in r:
        ar = r["allreduce_s"]
        print(f"  {'bare 1-elem. gloo all_reduce+.item(), per call':<48} {_fmt_us(ar['median'])}   (after a "
              f"barrier; min {ar['min'] * 1e6:.1f}, max {ar['max'] * 1e6:.1f} us, n={ar['n']}) = "
              f"{ar['median'] / step_wo * 100:.2f}% of a step")
        per_rank = ", ".join(f"rank {i} {x * 1e6:.1f}" for i, x in enumerate(r["preempt_per_rank_s"]))
        print(f"  {'PreemptionCallback.on_step_end us/step per rank':<48} {per_rank}")
        print("  (hooks with a collective include the wait for the other rank, and on this box the wait for "
              "the OS to schedule it)")
    reports = sorted({x.get("reports") for x in runs["with"]})
    print(f"  (hfscale/step_time_s log entries per WITH run: {reports}; expected "
          f"{(a.warmup + a.steps) // a.logging_steps})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="interleaved runs of each variant (default 5)")
    ap.add_argument("--direct-repeat", type=int, default=3,
                    help="instrumented runs of each variant for the direct hook cost (default 3)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed optimizer steps per run (default 20)")
    ap.add_argument("--steps", type=int, default=500, help="timed optimizer steps per run (default 500)")
    ap.add_argument("--logging-steps", type=int, default=10)
    ap.add_argument("--ranks", type=int, choices=[1, 2], default=1,
                    help="2: also a 2-rank torchrun + DeepSpeed ZeRO-2 run (default 1: single process only)")
    ap.add_argument("--ranks-steps", type=int, default=200,
                    help="timed optimizer steps per run in the 2-rank mode (default 200)")
    ap.add_argument("--allreduce-iters", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (default 1; 0: torch's default). With 2 threads on a "
                         "shared 2-core box every parallel region waits for a descheduled thread and the "
                         "runs vary 10x")
    # worker mode (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.repeat < 1 or a.direct_repeat < 1:
        ap.error("--repeat and --direct-repeat must be >= 1")
    for name in ("warmup", "steps", "ranks_steps"):
        if getattr(a, name) < a.logging_steps or getattr(a, name) % a.logging_steps:
            ap.error(f"--{name.replace('_', '-')} must be a positive multiple of --logging-steps")
    if a.worker:
        _worker(a)
        return 0

    import platform

    print(f"python {platform.python_version()}, {os.cpu_count()} cpus; tiny GPT-2 (2 layers, 64 wide, "
          f"vocab 256), {MICRO_BATCH} x {BLOCK} tokens per rank per step, no checkpoint saving")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_callbacks_") as tmp:
        print("single process ...", flush=True)
        r1 = _launch(a, 1, Path(tmp) / "single")
        results.append(("single process, plain Trainer", r1, a))
        if a.ranks == 2:
            b = argparse.Namespace(**vars(a))
            if a.ranks_steps:
                b.steps = a.ranks_steps
            print("2 ranks, torchrun + DeepSpeed ZeRO-2 (CPU) ...", flush=True)
            r2 = _launch(b, 2, Path(tmp) / "ranks2")
            results.append(("2 ranks, torchrun + DeepSpeed ZeRO-2", r2, b))
    versions = r1.get("torch"), r1.get("transformers")
    print(f"\ntorch {versions[0]}, transformers {versions[1]}"
          + (f", deepspeed {results[-1][1]['deepspeed']}" if "deepspeed" in results[-1][1] else ""))
    for label, r, args in results:
        _report(args, label, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
