"""The accelerate side's rules: GPU ids and parallelism against the cluster, and the accelerate
config keys hfscale owns (set from a typed field, so refused in ``accelerate.extra``)."""

from __future__ import annotations

from functools import lru_cache

from .config import HfscaleConfig
from .config_accelerate import FsdpSection, ParallelismConfig

Found = list[tuple[tuple, str]]


@lru_cache(maxsize=1)
def owned() -> dict[tuple[str, ...], str]:
    """accelerate config key path -> the hfscale key it is written from."""
    out = {
        ("compute_environment",): "runner.type (hfscale writes LOCAL_MACHINE)",
        ("distributed_type",): "distributed.backend",
        ("mixed_precision",): "precision",
        ("num_processes",): "cluster (slots, nproc_per_node)",
        ("num_machines",): "cluster (hosts, num_nodes)",
        ("machine_rank",): "cluster.hosts (hfscale gives each node its rank)",
        ("main_process_ip",): "cluster.master_addr",
        ("main_process_port",): "cluster.master_port",
        ("rdzv_backend",): "runner.launcher and runner.max_restarts",
        ("gpu_ids",): "accelerate.gpu_ids",
        ("deepspeed_config",): "distributed.deepspeed (accelerate refuses DeepSpeed keys beside the JSON)",
        ("fsdp_config", "fsdp_version"): "distributed.fsdp (hfscale writes FSDP2)",
    }
    out.update({("fsdp_config", f"fsdp_{k}"): f"distributed.fsdp.{k}" for k in FsdpSection.model_fields})
    out[("fsdp_config", "fsdp_transformer_layer_cls_to_wrap")] = "distributed.fsdp.transformer_layer_cls_to_wrap"
    out.update({("parallelism_config", f"parallelism_config_{k}"): f"distributed.parallelism.{k}"
                for k in ParallelismConfig.model_fields})
    return out


# accelerate config keys that do nothing in the configs hfscale writes, and what they need
IDLE = {"megatron_lm_config": "distributed_type MEGATRON_LM", "fp8_config": "mixed_precision fp8",
        "mpirun_config": "distributed_type MULTI_CPU", "tpu_name": "distributed_type XLA (TPU)",
        "tpu_zone": "distributed_type XLA (TPU)", "tpu_use_cluster": "distributed_type XLA (TPU)",
        "tpu_use_sudo": "distributed_type XLA (TPU)", "tpu_vm": "distributed_type XLA (TPU)",
        "tpu_env": "distributed_type XLA (TPU)", "command_file": "distributed_type XLA (TPU)",
        "commands": "distributed_type XLA (TPU)"}


# accelerate's FullyShardedDataParallelPlugin drops these with a warning for FSDP2, or raises
FSDP1_ONLY = {"sharding_strategy", "backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states"}


def problems(cfg: HfscaleConfig, world: int, procs_per_node: int) -> Found:
    """Problems of accelerate.gpu_ids, accelerate.extra's sections and distributed.parallelism,
    paths from the document root."""
    out: Found = []
    for key in cfg.accelerate.extra:
        if key in IDLE:
            out.append((("accelerate", "extra", key), f"does nothing here: accelerate reads it only with {IDLE[key]}, "
                        "which hfscale does not write"))
        elif key == "fsdp_config" and cfg.distributed.backend != "fsdp":
            out.append((("accelerate", "extra", key), f"FSDP settings, but distributed.backend is "
                        f"{cfg.distributed.backend}"))
        elif key == "fsdp_config" and isinstance(cfg.accelerate.extra[key], dict):
            for name in cfg.accelerate.extra[key]:
                if str(name).removeprefix("fsdp_") in FSDP1_ONLY:
                    out.append((("accelerate", "extra", key, name), "FSDP1 only, and hfscale writes FSDP2 (accelerate "
                                "drops it or refuses it there)"))
    ids = cfg.accelerate.gpu_ids
    if ids is not None and ids != "all" and len(ids.split(",")) != procs_per_node:
        out.append((("accelerate", "gpu_ids"), f"{len(ids.split(','))} GPU id(s) for {procs_per_node} process(es) "
                    "per node"))
    p = cfg.distributed.parallelism
    if p is not None:
        if cfg.distributed.backend != "fsdp":
            out.append((("distributed", "parallelism"), "accelerate's parallelism_config needs distributed.backend: "
                        f"fsdp (FSDP2); backend is {cfg.distributed.backend}"))
        if p.total != world:
            out.append((("distributed", "parallelism"), f"dp_replicate_size {p.dp_replicate_size} x dp_shard_size "
                        f"{p.dp_shard_size} x tp_size {p.tp_size} x cp_size {p.cp_size} = {p.total}, but the world "
                        f"size is {world}"))
    return out


def extra_problems(extra: dict) -> tuple[Found, Found]:
    """(problems, warnings) of ``accelerate.extra``, paths relative to it: checked against the
    installed accelerate's config keys, read from its source."""
    if not extra:
        return [], []
    from .accelerate_source import accelerate_keys
    from .extra_keys import check_extra

    keys = accelerate_keys()
    if keys is None:
        return [], [((), "accelerate is not installed here, so its keys are not checked")]
    return check_extra(extra, keys, owned()), []
