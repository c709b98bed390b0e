"""The DeepSpeed JSON, as a pure function of the job.

Rule: every value is an explicit number taken from the hfscale YAML, never ``"auto"``. The
TrainingArguments hfscale builds come from the same YAML, so the HF Trainer's consistency check
finds them equal, and a plain ``accelerate launch`` script gets usable numbers too. The optimizer
and LR scheduler belong to the training script and are left out, except with optimizer offload,
where DeepSpeed must build its own CPU optimizer: then an ``optimizer`` section is written from
``training`` (the Trainer handles this by itself; a custom loop uses ``accelerate.utils.DummyOptim``).
"""

from __future__ import annotations

import json
from typing import Any

from .config import OffloadConfig
from .job import Job


def _offload(off: OffloadConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"device": off.device, "pin_memory": off.pin_memory}
    if off.device == "nvme":
        out["nvme_path"] = off.nvme_path
    return out


def _zero(job: Job) -> dict[str, Any]:
    ds = job.deepspeed
    assert ds is not None
    zero: dict[str, Any] = {"stage": ds.stage}
    if ds.stage == 0:
        return zero
    zero.update(
        overlap_comm=ds.overlap_comm,
        contiguous_gradients=ds.contiguous_gradients,
        reduce_bucket_size=ds.reduce_bucket_size,
    )
    if ds.stage in (1, 2):
        zero.update(allgather_partitions=True, allgather_bucket_size=ds.allgather_bucket_size, reduce_scatter=True)
    else:
        zero.update(
            stage3_prefetch_bucket_size=ds.stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold=ds.stage3_param_persistence_threshold,
            stage3_max_live_parameters=ds.stage3_max_live_parameters,
            stage3_max_reuse_distance=ds.stage3_max_reuse_distance,
            stage3_gather_16bit_weights_on_model_save=ds.gather_16bit_weights_on_model_save,
        )
    if ds.offload_optimizer.device != "none":
        zero["offload_optimizer"] = _offload(ds.offload_optimizer)
    if ds.offload_param.device != "none":
        zero["offload_param"] = _offload(ds.offload_param)
    return zero


def deepspeed_config(job: Job) -> dict[str, Any]:
    """The DeepSpeed config dict for ``job`` (backend deepspeed)."""
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
        "zero_optimization": _zero(job),
        "steps_per_print": ds.steps_per_print,
        "wall_clock_breakdown": False,
    }
    if precision == "fp16":
        # dynamic loss scaling, DeepSpeed's documented defaults, written out so they are visible
        out["fp16"].update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)
    if ds.offload_optimizer.device != "none":
        t = cfg.training
        out["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": t.learning_rate,
                "betas": [t.adam_beta1, t.adam_beta2],
                "eps": t.adam_epsilon,
                "weight_decay": t.weight_decay,
            },
        }
    return out


def render_deepspeed(job: Job) -> str:
    """The DeepSpeed JSON text for ``job``."""
    return json.dumps(deepspeed_config(job), indent=2) + "\n"
