"""The DeepSpeed JSON, as a pure function of the job.

Rule: every value is an explicit number taken from the hfscale YAML, never ``"auto"`` (one
exception: a DeepSpeed scheduler's ``total_num_steps`` while ``training.max_steps`` is null,
which the HF Trainer fills with the step count it computes). The
TrainingArguments hfscale builds come from the same YAML, so the HF Trainer's consistency check
finds them equal, and a plain ``accelerate launch`` script gets usable numbers too (under sequence
parallelism ``train_batch_size`` is left for DeepSpeed to derive: see ``deepspeed_config``). The optimizer
and LR scheduler belong to the training script and are left out unless
``distributed.deepspeed.optimizer`` / ``scheduler`` hand them to DeepSpeed (with optimizer
offload and none named, accelerate swaps the script's torch optimizer for DeepSpeed's CPU Adam);
their parameters are written from ``training``.
``training.async_save`` writes ``checkpoint.writer`` (DeepSpeed's decoupled checkpoint engine: see
``ASYNC_WRITER``). ``distributed.deepspeed.extra`` is merged in last (hfscale.rules.deepspeed refuses keys written here).
"""

from __future__ import annotations

import json
from typing import Any

from hfscale.config.deepspeed import DeepSpeedSection, OffloadOptimizerConfig, OffloadParamConfig
from hfscale.config.extra_keys import merge
from hfscale.rules.deepspeed import ASYNC_WRITER, NVME_ONLY, SECTIONS, ZERO_KEYS
from hfscale.rules.parallelism import sequence_parallel_size
from hfscale.rules.resolved import Job


def _offload(kind: str, off: OffloadOptimizerConfig | OffloadParamConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"device": off.device, "pin_memory": off.pin_memory}
    if off.device == "nvme":
        out["nvme_path"] = off.nvme_path
    for name in type(off).model_fields:
        # the NVMe swap settings only for NVMe offload (DeepSpeed ignores them otherwise)
        if name not in ("device", "pin_memory", "nvme_path") and (off.device == "nvme" or name not in NVME_ONLY[kind]):
            out[name] = getattr(off, name)
    return out


def _zero(ds: DeepSpeedSection) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": ds.stage}
    if ds.stage == 0:
        return zero
    for key, stages in ZERO_KEYS.items():
        if ds.stage in stages:
            zero[key] = getattr(ds, key)
    zero["overlap_comm"] = ds.overlap()  # DeepSpeed's own default, written out
    if ds.stage in (1, 2):
        zero.update(allgather_partitions=True, reduce_scatter=True)
    else:
        zero["stage3_gather_16bit_weights_on_model_save"] = ds.gather_16bit_weights_on_model_save
    if ds.offload_optimizer.device != "none":
        zero["offload_optimizer"] = _offload("offload_optimizer", ds.offload_optimizer)
    if ds.offload_param.device != "none":
        zero["offload_param"] = _offload("offload_param", ds.offload_param)
    return zero


def _optimizer(job: Job, ds: DeepSpeedSection) -> dict[str, Any] | None:
    if ds.optimizer is None:
        return None
    kind = ds.optimizer.type
    t = job.config.training
    params: dict[str, Any] = {"lr": t.learning_rate, "betas": [t.adam_beta1, t.adam_beta2]}
    if kind != "Lion":  # Lion has no epsilon
        params["eps"] = t.adam_epsilon
    params["weight_decay"] = t.weight_decay
    return {"type": kind, "params": params}


def _scheduler(job: Job, ds: DeepSpeedSection) -> dict[str, Any] | None:
    if ds.scheduler is None:
        return None
    t = job.config.training
    kind = ds.scheduler.type
    # the Trainer's warm-up; DeepSpeed >= 0.19.6 refuses 0 steps, and transformers fills max(1, warmup) itself
    params: dict[str, Any] = {"warmup_num_steps": max(1, t.warmup_steps), "warmup_type": "linear"}
    # no max_steps: the Trainer fills "auto" with the step count it computes (epochs x batches)
    total = t.max_steps if t.max_steps is not None else "auto"
    if kind == "WarmupCosineLR":
        params.update(total_num_steps=total, warmup_min_ratio=0.0, cos_min_ratio=0.0)  # transformers' cosine ends at 0
    else:
        params.update(warmup_min_lr=0.0, warmup_max_lr=t.learning_rate)
        if kind == "WarmupDecayLR":
            params["total_num_steps"] = total
    return {"type": kind, "params": params}


def deepspeed_config(job: Job, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed config dict for ``job`` (backend deepspeed), ``extra`` merged in;
    ``load_universal``: the job resumes a universal checkpoint (hfscale.checkpoints.reshard)."""
    ds = job.deepspeed
    if ds is None:
        raise ValueError("deepspeed_config() needs distributed.backend: deepspeed")
    cfg = job.config
    precision = cfg.precision
    out: dict[str, Any] = {
        "train_batch_size": job.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.batch.micro_batch_size,
        "gradient_accumulation_steps": job.gradient_accumulation_steps,
        "gradient_clipping": cfg.gradient_clipping or 0.0,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_optimization": _zero(ds),
    }
    if sequence_parallel_size(cfg) > 1:
        # DeepSpeed derives it, micro x accumulation x its data-parallel world (world size / sp_size), and
        # accelerate writes the same just before deepspeed.initialize; a number here would meet the HF
        # Trainer's check, which counts every rank (micro x accumulation x world size), and fail it
        del out["train_batch_size"]
    if precision == "fp8":
        # accelerate's DeepSpeedPlugin.set_mixed_precision("fp8") adds bf16 {enabled: true} to a config
        # without one (fp8 runs under bf16 autocast); written here, the Trainer would see bf16 on against
        # its --bf16 false (the flag would turn fp8 off) and refuse the mismatch
        del out["bf16"], out["fp16"]
    if ds.steps_per_print is not None:
        out["steps_per_print"] = ds.steps_per_print
    out["wall_clock_breakdown"] = False
    if precision == "fp16":
        # dynamic loss scaling, DeepSpeed's documented defaults, written out so they are visible
        out["fp16"].update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)
    if ds.communication_data_type is not None:
        out["communication_data_type"] = ds.communication_data_type
    if ds.grad_accum_dtype is not None:
        out["data_types"] = {"grad_accum_dtype": ds.grad_accum_dtype}
    for name in SECTIONS:
        section = getattr(ds, name)
        if section is not None:
            out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in section.model_dump().items()}
    for name, section in (("optimizer", _optimizer(job, ds)), ("scheduler", _scheduler(job, ds))):
        if section is not None:
            out[name] = section
    if cfg.training.async_save:
        out["checkpoint"] = {"writer": dict(ASYNC_WRITER)}
    out = merge(out, ds.extra)
    if load_universal:  # after extra: the resume needs it whatever extra says
        out.setdefault("checkpoint", {})["load_universal"] = True
    return out


def render_deepspeed(job: Job, load_universal: bool = False) -> str:
    """The DeepSpeed JSON text for ``job``."""
    return json.dumps(deepspeed_config(job, load_universal), indent=2) + "\n"
