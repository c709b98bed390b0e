"""An existing Hugging Face Trainer script that adopts hfscale with three lines (marked ``# hfscale``).

    hfscale launch examples/existing_script/config.yaml          # from the repository root

Everything else is a plain Trainer script: TrainingArguments from the command line (hfscale
passes the flags its YAML determines, ``--deepspeed`` with the generated JSON included), a tiny
GPT-2 built from a config (nothing downloaded), the bytes of the Python standard library as data.
``hfscale.instrument`` returns the checkpoint a relaunch passes as ``--resume_from_checkpoint``
(the newest complete one), outside ``hfscale launch`` too.
"""

import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments, set_seed

import hfscale  # hfscale


class Blocks(torch.utils.data.Dataset):
    def __init__(self, block: int = 64, n: int = 2048):
        data = bytearray()
        for path in sorted(Path(os.path.dirname(os.__file__)).glob("*.py")):
            data += path.read_bytes()
            if len(data) >= block * n:
                break
        self.blocks = torch.tensor(list(data[: block * n]), dtype=torch.long).view(n, block)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main():
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses()
    set_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    trainer = Trainer(model=model, args=args, train_dataset=Blocks())
    resume = hfscale.instrument(trainer, seq_len=64)  # hfscale: callbacks as the YAML says; newest complete checkpoint
    trainer.train(resume_from_checkpoint=resume)  # hfscale


if __name__ == "__main__":
    main()
