"""Every typed DeepSpeed key reaches the JSON that DeepSpeed loads, with DeepSpeed's own defaults;
``distributed.deepspeed.extra`` is checked against DeepSpeed's own keys and merged in.

DeepSpeed's ``DeepSpeedConfig`` parses the generated files in a fresh interpreter with a fake
process group of the job's world size (as in test_consumers). The key tree hfscale reads from
DeepSpeed's source (hfscale.config.sources.engine) is compared with the real pydantic classes."""

from __future__ import annotations

import inspect

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT
from hfscale.config.deepspeed import DeepSpeedSection
from hfscale.config.errors import ConfigError
from hfscale.config.extra_keys import check_extra
from hfscale.config.sources.deepspeed import deepspeed_keys
from hfscale.config.sources.engine import OPEN
from hfscale.render.deepspeed import deepspeed_config
from hfscale.rules.config_file import load_text

# Two jobs that together set every typed key to a value other than its default.
ZERO3 = {
    "stage": 3, "overlap_comm": False, "contiguous_gradients": False, "reduce_bucket_size": 123456,
    "sub_group_size": 2_000_000, "stage3_prefetch_bucket_size": 3456, "stage3_param_persistence_threshold": 4567,
    "stage3_max_live_parameters": 5678, "stage3_max_reuse_distance": 6789, "gather_16bit_weights_on_model_save": True,
    "zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True,
    "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme/o", "pin_memory": False, "buffer_count": 6,
                          "pipeline_read": True, "pipeline_write": True, "fast_init": True},
    "offload_param": {"device": "nvme", "nvme_path": "/nvme/p", "pin_memory": False, "buffer_count": 7,
                      "buffer_size": 200_000_000, "max_in_cpu": 2_000_000_000},
    "communication_data_type": "fp32", "grad_accum_dtype": "fp32",
    # use_gds needs CUDA (DeepSpeed asserts it): left at false on this CPU machine
    "aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2, "single_submit": True,
            "overlap_events": False},
    "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                 "contiguous_memory_optimization": True, "number_checkpoints": 4,
                                 "synchronize_checkpoint_boundary": True, "profile": True},
    "flops_profiler": {"enabled": True, "profile_step": 5, "module_depth": 2, "top_modules": 3, "detailed": False,
                       "output_file": "/tmp/flops.txt"},
    "comms_logger": {"enabled": True, "verbose": True, "prof_all": False, "prof_ops": ["all_reduce"], "debug": True},
    "tensorboard": {"enabled": True, "output_path": "/tmp/tb", "job_name": "tbj"},
    "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"},
    "csv_monitor": {"enabled": True, "output_path": "/tmp/csv", "job_name": "cj"},
    "optimizer": {"type": "Lamb"}, "scheduler": {"type": "WarmupCosineLR"}, "steps_per_print": 7,
    "extra": {"zero_optimization": {"stage3_module_granularity_threshold": 99}, "wall_clock_breakdown": True},
}
ZERO2 = {
    "stage": 2, "overlap_comm": True, "allgather_bucket_size": 234567, "round_robin_gradients": True,
    "offload_optimizer": {"device": "cpu", "ratio": 1.0},
    "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupDecayLR"},
    "extra": {"fp16": {"initial_scale_power": 12}, "optimizer": {"params": {"torch_adam": True}}},
}
ZERO3_PARTIAL = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.25}, "scheduler": {"type": "WarmupLR"}}
JOBS = {  # name -> (deepspeed section, world size, training)
    "zero3": (ZERO3, 4, {"max_steps": 100, "lr_scheduler_type": "cosine", "warmup_steps": 10, "learning_rate": 1e-3}),
    "zero2": (ZERO2, 2, {"max_steps": 50, "lr_scheduler_type": "linear", "warmup_steps": 5, "learning_rate": 3e-4,
                         "adam_beta2": 0.95, "weight_decay": 0.1}),
    "zero3_partial": (ZERO3_PARTIAL, 2, {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 3}),
}
# typed key -> what DeepSpeedConfig holds it as (an expression on the parsed config ``c``)
WHERE = {
    "stage": "c.zero_optimization_stage", "overlap_comm": "z.overlap_comm",
    "contiguous_gradients": "z.contiguous_gradients", "reduce_bucket_size": "z.reduce_bucket_size",
    "allgather_bucket_size": "z.allgather_bucket_size", "round_robin_gradients": "z.round_robin_gradients",
    "sub_group_size": "z.sub_group_size", "stage3_prefetch_bucket_size": "z.prefetch_bucket_size",
    "stage3_param_persistence_threshold": "z.param_persistence_threshold",
    "stage3_max_live_parameters": "z.max_live_parameters", "stage3_max_reuse_distance": "z.max_reuse_distance",
    "gather_16bit_weights_on_model_save": "z.gather_16bit_weights_on_model_save",
    "zero_hpz_partition_size": "z.zero_hpz_partition_size", "zero_quantized_weights": "z.zero_quantized_weights",
    "zero_quantized_gradients": "z.zero_quantized_gradients",
    "offload_optimizer.*": "value(z.offload_optimizer.{k})", "offload_param.*": "value(z.offload_param.{k})",
    "communication_data_type": "str(c.communication_data_type).replace('torch.float32', 'fp32')",
    "grad_accum_dtype": "c.grad_accum_dtype",
    "aio.*": "c.aio_config['{k}']", "activation_checkpointing.*": "c.activation_checkpointing_config.{k}",
    "flops_profiler.*": "c.flops_profiler_config.{k}", "comms_logger.*": "c.comms_config.comms_logger.{k}",
    "tensorboard.*": "c.monitor_config.tensorboard.{k}", "wandb.*": "c.monitor_config.wandb.{k}",
    "csv_monitor.*": "c.monitor_config.csv_monitor.{k}", "optimizer.type": "c.optimizer_name",
    "scheduler.type": "c.scheduler_name", "steps_per_print": "c.steps_per_print",
}
NOT_IN_DEEPSPEED = {"zero3_init", "extra"}  # read by hfscale and accelerate (zero3_init_flag), not by DeepSpeed


def _doc(ds: dict, world: int, training: dict) -> dict:
    return {"name": "dsk", "cluster": {"nproc_per_node": world}, "distributed": {"backend": "deepspeed",
            "deepspeed": ds}, "precision": "bf16", "batch": {"micro_batch_size": 2}, "training": training}


def _expected(ds: dict) -> dict[str, tuple[str, Any]]:
    """expression -> value DeepSpeed must hold, for every typed key the section sets."""
    out = {}
    for key, value in ds.items():
        if key in NOT_IN_DEEPSPEED:
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                where = WHERE.get(f"{key}.{k}") or WHERE[f"{key}.*"].format(k=k)
                if key in ("optimizer", "scheduler"):
                    v = v.lower() if key == "optimizer" else v  # DeepSpeed keeps optimizer names lower-case
                out[f"{key}.{k}"] = (where, v)
        else:
            out[key] = (WHERE[key], value)
    return out


def test_the_jobs_set_every_typed_key():
    """A typed key added to DeepSpeedSection must be added to these jobs (and to WHERE)."""
    typed = set()
    for name, field in DeepSpeedSection.model_fields.items():
        sub = getattr(field.annotation, "model_fields", None) or next(
            (a.model_fields for a in getattr(field.annotation, "__args__", ()) if hasattr(a, "model_fields")), None)
        typed |= {f"{name}.{k}" for k in sub} if sub else {name}
    set_here = set()
    for ds, _, _ in JOBS.values():
        set_here |= set(_expected(ds))
    missing = typed - set_here - NOT_IN_DEEPSPEED - {"aio.use_gds"}
    assert missing == set(), sorted(missing)


PROBE = textwrap.dedent(
    r'''
    import json, sys
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    spec = json.load(open(sys.argv[1]))
    dist.init_process_group("fake", rank=0, world_size=spec["world"], store=FakeStore())
    import deepspeed.comm as dc
    dc.init_distributed(dist_backend="gloo")
    from deepspeed.runtime.config import DeepSpeedConfig

    def value(v):
        v = getattr(v, "value", v)  # enums
        return str(v) if type(v).__name__.endswith("Path") else v

    out = {}
    for name, item in spec["items"].items():
        c = DeepSpeedConfig(json.load(open(item["json"])))
        z = c.zero_config
        out[name] = {expr: eval(expr) for expr in item["exprs"]}
        out[name]["__raw_zero__"] = {"module_granularity_threshold": z.module_granularity_threshold,
                                     "wall_clock_breakdown": c.wall_clock_breakdown,
                                     "initial_scale_power": c.float16_config.initial_scale_power,
                                     "torch_adam": (c.optimizer_params or {}).get("torch_adam")}
    json.dump(out, open(sys.argv[2], "w"), default=str)
    '''
)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict[str, dict]:
    """DeepSpeedConfig's view of each job's generated JSON, by job name."""
    tmp = tmp_path_factory.mktemp("dskeys")
    by_world: dict[int, dict] = {}
    for name, (ds, world, training) in JOBS.items():
        job = load_text(yaml.safe_dump(_doc(ds, world, training)), f"{name}.yaml", tmp)
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(deepspeed_config(job)))
        by_world.setdefault(world, {})[name] = {"json": str(path),
                                                "exprs": [e for e, _ in _expected(ds).values()]}
    out: dict[str, dict] = {}
    (tmp / "probe.py").write_text(PROBE)
    for world, items in by_world.items():
        spec, result = tmp / f"spec{world}.json", tmp / f"result{world}.json"
        spec.write_text(json.dumps({"world": world, "items": items}))
        env = {**os.environ, "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": "29556"}
        r = subprocess.run([sys.executable, str(tmp / "probe.py"), str(spec), str(result)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        out.update(json.loads(result.read_text()))
    return out


@pytest.mark.parametrize("name", sorted(JOBS))
def test_every_typed_key_reaches_deepspeed(name, loaded):
    ds = JOBS[name][0]
    got = loaded[name]
    wrong = {key: (got[expr], want) for key, (expr, want) in _expected(ds).items() if got[expr] != want}
    assert wrong == {}, wrong


def test_extra_keys_reach_deepspeed(loaded):
    assert loaded["zero3"]["__raw_zero__"]["module_granularity_threshold"] == 99
    assert loaded["zero3"]["__raw_zero__"]["wall_clock_breakdown"] is True
    assert loaded["zero2"]["__raw_zero__"]["initial_scale_power"] == 12
    assert loaded["zero2"]["__raw_zero__"]["torch_adam"] is True


def test_scheduler_and_optimizer_params_come_from_training():
    job = load_text(yaml.safe_dump(_doc(*JOBS["zero2"])), "z.yaml", Path("."))
    cfg = deepspeed_config(job)
    assert cfg["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                            "weight_decay": 0.1, "torch_adam": True}}
    assert cfg["scheduler"] == {"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": 5, "warmup_type": "linear", "warmup_min_lr": 0.0, "warmup_max_lr": 3e-4,
        "total_num_steps": 50}}


# ---- defaults: DeepSpeed's own ----------------------------------------------------------------------

def test_defaults_are_deepspeeds_own():
    """Each typed key's default equals the installed DeepSpeed's class default (imported here)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT, STEPS_PER_PRINT_DEFAULT
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)
    from deepspeed.profiling.config import DeepSpeedFlopsProfilerConfig

    from hfscale.config.model import HfscaleConfig
    from hfscale.config.deepspeed import (ActivationCheckpointingConfig, AioConfig, CommsLoggerConfig as H_Comms,
                                          FlopsProfilerConfig, MonitorConfig, OffloadOptimizerConfig,
                                          OffloadParamConfig, WandbMonitorConfig)

    def value(v):
        v = getattr(v, "value", v)
        return list(v) if isinstance(v, tuple) else v

    zero = DeepSpeedZeroConfig()
    ours = DeepSpeedSection()
    differ = {"stage": (ours.stage, value(zero.stage))} if ours.stage != value(zero.stage) else {}
    for key, expr in WHERE.items():
        if "*" in key or "." in key or not expr.startswith("z."):
            continue
        theirs = getattr(zero, expr[2:])
        if key == "overlap_comm":
            theirs = None  # DeepSpeed resolves None by stage (true only for 3); hfscale keeps None and writes that
        if value(getattr(ours, key)) != value(theirs):
            differ[key] = (getattr(ours, key), theirs)
    assert differ == {"stage": (2, 0)}  # the one documented exception: backend deepspeed means ZeRO, stage 2
    assert "DeepSpeed's own default is 0" in DeepSpeedSection.model_fields["stage"].description
    pairs = [(OffloadOptimizerConfig(), DeepSpeedZeroOffloadOptimizerConfig()),
             (OffloadParamConfig(), DeepSpeedZeroOffloadParamConfig()), (H_Comms(), CommsLoggerConfig()),
             (MonitorConfig(), TensorBoardConfig()), (MonitorConfig(), CSVConfig()), (WandbMonitorConfig(), WandbConfig())]
    for mine, real in pairs:
        for key in type(mine).model_fields:
            assert value(getattr(mine, key)) == value(getattr(real, key)), (type(mine).__name__, key)
    aio = get_aio_config({})
    assert {k: value(getattr(AioConfig(), k)) for k in AioConfig.model_fields} == aio
    act = vars(DeepSpeedActivationCheckpointingConfig({}))
    assert {k: getattr(ActivationCheckpointingConfig(), k) for k in ActivationCheckpointingConfig.model_fields} == {
        k: act[k] for k in ActivationCheckpointingConfig.model_fields}
    flops = vars(DeepSpeedFlopsProfilerConfig({}))
    assert {k: getattr(FlopsProfilerConfig(), k) for k in FlopsProfilerConfig.model_fields} == {
        k: flops[k] for k in FlopsProfilerConfig.model_fields}
    assert HfscaleConfig.model_fields["gradient_clipping"].default == GRADIENT_CLIPPING_DEFAULT
    assert ours.steps_per_print == STEPS_PER_PRINT_DEFAULT


# ---- the key tree read from DeepSpeed's source, against the real classes ---------------------------

def _real_sections():
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    return {("zero_optimization",): DeepSpeedZeroConfig,
            ("zero_optimization", "offload_optimizer"): DeepSpeedZeroOffloadOptimizerConfig,
            ("zero_optimization", "offload_param"): DeepSpeedZeroOffloadParamConfig,
            ("bf16",): DeepSpeedBF16Config, ("fp16",): DeepSpeedFP16Config, ("tensorboard",): TensorBoardConfig,
            ("wandb",): WandbConfig, ("csv_monitor",): CSVConfig, ("comms_logger",): CommsLoggerConfig}


def _section(path: tuple[str, ...]):
    s = deepspeed_keys()
    for part in path:
        s = s.keys[part].section
    return s


@pytest.mark.parametrize("path", list(_real_sections()), ids=lambda p: ".".join(p))
def test_keys_read_from_source_are_the_classes_keys(path):
    model = _real_sections()[path]
    read = _section(path)
    assert read is not OPEN
    real = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    assert set(read.keys) == real


PROBES = [True, False, 0, 3, 2.5, -1, "x", "fp16", None, [1], {}]
# rules of DeepSpeed's model validators (across fields, or beyond a field's declaration): the source
# holds them as code, not data; DeepSpeed applies them when the job starts
VALIDATOR_RULES = {("zero_optimization", "compute_grad_norm", False): "false only with stage 1 or 2",
                   ("fp16", "loss_scale", -1): "a loss scale is not negative"}


@pytest.mark.parametrize("path", list(_real_sections()), ids=lambda p: ".".join(p))
def test_values_the_check_accepts_deepspeed_accepts(path):
    """Soundness over probe values: whatever check_extra lets through, the real class takes."""
    model = _real_sections()[path]
    read = _section(path)
    accepted_wrongly = []
    checked = 0
    for key, spec in read.keys.items():
        if spec.renamed_to or spec.section is not None:
            continue
        for v in PROBES:
            if check_extra({key: v}, read, {}):
                continue
            checked += 1
            try:
                model(**{key: v})
            except Exception as e:  # the class's own rejection
                if path + (key, v) not in VALIDATOR_RULES:
                    accepted_wrongly.append((key, v, str(e).splitlines()[0]))
    assert checked > 0 and accepted_wrongly == [], accepted_wrongly


# ---- extra: refused with the reason ----------------------------------------------------------------

def _problems(extra: dict, stage: int = 2) -> list[str]:
    """The problems of ``extra``, sorted (one YAML line holds several)."""
    doc = _doc({"stage": stage, "extra": extra}, 2, {})
    try:
        load_text(yaml.safe_dump(doc), "x.yaml", Path("."))
    except ConfigError as e:
        return sorted(f"{p.path}: {p.message}" for p in e.problems)
    return []


def test_bad_extra_keys_are_refused_with_a_did_you_mean():
    base = "distributed.deepspeed.extra"
    assert _problems({"zero_optimization": {"reduce_scater": False}, "optimizr": {}, "fp16": {"hysteresis": "2"}}) == sorted([
        f"{base}.zero_optimization.reduce_scater: unknown key 'reduce_scater'; did you mean 'reduce_scatter'?",
        f"{base}.fp16.hysteresis: must be a whole number, got a string",
    ])
    # DeepSpeedConfig ignores a top-level key it does not know (its sections refuse one): a warning
    from hfscale.rules.deepspeed import extra_problems

    assert extra_problems({"optimizr": {}}) == ([], [(("optimizr",), "'optimizr' is not a key DeepSpeed reads: it "
                                                                     "ignores it; did you mean 'optimizer'?")])


def test_keys_hfscale_types_are_refused_in_extra_naming_the_typed_key():
    base = "distributed.deepspeed.extra"
    got = _problems({"train_batch_size": 8, "zero_optimization": {"stage": 3, "sub_group_size": 10},
                     "bf16": {"enabled": True}, "optimizer": {"params": {"lr": 0.1}}})
    assert got == sorted([
        f"{base}.train_batch_size: hfscale sets this from batch.global_batch_size; set it there",
        f"{base}.zero_optimization.stage: hfscale sets this from distributed.deepspeed.stage; set it there",
        f"{base}.zero_optimization.sub_group_size: hfscale sets this from distributed.deepspeed.sub_group_size; "
        "set it there",
        f"{base}.bf16.enabled: hfscale sets this from precision; set it there",
        f"{base}.optimizer.params.lr: hfscale sets this from training.learning_rate; set it there",
    ])


def test_renamed_and_deprecated_keys_name_their_replacement():
    base = "distributed.deepspeed.extra"
    got = _problems({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True, "prefetch_bucket_size": 1,
                                           "cpu_offload": True}, "bfloat16": {"immediate_grad_update": True}})
    assert got == sorted([
        f"{base}.zero_optimization.stage3_gather_fp16_weights_on_model_save: hfscale sets this from "
        "distributed.deepspeed.gather_16bit_weights_on_model_save; set it there",
        f"{base}.zero_optimization.prefetch_bucket_size: hfscale sets this from "
        "distributed.deepspeed.stage3_prefetch_bucket_size; set it there",
        f"{base}.zero_optimization.cpu_offload: deprecated for 'offload_optimizer', which hfscale sets from "
        "distributed.deepspeed.offload_optimizer; set it there",
        f"{base}.bfloat16: deprecated for 'bf16': write 'bf16'",
    ])


def test_a_deepspeed_key_outside_extra_is_pointed_there():
    assert _problems({}) == []
    doc = _doc({"stage": 3, "stage3_module_granularity_threshold": 5}, 2, {})
    with pytest.raises(ConfigError) as e:
        load_text(yaml.safe_dump(doc), "x.yaml", Path("."))
    (p,) = e.value.problems
    assert p.message == ("unknown key 'stage3_module_granularity_threshold'; a DeepSpeed zero_optimization key hfscale "
                         "does not type: set it in 'extra: {zero_optimization: {stage3_module_granularity_threshold: "
                         "...}}'")


def test_optimizer_is_no_longer_pointed_at_offload_optimizer():
    """The issue's misleading hint: 'optimzer' (a typo of the now typed 'optimizer') -> 'optimizer'."""
    doc = _doc({"optimzer": {"type": "AdamW"}}, 2, {})
    with pytest.raises(ConfigError) as e:
        load_text(yaml.safe_dump(doc), "x.yaml", Path("."))
    assert [p.message for p in e.value.problems] == ["unknown key 'optimzer'; did you mean 'optimizer'?"]


@pytest.mark.parametrize("ds, training, message", [
    ({"stage": 2, "stage3_max_live_parameters": 5}, {}, "distributed.deepspeed.stage3_max_live_parameters: only for "
     "stage 3; stage is 2"),
    ({"stage": 3, "round_robin_gradients": True}, {}, "distributed.deepspeed.round_robin_gradients: only for stage 1 "
     "or 2; stage is 3"),
    ({"stage": 2, "aio": {"queue_depth": 4}}, {}, "distributed.deepspeed.aio: asynchronous I/O is used by NVMe offload "
     "only; no offload device is nvme"),
    ({"stage": 3, "offload_param": {"device": "cpu", "buffer_size": 5}}, {}, "distributed.deepspeed.offload_param."
     "buffer_size: used by NVMe offload only; device is cpu"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, {}, "distributed.deepspeed."
     "offload_optimizer.ratio: partial offload needs stage 3 and device cpu"),
    ({"stage": 2, "scheduler": {"type": "WarmupCosineLR"}}, {"max_steps": 10}, "distributed.deepspeed.scheduler.type: "
     "WarmupCosineLR is not training.lr_scheduler_type 'linear'; it gives cosine"),
])
def test_cross_checks(ds, training, message):
    doc = _doc(ds, 2, training)
    with pytest.raises(ConfigError) as e:
        load_text(yaml.safe_dump(doc), "x.yaml", Path("."))
    assert [f"{p.path}: {p.message}" for p in e.value.problems] == [message]


def test_an_hpz_group_larger_than_the_world_is_deepspeeds_whole_world():
    """DeepSpeed clamps zero_hpz_partition_size to the world size before it checks that it divides the
    world (utils/groups.py _create_zero_param_parallel_group): 16 on 8 ranks is one group of 8, accepted
    with a warning; 3 on 8 (3 divides nothing) is refused, as DeepSpeed refuses it."""
    from deepspeed.utils import groups

    assert "min(group_size, world_size)" in inspect.getsource(groups._create_zero_param_parallel_group)
    job = load_text(yaml.safe_dump(_doc({"stage": 3, "zero_hpz_partition_size": 16}, 8, {})), "x.yaml", Path("."))
    assert [f"{w.path}: {w.message}" for w in job.warnings if "hpz" in str(w.path)] == [
        "distributed.deepspeed.zero_hpz_partition_size: 16 is more than the world size 8: DeepSpeed makes it 8 (one "
        "group of every rank)"]
    assert deepspeed_config(job)["zero_optimization"]["zero_hpz_partition_size"] == 16  # as written: DeepSpeed clamps
    with pytest.raises(ConfigError, match=r"zero_hpz_partition_size \(line 9\): 3 does not divide the world size 8"):
        load_text(yaml.safe_dump(_doc({"stage": 3, "zero_hpz_partition_size": 3}, 8, {})), "x.yaml", Path("."))


def test_a_restated_default_is_not_a_problem():
    doc = _doc({"stage": 2, "stage3_max_live_parameters": 1_000_000_000, "zero_hpz_partition_size": 1}, 2, {})
    assert load_text(yaml.safe_dump(doc), "x.yaml", Path(".")).deepspeed.stage == 2


def test_a_schedule_without_max_steps_is_left_to_the_trainer():
    """WarmupDecayLR with training.max_steps null: total_num_steps is written as "auto", which the
    HF Trainer fills with its step count; a plain script (pass_args none) is warned."""
    text = yaml.safe_dump(_doc({"stage": 2, "scheduler": {"type": "WarmupDecayLR"}}, 2, {}))
    job = load_text(text, "job.yaml", Path("."))
    assert deepspeed_config(job)["scheduler"]["params"]["total_num_steps"] == "auto"
    assert not [w for w in job.warnings if "total_num_steps" in str(w)]
    doc = _doc({"stage": 2, "scheduler": {"type": "WarmupDecayLR"}}, 2, {})
    doc["training"] = {**doc.get("training", {}), "script": "train.py", "pass_args": "none"}
    job = load_text(yaml.safe_dump(doc), "job.yaml", Path("."))
    assert [w for w in job.warnings if "written as auto because training.max_steps is not set" in str(w)]


def test_stage_table_agrees_with_what_deepspeed_reads():
    """hfscale drops (import) or refuses (check) a zero_optimization key at a stage its table says
    the key is not for; DeepSpeed's engine, run at each stage (initialize, a step, save_16bit_model),
    must then never read it there."""
    import deepspeed.runtime.zero.stage_1_and_2 as zero12

    from hfscale.rules.deepspeed import ZERO_KEYS
    from real_corpus import READ_WITHOUT_EFFECT, zero_reads

    assert "zero_quantized_gradients" not in Path(zero12.__file__).read_text()  # why it is excused below 3
    reads = zero_reads()
    assert "overlap_comm" in reads[2] and "stage3_prefetch_bucket_size" in reads[3]  # the recording works
    wrong = [(key, stage) for key, stages in ZERO_KEYS.items() for stage in range(4)
             if stage not in stages and key in reads[stage] and (key, stage) not in READ_WITHOUT_EFFECT]
    assert not wrong, wrong
    assert all("stage3_gather_16bit_weights_on_model_save" not in reads[s] for s in (0, 1, 2))
    # the import leaves offload_param out below stage 3 (accelerate writes it at every stage)
    assert all("offload_param" not in reads[s] for s in (0, 1, 2)) and "offload_param" in reads[3]
