"""``hfscale import`` writes what the engines do, not hfscale's defaults: an optimizer or scheduler
parameter a DeepSpeed JSON leaves out becomes the default of the class DeepSpeed builds (the
original and the written JSON build the same class with the same arguments, and the same
learning-rate schedule); keys DeepSpeed and accelerate accept but never use are left out with a
note (offload_param below stage 3), accelerate's gpu_ids as CUDA reads it, and a MULTI_GPU config
of one process against what accelerate launch runs for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from deepspeed.runtime import lr_schedules

from conftest import ROOT
from hfscale.cli.importing.importer import Source, import_configs
from hfscale.render.deepspeed import deepspeed_config
from hfscale.rules.config_file import load_text
from test_engine_defaults import effective_optimizer

DATA = ROOT / "tests" / "data" / "import"
ENGINE_KEYS = ("optimizer", "scheduler", "zero_optimization")


def _import(tmp_path: Path, accelerate: str, ds: dict | None = None) -> tuple[str, dict | None]:
    """(the hfscale YAML, the DeepSpeed JSON hfscale writes from it)."""
    acc = Source(str(tmp_path / "acc.yaml"), accelerate)
    text = import_configs(acc, Source(str(tmp_path / "ds.json"), json.dumps(ds)) if ds else None, None, tmp_path)
    job = load_text(text, "job.yaml", tmp_path)
    return text, deepspeed_config(job) if job.deepspeed is not None else None


def _schedule(ds: dict, lr: float, steps: int = 40) -> list[float]:
    """The learning rate of each step under the JSON's scheduler, the optimizer built with ``lr``."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = getattr(lr_schedules, ds["scheduler"]["type"])(opt, **ds["scheduler"].get("params", {}))
    out = []
    for _ in range(steps):
        sched.step()
        out.append(round(opt.param_groups[0]["lr"], 12))
    return out


SECTIONS = {
    "torch AdamW (the issue's)": {"optimizer": {"type": "Adam", "params": {"torch_adam": True, "lr": 4e-5}}},
    "torch Adam": {"optimizer": {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}},
    "FusedAdam, nothing given": {"optimizer": {"type": "AdamW"}},
    "DeepSpeedCPUAdam": {"optimizer": {"type": "Adam", "params": {"betas": [0.8, 0.9]}},
                         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "FusedLion": {"optimizer": {"type": "Lion", "params": {"weight_decay": 0.1}}},
    "FusedLamb": {"optimizer": {"type": "Lamb", "params": {"lr": 2e-3}}},
    "WarmupLR peaks at the optimizer's lr": {"optimizer": {"type": "Adam", "params": {"lr": 3e-4}},
                                             "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
    "WarmupDecayLR's own 0.001": {"optimizer": {"type": "AdamW"},
                                  "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 30, "warmup_num_steps": 5}}},
    "WarmupCosineLR": {"optimizer": {"type": "Adam", "params": {"torch_adam": True, "lr": 5e-4}},
                       "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 30,
                                                                          "warmup_num_steps": 5}}},
}


@pytest.mark.parametrize("name", list(SECTIONS))
def test_what_a_json_leaves_out_is_the_default_of_the_class_deepspeed_builds(name, tmp_path, monkeypatch):
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, **SECTIONS[name]}
    text, written = _import(tmp_path, (DATA / "ds_plain.yaml").read_text(), ds)
    engine = {k: ds[k] for k in ENGINE_KEYS if k in ds and k != "scheduler"}
    before = effective_optimizer(engine, monkeypatch)
    after = effective_optimizer({k: written[k] for k in ENGINE_KEYS if k in written and k != "scheduler"}, monkeypatch)
    assert after == before
    if "scheduler" in ds:
        assert _schedule(written, after[1]["lr"]) == _schedule(ds, before[1]["lr"])
    if name == "torch AdamW (the issue's)":
        assert before[1]["weight_decay"] == written["optimizer"]["params"]["weight_decay"] == 0.01
        assert "weight_decay: 0.01  # absent from the optimizer: the default of torch.optim.AdamW, which DeepSpeed " \
            "builds for it" in text


def test_a_warmup_decay_without_its_peak_and_another_optimizer_lr_is_still_refused(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 30}}}
    with pytest.raises(Exception, match="WarmupDecayLR peaks at its default 0.001, not at the optimizer's lr 0.0003"):
        _import(tmp_path, (DATA / "ds_plain.yaml").read_text(), ds)
    cosine = {**ds, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 30, "warmup_max_lr": 1}}}
    with pytest.raises(Exception, match="WarmupCosineLR takes no warmup_max_lr"):
        _import(tmp_path, (DATA / "ds_plain.yaml").read_text(), cosine)
    with pytest.raises(TypeError):  # as DeepSpeed builds it
        _schedule(cosine, 0.1)


ZERO2_OFFLOAD_PARAM = """\
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 2
  offload_optimizer_device: cpu
  offload_param_device: cpu
mixed_precision: bf16
num_machines: 1
num_processes: 2
"""


def test_offload_param_below_stage_3_is_left_out_with_a_note(tmp_path, monkeypatch):
    """accelerate writes it into the config it builds and DeepSpeed accepts it at every stage; the
    engine reads it at stage 3 only (test_deepspeed_keys.py::test_stage_table_agrees_with_what_deepspeed_reads
    holds that to what it reads when run)."""
    from test_consumers import _deepspeed_plugin_as_launched
    from test_import import compare_deepspeed

    text, written = _import(tmp_path, ZERO2_OFFLOAD_PARAM)
    assert "# - " + str(tmp_path / "acc.yaml") + ": left out deepspeed_config.offload_param_device cpu: DeepSpeed " \
        "does not use it at ZeRO stage 2" in text
    assert written["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in written["zero_optimization"]
    (tmp_path / "orig.yaml").write_text(ZERO2_OFFLOAD_PARAM)
    (tmp_path / "ds.json").write_text(json.dumps(written))
    back = {**yaml.safe_load(ZERO2_OFFLOAD_PARAM), "deepspeed_config": {"deepspeed_config_file": str(tmp_path / "ds.json")}}
    back.pop("mixed_precision")
    (tmp_path / "back.yaml").write_text(yaml.safe_dump(back))
    with monkeypatch.context() as m:
        before = _deepspeed_plugin_as_launched(m, tmp_path / "orig.yaml").deepspeed_config
    with monkeypatch.context() as m:
        after = _deepspeed_plugin_as_launched(m, tmp_path / "back.yaml").deepspeed_config
    diffs = compare_deepspeed(before, after, 2)
    assert diffs == ["zero_optimization.offload_param.device: 'cpu' left out, not DeepSpeed's default"]
    assert before["zero_optimization"]["stage"] == after["zero_optimization"]["stage"] == 2
    # the same key in a DeepSpeed JSON
    text, written = _import(tmp_path, (DATA / "ds_plain.yaml").read_text(), {
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})
    assert "left out zero_optimization.offload_param: DeepSpeed does not use it at ZeRO stage 1" in text


@pytest.mark.parametrize("ids, read", [("0,", "0"), ("0,1,", "0,1"), ("2, 3,,", "2,3")])
def test_gpu_ids_with_a_trailing_comma_are_the_gpus_cuda_reads(ids, read, tmp_path, monkeypatch):
    """accelerate launch puts gpu_ids into CUDA_VISIBLE_DEVICES as written; torch reads that variable
    as CUDA does (torch.cuda._parse_visible_devices)."""
    from test_consumers import _launch_env

    procs = len(read.split(","))
    kind = "MULTI_GPU" if procs > 1 else "'NO'"  # quoted: YAML reads a bare NO as false
    acc = f"distributed_type: {kind}\nnum_machines: 1\nnum_processes: {procs}\n" \
          f"gpu_ids: {ids}\n"
    assert yaml.safe_load(acc)["gpu_ids"] == ids  # YAML reads 0, as the string "0,"
    text, _ = _import(tmp_path, acc)
    assert yaml.safe_load(text)["accelerate"]["gpu_ids"] == read
    assert f"gpu_ids {ids!r}: accelerate launch puts it into CUDA_VISIBLE_DEVICES as written" in text
    cuda = []
    for config in (acc, yaml.safe_dump({**yaml.safe_load(acc), "gpu_ids": read})):
        (tmp_path / "a.yaml").write_text(config)
        args, _, _ = _launch_env(tmp_path / "a.yaml")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", args.gpu_ids)
        cuda.append(torch.cuda._parse_visible_devices())
    assert cuda[0] == cuda[1] == [int(i) for i in read.split(",")]


def test_multi_gpu_with_one_process_keeps_its_process_group_of_one(tmp_path):
    """accelerate launch runs a MULTI_GPU config of one process through torch.distributed.run (a
    process group of one, OMP_NUM_THREADS=1); the import keeps it (distributed.process_group), and
    the accelerate config written back is launched the same way, with the same environment."""
    from accelerate.utils.launch import prepare_multi_gpu_env

    from hfscale.render.accelerate import accelerate_config
    from test_consumers import _launch_env

    acc = "distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 1\nmixed_precision: bf16\n"
    text, _ = _import(tmp_path, acc)
    assert "process_group: true  # distributed_type MULTI_GPU with 1 process: accelerate launch starts it through " \
        "torch.distributed.run as a process group of one" in text
    job = load_text(text, "job.yaml", tmp_path)
    (tmp_path / "orig.yaml").write_text(acc)
    (tmp_path / "back.yaml").write_text(yaml.safe_dump(accelerate_config(job, "unused.json")))
    (a_args, _, _), (b_args, _, _) = _launch_env(tmp_path / "orig.yaml"), _launch_env(tmp_path / "back.yaml")
    assert (a_args.multi_gpu, b_args.multi_gpu) == (True, True)  # multi_gpu_launcher both: torch.distributed.run
    assert (a_args.num_processes, b_args.num_processes) == (1, 1)
    env_a, env_b = prepare_multi_gpu_env(a_args), prepare_multi_gpu_env(b_args)
    keys = {k for k in set(env_a) | set(env_b) if k.startswith("ACCELERATE_") or k == "OMP_NUM_THREADS"}
    assert {k: env_a.get(k) for k in keys} == {k: env_b.get(k) for k in keys}
    assert env_b["ACCELERATE_MIXED_PRECISION"] == "bf16" and int(env_b["OMP_NUM_THREADS"]) == 1
    # the key without the import: only for ddp, and one plain process (NO) stays the default
    assert accelerate_config(load_text("name: t\ncluster: {nproc_per_node: 1}\ndistributed: {backend: ddp}\n"
                                       "batch: {micro_batch_size: 1}\n", "j.yaml", tmp_path), "u.json")[
        "distributed_type"] == "NO"
