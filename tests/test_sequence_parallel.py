"""DeepSpeed ALST/Ulysses sequence parallelism (accelerate's parallelism_config sp_* keys), written
by hfscale and read back by the libraries' own code: accelerate's config loader, launch
environment and ParallelismConfig; DeepSpeed's DeepSpeedConfig (its batch check); the HF
Trainer's DeepSpeed consistency check.

Running ALST needs GPUs (NCCL's all-to-all; gloo has none) and, for TRL's config, flash attention:
no training run here. What is checked is that every library accepts the files and that they agree on
the batch: micro x accumulation x (world size / sp_size) data-parallel ranks.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from hfscale.core.atomic_files import write_files
from hfscale.render.artifacts import ACCELERATE_FILE, DEEPSPEED_FILE, render_artifacts
from hfscale.rules.config_file import load_text
from hfscale.rules.trainer_args import training_arguments_kwargs
from real_corpus import _DataParallel, cases, join_group_of_one, run_case
from test_accelerate_keys import SP
from test_consumers import _launch_env


@pytest.fixture
def generated(tmp_path):
    job = load_text(yaml.safe_dump(SP, sort_keys=False), "sp.yaml", tmp_path)
    gen = tmp_path / "gen"
    write_files(gen, render_artifacts(job, str((gen / DEEPSPEED_FILE).resolve())))
    return job, gen


def test_accelerate_reads_the_sequence_parallel_settings_back(generated, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.parallelism_config import ParallelismConfig

    job, gen = generated
    path = gen / ACCELERATE_FILE
    assert load_config_from_file(str(path)).parallelism_config == {
        "parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 1, "parallelism_config_cp_size": 1, "parallelism_config_sp_size": 2,
        "parallelism_config_sp_backend": "deepspeed", "parallelism_config_sp_seq_length_is_variable": True,
        "parallelism_config_sp_attn_implementation": "flash_attention_2"}
    args, env, _ = _launch_env(path)  # accelerate launch's own merge of the file and its environment for the ranks
    assert args.use_deepspeed and args.use_parallelism_config
    for k, v in env.items():
        if k.startswith("PARALLELISM_CONFIG_") or k == "ACCELERATE_USE_PARALLELISM_CONFIG":
            monkeypatch.setenv(k, v)
    pc = ParallelismConfig()  # as Accelerator() builds it in each rank from that environment
    assert (pc.sp_size, pc.sp_backend, pc.total_size, pc.data_parallel_size) == (2, "deepspeed", 4, 2)
    assert pc.sp_handler.sp_attn_implementation == "flash_attention_2" and pc.sp_handler.sp_seq_length_is_variable
    assert pc.data_parallel_size == job.data_parallel_size


def test_deepspeed_and_the_trainer_accept_the_json_with_the_data_parallel_batch(generated, tmp_path):
    """DeepSpeed derives train_batch_size, micro 2 x accumulation 3 x 2 data-parallel ranks = 12 (and
    accelerate writes the same before deepspeed.initialize); the HF Trainer, which counts all 4 ranks,
    finds no number to disagree with."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    job, gen = generated
    ds = json.loads((gen / DEEPSPEED_FILE).read_text())
    assert "train_batch_size" not in ds
    join_group_of_one(tmp_path)
    assert DeepSpeedConfig(dict(ds), mpu=_DataParallel(job.data_parallel_size)).train_batch_size == \
        job.global_batch_size == 12
    # accelerate's _prepare_deepspeed under sequence parallelism: micro x accumulation x pc.data_parallel_size
    DeepSpeedConfig({**ds, "train_batch_size": 2 * 3 * 2}, mpu=_DataParallel(job.data_parallel_size))
    args = SimpleNamespace(**training_arguments_kwargs(job, str(gen / DEEPSPEED_FILE)), world_size=job.world_size,
                           save_on_each_node=False, fp16_full_eval=False, bf16_full_eval=False)
    trainer = HfTrainerDeepSpeedConfig(dict(ds))
    trainer.trainer_config_process(args)
    assert trainer.mismatches == []
    counted = HfTrainerDeepSpeedConfig({**ds, "train_batch_size": job.global_batch_size})
    counted.trainer_config_process(args)  # why hfscale leaves the number out: the Trainer counts every rank
    assert counted.mismatches == ["- ds train_batch_size=12 vs hf train_batch_size (calculated)=24"]


def test_trl_alst_config_imports_faithfully(tmp_path):
    """TRL's ALST/Ulysses preset through import -> check -> config, compared with the original through
    accelerate's loader and launch code and DeepSpeed's config (tests/real_corpus.py)."""
    (row, acc, ds), = [c for c in cases() if c[0].file == "huggingface__trl/alst_ulysses_4gpu.yaml"]
    join_group_of_one(tmp_path)
    with pytest.MonkeyPatch().context() as m:
        result = run_case(row, acc, ds, tmp_path / "case", m)
    assert (result.outcome, result.details) == ("faithful", [])
    assert any("seq_parallel_communication_data_type" in n and "never reads it" in n for n in result.notes)
    doc = yaml.safe_load((tmp_path / "case" / "job.yaml").read_text())
    assert doc["distributed"]["parallelism"] == {
        "dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 1, "sp_size": 2, "sp_backend": "deepspeed",
        "sp_seq_length_is_variable": True, "sp_attn_implementation": "flash_attention_2"}


def test_a_json_with_sequence_parallel_size_imports_beside_the_same_sp_size(tmp_path):
    from conftest import run_cli

    acc = tmp_path / "acc.yaml"
    acc.write_text(yaml.safe_dump({
        "distributed_type": "DEEPSPEED", "num_processes": 4, "deepspeed_config": {"deepspeed_config_file": "ds.json"},
        "parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_sp_size": 2}}))
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                                  "sequence_parallel_size": 2, "zero_optimization": {"stage": 3}}))
    r = run_cli("import", str(acc), "--out", "-", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(r.stdout)
    assert doc["distributed"]["deepspeed"]["extra"] == {"sequence_parallel_size": 2}
    assert doc["distributed"]["parallelism"]["sp_size"] == 2 and doc["batch"]["gradient_accumulation_steps"] == 2
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 4,
                                                  "zero_optimization": {"stage": 3}}))
    r = run_cli("import", str(acc), "--out", "-", cwd=tmp_path)
    assert r.returncode == 2 and "ds.json: sequence_parallel_size: 4, but distributed.parallelism.sp_size is 2" \
        in r.stderr, r.stderr


def test_a_sources_train_batch_size_is_left_out_under_sequence_parallelism(tmp_path):
    """accelerate overwrites train_batch_size with micro x gradient_accumulation_steps (1 when absent)
    x data-parallel ranks before deepspeed.initialize: the number in the JSON never trains, so it
    neither sets nor derives the accumulation."""
    from conftest import run_cli

    acc = tmp_path / "acc.yaml"
    acc.write_text(yaml.safe_dump({
        "distributed_type": "DEEPSPEED", "num_processes": 8, "deepspeed_config": {"deepspeed_config_file": "ds.json"},
        "parallelism_config": {"parallelism_config_dp_shard_size": 4, "parallelism_config_sp_size": 2}}))
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "train_batch_size": 16,
                                                  "zero_optimization": {"stage": 3}}))
    r = run_cli("import", str(acc), "--out", "job.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "job.yaml").read_text()
    doc = yaml.safe_load(text)
    assert "global_batch_size" not in doc["batch"] and doc["batch"].get("gradient_accumulation_steps", 1) == 1
    assert "train_batch_size 16 left out: under sequence parallelism (sp_size 2) accelerate replaces it with micro " \
           "batch x gradient_accumulation_steps (1 when absent) x 4 data-parallel ranks" in text
    assert doc["training"]["script"] == "train.py"  # the built-in entry point cannot run sequence parallelism
    job = load_text(text, "job.yaml", tmp_path)
    assert (job.gradient_accumulation_steps, job.global_batch_size) == (1, 4)  # what accelerate gives DeepSpeed
