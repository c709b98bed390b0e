#!/usr/bin/env python
"""Train a causal language model on a streaming dataset: a script in the style of transformers'
examples (run_clm.py with ``--streaming``), importing nothing from hfscale.

    python hf_clm_stream.py --data_dir DIR --model_type gpt2 --config_overrides n_layer=2 --output_dir out ...

The data are the JSON-lines files in ``--data_dir``, read by ``datasets.load_dataset("json",
streaming=True)``: a ``datasets.IterableDataset``, each record's text turned into ``--block_size``
byte tokens by ``.map()``, which costs ``--example_cost`` seconds an example (a tokenizer's time).
It resumes from ``--resume_from_checkpoint`` when given, as recent transformers examples do; the
Trainer then fast-forwards the stream past every batch already trained unless something tells it
not to.

For the tests: each process appends the id of every record it maps to ``--mapped_log``.<rank>
(one line each), and rank 0 writes the log history, the final step and the resume point to
``--report_file`` (JSON).
"""

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import transformers
from datasets import load_dataset
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments, set_seed

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_type: str = field(default="gpt2", metadata={"help": "Model type to train from scratch."})
    config_overrides: Optional[str] = field(default=None, metadata={"help": "e.g. n_embd=10,resid_pdrop=0.2"})


@dataclass
class DataTrainingArguments:
    data_dir: str = field(default="data", metadata={"help": "Folder of *.jsonl files: one {\"id\", \"text\"} a line."})
    block_size: int = field(default=64, metadata={"help": "Tokens (bytes) a training example."})
    example_cost: float = field(default=0.0, metadata={"help": "Seconds the map spends on each example."})
    mapped_log: Optional[str] = field(default=None, metadata={"help": "Each process appends the ids it maps here."})
    report_file: Optional[str] = field(default=None, metadata={"help": "Rank 0 writes what it saw here (JSON)."})


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)])
    transformers.utils.logging.set_verbosity_warning()

    set_seed(training_args.seed)
    config = AutoConfig.for_model(model_args.model_type)
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)

    files = sorted(str(p) for p in Path(data_args.data_dir).glob("*.jsonl"))
    raw = load_dataset("json", data_files=files, split="train", streaming=True)
    log = open(f"{data_args.mapped_log}.{training_args.process_index}", "a", buffering=1) if data_args.mapped_log else None
    block = data_args.block_size

    def tokenize(record):
        if data_args.example_cost:
            time.sleep(data_args.example_cost)
        if log is not None:
            log.write(f"{record['id']}\n")
        ids = list(record["text"].encode()[:block].ljust(block, b" "))
        return {"input_ids": ids, "labels": ids}

    train_dataset = raw.map(tokenize, remove_columns=["id", "text"])
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset)
    started = time.time()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if data_args.report_file and trainer.is_world_process_zero():
        report = {"global_step": trainer.state.global_step, "log_history": trainer.state.log_history,
                  "resume_from_checkpoint": training_args.resume_from_checkpoint,
                  "train_seconds": time.time() - started}
        Path(data_args.report_file).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
