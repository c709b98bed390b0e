"""hfscale plan's memory estimate against a real GPU: predicted vs torch.cuda.max_memory_reserved.

For a grid (ZeRO stage 0-3 on one GPU, micro batch, gradient checkpointing, three Llama-style
model sizes) each setting runs a few real DeepSpeed steps (bf16, AdamW) in its own process, so
an out-of-memory ends that process only and every measurement starts from a clean allocator.
Prints predicted (hfscale.memory's ``reserved``: everything but the CUDA context) vs measured,
the error, and whether hfscale said "fits" for a setting that ran out of memory (it never must).
Goal (issue 15): median |error| <= 10 %, max <= 20 %.

    python bench/bench_memory.py            # on a machine with a CUDA GPU
    python bench/bench_memory.py --predict  # the grid and the predictions only (no GPU needed)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfscale.memory import Setting, estimate  # noqa: E402
from hfscale.model_shape import shape_of  # noqa: E402

SIZES = {
    "160M": {"model_type": "llama", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 32000},
    "600M": {"model_type": "llama", "hidden_size": 1536, "num_hidden_layers": 16, "num_attention_heads": 12,
             "num_key_value_heads": 4, "intermediate_size": 4096, "vocab_size": 32000},
    "1.4B": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 8, "intermediate_size": 5632, "vocab_size": 32000},
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
    return out


def run_one(size: str, s: Setting) -> dict:
    """One setting in this process: a few steps, then the allocator's peak (or "oom")."""
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed("nccl")
    cfg = dict(SIZES[size])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="sdpa")
    if s.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ds = {"train_micro_batch_size_per_gpu": s.micro_batch, "gradient_accumulation_steps": 1,
          "bf16": {"enabled": True}, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": s.stage, "reduce_bucket_size": s.reduce_bucket,
                                "allgather_bucket_size": s.allgather_bucket, "overlap_comm": s.overlap_comm,
                                "stage3_prefetch_bucket_size": s.prefetch_bucket}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    ids = torch.randint(0, cfg["vocab_size"], (s.micro_batch, s.seq_len), device="cuda")
    try:
        for _ in range(STEPS):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        return {"oom": True, "reserved": torch.cuda.max_memory_reserved()}
    return {"oom": False, "reserved": torch.cuda.max_memory_reserved()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--predict", action="store_true", help="print the grid and predictions only")
    ap.add_argument("--size", choices=sorted(SIZES), help="one model size only (each size is ~16 runs)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    cases = grid()
    if a.one is not None:
        size, s = cases[int(a.one)]
        print(json.dumps(run_one(size, s)))
        return
    total = None
    if not a.predict:
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        print(f"GPU: {torch.cuda.get_device_name(0)}, {total / 2**30:.1f} GiB")
    print(f"{'model':>5} {'setting':<70} {'predicted':>10} {'measured':>10} {'error':>7}  verdict")
    errors, wrong = [], 0
    for i, (size, s) in enumerate(cases):
        if a.size and size != a.size:
            continue
        e = estimate(shape_of(SIZES[size]), s)
        predicted = e.reserved / 2**30
        if a.predict:
            print(f"{size:>5} {s.describe():<70} {predicted:>9.2f}G")
            continue
        r = subprocess.run([sys.executable, __file__, "--one", str(i)], capture_output=True, text=True, timeout=900)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        got = json.loads(lines[-1]) if lines else {"oom": True, "reserved": 0}
        fits = e.gpu_total <= total
        if got["oom"]:
            verdict = "OOM, predicted fits: WRONG" if fits else "OOM, predicted does not fit"
            wrong += fits
            print(f"{size:>5} {s.describe():<70} {predicted:>9.2f}G {'OOM':>10} {'':>7}  {verdict}")
            continue
        measured = got["reserved"] / 2**30
        err = (predicted - measured) / measured
        errors.append(abs(err))
        print(f"{size:>5} {s.describe():<70} {predicted:>9.2f}G {measured:>9.2f}G {err:>+7.1%}  "
              f"{'fits' if fits else 'predicted does not fit, ran'}")
    if errors:
        print(f"\n{len(errors)} settings ran: median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}; "
              f"'fits' predicted for a setting that ran out of memory: {wrong}")


if __name__ == "__main__":
    main()
