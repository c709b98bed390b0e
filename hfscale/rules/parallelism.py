"""``distributed.parallelism`` against the engine and the cluster, as accelerate's ParallelismConfig
(parallelism_config.py: ``__post_init__``, ``_validate_accelerator``) and DeepSpeed's ALST/Ulysses
sequence parallelism (runtime/sequence_parallel) check it when the job starts, and the DeepSpeed
JSON keys that divide DeepSpeed's data-parallel world (``sequence_parallel_size``,
``data_parallel_size`` in ``distributed.deepspeed.extra``).

With sequence parallelism accelerate writes DeepSpeed's ``train_batch_size`` as micro batch x
accumulation x dp_replicate_size x dp_shard_size (accelerator.py, ``_prepare_deepspeed``), and
DeepSpeed checks it against micro batch x accumulation x world size / sp_size (its data-parallel
world, runtime/config.py): the two agree only when the sizes multiply to the world size.
"""

from __future__ import annotations

from hfscale.config.model import HfscaleConfig

Found = list[tuple[tuple, str]]
HERE = ("distributed", "parallelism")
# accelerate's DeepSpeedSequenceParallelConfig.__post_init__: these, or a hub flash-attn kernel
SP_ATTENTION = ("flash_attention_2", "flash_attention_3", "sdpa")
SP_NOT_ATTENTION = ("eager", "flex_attention")


def sequence_parallel_size(cfg: HfscaleConfig) -> int:
    """Ranks that share each sample under DeepSpeed sequence parallelism (1: off)."""
    p = cfg.distributed.parallelism
    return p.sp_size if p is not None and cfg.distributed.backend == "deepspeed" else 1


def problems(cfg: HfscaleConfig, world: int) -> Found:
    """Problems of distributed.parallelism and of DeepSpeed's data-parallel keys, paths from the
    document root; ``world``: the processes of the job."""
    out = _deepspeed_keys(cfg, world)
    p = cfg.distributed.parallelism
    if p is None:
        return out
    backend = cfg.distributed.backend
    if p.sp_size > 1 and backend != "deepspeed":
        out.append((HERE + ("sp_size",), f"{p.sp_size}: sequence parallelism (ALST/Ulysses) is DeepSpeed's; accelerate "
                    f"applies it only with distributed_type DEEPSPEED, and backend is {backend}"))
    elif p.sp_size == 1 and backend != "fsdp":
        out.append((HERE, "accelerate's parallelism_config needs distributed.backend: fsdp (FSDP2), or sp_size > 1 "
                    f"with backend deepspeed (sequence parallelism); backend is {backend}"))
    if p.total != world:
        sizes = f"dp_replicate_size {p.dp_replicate_size} x dp_shard_size {p.dp_shard_size} x tp_size {p.tp_size} x " \
                f"cp_size {p.cp_size}" + (f" x sp_size {p.sp_size}" if p.sp_size > 1 else "")
        why = "" if p.sp_size == 1 else (
            ": accelerate writes DeepSpeed's train_batch_size for dp_replicate_size x dp_shard_size data-parallel "
            f"ranks, and DeepSpeed checks it against world size / sp_size = {world / p.sp_size:g}")
        out.append((HERE, f"{sizes} = {p.total}, but the world size is {world}{why}"))
    elif p.sp_size > 1 and p.tp_size > 1:
        out.append((HERE + ("tp_size",), f"{p.tp_size} beside sp_size {p.sp_size}: DeepSpeed's data-parallel world is "
                    f"world size / sp_size = {world // p.sp_size}, but accelerate writes train_batch_size for "
                    f"dp_replicate_size x dp_shard_size = {p.data_parallel} ranks, and DeepSpeed's batch check fails"))
    if p.cp_size > 1 and p.sp_size > 1:
        out.append((HERE + ("sp_size",), f"{p.sp_size} beside cp_size {p.cp_size}: accelerate refuses the pair "
                    "(context and sequence parallelism are mutually exclusive); set one of them to 1"))
    if (p.tp_size > 1 or p.cp_size > 1) and p.dp_replicate_size > 1 and p.dp_shard_size == 1:
        out.append((HERE + ("dp_shard_size",), "1 with dp_replicate_size > 1 and tensor or context parallelism: "
                    "accelerate refuses pure data parallelism beside them; set dp_shard_size > 1"))
    if backend == "fsdp" and world > 1 and p.total == world and p.dp_shard_size == 1 and p.cp_size == 1:
        out.append((HERE + ("dp_shard_size",), "1 and cp_size 1: accelerate refuses FSDP with no dimension to shard "
                    "across; give dp_shard_size (or cp_size) the ranks FSDP shards over"))
    if p.sp_size > 1:
        out += _sequence_problems(cfg)
    return out


def _sequence_problems(cfg: HfscaleConfig) -> Found:
    p = cfg.distributed.parallelism
    assert p is not None
    out: Found = []
    attn = p.sp_attn_implementation
    if attn in SP_NOT_ATTENTION or (attn not in SP_ATTENTION and not ("/" in attn and "flash-attn" in attn)):
        out.append((HERE + ("sp_attn_implementation",), f"{attn!r}: accelerate takes {', '.join(SP_ATTENTION)} or a "
                    "hub flash-attn kernel (such as kernels-community/flash-attn2) under sequence parallelism"))
    if not p.sp_seq_length_is_variable and p.sp_seq_length is None:
        out.append((HERE + ("sp_seq_length",), "required when sp_seq_length_is_variable is false: DeepSpeed refuses a "
                    "fixed sequence length it is not given"))
    if p.sp_seq_length is not None and not p.sp_seq_length_is_variable and p.sp_seq_length % p.sp_size:
        out.append((HERE + ("sp_seq_length",), f"{p.sp_seq_length} is not divisible by sp_size {p.sp_size}: DeepSpeed "
                    "refuses every batch of that length"))
    block = cfg.training.data.block_size
    if cfg.training.script is None and block % p.sp_size:
        out.append((("training", "data", "block_size"), f"{block} is not divisible by distributed.parallelism.sp_size "
                    f"{p.sp_size}: DeepSpeed refuses every batch of that length"))
    if cfg.training.script is None:
        out.append((HERE + ("sp_size",), f"{p.sp_size}: the built-in entry point (no training.script) cannot "
                    "train with sequence parallelism: its batches have no position_ids, which DeepSpeed's Ulysses "
                    "data-loader adapter requires (it raises on the first batch), and its model is built with "
                    "transformers' default attention, not sp_attn_implementation; name your training script in "
                    "training.script"))
    if cfg.runner.launcher != "accelerate":
        out.append((("runner", "launcher"), f"{cfg.runner.launcher}: sequence parallelism reaches the ranks through "
                    "accelerate launch (PARALLELISM_CONFIG_* from the accelerate config), which torchrun does not "
                    "run; the job would train without it: use runner.launcher: accelerate"))
    return out


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _deepspeed_keys(cfg: HfscaleConfig, world: int) -> Found:
    """DeepSpeed's own sequence_parallel_size / data_parallel_size in distributed.deepspeed.extra."""
    ds = cfg.distributed.deepspeed
    if cfg.distributed.backend != "deepspeed" or ds is None:
        return []
    sp = sequence_parallel_size(cfg)
    out: Found = []
    base = ("distributed", "deepspeed", "extra")
    if "sequence_parallel_size" not in ds.extra:  # data_parallel_size alone: a warning (warnings())
        return out
    value = ds.extra["sequence_parallel_size"]
    if type(value) is not int or value != sp:
        out.append((base + ("sequence_parallel_size",), f"{_shown(value)}, but distributed.parallelism.sp_size is "
                    f"{sp}: DeepSpeed divides its data-parallel world by it wherever it builds its config without "
                    "accelerate's sequence-parallel groups (deepspeed.zero.Init in from_pretrained), and its batch "
                    "check fails; set distributed.parallelism.sp_size (with backend deepspeed) instead"))
    if "data_parallel_size" in ds.extra:
        value = ds.extra["data_parallel_size"]
        if type(value) is not int or value * sp != world:
            out.append((base + ("data_parallel_size",), f"{_shown(value)}, but the data-parallel ranks are world size "
                        f"{world} / sp_size {sp} = {world / sp:g}: DeepSpeed builds its (data_parallel_size, "
                        "sequence_parallel_size) mesh of the processes from it"))
    return out


def warnings(cfg: HfscaleConfig) -> Found:
    """DeepSpeed's data_parallel_size without sequence_parallel_size, which nothing reads."""
    ds = cfg.distributed.deepspeed
    if cfg.distributed.backend != "deepspeed" or ds is None:
        return []
    if "data_parallel_size" in ds.extra and "sequence_parallel_size" not in ds.extra:
        return [(("distributed", "deepspeed", "extra", "data_parallel_size"), "does nothing without "
                 "sequence_parallel_size: deepspeed.initialize builds its (data_parallel_size, sequence_parallel_size) "
                 "mesh only when the JSON has both; remove it")]
    return []
