"""``hfscale plan``: a job's memory per GPU, the verdict and the table (no torch here).

The model comes from, first to last: ``--model`` (a config.json or a model directory),
``training.model.config``, ``training.model.path``, or the script's own arguments
(``--model_name_or_path``/``--config_name`` naming a local directory; ``--model_type`` with
``--config_overrides``, as transformers' run_clm.py takes them). The sequence length: ``--seq-len``,
the script's ``--block_size``/``--max_seq_length``/``--max_length``, else training.data.block_size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfscale.config.base import size_bytes
from hfscale.config.model import DEFAULT_MODEL_CONFIG
from hfscale.memory.estimate import Estimate, Setting, estimate
from hfscale.memory.fit import Verdict, judge
from hfscale.memory.model_shape import Shape, ShapeError, shape_of
from hfscale.rules.parallelism import sequence_parallel_size
from hfscale.rules.resolved import Job
from hfscale.rules.trainer_args import given_flags

GiB = 2**30
_SEQ_FLAGS = ("block_size", "max_seq_length", "max_length", "max_seq_len")
MAX_SEQ_LEN = 10_000_000  # tokens per sample: plan --seq-len takes 1 to this


class SizingError(ValueError):
    """What ``plan`` needs but cannot find; the message says where to give it."""


@dataclass(frozen=True)
class Sizing:
    """The inputs of one plan and where each came from."""

    shape: Shape
    model: dict[str, Any]  # the transformers config mapping the shape came from
    model_from: str
    setting: Setting
    seq_from: str
    limit: int | None
    limit_from: str


def _read_json(path: Path) -> dict[str, Any]:
    from hfscale.rules.config_file import _read

    if path.is_dir():
        path = path / "config.json"
    text, why = _read(path)
    if text is None:
        raise SizingError(why or f"cannot read {path}")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise SizingError(f"{path} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise SizingError(f"{path} holds no config mapping")
    return doc


def _value(word: str) -> Any:
    if word.lower() in ("true", "false"):
        return word.lower() == "true"
    for kind in (int, float):
        try:
            return kind(word)
        except ValueError:
            pass
    return word


def model_config(job: Job, model: str | None) -> tuple[dict[str, Any], str]:
    """(the transformers config mapping, where it came from)."""
    if model is not None:
        return _read_json(Path(model)), f"--model {model}"
    t = job.config.training
    if t.model.config is not None:
        return dict(t.model.config), "training.model.config"
    if t.model.path is not None:
        return _read_json(Path(t.model.path)), f"training.model.path {t.model.path}"
    if t.script is None:
        return dict(DEFAULT_MODEL_CONFIG), "the built-in entry point's default (a 2-layer GPT-2)"
    flags = {g.name: g.words for g in given_flags(t.script_args, {"model_name_or_path", "config_name",
                                                                   "model_type", "config_overrides"})}
    for name in ("config_name", "model_name_or_path"):
        words = flags.get(name)
        if words and (Path(words[0]) / "config.json").is_file():
            return _read_json(Path(words[0])), f"--{name} {words[0]} in training.script_args"
        if words:
            raise SizingError(f"--{name} {words[0]} (training.script_args) is not a local directory with a config.json; "
                              "give plan --model DIR (a directory or config.json of that model)")
    if flags.get("model_type"):
        cfg: dict[str, Any] = {"model_type": flags["model_type"][0]}
        for pair in (flags.get("config_overrides") or ("",))[0].split(","):
            key, eq, value = pair.partition("=")
            if eq:
                cfg[key.strip()] = _value(value.strip())
        return cfg, "--model_type/--config_overrides in training.script_args"
    raise SizingError("the script's model is not named in the YAML: give plan --model DIR (a directory with the "
                      "model's config.json, or the file)")


def sequence_length(job: Job, seq_len: int | None) -> tuple[int, str]:
    """(tokens per sample, where it came from)."""
    if seq_len is not None:
        return seq_len, "--seq-len"
    t = job.config.training
    if t.script is None:
        return t.data.block_size, "training.data.block_size"
    for g in given_flags(t.script_args, set(_SEQ_FLAGS)):
        if len(g.words) == 1 and g.words[0].isascii() and g.words[0].isdigit():
            if len(g.words[0]) > 8 or not 0 < int(g.words[0]) <= MAX_SEQ_LEN:  # plan --seq-len's own bounds
                raise SizingError(f"--{g.name} {g.words[0][:40]}{'...' if len(g.words[0]) > 40 else ''} in "
                                  f"training.script_args: not a sequence length from 1 to {MAX_SEQ_LEN:,}; give "
                                  "plan --seq-len N")
            return int(g.words[0]), f"--{g.name} in training.script_args"
    raise SizingError("the script's sequence length is not in the YAML: give plan --seq-len N")


def setting_of(job: Job, seq_len: int) -> Setting:
    """The memory-relevant settings of ``job``."""
    c = job.config
    ds, fs = job.deepspeed, job.fsdp
    p = c.distributed.parallelism
    sp = sequence_parallel_size(c)  # each rank of a sequence-parallel group holds its slice of the sequence
    common = dict(micro_batch=c.batch.micro_batch_size, accumulation=job.gradient_accumulation_steps,
                  precision=c.precision, seq_len=-(-seq_len // sp), gpus_per_node=job.procs_per_node,
                  nodes=job.num_nodes)
    if ds is not None:
        return Setting("deepspeed", ds.stage, ds.offload_optimizer.device != "none", ds.offload_param.device != "none",
                       checkpointing=c.training.gradient_checkpointing, world=job.world_size,
                       reduce_bucket=ds.reduce_bucket_size, allgather_bucket=ds.allgather_bucket_size,
                       prefetch_bucket=ds.stage3_prefetch_bucket_size,
                       overlap_comm=ds.overlap(), comm_bytes=ds.comm_bytes(c.precision), **common)
    if fs is not None:
        shards = p.dp_shard_size if p is not None and p.total == job.world_size else job.world_size
        return Setting("fsdp", 3 if fs.reshard_after_forward else 2, fs.offload_params, fs.offload_params,
                       checkpointing=fs.activation_checkpointing or c.training.gradient_checkpointing,
                       world=shards, **common)
    return Setting("ddp", 0, False, False, checkpointing=c.training.gradient_checkpointing, world=job.world_size,
                   **common)


def sizing(job: Job, model: str | None = None, seq_len: int | None = None, gpu_memory: str | None = None) -> Sizing:
    """Everything a plan needs, or SizingError naming what is missing or wrong."""
    try:
        given = size_bytes(gpu_memory) if gpu_memory is not None else None
    except ValueError as e:
        raise SizingError(f"--gpu-memory {e}") from None
    cfg, model_from = model_config(job, model)
    try:
        shape = shape_of(cfg)
    except ShapeError as e:
        raise SizingError(f"{model_from}: {e}") from None
    seq, seq_from = sequence_length(job, seq_len)
    if (sp := sequence_parallel_size(job.config)) > 1:
        seq_from += f"; per rank: {seq} / distributed.parallelism.sp_size {sp}"
    if given is not None:
        limit, limit_from = given, "--gpu-memory"
    elif job.config.cluster.gpu_memory is not None:
        limit, limit_from = size_bytes(job.config.cluster.gpu_memory), "cluster.gpu_memory"
    else:
        limit, limit_from = None, ""
    return Sizing(shape, cfg, model_from, setting_of(job, seq), seq_from, limit, limit_from)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def table(sz: Sizing, e: Estimate, v: Verdict | None, params_built: int | None = None) -> str:
    """The plan as people read it."""
    s, sh = sz.setting, sz.shape
    built = "" if params_built is None else (" (equal to the model built on the meta device)" if params_built == e.params
                                               else f" (the model built on the meta device has {params_built:,})")
    lines = [f"model        {sh.model_type}, {e.params:,} parameters{built}; from {sz.model_from}",
             f"             {sh.num_hidden_layers} layers, hidden {sh.hidden_size}, heads {sh.num_attention_heads}"
             f"/{sh.num_key_value_heads} kv, MLP {sh.intermediate_size}, vocab {sh.vocab_size}",
             f"setting      {s.describe()}; {s.precision}; {s.world} GPUs ({s.nodes} x {s.gpus_per_node}); "
             f"sequence {s.seq_len} ({sz.seq_from})", "", "per GPU"]
    width = max(len(n) for n, _, _ in e.gpu + e.cpu)
    lines += [f"  {n:<{width}}  {_gib(b):>12}  {how}" for n, b, how in e.gpu]
    lines += [f"  {'total':<{width}}  {_gib(e.gpu_total):>12}", "", "per node (CPU)"]
    lines += [f"  {n:<{width}}  {_gib(b):>12}  {how}" for n, b, how in e.cpu]
    if v is not None:
        lines += ["", f"verdict      {v.line()} ({sz.limit_from})"]
        if v.best is not None:
            lines.append(f"             then: {v.best.setting.describe()}")
    else:
        lines += ["", "verdict      give --gpu-memory (or cluster.gpu_memory) for one"]
    return "\n".join(lines)


def as_json(sz: Sizing, e: Estimate, v: Verdict | None, params_built: int | None = None) -> dict[str, Any]:
    """The plan as data (bytes)."""
    out: dict[str, Any] = {
        "model": {"model_type": sz.shape.model_type, "from": sz.model_from, "parameters": e.params,
                  "parameters_built": params_built, "largest_layer_parameters": sz.shape.largest_layer_params()},
        "setting": {**{k: getattr(sz.setting, k) for k in sz.setting.__dataclass_fields__}, "summary": sz.setting.describe()},
        "gpu": {n: b for n, b, _ in e.gpu}, "gpu_total": e.gpu_total, "gpu_reserved": e.reserved,
        "cpu_per_node": {n: b for n, b, _ in e.cpu},
    }
    if v is not None:
        out["verdict"] = {"gpu_memory": v.limit, "fits": v.fits, "largest_micro_batch": v.largest_micro,
                          "changes": list(v.changes), "after_changes": v.best.setting.describe() if v.best else None,
                          "after_changes_gpu_total": v.best.gpu_total if v.best else None, "line": v.line()}
    return out


def plan_memory(sz: Sizing) -> tuple[Estimate, Verdict | None]:
    """The estimate, and the verdict when the GPU memory is known (it holds the estimate)."""
    if not sz.limit:
        return estimate(sz.shape, sz.setting), None
    v = judge(sz.shape, sz.setting, sz.limit)
    return v.current, v
