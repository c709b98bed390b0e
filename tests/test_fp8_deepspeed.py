"""precision fp8 under DeepSpeed beyond the files: the launch line the files need, the dtype ZeRO-3
builds the model in, and the checks for what hfscale cannot reach (a user's Trainer script).

accelerate refuses mixed_precision in the accelerate YAML beside deepspeed_config_file, and fp8 has
no place in the DeepSpeed JSON: accelerate adds bf16 {enabled: true} only when the Accelerator is
built, after the model. What runs here is the libraries' own code on the CPU (gloo, a world of one):
deepspeed.zero.Init reading the config transformers holds, accelerate's DeepSpeedPlugin.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import job_of, run_cli
from hfscale.render.artifacts import ACCELERATE_FILE, DEEPSPEED_FILE, render_artifacts
from hfscale.render.deepspeed import render_deepspeed
from real_corpus import join_group_of_one

Z3 = """
name: f8
cluster: {nproc_per_node: 1}
distributed: {backend: deepspeed, deepspeed: {stage: 3}}
precision: fp8
batch: {micro_batch_size: 1}
"""


def test_the_accelerate_yaml_and_hfscale_config_say_the_launch_needs_mixed_precision_fp8(tmp_path):
    job = job_of(Z3)
    text = render_artifacts(job, str(tmp_path / DEEPSPEED_FILE))[ACCELERATE_FILE]
    head = " ".join(line[2:] for line in text.splitlines() if line.startswith("# "))  # the header comment
    assert "accelerate launch --mixed_precision fp8 --config_file accelerate_config.yaml" in head
    assert "trains in fp32" in head
    (tmp_path / "j.yaml").write_text(Z3)
    r = run_cli("config", "j.yaml", "--out", "gen", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "note: precision fp8 with DeepSpeed: launch with accelerate launch --mixed_precision fp8" in r.stderr
    (tmp_path / "b.yaml").write_text(Z3.replace("fp8", "bf16"))
    r = run_cli("config", "b.yaml", "--out", "gen3", cwd=tmp_path)
    assert r.returncode == 0 and "mixed_precision" not in r.stderr
    assert "--mixed_precision fp8" in run_cli("--help").stdout


def _forget_state() -> None:
    """accelerate's and transformers' process-wide DeepSpeed state, as the next test expects it."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()


def test_fp8_zero3_partitions_the_model_in_bf16_as_deepspeed_trains_it(tmp_path, monkeypatch, request):
    """hfscale.train builds its TrainingArguments with training_arguments, then the model under
    deepspeed.zero.Init with transformers' deepspeed_config(): bf16, not fp32."""
    import deepspeed
    import torch
    from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled

    from hfscale.rules.trainer_args import training_arguments

    job = job_of(Z3)
    path = tmp_path / DEEPSPEED_FILE
    path.write_text(render_deepspeed(job))
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)  # a rank of a world of one, as accelerate launch starts it
    join_group_of_one(tmp_path)
    args = training_arguments(job, str(path), use_cpu=True)
    request.addfinalizer(_forget_state)
    assert is_deepspeed_zero3_enabled() and args.hf_deepspeed_config.dtype() == torch.bfloat16
    with deepspeed.zero.Init(config_dict_or_path=deepspeed_config()):
        model = torch.nn.Linear(8, 8)
    assert model.weight.ds_tensor.dtype == torch.bfloat16
    assert args.hf_deepspeed_config.mismatches == []  # the Trainer's check still finds nothing to refuse
    plugin = args.deepspeed_plugin  # what the Accelerator then does with --mixed_precision fp8
    plugin.set_mixed_precision("fp8")
    assert (plugin.deepspeed_config["bf16"], plugin.deepspeed_config["fp16"]) == ({"enabled": True},
                                                                                  {"enabled": False})


def _warnings(text: str) -> dict[str, str]:
    return {w.path: w.message for w in job_of(text).warnings}


def test_a_trainer_script_with_fp8_and_zero3_is_warned_of_fp32_weights():
    script = Z3 + "training: {script: train.py}\n"
    found = _warnings(script)
    assert "partitioned in fp32 and DeepSpeed never casts them" in found["precision"]
    assert "args.hf_deepspeed_config.config.setdefault('bf16', {'enabled': True})" in found["precision"]
    assert "precision" not in _warnings(Z3)  # hfscale.train sets bf16 itself
    assert "precision" not in _warnings(script.replace("stage: 3}", "stage: 2}"))
    assert "precision" not in _warnings(script.replace("fp8", "bf16"))


FSDP = """
name: f8
cluster: {nproc_per_node: 2}
distributed: {backend: fsdp}
precision: fp8
batch: {micro_batch_size: 1}
"""


def test_fp8_under_fsdp_without_a_backend_is_warned_of_torchao_and_cpu_ram_efficient_loading():
    key = "accelerate.extra.fp8_config.fp8_backend"
    assert "torchao with FSDP2 and cpu_ram_efficient_loading" in _warnings(FSDP)[key]
    assert key not in _warnings(FSDP + "accelerate: {extra: {fp8_config: {fp8_backend: TE}}}\n")
    assert key not in _warnings(FSDP.replace("backend: fsdp}", "backend: fsdp, fsdp: {cpu_ram_efficient_loading: "
                                                              "false}}"))
    assert key not in _warnings(FSDP.replace("fp8", "bf16"))


@pytest.mark.parametrize("section, why", [
    ("{enabled: true}", "with enabled: true the HF Trainer refuses it"),
    ("{enabled: false}", "with this one DeepSpeed would train fp32 weights"),
    ("{immediate_grad_update: true}", "with this one DeepSpeed would train fp32 weights"),
])
def test_a_bf16_section_beside_fp8_is_refused_with_what_it_would_do(section, why):
    from hfscale.config.errors import ConfigError
    from hfscale.rules.config_file import load_text

    text = Z3.replace("stage: 3}", f"stage: 3, extra: {{bf16: {section}}}}}")
    with pytest.raises(ConfigError) as e:
        load_text(text, "t.yaml", Path("."))
    (message,) = [p.message for p in e.value.problems if p.path == "distributed.deepspeed.extra.bf16"]
    assert why in message and message.endswith(": remove it")


def test_mixed_precision_fp8_beside_a_deepspeed_file_is_refused_with_the_launch_flag_not_the_json(tmp_path):
    from hfscale.config.errors import ConfigError
    from hfscale.cli.importing.importer import import_configs, read_source

    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    acc = tmp_path / "acc.yaml"
    for precision, hint in (("fp8", "fp8 cannot go in the JSON: remove it here and launch with accelerate launch "
                                    "--mixed_precision fp8"), ("bf16", "set bf16/fp16 in the JSON")):
        acc.write_text(f"distributed_type: DEEPSPEED\nmixed_precision: {precision}\ndeepspeed_config: "
                       "{deepspeed_config_file: ds.json}\n")
        with pytest.raises(ConfigError) as e:
            import_configs(read_source(str(acc), str(acc)), read_source(str(tmp_path / "ds.json"), "x"), None,
                           tmp_path)
        (message,) = [p.message for p in e.value.problems if p.path.endswith("mixed_precision")]
        assert hint in message and ("bf16/fp16" in message) == (precision == "bf16")
