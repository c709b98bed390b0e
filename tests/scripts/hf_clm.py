#!/usr/bin/env python
"""Train a causal language model: a script in the style of transformers' examples (run_clm.py).

    python hf_clm.py --model_type gpt2 --config_overrides n_layer=2,n_embd=64 --output_dir out ...

It imports nothing from hfscale: it is the kind of unchanged HfArgumentParser script the tests
drive from an hfscale YAML. As in recent transformers examples it does not look for the last
checkpoint itself; it resumes from ``--resume_from_checkpoint`` when given. The model is built
from a config (random init, nothing downloaded); the data are the bytes of the Python standard
library's source files (token = byte), packed into ``--block_size`` blocks.

For the tests, ``--report_file`` makes rank 0 write what the script saw: the TrainingArguments it
parsed, the engine the Trainer ran with, the log history and the final step (JSON).
"""

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_type: str = field(default="gpt2", metadata={"help": "Model type to train from scratch."})
    config_overrides: Optional[str] = field(
        default=None, metadata={"help": "Override some default config settings, e.g. n_embd=10,resid_pdrop=0.2"}
    )


@dataclass
class DataTrainingArguments:
    block_size: int = field(default=64, metadata={"help": "Sequence length of the training blocks."})
    max_train_samples: int = field(default=4096, metadata={"help": "Number of training blocks."})
    report_file: Optional[str] = field(default=None, metadata={"help": "Rank 0 writes what it saw here (JSON)."})


class ByteBlocks(torch.utils.data.Dataset):
    """Blocks of the standard library's source bytes."""

    def __init__(self, block: int, n: int):
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
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)])
    transformers.utils.logging.set_verbosity_warning()
    logger.warning(f"Process rank: {training_args.process_index}, device: {training_args.device}, "
                   f"world size: {training_args.world_size}")

    set_seed(training_args.seed)
    config = AutoConfig.for_model(model_args.model_type)
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)
    train_dataset = ByteBlocks(data_args.block_size, data_args.max_train_samples)

    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset)
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    metrics = train_result.metrics
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()

    if data_args.report_file and trainer.is_world_process_zero():
        seen = {k: v for k, v in training_args.to_dict().items() if isinstance(v, (int, float, str, bool, list, type(None)))}
        report = {
            "args": seen,
            "world_size": training_args.world_size,
            "deepspeed_enabled": trainer.is_deepspeed_enabled,
            "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None,
            "device": str(training_args.device),
            "global_step": trainer.state.global_step,
            "log_history": trainer.state.log_history,
        }
        Path(data_args.report_file).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
