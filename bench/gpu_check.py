"""GPU check (not a test; CI has no GPU): hfscale's Trainer integration on one real CUDA device.

    python bench/gpu_check.py [--steps 60] [--repeat 3]

A GPT-2 (124M-class, byte-level vocabulary) in bf16 trained by the HF Trainer with the
TrainingArguments hfscale builds from a YAML, on the Python standard library's source bytes.
Prints, measured in one run:
  * tokens/s and steps/s with and without hfscale's callbacks (interleaved), and the overhead;
  * what MetricsCallback reported (tokens/s, MFU against the device's peak, CUDA peak memory)
    next to torch's own ``max_memory_allocated`` and an independent tokens/s from our own timer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfscale.rules.config_file import load_text  # noqa: E402
from hfscale.rules.trainer_args import training_arguments  # noqa: E402
from hfscale.training.callbacks import CheckpointCompleteCallback, MetricsCallback, PreemptionCallback, StragglerCallback  # noqa: E402
from hfscale.training.instrument import PEAK_TFLOPS  # noqa: E402
from hfscale.training.train import stdlib_bytes  # noqa: E402

BLOCK = 1024


class Blocks(torch.utils.data.Dataset):
    def __init__(self, n: int):
        data = stdlib_bytes(n * BLOCK)
        self.t = torch.tensor(list(data), dtype=torch.long).view(n, BLOCK)

    def __len__(self):
        return len(self.t)

    def __getitem__(self, i):
        return {"input_ids": self.t[i], "labels": self.t[i]}


class Timer(TrainerCallback):
    """Our own clock, present in both variants: wall time of the steps after the warm-up."""

    def __init__(self, warmup: int):
        self.warmup, self.t0, self.t1, self.steps = warmup, None, None, 0

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.warmup:
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()
        elif state.global_step > self.warmup:
            self.steps += 1
            if state.global_step == state.max_steps:
                torch.cuda.synchronize()
                self.t1 = time.perf_counter()


def run(with_callbacks: bool, steps: int, warmup: int, micro: int, out: str) -> dict:
    yaml_text = f"""
name: gpu-check
distributed: {{backend: ddp}}
precision: bf16
batch: {{micro_batch_size: {micro}, gradient_accumulation_steps: 1}}
training:
  output_dir: {json.dumps(out)}
  max_steps: {steps}
  learning_rate: 3.0e-4
  logging_steps: 10
  save_steps: 100000
"""
    job = load_text(yaml_text, "gpu-check.yaml", Path("."))
    args = training_arguments(job, None, disable_tqdm=True, dataloader_num_workers=2, save_strategy="no")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=256, n_positions=BLOCK,
                                       bos_token_id=0, eos_token_id=0))
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(micro * (steps + 2)))
    timer = Timer(warmup)
    trainer.add_callback(timer)
    metrics = None
    if with_callbacks:
        name = torch.cuda.get_device_name()
        peak = next((tf * 1e12 for k, tf in PEAK_TFLOPS.items() if k in name), None)
        metrics = MetricsCallback(seq_len=BLOCK, peak_flops_per_device=peak, trainer=trainer)
        for cb in (metrics, StragglerCallback(trainer=trainer), PreemptionCallback(), CheckpointCompleteCallback()):
            trainer.add_callback(cb)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    wall = timer.t1 - timer.t0
    res = {"steps_per_s": timer.steps / wall, "tokens_per_s": timer.steps * micro * BLOCK / wall,
           "torch_max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20}
    if metrics is not None:
        res["metrics"] = metrics.last
    del trainer, model
    torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU")
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeat):
            for variant in (False, True) if i % 2 == 0 else (True, False):
                rows[variant].append(run(variant, a.steps, a.warmup, a.micro, f"{tmp}/r{i}{int(variant)}"))
    for variant, label in ((False, "without hfscale callbacks"), (True, "with hfscale callbacks")):
        sps = [r["steps_per_s"] for r in rows[variant]]
        tps = [r["tokens_per_s"] for r in rows[variant]]
        print(f"{label:28s} steps/s median {statistics.median(sps):7.3f} (min {min(sps):.3f} max {max(sps):.3f})  "
              f"tokens/s median {statistics.median(tps):,.0f}")
    base = statistics.median(r["steps_per_s"] for r in rows[False])
    withc = statistics.median(r["steps_per_s"] for r in rows[True])
    print(f"callback overhead on median steps/s: {100 * (base - withc) / base:+.2f}% (target <= 1%)")
    last = rows[True][-1]
    m = last["metrics"]
    print("MetricsCallback's last record:", json.dumps({k: m[k] for k in ("step", "tokens_per_s", "samples_per_s",
                                                                          "step_time_s", "mem_peak_mb", "mfu",
                                                                          "flops_per_token")}))
    print(f"independent: tokens/s {last['tokens_per_s']:,.0f} (our timer), torch max_memory_allocated "
          f"{last['torch_max_allocated_mb']:.0f} MB; MetricsCallback mem_peak_mb {m['mem_peak_mb']:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
