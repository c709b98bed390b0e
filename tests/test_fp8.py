"""precision: fp8 as accelerate 1.15 reads it: the accelerate YAML, the launch environment, the
recipe classes, the DeepSpeed JSON and the Trainer's check of it; imports; refusals, each with why.

No fp8 step runs here: this CPU machine has no GPU of compute capability 8.9 or more and none of
Transformer Engine, torchao or MS-AMP (accelerate launch refuses fp8 without one of them; their
presence is patched in). What runs is accelerate's own code up to the training step: its config
loader, launch_command's merge and environment builders, DeepSpeedPlugin.set_mixed_precision, the
recipe classes reading that environment, and transformers' DeepSpeed consistency check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin
from accelerate.utils import dataclasses as acc_dataclasses
from accelerate.utils import launch as acc_launch

from conftest import job_of
from hfscale.cli.importing.importer import import_configs, read_source
from hfscale.config.errors import ConfigError
from hfscale.core.atomic_files import write_files
from hfscale.launch.context import LaunchContext
from hfscale.launch.node.command import Rendezvous, launcher_argv
from hfscale.memory.estimate import Setting, estimate
from hfscale.memory.model_shape import shape_of
from hfscale.render.artifacts import ACCELERATE_FILE, DEEPSPEED_FILE, render_artifacts
from hfscale.render.deepspeed import deepspeed_config
from hfscale.rules.config_file import load_text
from hfscale.rules.trainer_args import training_arguments
from real_corpus import CORPUS, fp8_launch

FP8_CONFIG = {"fp8_backend": "TE", "fp8_format": "e4m3", "fp8_amax_history_len": 16, "fp8_amax_compute_algo": "MAX",
              "fp8_margin": 1, "fp8_interval": 2, "fp8_override_linear_precision": [False, True, False],
              "fp8_use_autocast_during_eval": True}
DDP = f"""
name: f8
cluster: {{nproc_per_node: 2}}
distributed: {{backend: ddp}}
precision: fp8
batch: {{micro_batch_size: 1}}
accelerate: {{extra: {{fp8_config: {FP8_CONFIG}}}}}
"""
DEEPSPEED = """
name: f8
cluster: {nproc_per_node: 2}
distributed: {backend: deepspeed, deepspeed: {stage: 2}}
precision: fp8
batch: {micro_batch_size: 1}
accelerate: {extra: {fp8_config: {fp8_backend: MSAMP, fp8_opt_level: O1}}}
"""


def _written(text: str, tmp: Path) -> tuple[object, Path]:
    job = job_of(text)
    write_files(tmp, render_artifacts(job, str(tmp / DEEPSPEED_FILE)))
    return job, tmp / ACCELERATE_FILE


def _launch(monkeypatch, path: Path, *flags: str) -> dict[str, str]:
    """The environment accelerate launch gives a rank for ``--config_file path *flags``, set here
    as the rank would see it."""
    monkeypatch.setattr(acc_launch, "is_fp8_available", lambda: True)
    args = launch_command_parser().parse_args(["--config_file", str(path), *flags, "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # as launch_command lists the YAML's DeepSpeed keys
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = acc_launch.prepare_deepspeed_cmd_env(args)
    else:
        env = acc_launch.prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    return env


def test_fp8_yaml_is_read_back_by_accelerate_with_the_same_settings(tmp_path, monkeypatch):
    _, path = _written(DDP, tmp_path)
    loaded = load_config_from_file(str(path))
    assert loaded.mixed_precision == "fp8" and loaded.fp8_config == FP8_CONFIG
    env = _launch(monkeypatch, path)
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp8"
    # what the Accelerator then builds: the backend as FP8BackendType, the recipe from the environment
    assert acc_dataclasses.FP8BackendType(env["ACCELERATE_FP8_BACKEND"]) is acc_dataclasses.FP8BackendType.TE
    monkeypatch.setattr(acc_dataclasses, "is_transformer_engine_available", lambda: True)
    te = acc_dataclasses.TERecipeKwargs()
    assert (te.fp8_format, te.amax_history_len, te.amax_compute_algo, te.margin, te.interval,
            te.override_linear_precision, te.use_autocast_during_eval) == ("E4M3", 16, "max", 1, 2,
                                                                          (False, True, False), True)


def test_fp8_with_deepspeed_is_what_accelerate_builds_and_the_trainer_accepts(tmp_path, monkeypatch):
    """accelerate refuses mixed_precision in the YAML beside deepspeed_config_file, so hfscale gives
    accelerate launch --mixed_precision fp8 and leaves bf16 out of the JSON: accelerate adds bf16
    {enabled: true} itself, as for its own fp8 DeepSpeed configs. The Trainer has no fp8 flag: it
    gets --bf16 false and takes fp8 from accelerate's environment, and finds nothing to disagree
    with in the JSON (a bf16 section there would be one)."""
    job, path = _written(DEEPSPEED, tmp_path)
    assert not {"bf16", "fp16"} & set(deepspeed_config(job))
    ctx = LaunchContext.of("/work", "py", "20261122-120000-abcdef", {})
    argv = launcher_argv(job, "py", "/run", ctx, Rendezvous(rank="0"))
    assert argv[:10] == ["py", "-m", "hfscale.training.warm_launcher", "--preload", "trainer,deepspeed,builtin",
                         "accelerate.commands.launch", "--config_file", "/run/accelerate_config.yaml",
                         "--mixed_precision", "fp8"]
    env = _launch(monkeypatch, path, "--mixed_precision", "fp8")
    assert (env["ACCELERATE_MIXED_PRECISION"], env["ACCELERATE_FP8_BACKEND"]) == ("fp8", "MSAMP")
    plugin = DeepSpeedPlugin()  # as the Accelerator builds it from the environment (its own checks included)
    plugin.set_mixed_precision("fp8")
    ds = plugin.deepspeed_config
    assert (ds["bf16"], ds["fp16"], ds["msamp"]) == ({"enabled": True}, {"enabled": False},
                                                     {"enabled": True, "opt_level": "O1"})
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = training_arguments(job, None, use_cpu=True)
    assert (args.bf16, args.fp16, args.mixed_precision) == (False, False, "fp8")
    for written, clash in ((deepspeed_config(job), []), ({**deepspeed_config(job), "bf16": {"enabled": True}},
                                                          ["- ds bf16.enabled=True vs hf bf16|bf16_full_eval=False"])):
        trainer_ds = HfTrainerDeepSpeedConfig(written)
        trainer_ds.trainer_config_process(args)  # (this process is a world of 1: the batch differs)
        assert [m for m in trainer_ds.mismatches if "16" in m.split("=")[0]] == clash


def test_accelerates_fp8_template_imports_faithfully(tmp_path):
    src = CORPUS / "huggingface__accelerate" / "fp8.yaml"
    text = import_configs(read_source(str(src), str(src)), None, None, tmp_path)
    doc = yaml.safe_load(text)
    assert doc["precision"] == "fp8" and doc["distributed"]["backend"] == "ddp"
    assert doc["accelerate"]["extra"]["fp8_config"] == {  # the names accelerate launch gives them
        "fp8_backend": "TE", "fp8_amax_history_len": 1024, "fp8_format": "E4M3", "fp8_interval": 1, "fp8_margin": 0,
        "fp8_override_linear_precision": [False, False, False], "fp8_use_autocast_during_eval": False}
    _, path = _written(text, tmp_path / "gen")
    assert fp8_launch(src, path) == []  # the same ACCELERATE_MIXED_PRECISION and ACCELERATE_FP8_* variables


def test_inline_deepspeed_fp8_imports_as_fp8_and_beside_a_json_is_refused(tmp_path):
    acc = tmp_path / "acc.yaml"
    acc.write_text("distributed_type: DEEPSPEED\nmixed_precision: fp8\nnum_processes: 2\n"
                   "deepspeed_config: {zero_stage: 2}\nfp8_config: {backend: AO}\n")
    doc = yaml.safe_load(import_configs(read_source(str(acc), str(acc)), None, None, tmp_path))
    assert (doc["precision"], doc["distributed"]["deepspeed"]["stage"]) == ("fp8", 2)
    assert doc["accelerate"]["extra"]["fp8_config"] == {"fp8_backend": "AO"}
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    acc.write_text("distributed_type: DEEPSPEED\nmixed_precision: fp8\ndeepspeed_config: "
                   "{deepspeed_config_file: ds.json}\n")
    with pytest.raises(ConfigError) as e:
        import_configs(read_source(str(acc), str(acc)), read_source(str(tmp_path / "ds.json"), "x"), None, tmp_path)
    assert any(p.path.endswith("mixed_precision") and "beside deepspeed_config_file" in p.message
               for p in e.value.problems)


def _problems(text: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        load_text(text, "t.yaml", Path("."))
    return {p.path: p.message for p in e.value.problems}


BASE = "name: x\nbatch: {micro_batch_size: 1}\ncluster: {nproc_per_node: 2}\n"


@pytest.mark.parametrize("text,path,why", [
    ("precision: fp8\ndistributed: {backend: ddp}\naccelerate: {extra: {fp8_config: {fp8_backend: te}}}\n",
     "accelerate.extra.fp8_config.fp8_backend", "must be one of 'NO', 'TE', 'MSAMP', 'AO'; got 'te'"),
    ("precision: fp8\ndistributed: {backend: ddp}\n"
     "accelerate: {extra: {fp8_config: {fp8_override_linear_precision: [true]}}}\n",
     "accelerate.extra.fp8_config.fp8_override_linear_precision", "reads three values, fprop, dgrad and wgrad"),
    ("precision: fp8\ndistributed: {backend: ddp}\nrunner: {launcher: torchrun}\n",
     "precision", "torchrun does not run: the job would train in fp32"),
    ("precision: fp8\ndistributed: {backend: fsdp}\naccelerate: {extra: {fp8_config: {fp8_backend: MSAMP}}}\n",
     "accelerate.extra.fp8_config.fp8_backend", "accelerate + MS-AMP + FSDP is not supported"),
    ("precision: fp8\ndistributed: {backend: fsdp}\naccelerate: {extra: {fp8_config: {fp8_backend: AO}}}\n",
     "distributed.fsdp.cpu_ram_efficient_loading", "torchao with FSDP2 and cpu_ram_efficient_loading"),
    ("precision: fp8\ndistributed: {backend: deepspeed, deepspeed: {extra: {bf16: {immediate_grad_update: true}}}}\n",
     "distributed.deepspeed.extra.bf16", "accelerate turns DeepSpeed's bf16 on only when the JSON has no bf16"),
    ("precision: bf16\naccelerate: {extra: {fp8_config: {fp8_backend: TE}}}\n",
     "accelerate.extra.fp8_config", "accelerate reads it only with mixed_precision fp8 (precision: fp8)"),
])
def test_what_accelerate_refuses_of_fp8_is_refused_with_why(text, path, why):
    found = _problems(BASE + text)
    assert path in found and why in found[path], found


def test_fp8_is_sized_as_bf16():
    """accelerate runs fp8 under bf16 (DeepSpeed bf16 on, FSDP parameters in bf16)."""
    shape = shape_of({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
                      "intermediate_size": 172, "vocab_size": 500})
    for engine, stage in (("deepspeed", 2), ("deepspeed", 3), ("fsdp", 3), ("ddp", 0)):
        s = dict(engine=engine, stage=stage, offload_optimizer=False, offload_params=False, micro_batch=2,
                 accumulation=1, checkpointing=False, seq_len=128, world=8, gpus_per_node=8, nodes=1)
        assert estimate(shape, Setting(precision="fp8", **s)).gpu == estimate(shape, Setting(precision="bf16", **s)).gpu
