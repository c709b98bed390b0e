#!/usr/bin/env python
"""Benchmark: the loss guard's judgement per optimizer step (hfscale.training.loss_guard), as a
fraction of the README job's model's step time, against LLM Foundry's KillLossSpike's per-step work.

In one run, interleaved, medians of 5 rounds:
  * ``LossGuard.observe(step, loss, grad_norm)`` over 100,000 steps of a noisy falling curve (both
    measures judged, windows of 100);
  * the named alternative's per-step work, as its source does it (llmfoundry/callbacks/
    kill_loss_spike_callback.py: ``np.mean`` over a deque of the last 100 losses, each step; the
    loss only; llm-foundry and composer are not installed here, so its arithmetic is rebuilt);
  * one optimizer step of the README job's model (examples/tiny_cpu: GPT-2, 4 layers, 128 wide,
    micro batch 8 x 128 tokens, AdamW) in this process on CPU: forward, backward, step.

Not measured here: getting the loss to the host (``loss.item()``: a device sync on a GPU, which the
Trainer already does at each logging step) and agreeing on an alarm across ranks (one all-reduce of
a flag); they come with the wiring, not built yet.

    python bench/bench_loss_guard.py
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfscale.training.loss_guard import LossGuard  # noqa: E402

STEPS = 100_000


def curve(n: int) -> list[tuple[float, float]]:
    rng = random.Random(0)
    return [((2.0 + 3.5 * math.exp(-t / 400)) * math.exp(rng.gauss(0, 0.15)), math.exp(rng.gauss(0, 0.5)))
            for t in range(n)]


def guard_per_step(values: list[tuple[float, float]]) -> float:
    g = LossGuard()
    t0 = time.perf_counter()
    for i, (loss, grad) in enumerate(values, 1):
        if g.observe(i, loss, grad) is not None:
            raise SystemExit(f"an alarm on an ordinary curve at step {i}")
    return (time.perf_counter() - t0) / len(values)


def foundry_per_step(values: list[tuple[float, float]]) -> float:
    import numpy as np

    window: deque[float] = deque(maxlen=100)
    outliers = 0
    t0 = time.perf_counter()
    for loss, _ in values:
        if len(window) == window.maxlen:
            avg = np.mean(window)
            outliers = outliers + 1 if loss > 2 * avg else 0
        window.append(loss)
    return (time.perf_counter() - t0) / len(values)


def model_step_s(rounds: int = 10) -> float:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=256, n_positions=128,
                                       bos_token_id=0, eos_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 256, (8, 128))
    times = []
    for i in range(rounds + 2):
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    values = curve(STEPS)
    ours, theirs = [], []
    for _ in range(5):
        ours.append(guard_per_step(values))
        theirs.append(foundry_per_step(values))
    g, f = statistics.median(ours), statistics.median(theirs)
    step = model_step_s()
    print(f"loss guard (loss and gradient norm): {g * 1e6:.2f} us per step (median of 5 x {STEPS:,} steps)")
    print(f"KillLossSpike's per-step work (loss only, np.mean over 100): {f * 1e6:.2f} us per step; "
          f"ratio {f / g:.1f}x")
    print(f"README job's model, one optimizer step in this process on CPU: {step * 1e3:.1f} ms")
    print(f"the judgement's share of a step: {g / step:.2e} ({g / step * 100:.4f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
