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

  * the wiring's per-step work on 2 ranks (hfscale.training.callbacks.loss_guard's ``on_step_end``):
    the step's loss to the host, one 2-element float64 ``all_reduce`` over gloo between 2 processes
    on this machine, and the judgement; median over 2,000 steps.

On a GPU the loss's trip to the host is a device sync per step (the Trainer already makes one at
each logging step, and PreemptionCallback's flag one every step): not measured here.

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


def _wiring(rank: int, port: int, steps: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    g, values, times = LossGuard(), curve(steps + 100), []
    loss = torch.tensor(0.0)
    for i, (value, grad) in enumerate(values, 1):
        loss.fill_(value)
        t0 = time.perf_counter()
        t = torch.tensor([float(loss.item()), 1.0], dtype=torch.float64)
        dist.all_reduce(t)
        total, count = t.tolist()
        g.observe(i, total / count, grad)
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank == 0:
        out.put(statistics.median(times[100:]))


def wiring_per_step(steps: int = 2000) -> float:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_wiring, args=(r, port, steps, out)) for r in range(2)]
    for p in procs:
        p.start()
    value = out.get(timeout=300)
    for p in procs:
        p.join(60)
    return value


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
    w = wiring_per_step()
    print(f"the wiring on 2 ranks (loss to host, 2-element all_reduce over gloo, judgement): {w * 1e6:.1f} us per "
          f"step; its share of a step: {w / step:.2e} ({w / step * 100:.3f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
