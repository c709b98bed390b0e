#!/usr/bin/env python
"""hf_clm.py's training opted in to in-process restarts through hfscale's public face: ``main`` builds
the model, the data and the Trainer and resumes from the newest complete checkpoint
(``hfscale.instrument``) at every call, and ``hfscale.restart_in_process`` calls it once per attempt.
"""

import sys

import hfscale
from hf_clm import ByteBlocks, DataTrainingArguments, ModelArguments
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments, set_seed


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)
    config = AutoConfig.for_model(model_args.model_type)
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)
    trainer = Trainer(model=model, args=training_args,
                      train_dataset=ByteBlocks(data_args.block_size, data_args.max_train_samples))
    trainer.train(resume_from_checkpoint=hfscale.instrument(trainer))


if __name__ == "__main__":
    sys.exit(hfscale.restart_in_process(main))
