"""accelerate settings beyond the engine's: gpu_ids, parallelism_config and ``accelerate.extra``,
read back by accelerate's own loader and launch-argument merge; the key tree hfscale reads from
accelerate's source compared with accelerate's real classes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from hfscale.artifacts import ACCELERATE_FILE, render_artifacts
from hfscale.accelerate_source import accelerate_keys
from hfscale.errors import ConfigError
from hfscale.load import load_text

from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import launch_command_parser
from test_consumers import _launch_env

FSDP_TP = {
    "name": "tp", "cluster": {"nproc_per_node": 8},
    "distributed": {"backend": "fsdp", "parallelism": {"dp_shard_size": 2, "tp_size": 2, "cp_size": 2}},
    "precision": "bf16", "batch": {"micro_batch_size": 2, "global_batch_size": 16},
    "accelerate": {"gpu_ids": "0,1,2,3,4,5,6,7",
                   "extra": {"dynamo_config": {"dynamo_backend": "INDUCTOR"}}},
}


def _load(doc: dict, tmp: Path = Path(".")):
    return load_text(yaml.safe_dump(doc, sort_keys=False), "a.yaml", tmp)


def _problems(doc: dict) -> list[str]:
    try:
        _load(doc)
    except ConfigError as e:
        return sorted(f"{p.path}: {p.message}" for p in e.problems)
    return []


def test_keys_read_from_source_are_accelerates():
    keys = accelerate_keys()
    assert set(keys.keys) == {f.name for f in dataclasses.fields(ClusterConfig)}
    groups = {g.title: {a.dest for a in g._group_actions} for g in launch_command_parser()._action_groups}
    for section, title in (("fsdp_config", "FSDP Arguments"), ("deepspeed_config", "DeepSpeed Arguments"),
                           ("parallelism_config", "ParallelismConfig Arguments")):
        read = {k for k, v in keys.keys[section].section.keys.items() if not v.renamed_to}
        assert read == groups[title], section


def test_parallelism_gpu_ids_and_extra_reach_accelerate(tmp_path):
    job = _load(FSDP_TP, tmp_path)
    # tensor- and context-parallel ranks share samples: 8 ranks are 2 data-parallel ranks
    assert job.data_parallel_size == 2 and job.gradient_accumulation_steps == 4 and job.global_batch_size == 16
    path = tmp_path / ACCELERATE_FILE
    path.write_text(render_artifacts(job, "unused.json")[ACCELERATE_FILE])
    loaded = load_config_from_file(str(path))
    assert loaded.dynamo_config == {"dynamo_backend": "INDUCTOR"} and loaded.gpu_ids == "0,1,2,3,4,5,6,7"
    assert loaded.parallelism_config == {"parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 2,
                                         "parallelism_config_tp_size": 2, "parallelism_config_cp_size": 2}
    args, _, _ = _launch_env(path)  # accelerate launch's own merge of the file into its arguments
    assert (args.parallelism_config_dp_shard_size, args.parallelism_config_tp_size,
            args.parallelism_config_cp_size) == (2, 2, 2)
    assert args.use_parallelism_config and args.gpu_ids == "0,1,2,3,4,5,6,7"
    assert args.dynamo_backend == "INDUCTOR" and str(args.fsdp_version) == "2"


def test_keys_accelerate_launch_never_reads_from_a_file_are_refused(tmp_path):
    """accelerate launch fills an argument from the config file only while it is None; these flags
    default to False, so the file's value is silently lost (shown here with accelerate's own merge)."""
    path = tmp_path / "acc.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n"
                    "enable_cpu_affinity: true\ndowncast_bf16: 'yes'\n")
    assert load_config_from_file(str(path)).enable_cpu_affinity is True  # the loader has it...
    args, _, _ = _launch_env(path)
    assert args.enable_cpu_affinity is False and args.downcast_bf16 is False  # ...the launch does not
    doc = {**FSDP_TP, "accelerate": {"extra": {"enable_cpu_affinity": True}}}
    assert _problems(doc) == ["accelerate.extra.enable_cpu_affinity: accelerate launch never reads it from a config "
                              "file: its --enable_cpu_affinity argument has a default, and the file only fills "
                              "arguments left unset"]


def test_extra_keys_are_checked_against_accelerates():
    doc = {**FSDP_TP, "accelerate": {"extra": {
        "enable_cpu_afinity": True, "mixed_precision": "fp16", "main_training_function": 5, "deepspeed_config": {"zero_stage": 3},
        "megatron_lm_config": {"megatron_lm_tp_degree": 2},
        "fsdp_config": {"fsdp_forward_prefech": True, "fsdp_sync_module_states": True,
                        "fsdp_activation_checkpointing": True},
        "same_network": "yes"}}}
    base = "accelerate.extra"
    assert _problems(doc) == sorted([
        f"{base}.enable_cpu_afinity: unknown key 'enable_cpu_afinity'; did you mean 'enable_cpu_affinity'?",
        f"{base}.mixed_precision: hfscale sets this from precision; set it there",
        f"{base}.main_training_function: must be a string, got a whole number",
        f"{base}.deepspeed_config: hfscale sets this from distributed.deepspeed (accelerate refuses DeepSpeed keys "
        "beside the JSON); set it there",
        f"{base}.megatron_lm_config: does nothing here: accelerate reads it only with distributed_type MEGATRON_LM, "
        "which hfscale does not write",
        f"{base}.fsdp_config.fsdp_forward_prefech: unknown key 'fsdp_forward_prefech'; did you mean "
        "'fsdp_forward_prefetch'?",
        f"{base}.fsdp_config.fsdp_sync_module_states: FSDP1 only, and hfscale writes FSDP2 (accelerate drops it or "
        "refuses it there)",
        f"{base}.fsdp_config.fsdp_activation_checkpointing: hfscale sets this from "
        "distributed.fsdp.activation_checkpointing; set it there",
        f"{base}.same_network: accelerate launch never reads it from a config file: its --same_network argument has "
        "a default, and the file only fills arguments left unset",
    ])


@pytest.mark.parametrize("change, message", [
    ({"accelerate": {"gpu_ids": "0,1"}}, "accelerate.gpu_ids: 2 GPU id(s) for 8 process(es) per node"),
    ({"accelerate": {"gpu_ids": "0;1"}}, "accelerate.gpu_ids: '0;1' is not 'all' or a comma-separated list of GPU ids"),
    ({"distributed": {"backend": "fsdp", "parallelism": {"tp_size": 3}}},
     "distributed.parallelism: dp_replicate_size 1 x dp_shard_size 1 x tp_size 3 x cp_size 1 = 3, but the world "
     "size is 8"),
    ({"distributed": {"backend": "deepspeed", "parallelism": {"dp_shard_size": 8}}},
     "distributed.parallelism: accelerate's parallelism_config needs distributed.backend: fsdp (FSDP2); backend is "
     "deepspeed"),
])
def test_accelerate_cross_checks(change, message):
    doc = {**FSDP_TP, "batch": {"micro_batch_size": 1}, **change}
    assert message in _problems(doc)


def test_extra_fsdp_settings_need_the_fsdp_backend():
    doc = {"name": "d", "batch": {"micro_batch_size": 1},
           "accelerate": {"extra": {"fsdp_config": {"fsdp_forward_prefetch": False}}}}
    assert _problems(doc) == ["accelerate.extra.fsdp_config: FSDP settings, but distributed.backend is deepspeed"]
