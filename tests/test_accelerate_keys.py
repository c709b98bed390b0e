"""accelerate settings beyond the engine's: gpu_ids, parallelism_config and ``accelerate.extra``,
read back by accelerate's own loader and launch-argument merge; the key tree hfscale reads from
accelerate's source compared with accelerate's real classes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from hfscale.config.errors import ConfigError
from hfscale.config.sources.accelerate import accelerate_keys
from hfscale.render.artifacts import ACCELERATE_FILE, render_artifacts
from hfscale.rules.config_file import load_text

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
     "distributed.parallelism: accelerate's parallelism_config needs distributed.backend: fsdp (FSDP2), or sp_size > 1 "
     "with backend deepspeed (sequence parallelism); backend is deepspeed"),
    ({"distributed": {"backend": "fsdp", "parallelism": {"tp_size": 8}}},
     "distributed.parallelism.dp_shard_size: 1 and cp_size 1: accelerate refuses FSDP with no dimension to shard "
     "across; give dp_shard_size (or cp_size) the ranks FSDP shards over"),
    ({"distributed": {"backend": "fsdp", "parallelism": {"dp_replicate_size": 4, "tp_size": 2}}},
     "distributed.parallelism.dp_shard_size: 1 with dp_replicate_size > 1 and tensor or context parallelism: "
     "accelerate refuses pure data parallelism beside them; set dp_shard_size > 1"),
])
def test_accelerate_cross_checks(change, message):
    doc = {**FSDP_TP, "batch": {"micro_batch_size": 1}, **change}
    assert message in _problems(doc)


def test_extra_fsdp_settings_need_the_fsdp_backend():
    doc = {"name": "d", "batch": {"micro_batch_size": 1},
           "accelerate": {"extra": {"fsdp_config": {"fsdp_forward_prefetch": False}}}}
    assert _problems(doc) == ["accelerate.extra.fsdp_config: FSDP settings, but distributed.backend is deepspeed"]


SP = {  # TRL's ALST/Ulysses layout (tests/data/real_configs/huggingface__trl/alst_ulysses_4gpu.yaml) in hfscale's words
    "name": "sp", "cluster": {"nproc_per_node": 4},
    "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 3},
                    "parallelism": {"dp_shard_size": 2, "sp_size": 2, "sp_attn_implementation": "flash_attention_2"}},
    "precision": "bf16", "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 3},
    "training": {"script": "train.py"},
}


def _sp(parallelism: dict | None = None, **top) -> dict:
    d = SP["distributed"]
    return {**SP, "distributed": {**d, "parallelism": {**d["parallelism"], **(parallelism or {})}}, **top}


def test_sequence_parallel_batch_is_per_data_parallel_rank(tmp_path):
    """ALST/Ulysses: the 2 ranks of a sequence-parallel group share their samples, so 4 processes are
    2 data-parallel ranks (accelerate's train_batch_size: micro x accumulation x dp_replicate x
    dp_shard). Running it needs GPUs and flash attention: here only the config is checked."""
    job = _load(SP, tmp_path)
    assert (job.world_size, job.data_parallel_size, job.global_batch_size) == (4, 2, 12)
    derived = _load({**SP, "batch": {"micro_batch_size": 2, "global_batch_size": 24}}, tmp_path)
    assert derived.gradient_accumulation_steps == 6  # 24 / (2 x 2 data-parallel ranks), not / 4 processes
    assert _problems({**SP, "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 3,
                                      "global_batch_size": 24}}) == [
        "batch.global_batch_size: 24 != micro_batch_size 2 x gradient_accumulation_steps 3 x world size 2 "
        "(data-parallel ranks: distributed.parallelism dp_replicate_size x dp_shard_size) = 12"]


SPS_WHY = (": DeepSpeed divides its data-parallel world by it wherever it builds its config without accelerate's "
           "sequence-parallel groups (deepspeed.zero.Init in from_pretrained), and its batch check fails; set "
           "distributed.parallelism.sp_size (with backend deepspeed) instead")


@pytest.mark.parametrize("change, message", [
    (_sp({"sp_size": 4}), "distributed.parallelism: dp_replicate_size 1 x dp_shard_size 2 x tp_size 1 x cp_size 1 x "
     "sp_size 4 = 8, but the world size is 4: accelerate writes DeepSpeed's train_batch_size for dp_replicate_size x "
     "dp_shard_size data-parallel ranks, and DeepSpeed checks it against world size / sp_size = 1"),
    (_sp({"dp_shard_size": 1}), "distributed.parallelism: dp_replicate_size 1 x dp_shard_size 1 x tp_size 1 x "
     "cp_size 1 x sp_size 2 = 2, but the world size is 4: accelerate writes DeepSpeed's train_batch_size for "
     "dp_replicate_size x dp_shard_size data-parallel ranks, and DeepSpeed checks it against world size / sp_size = 2"),
    (_sp({"dp_shard_size": 1, "tp_size": 2}), "distributed.parallelism.tp_size: 2 beside sp_size 2: DeepSpeed's "
     "data-parallel world is world size / sp_size = 2, but accelerate writes train_batch_size for dp_replicate_size x "
     "dp_shard_size = 1 ranks, and DeepSpeed's batch check fails"),
    (_sp({"dp_shard_size": 1, "cp_size": 2}), "distributed.parallelism.sp_size: 2 beside cp_size 2: accelerate refuses "
     "the pair (context and sequence parallelism are mutually exclusive); set one of them to 1"),
    ({**_sp(), "distributed": {"backend": "fsdp", "parallelism": SP["distributed"]["parallelism"]}},
     "distributed.parallelism.sp_size: 2: sequence parallelism (ALST/Ulysses) is DeepSpeed's; accelerate applies it "
     "only with distributed_type DEEPSPEED, and backend is fsdp"),
    (_sp({"sp_attn_implementation": "eager"}), "distributed.parallelism.sp_attn_implementation: 'eager': accelerate "
     "takes flash_attention_2, flash_attention_3, sdpa or a hub flash-attn kernel (such as "
     "kernels-community/flash-attn2) under sequence parallelism"),
    (_sp({"sp_seq_length_is_variable": False}), "distributed.parallelism.sp_seq_length: required when "
     "sp_seq_length_is_variable is false: DeepSpeed refuses a fixed sequence length it is not given"),
    (_sp({"sp_seq_length_is_variable": False, "sp_seq_length": 1001}), "distributed.parallelism.sp_seq_length: 1001 "
     "is not divisible by sp_size 2: DeepSpeed refuses every batch of that length"),
    (_sp({"sp_backend": "torch"}),
     "distributed.parallelism.sp_backend: must be one of 'deepspeed', got 'torch' (a string)"),
    (_sp(runner={"launcher": "torchrun"}), "runner.launcher: torchrun: sequence parallelism reaches the ranks through "
     "accelerate launch (PARALLELISM_CONFIG_* from the accelerate config), which torchrun does not run; the job would "
     "train without it: use runner.launcher: accelerate"),
    (_sp(training={"data": {"block_size": 1001}}), "training.data.block_size: 1001 is not divisible by "
     "distributed.parallelism.sp_size 2: DeepSpeed refuses every batch of that length"),
    ({**_sp(), "distributed": {**_sp()["distributed"], "deepspeed": {"extra": {"sequence_parallel_size": 4}}}},
     "distributed.deepspeed.extra.sequence_parallel_size: 4, but distributed.parallelism.sp_size is 2: DeepSpeed "
     "divides its data-parallel world by it wherever it builds its config without accelerate's sequence-parallel "
     "groups (deepspeed.zero.Init in from_pretrained), and its batch check fails; set distributed.parallelism.sp_size "
     "(with backend deepspeed) instead"),
    ({**_sp(), "distributed": {**_sp()["distributed"], "deepspeed": {"extra": {"sequence_parallel_size": "2"}}}},
     "distributed.deepspeed.extra.sequence_parallel_size: '2', but distributed.parallelism.sp_size is 2" + SPS_WHY),
    ({**_sp(), "distributed": {**_sp()["distributed"], "deepspeed": {"extra": {"sequence_parallel_size": 2.0}}}},
     "distributed.deepspeed.extra.sequence_parallel_size: 2.0, but distributed.parallelism.sp_size is 2" + SPS_WHY),
    ({**_sp(), "distributed": {**_sp()["distributed"], "deepspeed": {"extra": {"sequence_parallel_size": True}}}},
     "distributed.deepspeed.extra.sequence_parallel_size: True, but distributed.parallelism.sp_size is 2" + SPS_WHY),
    ({**_sp(), "training": {}}, "distributed.parallelism.sp_size: 2: the built-in entry point (no training.script) "
     "cannot train with sequence parallelism: its batches have no position_ids, which DeepSpeed's Ulysses data-loader "
     "adapter requires (it raises on the first batch), and its model is built with transformers' default attention, "
     "not sp_attn_implementation; name your training script in training.script"),
    ({**_sp(), "distributed": {**_sp()["distributed"], "deepspeed": {"extra": {"sequence_parallel_size": 2,
                                                                                "data_parallel_size": 4}}}},
     "distributed.deepspeed.extra.data_parallel_size: 4, but the data-parallel ranks are world size 4 / sp_size 2 = "
     "2: DeepSpeed builds its (data_parallel_size, sequence_parallel_size) mesh of the processes from it"),
])
def test_sequence_parallel_sizes_accelerate_or_deepspeed_refuse(change, message):
    assert message in _problems(change)


def test_sequence_parallel_keys_deepspeed_reads_are_accepted_when_they_agree():
    doc = {**_sp(), "distributed": {**_sp()["distributed"], "deepspeed": {
        "stage": 3, "extra": {"sequence_parallel_size": 2, "data_parallel_size": 2}}}}
    assert _problems(doc) == []


def test_data_parallel_size_without_sequence_parallel_size_is_a_warning_not_a_check():
    """deepspeed.initialize reads data_parallel_size only beside sequence_parallel_size (its mesh)."""
    doc = {**_sp(), "distributed": {**_sp()["distributed"], "deepspeed": {"extra": {"data_parallel_size": 4}}}}
    assert _problems(doc) == []
    assert [f"{w.path}: {w.message}" for w in _load(doc).warnings] == [
        "distributed.deepspeed.extra.data_parallel_size: does nothing without sequence_parallel_size: "
        "deepspeed.initialize builds its (data_parallel_size, sequence_parallel_size) mesh only when the JSON has "
        "both; remove it"]
