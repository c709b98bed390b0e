#!/usr/bin/env python
"""Train a tiny causal LM with an HfArgumentParser Trainer script and record the trained model's logits.

    python export_clm.py --config_overrides n_layer=2,n_embd=32 --logits_file ref.pt --output_dir out ...

For the export tests (tests/test_export.py): after ``trainer.train()`` every rank runs the trained
model, as the Trainer holds it (under ZeRO-3 DeepSpeed's hooks gather each layer's partitioned
parameters), on fixed input ids, and rank 0 saves the ids and the logits with ``torch.save``. An
export of the last checkpoint must reproduce them. The Trainer gets a small tokenizer (so
checkpoints hold tokenizer files) and the model a generation setting of its own (so they hold a
generation_config.json that is not the default). Like tests/scripts/hf_clm.py it imports nothing
from hfscale; the data are the bytes of the standard library's source files (token = byte).
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, HfArgumentParser, PreTrainedTokenizerFast, Trainer,
                          TrainingArguments, default_data_collator, set_seed)

from hf_clm import ByteBlocks  # beside this script: the same training blocks

MAX_NEW_TOKENS = 7  # the generation setting an export must carry over


@dataclass
class ScriptArguments:
    config_overrides: str = field(default="n_layer=2,n_head=2,n_embd=32,vocab_size=256")
    block_size: int = field(default=32)
    max_train_samples: int = field(default=256)
    logits_file: Optional[str] = field(default=None, metadata={"help": "rank 0 saves ids and logits here"})


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over 256 made-up tokens: built offline, saved as tokenizer.json."""
    tok = Tokenizer(models.WordLevel({f"b{i}": i for i in range(256)}, unk_token="b0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="b0", eos_token="b0")


def main():
    script_args, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    # deepspeed.zero.Init (from_config under a ZeRO-3 config) reads the world size from DeepSpeed's
    # communication layer; with use_cpu the TrainingArguments set up torch's process group only
    print(f"rank {training_args.process_index} of {training_args.world_size} on {training_args.device}")
    if training_args.deepspeed and torch.distributed.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
    set_seed(training_args.seed)
    config = AutoConfig.for_model("gpt2")
    config.update_from_string(script_args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)  # partitioned at once under a ZeRO-3 config
    model.generation_config.max_new_tokens = MAX_NEW_TOKENS
    trainer = Trainer(model=model, args=training_args, processing_class=byte_tokenizer(),
                      data_collator=default_data_collator,  # equal blocks: no padding (the default would pad)
                      train_dataset=ByteBlocks(script_args.block_size, script_args.max_train_samples))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(11))
    trained = trainer.model
    trained.eval()
    with torch.no_grad():  # every rank: under ZeRO-3 each layer's forward gathers its parameters
        logits = trained(input_ids=ids.to(training_args.device)).logits.float().cpu()
    if script_args.logits_file and trainer.is_world_process_zero():
        torch.save({"input_ids": ids, "logits": logits, "global_step": trainer.state.global_step},
                   script_args.logits_file)


if __name__ == "__main__":
    main()
