"""The accelerate config YAML, as a pure function of the job.

With DeepSpeed, everything DeepSpeed owns stays in the DeepSpeed JSON and the YAML only points
at it (``deepspeed_config_file``): accelerate refuses the keys in ``FORBIDDEN_BESIDE_DS_FILE``
next to it, ``mixed_precision`` included. ``accelerate.extra`` is merged in last
(hfscale.rules.accelerate refuses keys written here). Multi-node launches use accelerate's ``standard``
launcher (torchrun on each node, ``--machine_rank`` given per node); hfscale does the fan-out.
"""

from __future__ import annotations

from typing import Any

import yaml

from hfscale.config.accelerate import ParallelismConfig
from hfscale.config.extra_keys import merge
from hfscale.rules.resolved import Job

# accelerate.utils.dataclasses.DeepSpeedPlugin._deepspeed_config_checks
FORBIDDEN_BESIDE_DS_FILE = frozenset(
    {
        "gradient_accumulation_steps",
        "gradient_clipping",
        "zero_stage",
        "offload_optimizer_device",
        "offload_param_device",
        "offload_param_nvme_path",
        "offload_optimizer_nvme_path",
        "zero3_save_16bit_model",
        "mixed_precision",
    }
)


def _fsdp(job: Job) -> dict[str, Any]:
    fs = job.fsdp
    assert fs is not None
    out: dict[str, Any] = {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": fs.reshard_after_forward,
        "fsdp_offload_params": fs.offload_params,
        "fsdp_auto_wrap_policy": fs.auto_wrap_policy,
    }
    if fs.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and fs.transformer_layer_cls_to_wrap:
        out["fsdp_transformer_layer_cls_to_wrap"] = ",".join(fs.transformer_layer_cls_to_wrap)
    if fs.auto_wrap_policy == "SIZE_BASED_WRAP":
        out["fsdp_min_num_params"] = fs.min_num_params
    out.update(
        fsdp_state_dict_type=fs.state_dict_type,
        fsdp_activation_checkpointing=fs.activation_checkpointing,
        fsdp_activation_checkpointing_offload=fs.activation_checkpointing_offload,
        fsdp_cpu_ram_efficient_loading=fs.cpu_ram_efficient_loading,
    )
    return out


def _parallelism(p: ParallelismConfig) -> dict[str, Any]:
    """The sizes; the sequence-parallel settings when sequence parallelism is on (accelerate launch
    passes them to the ranks only then) or the YAML sets them."""
    sizes = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
    return {f"parallelism_config_{k}": v for k, v in p.model_dump(exclude_none=True).items()
            if k in sizes or p.sp_size > 1 or k in p.model_fields_set}


def accelerate_config(job: Job, deepspeed_config_file: str) -> dict[str, Any]:
    """The accelerate config dict; ``deepspeed_config_file`` is the path written into it."""
    cfg = job.config
    backend = cfg.distributed.backend
    out: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if backend == "deepspeed":
        ds = job.deepspeed
        assert ds is not None
        dsc: dict[str, Any] = {"deepspeed_config_file": deepspeed_config_file, "deepspeed_multinode_launcher": "standard"}
        if ds.stage == 3:
            dsc["zero3_init_flag"] = ds.zero3_init
        out.update(distributed_type="DEEPSPEED", deepspeed_config=dsc)
    elif backend == "fsdp":
        out.update(distributed_type="FSDP", fsdp_config=_fsdp(job), mixed_precision=cfg.precision)
    else:
        group = job.world_size > 1 or cfg.distributed.process_group  # one process: a group of one, or plain
        out.update(distributed_type="MULTI_GPU" if group else "NO", mixed_precision=cfg.precision)
    p = cfg.distributed.parallelism
    if p is not None:
        out["parallelism_config"] = _parallelism(p)
    if cfg.accelerate.gpu_ids is not None:
        out["gpu_ids"] = cfg.accelerate.gpu_ids
    out.update(downcast_bf16="no", machine_rank=0)
    if job.num_nodes > 1 and job.master_addr:  # schedulers: given at run time (--main_process_ip)
        out["main_process_ip"] = job.master_addr
    out.update(
        main_process_port=cfg.cluster.master_port,
        main_training_function="main",
        num_machines=job.num_nodes,
        num_processes=job.world_size,
        rdzv_backend="static",
        same_network=True,
        use_cpu=False,
    )
    return merge(out, cfg.accelerate.extra)


def render_accelerate(job: Job, deepspeed_config_file: str, header: str = "") -> str:
    """The accelerate config YAML text, with an optional comment header."""
    body = yaml.safe_dump(accelerate_config(job, deepspeed_config_file), sort_keys=False, default_flow_style=False)
    return header + body
