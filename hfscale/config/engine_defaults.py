"""The class DeepSpeed builds from a JSON's ``optimizer`` and ``scheduler`` sections, and the
defaults of its constructor for the parameters hfscale writes: where the JSON leaves a parameter
out, the engine uses the default of that class, not hfscale's or the Trainer's.

``built_optimizer`` follows ``DeepSpeedEngine._configure_basic_optimizer`` and
``get_optimizer_configuration`` (deepspeed/runtime/engine.py): Adam and AdamW build
torch.optim.AdamW / Adam with ``torch_adam`` (AdamW unless ``adam_w_mode`` is false for type Adam:
the mode defaults to true), else DeepSpeedCPUAdam with optimizer offload (cpu or nvme), else
FusedAdam; Lamb builds FusedLamb; Lion DeepSpeedCPULion with offload, else FusedLion. The 1-bit
optimizers were built by ``deepspeed.runtime.fp16.onebit`` in older DeepSpeed, never with ZeRO;
``hfscale.config.sources.deepspeed.deepspeed_optimizers`` says whether the installed one builds them.
The schedulers are the classes of deepspeed/runtime/lr_schedules.py, built with ``**params``.

tests/test_engine_defaults.py holds every value here to the installed classes' signatures.
Nothing is imported.
"""

from __future__ import annotations

from typing import Any

PARAMS = ("lr", "betas", "eps", "weight_decay")  # what hfscale writes from training.* (render.deepspeed)
_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_LION = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}  # no eps
OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    "torch.optim.AdamW": {**_ADAM, "weight_decay": 0.01},
    "torch.optim.Adam": _ADAM,
    "deepspeed.ops.adam.FusedAdam": _ADAM,
    "deepspeed.ops.adam.DeepSpeedCPUAdam": _ADAM,
    "deepspeed.ops.lamb.FusedLamb": _ADAM,
    "deepspeed.ops.lion.FusedLion": _LION,
    "deepspeed.ops.lion.DeepSpeedCPULion": _LION,
    "deepspeed.runtime.fp16.onebit.adam.OnebitAdam": _ADAM,
    "deepspeed.runtime.fp16.onebit.zoadam.ZeroOneAdam": _ADAM,
    "deepspeed.runtime.fp16.onebit.lamb.OnebitLamb": _ADAM,
}
ONEBIT = {"onebitadam": "deepspeed.runtime.fp16.onebit.adam.OnebitAdam",
          "zerooneadam": "deepspeed.runtime.fp16.onebit.zoadam.ZeroOneAdam",
          "onebitlamb": "deepspeed.runtime.fp16.onebit.lamb.OnebitLamb"}

# deepspeed/runtime/lr_schedules.py; WarmupLR's warmup_max_lr None: the optimizer's own lr
OPTIMIZER_LR = None
SCHEDULER_DEFAULTS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": OPTIMIZER_LR, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
                       "warmup_type": "log"},
}


def built_optimizer(kind: str, params: dict[str, Any], cpu_optimizer: bool) -> str | None:
    """The class DeepSpeed builds for ``optimizer.type`` ``kind`` with ``params``; ``cpu_optimizer``:
    zero_optimization.offload_optimizer.device is cpu or nvme. None for a type not listed here."""
    name = kind.lower()
    if name in ("adam", "adamw"):
        adam_w = name == "adamw" or bool(params.get("adam_w_mode", True))
        if params.get("torch_adam", False):
            return "torch.optim.AdamW" if adam_w else "torch.optim.Adam"
        return "deepspeed.ops.adam.DeepSpeedCPUAdam" if cpu_optimizer else "deepspeed.ops.adam.FusedAdam"
    if name == "lamb":
        return "deepspeed.ops.lamb.FusedLamb"
    if name == "lion":
        return "deepspeed.ops.lion.DeepSpeedCPULion" if cpu_optimizer else "deepspeed.ops.lion.FusedLion"
    return ONEBIT.get(name)


def short(cls: str) -> str:
    """``torch.optim.AdamW`` as people name it in a message."""
    return cls if cls.startswith("torch.") else cls.rsplit(".", 1)[-1]
