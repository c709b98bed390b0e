"""An existing Hugging Face Trainer script that adopts hfscale's callbacks with two lines (marked ``# hfscale``).

    hfscale launch examples/existing_script/config.yaml          # from the repository root

Everything else is a plain Trainer script: TrainingArguments from the command line (hfscale
passes the flags its YAML determines, ``--deepspeed`` with the generated JSON included, and
``--resume_from_checkpoint`` on a relaunch), a tiny GPT-2 built from a config (nothing
downloaded), the bytes of the Python standard library as data.
"""

import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments, set_seed

from hfscale.callbacks import CheckpointCompleteCallback, MetricsCallback, PreemptionCallback  # hfscale


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
    for cb in (MetricsCallback(seq_len=64, trainer=trainer), PreemptionCallback(), CheckpointCompleteCallback()):
        trainer.add_callback(cb)  # hfscale
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)


if __name__ == "__main__":
    main()
