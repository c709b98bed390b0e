"""hfscale plan's memory estimate against a real GPU: predicted vs torch.cuda.max_memory_reserved.

For a grid (ZeRO stage 0-3 on one GPU, micro batch, gradient checkpointing, three Llama-style
model sizes) each setting runs a few real DeepSpeed steps (bf16, AdamW) in its own process, so
an out-of-memory ends that process only and every measurement starts from a clean allocator.
Prints predicted (hfscale.memory.estimate's ``reserved``: everything but the CUDA context) vs measured,
the error, and whether hfscale said "fits" for a setting that ran out of memory (it never must).
Goal (issue 15): median |error| <= 10 %, max <= 20 %.

    python bench/bench_memory.py            # on a machine with a CUDA GPU
    python bench/bench_memory.py --predict  # the grid and the predictions only (no GPU needed)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfscale.memory.estimate import Setting, estimate  # noqa: E402
from hfscale.memory.model_shape import shape_of  # noqa: E402

SIZES = {
    "160M": {"model_type": "llama", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 32000},
    "600M": {"model_type": "llama", "hidden_size": 1536, "num_hidden_layers": 16, "num_attention_heads": 12,
             "num_key_value_heads": 4, "intermediate_size": 4096, "vocab_size": 32000},
    "1.4B": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 8, "intermediate_size": 5632, "vocab_size": 32000},
    # held out: not used while calibrating the estimate (Qwen2-1.5B's shape: a large vocabulary, tied)
    "qwen2-1.5B": {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                   "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936,
                   "tie_word_embeddings": True},
}
SEQ = 2048
STEPS = 3


def grid() -> list[tuple[str, Setting]]:
    base = Setting("deepspeed", 0, False, False, micro_batch=1, accumulation=1, checkpointing=False, precision="bf16",
                   seq_len=SEQ, world=1, gpus_per_node=1, nodes=1, reduce_bucket=50_000_000,
                   allgather_bucket=50_000_000)
    out = []
    for size in SIZES:
        for stage in (0, 1, 2, 3):
            for ckpt in (False, True):
                for micro in (1, 8):
                    out.append((size, replace(base, stage=stage, checkpointing=ckpt, micro_batch=micro,
                                              overlap_comm=stage == 3)))
    # The edge of an 80 GB card: micro batches whose prediction is just under and just over it.
    for stage in (0, 3):
        for micro in (10, 11):
            out.append(("1.4B", replace(base, stage=stage, micro_batch=micro, overlap_comm=stage == 3)))
    return out


def heldout() -> list[tuple[str, Setting]]:
    """Settings the estimate was not tuned on: another architecture and sequence length, and the
    edge of an 80 GB card (run it on an H100: just under must run, just over must be predicted
    not to fit)."""
    base = grid()[0][1]
    out = [("qwen2-1.5B", replace(base, stage=stage, micro_batch=micro, checkpointing=ckpt, seq_len=1024,
                                  overlap_comm=stage == 3))
           for stage in (0, 2, 3) for micro in (1, 4) for ckpt in (False, True)]
    out += [("1.4B", replace(base, stage=stage, micro_batch=micro, overlap_comm=stage == 3))
            for stage, micro in ((0, 10), (0, 11), (2, 10), (3, 11), (3, 12))]
    return out


GRIDS = {"main": grid, "heldout": heldout}


def build_model(size: str):
    """The model on the CPU in fp32, as a script's from_config/from_pretrained leaves it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**SIZES[size]), attn_implementation="sdpa")


def run_one(size: str, s: Setting, port: int, model=None) -> dict:
    """One setting in this process: a few steps, then the allocator's peak (or "oom")."""
    import time

    import deepspeed
    import torch

    t0 = time.monotonic()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed("nccl")
    model = build_model(size) if model is None else model
    if s.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ds = {"train_micro_batch_size_per_gpu": s.micro_batch, "gradient_accumulation_steps": 1,
          "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 10**6,
          "zero_optimization": {"stage": s.stage, "reduce_bucket_size": s.reduce_bucket,
                                "allgather_bucket_size": s.allgather_bucket, "overlap_comm": s.overlap_comm,
                                "stage3_prefetch_bucket_size": s.prefetch_bucket}}
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
        ids = torch.randint(0, SIZES[size]["vocab_size"], (s.micro_batch, s.seq_len), device="cuda")
        for _ in range(STEPS):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        return {"oom": True, "reserved": torch.cuda.max_memory_reserved(), "total": total,
                "seconds": time.monotonic() - t0}
    return {"oom": False, "reserved": torch.cuda.max_memory_reserved(), "total": total,
            "loss": float(loss), "seconds": time.monotonic() - t0}


def forked(fn, *args) -> dict:
    """fn(*args) in a forked child (so it inherits the imports and the CPU model); its dict, or why not."""
    import multiprocessing as mp
    import traceback

    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()

    def child() -> None:
        try:
            q.put(fn(*args))
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which prints it
            q.put({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})

    p = ctx.Process(target=child)
    p.start()
    p.join(900)
    if p.is_alive():
        p.kill()
        return {"error": "timed out after 900 s"}
    return q.get() if not q.empty() else {"error": f"child exited {p.exitcode} with no result"}


def measure(i: int, size: str, s: Setting, model, which: str = "main") -> dict:
    """A clean process per setting: forked from this one when CUDA is untouched here, else a new interpreter."""
    import torch

    if model is not None and not torch.cuda.is_initialized():
        return forked(run_one, size, s, 29500 + i, model)
    r = subprocess.run([sys.executable, __file__, "--grid", which, "--one", str(i)], capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": (r.stderr or "no output")[-2000:]}


@functools.lru_cache(maxsize=None)
def _cases(grid_name: str) -> dict[tuple[str, str], Setting]:
    return {(size, s.describe()): s for size, s in GRIDS[grid_name]()}


def case_of(record: dict) -> tuple[str, Setting]:
    """The model size and Setting a saved record (--json) was measured for."""
    return record["size"], _cases(record.get("grid", "main"))[(record["size"], record["setting"])]


def rescore(path: Path) -> None:
    """A saved measurement (no GPU needed) against today's estimate: the measurements do not depend
    on the estimate, so a changed estimate is scored on the same runs."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    errors, wrong = [], 0
    for r in rows:
        size, setting = case_of(r)
        e = estimate(shape_of(SIZES[size]), setting)
        predicted, fits = e.reserved / 2**30, e.gpu_total <= r["total"]
        if r.get("oom"):
            wrong += fits
            print(f"{r['size']:>10} {r['setting']:<70} {predicted:>9.2f}G {'OOM':>10} {'':>7}  "
                  f"{'OOM, predicted fits: WRONG' if fits else 'OOM, predicted does not fit'}")
            continue
        measured = r["reserved"] / 2**30
        err = (predicted - measured) / measured
        errors.append(abs(err))
        print(f"{r['size']:>10} {r['setting']:<70} {predicted:>9.2f}G {measured:>9.2f}G {err:>+7.1%}  "
              f"{'fits' if fits else 'predicted does not fit, ran'}")
    print(f"\n{len(errors)} settings ran (GPU {rows[0]['total'] / 2**30:.1f} GiB): median |error| "
          f"{statistics.median(errors):.1%}, max {max(errors):.1%}; "
          f"'fits' predicted for a setting that ran out of memory: {wrong}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--predict", action="store_true", help="print the grid and predictions only")
    ap.add_argument("--size", choices=sorted(SIZES), help="one model size only (each size is ~16 runs)")
    ap.add_argument("--budget", type=float, default=0, help="start no new setting after this many seconds")
    ap.add_argument("--json", help="also write each result as a JSON line to this file")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="main",
                    help="main: the calibration grid; heldout: settings the estimate was not tuned on")
    ap.add_argument("--rescore", metavar="JSONL", help="score a saved run (--json) against the current estimate")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rescore:
        rescore(Path(a.rescore))
        return
    cases = GRIDS[a.grid]()
    if a.one is not None:
        size, s = cases[int(a.one)]
        print(json.dumps(run_one(size, s, 29500 + int(a.one))))
        return
    import time

    t0 = time.monotonic()
    if not a.predict:
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # forking needs CUDA untouched here
        import deepspeed  # noqa: F401 - imported once, inherited by every forked setting
        import torch  # noqa: F401
    print(f"{'model':>10} {'setting':<70} {'predicted':>10} {'measured':>10} {'error':>7}  verdict", flush=True)
    errors, wrong, skipped, built = [], 0, 0, {}
    out = open(a.json, "a") if a.json else None
    order = sorted(range(len(cases)), key=lambda j: -list(SIZES).index(cases[j][0]))  # largest first
    for i in (range(len(cases)) if a.predict else order):
        size, s = cases[i]
        if a.size and size != a.size:
            continue
        e = estimate(shape_of(SIZES[size]), s)
        predicted = e.reserved / 2**30
        if a.predict:
            print(f"{size:>10} {s.describe():<70} {predicted:>9.2f}G")
            continue
        if a.budget and time.monotonic() - t0 > a.budget:
            skipped += 1
            continue
        if size not in built:
            built.clear()  # one model size in memory at a time
            built[size] = build_model(size)
        got = measure(i, size, s, built[size], a.grid)
        if out:
            out.write(json.dumps({"grid": a.grid, "size": size, "setting": s.describe(), "predicted": e.reserved,
                                  "predicted_gpu_total": e.gpu_total, **got}) + "\n")
            out.flush()
        if "error" in got:
            print(f"{size:>10} {s.describe():<70} {predicted:>9.2f}G  failed: {got['error'][:200]}", flush=True)
            continue
        fits = e.gpu_total <= got["total"]
        if got["oom"]:
            verdict = "OOM, predicted fits: WRONG" if fits else "OOM, predicted does not fit"
            wrong += fits
            print(f"{size:>10} {s.describe():<70} {predicted:>9.2f}G {'OOM':>10} {'':>7}  {verdict}", flush=True)
            continue
        measured = got["reserved"] / 2**30
        err = (predicted - measured) / measured
        errors.append(abs(err))
        print(f"{size:>10} {s.describe():<70} {predicted:>9.2f}G {measured:>9.2f}G {err:>+7.1%}  "
              f"{'fits' if fits else 'predicted does not fit, ran'} ({got['seconds']:.0f} s)", flush=True)
    if errors:
        print(f"\n{len(errors)} settings ran: median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}; "
              f"'fits' predicted for a setting that ran out of memory: {wrong}; not started (budget): {skipped}")


if __name__ == "__main__":
    main()
