"""``hfscale import``: a DeepSpeed JSON's ``optimizer`` and ``scheduler`` sections into the draft.

Their parameters become ``training.*`` (hfscale writes both sections from there). A parameter the
JSON leaves out is written as the default of the class DeepSpeed builds for it
(hfscale.config.engine_defaults), with a comment saying which: torch's AdamW decays by 0.01 where
FusedAdam does not, WarmupLR peaks at the optimizer's lr and WarmupDecayLR at 0.001. Parameters
hfscale does not type go to ``distributed.deepspeed.extra``.
"""

from __future__ import annotations

from typing import Any

from hfscale.cli.importing.draft import AUTO, Draft
from hfscale.config.deepspeed import DeepSpeedSection
from hfscale.config.engine_defaults import (
    OPTIMIZER_DEFAULTS,
    OPTIMIZER_LR,
    SCHEDULER_DEFAULTS,
    built_optimizer,
    short,
)
from hfscale.config.model import TrainingConfig

DS = ("distributed", "deepspeed")
T = ("training",)
SCHEDULES = {"WarmupLR": "constant_with_warmup", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def import_optimizer(opt: Any, draft: Draft, source: str, extra: dict) -> None:
    """The JSON's optimizer section into ``draft`` (after zero_optimization: offload picks the class)."""
    if not isinstance(opt, dict):
        return
    opt = dict(opt)
    kind = opt.pop("type", None)
    allowed = DeepSpeedSection.model_fields["optimizer"].annotation.__args__[0].model_fields["type"].annotation.__args__
    match = next((a for a in allowed if isinstance(kind, str) and a.lower() == kind.lower()), None)
    if match is None:
        draft.refuse(f"{source}: optimizer.type", f"{kind!r} is not one of {', '.join(allowed)}")
    else:
        draft.set(DS + ("optimizer",), {"type": match}, key="optimizer")
    params = dict(opt.pop("params", None) or {})
    offload = draft.get(DS + ("offload_optimizer",)) or {}
    built = built_optimizer(match, params, offload.get("device") in ("cpu", "nvme")) if match else None
    defaults = OPTIMIZER_DEFAULTS.get(built or "", {})
    for key, target in (("lr", "learning_rate"), ("eps", "adam_epsilon"), ("weight_decay", "weight_decay")):
        if key in params:
            _auto_or(T + (target,), params.pop(key), draft, f"optimizer.params.{key}")
        elif key in defaults:  # the engine builds the class with its own default
            draft.set(T + (target,), defaults[key], _class_default(built))
    betas = params.pop("betas", None) if "betas" in params else defaults.get("betas")
    if isinstance(betas, (list, tuple)) and len(betas) == 2:
        comment = None if isinstance(betas, list) else _class_default(built)
        draft.set(T + ("adam_beta1",), betas[0], comment, key=None if comment else "optimizer.params.betas")
        draft.set(T + ("adam_beta2",), betas[1], comment, key=None if comment else "optimizer.params.betas")
    elif betas == AUTO:
        _auto_or(T + ("adam_beta1",), AUTO, draft)
        _auto_or(T + ("adam_beta2",), AUTO, draft)
    if params:
        opt["params"] = params
    if opt:
        extra["optimizer"] = opt


def _class_default(built: str | None) -> str:
    return f"absent from the optimizer: the default of {short(built or '')}, which DeepSpeed builds for it"


def import_scheduler(sched: Any, draft: Draft, source: str, extra: dict) -> None:
    """The JSON's scheduler section into ``draft`` (after the optimizer: WarmupLR peaks at its lr)."""
    if not isinstance(sched, dict):
        return
    sched = dict(sched)
    kind = sched.pop("type", None)
    params = dict(sched.pop("params", None) or {})
    if kind not in SCHEDULES:
        draft.refuse(f"{source}: scheduler.type", f"{kind!r}: hfscale writes {', '.join(SCHEDULES)}")
        return
    defaults = SCHEDULER_DEFAULTS[kind]  # deepspeed/runtime/lr_schedules.py, the class built with **params
    if "warmup_num_steps" not in params:
        draft.set(T + ("warmup_steps",), defaults["warmup_num_steps"],
                  f"absent from the scheduler: {kind}'s default warmup_num_steps")
    warmup = params.pop("warmup_num_steps", defaults["warmup_num_steps"])
    if warmup != AUTO and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup <= 0):
        # deepspeed/runtime/lr_schedules.py (0.19.6 on), when the engine builds the scheduler: the file fails there
        draft.refuse(f"{source}: scheduler.params.warmup_num_steps", f"{warmup!r}: DeepSpeed refuses it when it builds "
                     f"{kind} (ValueError: warmup_num_steps must be a positive integer, got {warmup}); write 1 or more, "
                     "or auto")
        return
    total = params.pop("total_num_steps", None)
    if kind == "WarmupCosineLR" and "warmup_max_lr" in params:
        draft.refuse(f"{source}: scheduler.params.warmup_max_lr", "WarmupCosineLR takes no warmup_max_lr "
                     "(DeepSpeed would fail: an unexpected keyword argument); it peaks at the optimizer's lr")
    lr = params.pop("warmup_max_lr", None)
    peak = defaults.get("warmup_max_lr", OPTIMIZER_LR)
    if lr is None and peak is not OPTIMIZER_LR:
        if draft.get(T + ("learning_rate",)) in (None, peak):
            draft.set(T + ("learning_rate",), peak, f"absent from the scheduler: {kind}'s default warmup_max_lr")
        else:
            draft.refuse(f"{source}: scheduler.params", f"no warmup_max_lr: DeepSpeed's {kind} peaks at its default "
                         f"{peak}, not at the optimizer's lr {draft.get(T + ('learning_rate',))}; hfscale writes one "
                         "learning rate to both: write warmup_max_lr")
    elif lr is None and kind == "WarmupLR":
        draft.comments.setdefault(T + ("learning_rate",), "the optimizer's lr: WarmupLR without warmup_max_lr "
                                                          "peaks there")
    draft.set(DS + ("scheduler",), {"type": kind}, key="scheduler")
    schedule = SCHEDULES[kind] if kind != "WarmupLR" or warmup not in (0, AUTO) else "constant"
    draft.set(T + ("lr_scheduler_type",), schedule)
    if warmup == AUTO or warmup:
        _auto_or(T + ("warmup_steps",), warmup, draft, "scheduler.params.warmup_num_steps")
    if total == AUTO:
        draft.comments[DS + ("scheduler",)] = ("total_num_steps auto: written as auto while training.max_steps is "
                                               "null; the Trainer fills in its step count")
    elif total is not None:
        draft.set(T + ("max_steps",), total, key="scheduler.params.total_num_steps")
    if lr is not None and not (lr == AUTO and draft.get(T + ("learning_rate",)) is not None):
        _auto_or(T + ("learning_rate",), lr, draft, "scheduler.params.warmup_max_lr")
    written = {"warmup_type": "linear", "warmup_min_lr": 0.0, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0}
    # the class's own defaults where the file leaves them out and hfscale writes another value
    for key, default in defaults.items():
        if key in written and key not in params and written[key] != default:
            params[key] = default
    rest = {k: v for k, v in params.items() if written.get(k, object()) != v
            and not (k == "warmup_min_lr" and v in (0, AUTO))}
    if rest:
        extra["scheduler"] = {"params": rest}


def _auto_or(path: tuple[str, ...], value: Any, draft: Draft, key: str | None = None) -> None:
    """``value``, or for "auto" hfscale's default of ``path`` (a training key), said in a comment."""
    if value != AUTO:
        draft.set(path, value, key=key)
        return
    draft.set(path, TrainingConfig.model_fields[path[-1]].default, f"auto: the Trainer's {path[-1]}; hfscale's default")
