"""Train a tiny GPT-2 with a plain accelerate loop; batch geometry comes from an hfscale config.

    hfscale config examples/accelerate_loop/config.yaml --out generated/accelerate_loop
    DS_ACCELERATOR=cpu accelerate launch --config_file generated/accelerate_loop/accelerate_config.yaml \
        examples/accelerate_loop/train.py --config examples/accelerate_loop/config.yaml

The model is built from ``training.model.config`` (random init, nothing downloaded). The data are
the bytes of the Python standard library's own source files (token = byte value, vocabulary 256).
At the end every rank prints one line: ``HFSCALE_RANK rank=R world_size=W steps=S loss=L``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DummyOptim, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModelForCausalLM

import hfscale


def stdlib_blocks(block_size: int, n_blocks: int) -> torch.Tensor:
    """``n_blocks`` rows of ``block_size`` byte tokens from the standard library's .py files (sorted)."""
    data, n = bytearray(), block_size * n_blocks
    for path in sorted(Path(os.path.dirname(os.__file__)).glob("*.py")):
        data += path.read_bytes()
        if len(data) >= n:
            return torch.tensor(list(data[:n]), dtype=torch.long).view(n_blocks, block_size)
    raise SystemExit(f"the standard library has only {len(data)} bytes of source, {n} needed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.environ.get("HFSCALE_CONFIG"),
                    help="the hfscale YAML this job was generated from (default: $HFSCALE_CONFIG, set by hfscale launch)")
    ap.add_argument("--max-steps", type=int, help="optimizer steps (default: training.max_steps)")
    args = ap.parse_args()
    if not args.config:
        ap.error("--config is required outside hfscale launch")

    job = hfscale.load_job(args.config)  # the YAML's batch geometry and training settings
    cfg, t = job.config, job.config.training
    steps = args.max_steps or t.max_steps or 100

    # On a machine without CUDA, DeepSpeed mode must be told to use gloo (else every rank runs alone).
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(kwargs_handlers=handlers)
    if accelerator.num_processes != job.world_size:
        raise SystemExit(f"started {accelerator.num_processes} processes but {args.config} "
                         f"says world size {job.world_size}: launch with the accelerate config generated from it")
    if accelerator.num_processes > 1 and accelerator.distributed_type == "NO":
        # accelerate runs FSDP and DDP configs on GPUs only; on CPU each rank would train its own model.
        raise SystemExit(f"{accelerator.num_processes} processes but no distributed engine: on a machine "
                         "without GPUs use distributed.backend: deepspeed")
    set_seed(t.seed)

    # Built after the Accelerator, so that with ZeRO-3 the model is created already partitioned.
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**t.model.config))

    # Exactly enough blocks for `steps` optimizer steps over all ranks.
    blocks = stdlib_blocks(t.data.block_size, steps * job.global_batch_size)
    loader = DataLoader(TensorDataset(blocks), batch_size=cfg.batch.micro_batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(t.seed))

    opt_kw = dict(lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon,
                  weight_decay=t.weight_decay)
    ds = accelerator.state.deepspeed_plugin
    if ds is not None and "optimizer" in ds.deepspeed_config:
        optimizer = DummyOptim(model.parameters(), **opt_kw)  # DeepSpeed builds its own (offload)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **opt_kw)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    model.train()
    step, loss = 0, torch.tensor(float("nan"))
    for (tokens,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            hfscale.step(step)  # for hfscale launch's hang watchdog (does nothing elsewhere)
            if accelerator.is_main_process and (step % t.logging_steps == 0 or step == 1):
                value = loss.item()  # one device sync
                print(f"step {step}/{steps} loss {value:.4f}", flush=True)
                # hfscale launch's progress line and hfscale runs (rank 0 only; nothing elsewhere)
                hfscale.report(step=step, max_steps=steps, loss=value)
        if step >= steps:
            break

    value = loss.item()
    zero = model.zero_optimization_stage() if accelerator.distributed_type == "DEEPSPEED" else "-"
    print(f"HFSCALE_RANK rank={accelerator.process_index} world_size={accelerator.num_processes} "
          f"steps={step} loss={value:.6f} distributed_type={accelerator.distributed_type.value} "
          f"zero_stage={zero}", flush=True)
    accelerator.end_training()
    if not math.isfinite(value):
        raise SystemExit(f"rank {accelerator.process_index}: loss is {value}")
    # Skip interpreter teardown: under load, gloo/DeepSpeed threads still alive there can abort a
    # finished rank (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
