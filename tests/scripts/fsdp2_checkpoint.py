#!/usr/bin/env python
"""Write a Trainer checkpoint as accelerate's FSDP2 SHARDED_STATE_DICT save lays it out, from 2 gloo processes.

    python fsdp2_checkpoint.py OUTPUT_DIR --port 29953 [--steps 4]

Why not the Trainer: on a machine without a GPU, accelerate (1.15) runs the job as MULTI_CPU and
drops the FSDP plugin (``AcceleratorState`` turns on FSDP only for GPU-like distributed types), so
``hfscale launch`` with ``distributed.backend: fsdp`` trains with DDP and saves a whole
model.safetensors. FSDP2 itself runs on CPU with gloo, and so does accelerate's save, so this
script does what the Trainer does around them: each of 2 processes builds the same tiny GPT-2,
shards it with ``fully_shard`` (each GPT2Block, then the root: accelerate's TRANSFORMER_BASED_WRAP),
trains ``--steps`` AdamW steps on its own micro-batches, and then

- ``OUTPUT_DIR/checkpoint-<steps>/pytorch_model_fsdp_0/`` and ``optimizer_0/``: accelerate's own
  ``save_fsdp_model`` / ``save_fsdp_optimizer`` with an FSDP2 plugin (``fsdp_version=2``,
  ``SHARDED_STATE_DICT``), as ``Trainer._save_optimizer_and_scheduler`` calls them;
- ``scheduler.pt``, ``rng_state_<rank>.pth``, ``trainer_state.json``: what the Trainer adds (and,
  as from the Trainer, no config.json: ``save_model`` writes nothing for a sharded FSDP state);
- ``OUTPUT_DIR/model/``: the model's config, generation config and tokenizer (the folder a job
  starts from);
- ``OUTPUT_DIR/ref.pt``: the input ids and the logits of the trained, still sharded model (every
  rank runs it; FSDP2 gathers each block's parameters), and those before training, saved by rank 0.
"""

import argparse
import json
import os
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from export_clm import MAX_NEW_TOKENS, ByteBlocks, byte_tokenizer  # noqa: E402

MODEL = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
WORLD = 2


def work(rank: int, out: str, port: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerState

    torch.manual_seed(5)  # the same initial weights on both ranks before they are sharded
    config = GPT2Config(**MODEL)
    model = GPT2LMHeadModel(config)
    model.generation_config.max_new_tokens = MAX_NEW_TOKENS
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        initial = model(input_ids=ids).logits  # before sharding: for the test to show the comparison can fail
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    data = ByteBlocks(32, 64)
    for step in range(steps):
        batch = data.blocks[(step * WORLD + rank) * 2:(step * WORLD + rank) * 2 + 2]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    ckpt = Path(out) / f"checkpoint-{steps}"
    state = PartialState()  # what save_fsdp_* use of the Accelerator: process_index, wait_for_everyone
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    save_fsdp_model(plugin, state, model, str(ckpt))
    save_fsdp_optimizer(plugin, state, optimizer, model, str(ckpt))
    torch.save({"python": random.getstate(), "cpu": torch.random.get_rng_state()}, ckpt / f"rng_state_{rank}.pth")

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    dist.barrier()
    if rank == 0:
        torch.save(scheduler.state_dict(), ckpt / "scheduler.pt")
        TrainerState(global_step=steps, max_steps=steps).save_to_json(str(ckpt / "trainer_state.json"))
        source = Path(out) / "model"
        config.save_pretrained(source)
        model.generation_config.save_pretrained(source)
        byte_tokenizer().save_pretrained(source)
        torch.save({"input_ids": ids, "logits": logits, "initial_logits": initial, "global_step": steps}, Path(out) / "ref.pt")
        print(json.dumps({"checkpoint": str(ckpt), "world_size": WORLD}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("output_dir")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    mp.spawn(work, args=(a.output_dir, a.port, a.steps), nprocs=WORLD)


if __name__ == "__main__":
    main()
