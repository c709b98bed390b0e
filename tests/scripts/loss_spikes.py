#!/usr/bin/env python
"""A Trainer script for the loss guard's tests (tests/test_loss_guard_runs.py): a tiny GPT-2 on a stream
of the standard library's source bytes, instrumented with ``hfscale.instrument(trainer)``.

The stream is read in order (a torch IterableDataset: step t trains samples (t-1)*B .. t*B-1 of it,
B the global batch), so the tests can name a step's data:

- ``POISON_STEPS=a-b``: those steps' samples get labels of one byte the source never holds (0xff: the loss
  jumps): bad data;
- ``LEAVE_OUT_STEPS=a-b[,c-d]``: those steps' samples are not in the stream at all (the reference run
  trained on the same data with those batches removed);
- ``NAN_AT_STEP=s`` with ``NAN_RANK=r``: before step s, rank r's weights get a NaN (silent corruption);
  with ``NAN_ONCE=path`` only once (the file marks it done), with ``NAN_HOST=h`` only on that host.

Rank 0 writes ``losses.json`` in the output_dir at the end: {step: loss} of the Trainer's log history.
"""

import json
import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

import hfscale

BLOCK = 32


def _ranges(text: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, global_batch: int, n: int = 4000):
        data = bytearray()
        for path in sorted(Path(os.path.dirname(os.__file__)).glob("*.py")):
            data += path.read_bytes()
            if len(data) >= BLOCK * n:
                break
        self.blocks = torch.tensor(list(data[: BLOCK * n]), dtype=torch.long).view(n, BLOCK)
        self.batch = global_batch
        self.poison = _ranges(os.environ.get("POISON_STEPS", ""))
        self.leave_out = _ranges(os.environ.get("LEAVE_OUT_STEPS", ""))

    def __iter__(self):
        for i in range(len(self.blocks)):
            step = i // self.batch + 1
            if step in self.leave_out:
                continue
            ids = self.blocks[i]
            labels = ids
            if step in self.poison:
                labels = torch.full((BLOCK,), 255, dtype=torch.long)
            yield {"input_ids": ids, "labels": labels}


class InjectNaN(TrainerCallback):
    def __init__(self, model):
        self.model = model

    def on_step_begin(self, args, state, control, **kwargs):
        at, rank = os.environ.get("NAN_AT_STEP"), int(os.environ.get("NAN_RANK", "0"))
        if at is None or state.global_step + 1 != int(at) or args.process_index != rank:
            return
        if os.environ.get("NAN_HOST") and os.environ.get("HFSCALE_HOST") != os.environ["NAN_HOST"]:
            return
        once = os.environ.get("NAN_ONCE")
        if once:
            if os.path.exists(once):
                return
            Path(once).write_text("done")
        with torch.no_grad():
            next(self.model.parameters()).view(-1)[0] = float("nan")
        print(f"injected a NaN on rank {rank} before step {at}", flush=True)


def main():
    (args,) = HfArgumentParser((TrainingArguments,)).parse_args_into_dataclasses()
    torch.manual_seed(args.seed)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=256, n_positions=BLOCK, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = Stream(args.per_device_train_batch_size * args.gradient_accumulation_steps * world)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[InjectNaN(model)])
    trainer.train(resume_from_checkpoint=hfscale.instrument(trainer))
    if trainer.is_world_process_zero():
        losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        (Path(args.output_dir) / "losses.json").write_text(json.dumps(losses))
    hfscale.exit_cleanly()


if __name__ == "__main__":
    main()
