"""The accelerate side's rules: GPU ids and parallelism against the cluster, and the accelerate
config keys hfscale owns (set from a typed field, so refused in ``accelerate.extra``)."""

from __future__ import annotations

from functools import lru_cache

from hfscale.config.accelerate import FsdpSection, ParallelismConfig
from hfscale.config.model import HfscaleConfig
from hfscale.rules import parallelism as parallelism_rules

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
IDLE = {"megatron_lm_config": "distributed_type MEGATRON_LM",
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
    out: Found = fp8_problems(cfg)
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
    if cfg.distributed.process_group and cfg.distributed.backend != "ddp":
        out.append((("distributed", "process_group"), f"only for backend ddp (deepspeed and fsdp always start a "
                    f"process group); the backend is {cfg.distributed.backend}"))
    ids = cfg.accelerate.gpu_ids
    if ids is not None and ids != "all" and len(ids.split(",")) != procs_per_node:
        out.append((("accelerate", "gpu_ids"), f"{len(ids.split(','))} GPU id(s) for {procs_per_node} process(es) "
                    "per node"))
    return out + parallelism_rules.problems(cfg, world)


_TRUTH = {"y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0"}  # accelerate's str_to_bool


def fp8_problems(cfg: HfscaleConfig) -> Found:
    """What accelerate refuses of precision fp8 and its fp8_config (accelerator.py, utils/launch.py),
    and fp8 under torchrun, which never sets it up."""
    fp8 = cfg.accelerate.extra.get("fp8_config")
    here = ("accelerate", "extra", "fp8_config")
    if cfg.precision != "fp8":
        return [(here, "does nothing here: accelerate reads it only with mixed_precision fp8 (precision: fp8)")] \
            if "fp8_config" in cfg.accelerate.extra else []
    out: Found = []
    if cfg.runner.launcher == "torchrun":
        out.append((("precision",), "fp8 is set up for each rank by accelerate launch (ACCELERATE_MIXED_PRECISION, "
                    "ACCELERATE_FP8_*), which torchrun does not run: the job would train in fp32; use "
                    "runner.launcher: accelerate"))
    fp8 = fp8 if isinstance(fp8, dict) else {}
    backend = fp8.get("fp8_backend", fp8.get("backend"))
    engine = cfg.distributed.backend
    if backend == "MSAMP" and engine == "fsdp":
        out.append((here + ("fp8_backend",), "MSAMP with FSDP: accelerate refuses it (\"accelerate + MS-AMP + FSDP is "
                    "not supported\"); use TE or AO, or distributed.backend deepspeed"))
    if backend == "AO" and engine == "fsdp" and (cfg.distributed.fsdp or FsdpSection()).cpu_ram_efficient_loading:
        out.append((("distributed", "fsdp", "cpu_ram_efficient_loading"), "true with fp8_backend AO: accelerate "
                    "refuses the pair (torchao with FSDP2 and cpu_ram_efficient_loading); set it false"))
    name = "fp8_override_linear_precision" if "fp8_override_linear_precision" in fp8 else "override_linear_precision"
    olp = fp8.get(name)
    if isinstance(olp, list) and (len(olp) < 3 or any(str(v).lower() not in _TRUTH for v in olp[:3])):
        out.append((here + (name,), f"{olp!r}: accelerate launch reads three values, fprop, dgrad and wgrad, each "
                    "true or false"))
    ds = cfg.distributed.deepspeed
    if engine == "deepspeed" and ds is not None and "bf16" in ds.extra:
        out.append((("distributed", "deepspeed", "extra", "bf16"), "with precision fp8, accelerate turns DeepSpeed's "
                    "bf16 on only when the JSON has no bf16 section (DeepSpeedPlugin.set_mixed_precision); " + (
                        "with enabled: true the HF Trainer refuses it (its bf16 flag is false under fp8: the "
                        "mismatch check fails)" if _enabled(ds.extra["bf16"]) else
                        "with this one DeepSpeed would train fp32 weights") + ": remove it"))
    return out


def _enabled(section: object) -> bool:
    return isinstance(section, dict) and str(section.get("enabled", False)).lower() == "true"


def warnings(cfg: HfscaleConfig) -> Found:
    """fp8 under FSDP with no fp8_backend: accelerate picks the first one installed, torchao before
    Transformer Engine and MS-AMP (Accelerator.__init__), and then refuses torchao beside
    cpu_ram_efficient_loading, which is hfscale's default."""
    fsdp = cfg.distributed.fsdp or FsdpSection()
    fp8 = cfg.accelerate.extra.get("fp8_config")
    fp8 = fp8 if isinstance(fp8, dict) else {}
    if cfg.precision != "fp8" or cfg.distributed.backend != "fsdp" or not fsdp.cpu_ram_efficient_loading:
        return []
    if fp8.get("fp8_backend", fp8.get("backend")) not in (None, "NO"):
        return []
    return [(("accelerate", "extra", "fp8_config", "fp8_backend"), "unset with FSDP: accelerate then uses torchao "
             "where it is installed (before Transformer Engine and MS-AMP), and refuses torchao beside "
             "distributed.fsdp.cpu_ram_efficient_loading: true (\"torchao with FSDP2 and cpu_ram_efficient_loading "
             "is not supported\"); name the backend (TE), or set cpu_ram_efficient_loading: false")]


def extra_problems(extra: dict) -> tuple[Found, Found]:
    """(problems, warnings) of ``accelerate.extra``, paths relative to it: checked against the
    installed accelerate's config keys, read from its source."""
    if not extra:
        return [], []
    from hfscale.config.sources.accelerate import accelerate_keys
    from hfscale.config.extra_keys import check_extra

    keys = accelerate_keys()
    if keys is None:
        return [], [((), "accelerate is not installed here, so its keys are not checked")]
    return check_extra(extra, keys, owned()), []
