"""Will a setting fit a GPU, and the cheapest change that makes it fit (pure).

The global batch stays the same: only micro batch x accumulation is traded (the product per rank
is kept). Changes are tried cheapest first, by what they cost in speed: a smaller micro batch
(none), ZeRO-2 over ZeRO-0/1 (almost none), gradient checkpointing (a forward pass recomputed),
ZeRO-3 (parameters gathered every pass), optimizer offload, parameter offload (PCIe every step).
Among equally cheap changes the one allowing the largest micro batch wins.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import combinations

from hfscale.memory.estimate import Estimate, Setting, estimate
from hfscale.memory.model_shape import Shape


@dataclass(frozen=True)
class Lever:
    """One change to a setting, with its cost rank and the YAML keys that make it."""

    name: str
    cost: int
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Verdict:
    """``fits`` for the setting as configured; ``best`` the estimate of the change proposed."""

    limit: int
    current: Estimate
    fits: bool
    largest_micro: int | None  # the largest micro batch that fits as configured (None: none does)
    changes: tuple[str, ...]  # YAML keys and values, e.g. "distributed.deepspeed.stage: 3"
    best: Estimate | None

    def line(self) -> str:
        """One line for ``check``: fits or not, and what to change."""
        gib = 2**30
        head = (f"~{self.current.gpu_total / gib:.1f} GiB per GPU of {self.limit / gib:.1f} GiB "
                f"({self.current.setting.describe()})")
        if self.fits:
            more = self.largest_micro or 0
            extra = (f"; micro batch up to {more} fits" if more > self.current.setting.micro_batch else "")
            return f"fits: {head}{extra}"
        if self.best is None:
            return f"does not fit: {head}; no change hfscale knows makes it fit (more GPUs, a shorter sequence)"
        return (f"does not fit: {head}; cheapest change that fits: {', '.join(self.changes)} "
                f"(~{self.best.gpu_total / gib:.1f} GiB)")


def levers(s: Setting) -> list[tuple[Lever, dict]]:
    """The changes that apply to ``s``, each with the Setting fields it sets."""
    out: list[tuple[Lever, dict]] = []
    if s.engine == "deepspeed":
        if s.stage < 2:
            out.append((Lever("ZeRO-2", 1, ("distributed.deepspeed.stage: 2",)), {"stage": 2}))
        if s.stage < 3:
            out.append((Lever("ZeRO-3", 3, ("distributed.deepspeed.stage: 3",)), {"stage": 3}))
        if not s.offload_optimizer:  # at stage 0 only with a higher stage (_valid)
            out.append((Lever("optimizer offload", 4, ("distributed.deepspeed.offload_optimizer.device: cpu",)),
                        {"offload_optimizer": True}))
        if not s.offload_params:
            out.append((Lever("parameter offload", 5, ("distributed.deepspeed.offload_param.device: cpu",)),
                        {"offload_params": True}))
    elif s.engine == "fsdp":
        if s.stage == 2:
            out.append((Lever("reshard after forward", 3, ("distributed.fsdp.reshard_after_forward: true",)),
                        {"stage": 3}))
        if not s.offload_params:
            out.append((Lever("offload", 5, ("distributed.fsdp.offload_params: true",)), {"offload_params": True}))
    else:  # DDP: DeepSpeed's levers from ZeRO-0, each also switching the backend
        for lv, f in levers(replace(s, engine="deepspeed", stage=0, checkpointing=True)):
            out.append((replace(lv, keys=("distributed.backend: deepspeed", *lv.keys)), {"engine": "deepspeed", **f}))
    if not s.checkpointing:
        key = "distributed.fsdp.activation_checkpointing: true" if s.engine == "fsdp" else \
            "training.gradient_checkpointing: true"
        out.append((Lever("gradient checkpointing", 2, (key,)), {"checkpointing": True}))
    return out


def _valid(fields: dict, s: Setting) -> bool:
    stage = fields.get("stage", s.stage)
    engine = fields.get("engine", s.engine)
    if engine == "deepspeed" and fields.get("offload_params", s.offload_params) and stage != 3:
        return False  # DeepSpeed offloads parameters only at stage 3
    return not (engine == "deepspeed" and fields.get("offload_optimizer", s.offload_optimizer) and stage == 0)


def micro_batches(s: Setting) -> list[int]:
    """Micro batches that keep micro x accumulation (so the global batch), largest first."""
    per_rank = s.micro_batch * s.accumulation
    return [m for m in range(per_rank, 0, -1) if per_rank % m == 0]


def largest_fitting(shape: Shape, s: Setting, limit: int) -> Estimate | None:
    """The estimate with the largest micro batch that fits ``limit`` (None: not even 1)."""
    per_rank = s.micro_batch * s.accumulation
    for m in micro_batches(s):
        e = estimate(shape, replace(s, micro_batch=m, accumulation=per_rank // m))
        if e.gpu_total <= limit:
            return e
    return None


def judge(shape: Shape, s: Setting, limit: int) -> Verdict:
    """Whether ``s`` fits ``limit`` bytes per GPU, and otherwise the cheapest change that does."""
    current = estimate(shape, s)
    best_here = largest_fitting(shape, s, limit)
    largest = best_here.setting.micro_batch if best_here else None
    if current.gpu_total <= limit:
        return Verdict(limit, current, True, largest, (), None)
    options = levers(s)
    tries = []
    for n in range(len(options) + 1):
        for combo in combinations(options, n):
            fields: dict = {}
            for _, f in combo:
                fields.update(f)
            if _valid(fields, s):
                tries.append((sum(lv.cost for lv, _ in combo), combo, fields))
    tries.sort(key=lambda t: t[0])
    found: list[tuple[int, int, tuple, Estimate]] = []
    for cost, combo, fields in tries:
        if found and cost > found[0][0]:
            break
        e = largest_fitting(shape, replace(s, **fields), limit)
        if e is not None:
            found.append((cost, -e.setting.micro_batch, combo, e))
    if not found:
        return Verdict(limit, current, False, largest, (), None)
    _, _, combo, e = min(found, key=lambda f: (f[0], f[1]))
    changes = list(dict.fromkeys(k for lv, _ in combo for k in lv.keys))  # the backend switch once
    if e.setting.micro_batch != s.micro_batch:
        changes.insert(0, f"batch.micro_batch_size: {e.setting.micro_batch} "
                          f"(gradient accumulation {e.setting.accumulation})")
    return Verdict(limit, current, False, largest, tuple(changes), e)
