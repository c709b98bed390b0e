"""The DeepSpeed section's rules across its keys and the rest of the job, and the DeepSpeed JSON
keys hfscale owns (set from a typed field, so refused in ``distributed.deepspeed.extra``)."""

from __future__ import annotations

from functools import lru_cache

from hfscale.config.model import HfscaleConfig
from hfscale.rules import parallelism as parallelism_rules
from hfscale.config.deepspeed import (
    ActivationCheckpointingConfig,
    AioConfig,
    CommsLoggerConfig,
    DeepSpeedSection,
    FlopsProfilerConfig,
    MonitorConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    WandbMonitorConfig,
)

BASE = "distributed.deepspeed"
Found = list[tuple[tuple, str]]
# zero_optimization keys typed under the same name in distributed.deepspeed, and the stages they are for
ZERO_KEYS = {
    "overlap_comm": (1, 2, 3), "contiguous_gradients": (1, 2, 3), "reduce_bucket_size": (1, 2, 3),
    "allgather_bucket_size": (1, 2), "round_robin_gradients": (1, 2), "sub_group_size": (1, 2, 3),
    "stage3_prefetch_bucket_size": (3,), "stage3_param_persistence_threshold": (3,),
    "stage3_max_live_parameters": (3,), "stage3_max_reuse_distance": (3,), "zero_hpz_partition_size": (3,),
    "zero_quantized_weights": (3,), "zero_quantized_gradients": (3,),
}
SECTIONS = {"aio": AioConfig, "activation_checkpointing": ActivationCheckpointingConfig,
            "flops_profiler": FlopsProfilerConfig, "comms_logger": CommsLoggerConfig, "tensorboard": MonitorConfig,
            "wandb": WandbMonitorConfig, "csv_monitor": MonitorConfig}
SCHEDULE_OF = {"WarmupLR": ("constant", "constant_with_warmup"), "WarmupDecayLR": ("linear",),
               "WarmupCosineLR": ("cosine",)}
NVME_ONLY = {  # offload keys only NVMe offload reads
    "offload_optimizer": ("buffer_count", "pipeline_read", "pipeline_write", "fast_init"),
    "offload_param": ("buffer_count", "buffer_size", "max_in_cpu")}

# training.async_save: DeepSpeed's decoupled checkpoint engine (deepspeed/runtime/checkpoint_engine/
# decoupled_checkpoint_engine.py): each rank hands its state to a writer process and trains on; the engine
# commits (waits for the writers, then writes 'latest') at the next optimizer step. "python": a plain file
# writer ("fast" needs the async_io op and, with ZeRO-1/2, names its files <name>-<rank>.<n>, which the
# loader does not read); "replica": DeepSpeed 0.19.8 fails without a data_parallel unit when there is no
# model-parallel unit ('UniversalParallelInfo' object has no attribute 'dp_rank'), and with replica every
# rank writes its own shards, as without the writer.
ASYNC_WRITER = {"type": "python", "decoupled": True, "data_parallel": "replica"}


@lru_cache(maxsize=1)
def owned() -> dict[tuple[str, ...], str]:
    """DeepSpeed JSON key path -> the hfscale key it is written from."""
    out = {
        ("train_batch_size",): "batch.global_batch_size",
        ("train_micro_batch_size_per_gpu",): "batch.micro_batch_size",
        ("gradient_accumulation_steps",): "batch.gradient_accumulation_steps",
        ("gradient_clipping",): "gradient_clipping",
        ("bf16", "enabled"): "precision",
        ("fp16", "enabled"): "precision",
        ("steps_per_print",): f"{BASE}.steps_per_print",
        ("communication_data_type",): f"{BASE}.communication_data_type",
        ("data_types", "grad_accum_dtype"): f"{BASE}.grad_accum_dtype",
        ("zero_optimization", "stage"): f"{BASE}.stage",
        ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"): f"{BASE}.gather_16bit_weights_on_model_save",
        ("optimizer", "type"): f"{BASE}.optimizer.type",
        ("optimizer", "params", "lr"): "training.learning_rate",
        ("optimizer", "params", "betas"): "training.adam_beta1 and training.adam_beta2",
        ("optimizer", "params", "eps"): "training.adam_epsilon",
        ("optimizer", "params", "weight_decay"): "training.weight_decay",
        ("scheduler", "type"): f"{BASE}.scheduler.type",
        ("scheduler", "params", "warmup_max_lr"): "training.learning_rate",
        ("scheduler", "params", "warmup_num_steps"): "training.warmup_steps",
        ("scheduler", "params", "total_num_steps"): "training.max_steps",
    }
    out.update({("zero_optimization", k): f"{BASE}.{k}" for k in ZERO_KEYS})
    for name, model in (("offload_optimizer", OffloadOptimizerConfig), ("offload_param", OffloadParamConfig)):
        out.update({("zero_optimization", name, k): f"{BASE}.{name}.{k}" for k in model.model_fields})
    for name, model in SECTIONS.items():
        out.update({(name, k): f"{BASE}.{name}.{k}" for k in model.model_fields})
    return out


def _is_set(model, key: str) -> bool:
    """Set in the YAML to something other than its default (a default restated does nothing)."""
    return (model is not None and key in model.model_fields_set
            and getattr(model, key) != type(model).model_fields[key].get_default(call_default_factory=True))


def problems(cfg: HfscaleConfig, world: int) -> tuple[Found, Found]:
    """(problems, warnings) of the DeepSpeed section, paths from the document root."""
    ds = cfg.distributed.deepspeed
    if cfg.distributed.backend != "deepspeed" or ds is None:
        return [], parallelism_rules.warnings(cfg)
    base = ("distributed", "deepspeed")
    out: Found = []
    notes: Found = []
    for key, stages in ZERO_KEYS.items():
        if _is_set(ds, key) and ds.stage not in stages:
            which = "ZeRO is off at stage 0" if ds.stage == 0 else f"only for stage {' or '.join(map(str, stages))}"
            out.append((base + (key,), f"{which}; stage is {ds.stage}"))
    if _is_set(ds, "gather_16bit_weights_on_model_save") and ds.stage != 3:
        out.append((base + ("gather_16bit_weights_on_model_save",), f"only for stage 3; stage is {ds.stage}"))
    # DeepSpeed clamps the group to the world size before it checks divisibility (utils/groups.py,
    # _create_zero_param_parallel_group: min(group_size, world_size)): 16 on 8 ranks is one group of 8
    hpz = min(ds.zero_hpz_partition_size, world) if world else ds.zero_hpz_partition_size
    if ds.stage == 3 and hpz > 1 and world % hpz:
        out.append((base + ("zero_hpz_partition_size",), f"{ds.zero_hpz_partition_size} does not divide the world "
                    f"size {world}"))
    elif ds.stage == 3 and ds.zero_hpz_partition_size > world > 0:
        notes.append((base + ("zero_hpz_partition_size",), f"{ds.zero_hpz_partition_size} is more than the world size "
                      f"{world}: DeepSpeed makes it {world} (one group of every rank)"))
    if cfg.training.async_save and ds.stage == 0:
        out.append((("training", "async_save"), "needs ZeRO (distributed.deepspeed.stage 1, 2 or 3): hfscale tests "
                    "DeepSpeed's decoupled checkpoint writer with ZeRO's sharded state only; stage is 0"))
    checkpoint = ds.extra.get("checkpoint")
    if isinstance(checkpoint, dict) and "writer" in checkpoint:  # DeepSpeed's checkpoint section is read as open
        out.append((base + ("extra", "checkpoint", "writer"), "hfscale sets this from training.async_save; set it there"))
    out += _offload_problems(ds, base)
    nvme = "nvme" in (ds.offload_optimizer.device, ds.offload_param.device)
    if ds.aio is not None and not nvme:
        out.append((base + ("aio",), "asynchronous I/O is used by NVMe offload only; no offload device is nvme"))
    if ds.round_robin_gradients and ds.offload_optimizer.device != "cpu":
        notes.append((base + ("round_robin_gradients",), "speeds up copying gradients to the CPU; without "
                      "offload_optimizer.device: cpu it does nothing"))
    out += _schedule_problems(cfg, ds, base) + _optimizer_problems(ds, base)
    if cfg.precision == "fp8" and ds.stage == 3 and ds.zero3_init and cfg.training.script is not None:
        # hfscale.train sets bf16 in the config its TrainingArguments hold (trainer_args.bf16_under_fp8)
        notes.append((("precision",), "fp8 with ZeRO-3: a Trainer script builds its model under deepspeed.zero.Init "
                      "from the DeepSpeed JSON, which has no bf16 section (accelerate adds it for fp8 only when the "
                      "Accelerator is built, after the model), so the weights are partitioned in fp32 and DeepSpeed "
                      "never casts them: the job trains fp32 weights. In the script, after TrainingArguments(...) "
                      "and before the model: args.hf_deepspeed_config.config.setdefault('bf16', {'enabled': True}) "
                      "and args.hf_deepspeed_config._dtype = torch.bfloat16" + (
                          "" if parallelism_rules.sequence_parallel_size(cfg) > 1 else
                          " (or leave training.script null: hfscale.train does this)")))
    return out, notes + schedule_warnings(cfg) + parallelism_rules.warnings(cfg)


def _offload_problems(ds: DeepSpeedSection, base: tuple) -> Found:
    out: Found = []
    for key, what in (("offload_optimizer", "optimizer"), ("offload_param", "parameter")):
        off = getattr(ds, key)
        for name in NVME_ONLY[key]:
            if _is_set(off, name) and off.device != "nvme":
                out.append((base + (key, name), f"used by NVMe offload only; device is {off.device}"))
        if off.device == "none":
            if off.nvme_path is not None:
                out.append((base + (key, "nvme_path"), "only used with device: nvme"))
            continue
        if ds.stage == 0:
            out.append((base + (key, "device"), f"{what} offload needs ZeRO stage 1-3, stage is 0"))
        elif key == "offload_param" and ds.stage != 3:
            out.append((base + (key, "device"), f"parameter offload needs ZeRO stage 3, stage is {ds.stage}"))
        elif off.device == "nvme" and ds.stage != 3:
            out.append((base + (key, "device"), f"NVMe offload (ZeRO-Infinity) needs ZeRO stage 3, stage is {ds.stage}"))
        if off.device == "nvme" and not off.nvme_path:
            out.append((base + (key, "nvme_path"), "required with device: nvme"))
        if off.device != "nvme" and off.nvme_path is not None:
            out.append((base + (key, "nvme_path"), "only used with device: nvme"))
    opt = ds.offload_optimizer
    if opt.ratio < 1 and (ds.stage != 3 or opt.device != "cpu"):
        out.append((base + ("offload_optimizer", "ratio"), "partial offload needs stage 3 and device cpu"))
    return out


def _optimizer_problems(ds: DeepSpeedSection, base: tuple) -> Found:
    """An optimizer type the installed DeepSpeed cannot build, or a 1-bit one beside ZeRO (older
    DeepSpeed asserts "not compatible with ZeRO")."""
    if ds.optimizer is None:
        return []
    from hfscale.config.engine_defaults import ONEBIT
    from hfscale.config.sources.deepspeed import deepspeed_optimizers

    kind, known = ds.optimizer.type, deepspeed_optimizers()
    if known is not None and kind.lower() not in known:
        types = type(ds.optimizer).model_fields["type"].annotation.__args__
        return [(base + ("optimizer", "type"), f"{kind}: the installed DeepSpeed does not build it (its optimizers: "
                 f"{', '.join(sorted(known))}; any other type it looks up in torch.optim, which has no {kind}), so "
                 f"deepspeed.initialize would fail; use {', '.join(t for t in types if t.lower() in known)}")]
    if kind.lower() in ONEBIT and ds.stage != 0:
        return [(base + ("optimizer", "type"), f"{kind} is not compatible with ZeRO (DeepSpeed asserts it); stage "
                 f"is {ds.stage}: set stage 0, or another optimizer")]
    return []


def _schedule_problems(cfg: HfscaleConfig, ds: DeepSpeedSection, base: tuple) -> Found:
    if ds.scheduler is None:
        return []
    t = cfg.training
    kind = ds.scheduler.type
    out: Found = []
    if t.lr_scheduler_type not in SCHEDULE_OF[kind]:
        out.append((base + ("scheduler", "type"), f"{kind} is not training.lr_scheduler_type {t.lr_scheduler_type!r}; "
                    f"it gives {' or '.join(SCHEDULE_OF[kind])}"))
    return out


def schedule_warnings(cfg: HfscaleConfig) -> Found:
    """A DeepSpeed schedule whose length is left to the Trainer, in a job no Trainer runs."""
    ds = cfg.distributed.deepspeed
    if ds is None or ds.scheduler is None or ds.scheduler.type == "WarmupLR" or cfg.training.max_steps is not None:
        return []
    if cfg.training.script is None or cfg.training.pass_args == "trainer":
        return []
    return [(("distributed", "deepspeed", "scheduler", "type"),
             f"{ds.scheduler.type} decays over total_num_steps, written as auto because training.max_steps is not "
             f"set: a Trainer fills it in, a plain script must (accelerate's DummyScheduler(total_num_steps=...)) or "
             "DeepSpeed fails; set training.max_steps")]


def extra_problems(extra: dict) -> tuple[Found, Found]:
    """(problems, warnings) of ``distributed.deepspeed.extra``, paths relative to it: checked
    against the installed DeepSpeed's keys, read from its source."""
    if not extra:
        return [], []
    from hfscale.config.sources.deepspeed import deepspeed_keys
    from hfscale.config.extra_keys import check_extra, ignored_keys

    keys = deepspeed_keys()
    if keys is None:
        return [], [((), "DeepSpeed is not installed here, so its keys are not checked; the nodes' DeepSpeed "
                     "reads them when the job starts")]
    ignored = ignored_keys(extra, keys, "DeepSpeed")
    return check_extra(extra, keys, owned()), [((name,), message) for name, message in ignored]
