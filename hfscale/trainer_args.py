"""TrainingArguments from the same YAML as the DeepSpeed JSON, so the two always agree."""

from __future__ import annotations

from typing import Any

from .job import Job


def training_arguments_kwargs(job: Job, deepspeed_config_file: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments`` (pure; no transformers import).

    Every value the HF Trainer compares with the DeepSpeed JSON (batch sizes, accumulation,
    clipping, precision, AdamW settings) comes from the same field the JSON was rendered from.
    """
    cfg = job.config
    t = cfg.training
    kw: dict[str, Any] = dict(
        output_dir=t.output_dir,
        per_device_train_batch_size=cfg.batch.micro_batch_size,
        gradient_accumulation_steps=job.gradient_accumulation_steps,
        max_grad_norm=cfg.gradient_clipping or 0.0,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_epsilon,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_steps,
        max_steps=t.max_steps if t.max_steps is not None else -1,
        num_train_epochs=t.num_train_epochs,
        seed=t.seed,
        logging_steps=t.logging_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        report_to=list(t.report_to),
        bf16=cfg.precision == "bf16",
        fp16=cfg.precision == "fp16",
    )
    if job.deepspeed is not None:
        kw["deepspeed"] = deepspeed_config_file
    return kw


def training_arguments(job: Job, deepspeed_config_file: str | None = None, **overrides: Any):
    """A ``transformers.TrainingArguments`` for ``job``; ``overrides`` win (e.g. ``use_cpu=True``)."""
    from transformers import TrainingArguments

    return TrainingArguments(**{**training_arguments_kwargs(job, deepspeed_config_file), **overrides})
