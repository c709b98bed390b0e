"""``hfscale import``: a DeepSpeed JSON into the hfscale draft.

Each key goes to its typed hfscale key, or into ``distributed.deepspeed.extra`` when DeepSpeed
knows it and hfscale does not type it; DeepSpeed's renamed keys are normalised first. ``"auto"``
(a value the HF Trainer or accelerate fills) is resolved from the accelerate config or from
hfscale's defaults, with a comment saying which. What DeepSpeed never reads (a top-level key it
does not know, a ZeRO key of another stage) is left out with a note. A key inside one of its
sections that DeepSpeed does not know, an ``"auto"`` hfscale cannot resolve, and a value hfscale
cannot write are problems.
"""

from __future__ import annotations

from typing import Any

from hfscale.cli.importing.draft import AUTO, Draft
from hfscale.cli.importing.optimizer import DS, import_optimizer, import_scheduler
from hfscale.config.deepspeed import DeepSpeedSection
from hfscale.config.extra_keys import check_extra, ignored_keys
from hfscale.config.sources.deepspeed import deepspeed_keys
from hfscale.config.sources.engine import Section
from hfscale.rules.deepspeed import SECTIONS, ZERO_KEYS

# what hfscale writes for fp16 beside enabled (render_deepspeed): not repeated in extra
FP16_WRITTEN = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                "min_loss_scale": 1}
# keys DeepSpeed took under older names whose value changes form (zero_optimization)
_OLD_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
_AUTO_FROM_MODEL = ("the Trainer derives it from the model's hidden size; hfscale's default (DeepSpeed's) here, set "
                    "one for your model")


def _default(key: str) -> Any:
    return DeepSpeedSection.model_fields[key].default


def import_deepspeed(ds: dict[str, Any], draft: Draft, source: str, mixed_precision: str | None, world: int,
                     save_16bit: bool = False, sequence_parallel: int = 1) -> None:
    """Put DeepSpeed JSON ``ds`` (from file ``source``) into ``draft``: ``world`` data-parallel ranks
    (the processes / ``sequence_parallel``, the accelerate config's sp_size), ``save_16bit`` the
    accelerate config's zero3_save_16bit_model."""
    previous, draft.source = draft.source, source
    try:
        _import(ds, draft, source, mixed_precision, world, save_16bit, sequence_parallel)
    finally:
        draft.source = previous


def _import(ds: dict[str, Any], draft: Draft, source: str, mixed_precision: str | None, world: int,
            save_16bit: bool, sequence_parallel: int = 1) -> None:
    keys = deepspeed_keys()
    extra: dict[str, Any] = {}
    ds = _whole_numbers(_shapes(dict(ds), draft, source), keys)
    if "bfloat16" in ds and "bf16" not in ds:
        ds["bf16"] = ds.pop("bfloat16")
        draft.notes.append(f"{source}: 'bfloat16' is DeepSpeed's old name of 'bf16'; under accelerate launch it was "
                           "overridden (accelerate writes bf16.enabled false beside it), here it means bf16")
    _batch(ds, draft, source, world, sequence_parallel)
    extra.update(_precision(ds, draft, source, mixed_precision))
    clip = ds.pop("gradient_clipping", 1.0)
    if clip == AUTO:
        draft.set(("gradient_clipping",), 1.0, "auto: the Trainer's max_grad_norm default")
    elif clip != 1.0:
        draft.set(("gradient_clipping",), clip or None, key="gradient_clipping")
    zero = ds.pop("zero_optimization", None)
    if zero is None:
        draft.notes.append(f"{source} has no zero_optimization: accelerate's DeepSpeedPlugin refuses such a file; "
                           "hfscale writes stage 0, DeepSpeed's own default")
    _zero(zero if isinstance(zero, dict) else {}, draft, source, extra, keys, save_16bit)
    import_optimizer(ds.pop("optimizer", None), draft, source, extra)
    import_scheduler(ds.pop("scheduler", None), draft, source, extra)
    if ds.get("steps_per_print") == AUTO:  # accelerate's DeepSpeedPlugin sets it, whatever the file says
        ds.pop("steps_per_print")
        draft.notes.append(f"{source}: steps_per_print auto left out: accelerate's DeepSpeedPlugin (which the Trainer "
                           "builds too) always sets steps_per_print to infinity, so no value of it is ever read")
    for name in ("steps_per_print", "communication_data_type"):
        if name in ds:
            _typed(DS + (name,), ds.pop(name), draft, source, name)
    types = ds.pop("data_types", None)
    if isinstance(types, dict):
        types = dict(types)
        if "grad_accum_dtype" in types:
            _typed(DS + ("grad_accum_dtype",), types.pop("grad_accum_dtype"), draft, source, "data_types.grad_accum_dtype")
        if types:
            extra["data_types"] = types
    for name, model in SECTIONS.items():
        section = ds.pop(name, None)
        if isinstance(section, dict):
            typed = {k: v for k, v in section.items() if k in model.model_fields}
            draft.set(DS + (name,), typed, key=name)
            rest = {k: v for k, v in section.items() if k not in model.model_fields}
            if rest:
                extra[name] = rest
    if ds.get("wall_clock_breakdown") is False:
        ds.pop("wall_clock_breakdown")  # what hfscale writes
    extra.update(ds)
    _extra(extra, draft, source, keys)


_MAPPINGS = ("bf16", "fp16", "optimizer", "scheduler", "data_types", *SECTIONS)
_DTYPES = {"fp32": ("fp32", "float32", "float", "torch.float32"), "fp16": ("fp16", "float16", "half", "torch.float16"),
           "bf16": ("bf16", "bfloat16", "torch.bfloat16")}  # DeepSpeed's DtypeEnum spellings (runtime/config.py)


def _shapes(ds: dict, draft: Draft, source: str) -> dict:
    """``ds`` with each section a mapping (a problem otherwise), DeepSpeed's boolean form of
    zero_optimization spelt out, and its dtype spellings normalised."""
    for name in _MAPPINGS:
        if name in ds and not isinstance(ds[name], dict):
            draft.refuse(f"{source}: {name}", f"must be a mapping, got {type(ds.pop(name)).__name__}")
    for name, inner in (("optimizer", "params"), ("scheduler", "params")):
        section = ds.get(name)
        if isinstance(section, dict) and not isinstance(section.get(inner, {}), dict):
            draft.refuse(f"{source}: {name}.{inner}", "must be a mapping")
            ds[name] = {k: v for k, v in section.items() if k != inner}
        if isinstance(section, dict) and not isinstance(section.get("type", ""), str):
            draft.refuse(f"{source}: {name}.type", "must be a string")
            ds.pop(name)
    zero = ds.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's old form: true is stage 1 (runtime/zero/config.py)
        ds["zero_optimization"] = {"stage": 1, "allgather_bucket_size": ds.pop("allgather_size", 500_000_000)} \
            if zero else {"stage": 0}
        draft.notes.append(f"{source}: zero_optimization {str(zero).lower()} is DeepSpeed's old form of stage "
                           f"{1 if zero else 0}")
    elif zero is not None and not isinstance(zero, dict):
        draft.refuse(f"{source}: zero_optimization", f"must be a mapping, got {type(ds.pop('zero_optimization')).__name__}")
    for name in ("offload_optimizer", "offload_param"):
        off = (ds.get("zero_optimization") or {}).get(name)
        if off is not None and not isinstance(off, dict):
            draft.refuse(f"{source}: zero_optimization.{name}", "must be a mapping ({device: cpu})")
            ds["zero_optimization"] = {k: v for k, v in ds["zero_optimization"].items() if k != name}
    for where, node, key in (("communication_data_type", ds, "communication_data_type"),
                             ("data_types.grad_accum_dtype", ds.get("data_types") or {}, "grad_accum_dtype")):
        value = node.get(key)
        if isinstance(value, str):
            node[key] = next((k for k, names in _DTYPES.items() if value.lower() in names), value)
    return ds


def _whole_numbers(node: dict, keys: Section | None) -> dict:
    """``1e9`` (a float in JSON) as the whole number DeepSpeed reads it as, where it wants one."""
    out = {}
    for k, v in node.items():
        key = keys.keys.get(keys.canonical(k)) if keys is not None else None
        if isinstance(v, dict):
            v = _whole_numbers(v, key.section if key is not None else None)
        elif isinstance(v, float) and v.is_integer() and key is not None and key.kinds and "float" not in key.kinds:
            v = int(v)
        out[k] = v
    return out


def _typed(path: tuple[str, ...], value: Any, draft: Draft, source: str, where: str) -> None:
    if value == AUTO:
        draft.refuse(f"{source}: {where}", "'auto' here is not a TrainingArguments value; write a number")
    else:
        draft.set(path, value, key=where)


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _batch(ds: dict, draft: Draft, source: str, world: int, sp: int = 1) -> None:
    """``world``: the data-parallel ranks; ``sp``: the sequence-parallel size."""
    given = set(ds)
    micro = _whole(ds.pop("train_micro_batch_size_per_gpu", None))
    ga = _whole(ds.pop("gradient_accumulation_steps", None))
    total = _whole(ds.pop("train_batch_size", None))
    if sp > 1 and "train_batch_size" in given:
        # accelerate's _prepare_deepspeed overwrites it with micro x accumulation x data-parallel ranks before
        # deepspeed.initialize, the accumulation being gradient_accumulation_steps or 1: the number is never used
        shown = repr(total) if len(repr(total)) <= 20 else repr(total)[:17] + "..."
        draft.notes.append(f"{source}: train_batch_size {shown} left out: under sequence parallelism (sp_size {sp}) "
                           "accelerate replaces it with micro batch x gradient_accumulation_steps (1 when absent) x "
                           f"{world} data-parallel ranks before deepspeed.initialize")
        total = None
    counts = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (total, micro))
    if micro is not None and ga is None and counts and total != micro * world:
        draft.notes.append(f"{source}: no gradient_accumulation_steps: accelerate sets it to 1, and DeepSpeed's batch "
                           f"check then fails at {world} processes ({total} != {micro} x 1 x {world}); hfscale derives "
                           "it from train_batch_size, as DeepSpeed alone does")
    if micro is None and isinstance(total, int) and not isinstance(total, bool) and total > 0:
        # DeepSpeed derives the micro batch from the global one (gradient accumulation 1 when absent)
        per_rank = world * (ga if isinstance(ga, int) and not isinstance(ga, bool) and ga > 0 else 1)
        if total % per_rank == 0:
            micro = total // per_rank
            draft.comments[("batch", "micro_batch_size")] = (f"absent: DeepSpeed derives it, train_batch_size {total} "
                                                            f"/ ({per_rank // world} x {world} processes)")
    if micro in (None, AUTO):
        draft.set(("batch", "micro_batch_size"), 1, "auto: the Trainer's per_device_train_batch_size; set yours")
    else:
        draft.set(("batch", "micro_batch_size"), micro, draft.comments.get(("batch", "micro_batch_size")),
                  key="train_micro_batch_size_per_gpu" if "train_micro_batch_size_per_gpu" in given else "train_batch_size")
    if ga == AUTO:
        draft.set(("batch", "gradient_accumulation_steps"), draft.get(("batch", "gradient_accumulation_steps"), 1),
                  "auto: the Trainer's gradient_accumulation_steps (1 unless the accelerate config says)")
    elif ga is not None:
        draft.set(("batch", "gradient_accumulation_steps"), ga, key="gradient_accumulation_steps")
    if total not in (None, AUTO):
        draft.set(("batch", "global_batch_size"), total, key="train_batch_size")


def _precision(ds: dict, draft: Draft, source: str, mixed_precision: str | None) -> dict[str, Any]:
    """Set ``precision``; return what bf16/fp16 hold beyond what hfscale writes (for extra)."""
    bf16 = dict(ds.pop("bf16", None) or {})
    fp16 = dict(ds.pop("fp16", None) or {})
    on = {name: section.pop("enabled", False) for name, section in (("bf16", bf16), ("fp16", fp16))}
    if AUTO in on.values():
        # accelerate fills "auto" from its mixed_precision, "no" when the file has none
        explicit = [n for n, v in on.items() if v is True]
        value = explicit[0] if explicit else mixed_precision or "no"
        why = "the accelerate config's mixed_precision" if mixed_precision else "the Trainer's --bf16/--fp16 (off " \
            "unless your command line set them; hfscale writes them from precision): set yours"
        draft.set(("precision",), value, f"auto: {why}")
    else:
        value = "bf16" if on["bf16"] else "fp16" if on["fp16"] else "no"
        if on["bf16"] and on["fp16"]:
            draft.refuse(f"{source}: bf16.enabled, fp16.enabled", "both are true; DeepSpeed trains one precision")
        draft.set(("precision",), value, key="bf16.enabled" if on["bf16"] else "fp16.enabled")
    if value == "fp16":
        fp16 = {k: v for k, v in fp16.items() if FP16_WRITTEN.get(k, object()) != v}
    return {name: rest for name, rest in (("bf16", bf16), ("fp16", fp16)) if rest}


def _zero(zero: dict, draft: Draft, source: str, extra: dict, keys: Section | None, save_16bit: bool) -> None:
    zero = dict(zero)
    section = keys.keys["zero_optimization"].section if keys else None
    for old, new in _OLD_OFFLOAD.items():  # bool forms of the offload sections
        if old in zero:
            if zero.pop(old) is True and new not in zero:
                zero[new] = {"device": "cpu"}
    if "cpu_offload_use_pin_memory" in zero:  # DeepSpeed declares it but sets nothing from it (set_new_param False)
        zero.pop("cpu_offload_use_pin_memory")
        draft.notes.append(f"{source}: left out zero_optimization.cpu_offload_use_pin_memory: DeepSpeed reads nothing "
                           "from it")
    if section is not None:
        zero = {section.canonical(k): v for k, v in zero.items()}
    stage = zero.pop("stage", 0)
    draft.set(DS + ("stage",), stage, None if zero or stage else "zero_optimization absent: ZeRO off",
              key="zero_optimization.stage")
    ignored = []
    for key, stages in ZERO_KEYS.items():
        if key in zero:
            value = zero.pop(key)
            if stage not in stages:
                ignored.append(key)  # DeepSpeed never reads it at this stage
            elif value == AUTO:
                draft.set(DS + (key,), _default(key), f"auto: {_AUTO_FROM_MODEL}")
            elif value is not None or key == "overlap_comm":
                draft.set(DS + (key,), value, key=f"zero_optimization.{key}")
    if "stage3_gather_16bit_weights_on_model_save" in zero:
        gather = zero.pop("stage3_gather_16bit_weights_on_model_save")
        if gather == AUTO:  # accelerate's DeepSpeedPlugin fills it from zero3_save_16bit_model, default false
            draft.set(DS + ("gather_16bit_weights_on_model_save",), save_16bit, "auto: accelerate's "
                      f"zero3_save_16bit_model{'' if save_16bit else ', default false'}")
        elif stage == 3:
            draft.set(DS + ("gather_16bit_weights_on_model_save",), gather,
                      key="zero_optimization.stage3_gather_16bit_weights_on_model_save")
        elif gather:
            draft.notes.append(f"{source}: left out zero_optimization.stage3_gather_16bit_weights_on_model_save: "
                               f"DeepSpeed reads it at stage 3 only, this is stage {stage}")
    for name in ("offload_optimizer", "offload_param"):
        off = zero.pop(name, None)
        if name == "offload_param" and stage in (0, 1, 2) and off is not None:
            ignored.append(name)  # DeepSpeed accepts it at every stage and reads it at stage 3 only
        elif isinstance(off, dict):
            model = DeepSpeedSection.model_fields[name].annotation
            typed = {k: (str(v) if k == "nvme_path" else v) for k, v in off.items() if k in model.model_fields}
            draft.set(DS + (name,), typed, key=f"zero_optimization.{name}")
            rest = {k: v for k, v in off.items() if k not in model.model_fields}
            if rest:
                extra.setdefault("zero_optimization", {})[name] = rest
    if ignored:
        draft.notes.append(f"{source}: left out zero_optimization.{', '.join(ignored)}: DeepSpeed does not use "
                           f"{'it' if len(ignored) == 1 else 'them'} at ZeRO stage {stage}")
    if stage in (1, 2):  # written by hfscale for these stages: only a changed value goes to extra
        for key in ("allgather_partitions", "reduce_scatter"):
            if zero.get(key) is True:
                zero.pop(key)
    if zero:
        extra.setdefault("zero_optimization", {}).update(zero)


def _extra(extra: dict, draft: Draft, source: str, keys: Section | None) -> None:
    if keys is not None:
        skipped = [name for name, _ in ignored_keys(extra, keys, "DeepSpeed")]
        if skipped:  # DeepSpeed reads none of them: leaving them out changes nothing
            draft.notes.append(f"{source}: left out {', '.join(skipped)}: not {'a key' if len(skipped) == 1 else 'keys'}"
                               " DeepSpeed reads (it ignores them)")
            extra = {k: v for k, v in extra.items() if k not in skipped}
    if not extra:
        return
    autos = [k for k, v in _leaves(extra) if v == AUTO]
    for path in autos:
        draft.refuse(f"{source}: {'.'.join(path)}", "'auto' here is not a TrainingArguments value; write a value")
    if keys is not None:
        for path, message in check_extra(extra, keys, {}):
            if tuple(path) not in autos:
                draft.refuse(f"{source}: {'.'.join(map(str, path))}", message)
    draft.set(DS + ("extra",), extra)
    draft.origins.update({DS + ("extra", str(k)): f"{source}: {k}" for k in extra})


def _leaves(node: dict, here: tuple = ()) -> list[tuple[tuple, Any]]:
    out = []
    for k, v in node.items():
        if isinstance(v, dict):
            out += _leaves(v, here + (k,))
        else:
            out.append((here + (k,), v))
    return out
