"""Resuming at another world size: 2 processes train a tiny GPT-2 (ZeRO-2, dropout 0) to step 20;
relaunched with 1 process and with 4 to step 30, ``hfscale launch`` converts the checkpoint to
DeepSpeed's universal checkpoint and the job continues at step 20. The converted fp32 weights and
Adam moments equal the saved shards, and every step after the resume logs the loss of an
uninterrupted 2-process run at the same global batch (samples neither repeated nor skipped: a
shifted sample order would change the losses)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT

pytestmark = pytest.mark.slow
MODEL = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "n_positions": 64,
         "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def config(tmp_path: Path, out: Path, nproc: int, max_steps: int, port: int) -> Path:
    doc = {"name": "rs", "cluster": {"nproc_per_node": nproc, "master_port": port},
           "runner": {"launcher": "torchrun", "run_dir": str(tmp_path / "runs")},
           "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}}, "precision": "no",
           "batch": {"micro_batch_size": 2, "global_batch_size": 8},
           "env": {"vars": {"OMP_NUM_THREADS": "1"}},
           "training": {"output_dir": str(out), "max_steps": max_steps, "save_steps": 10, "logging_steps": 1,
                        "learning_rate": 1.0e-3, "lr_scheduler_type": "constant", "seed": 3,
                        "model": {"config": MODEL}, "data": {"block_size": 32}}}
    path = tmp_path / f"job-{nproc}-{max_steps}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def launch(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfscale", "launch", str(path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def losses(ckpt: Path) -> dict[int, float]:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted 2-process run to 30, and the 2-process run to 20 that is resumed."""
    tmp = tmp_path_factory.mktemp("reshard")
    ref = launch(config(tmp, tmp / "ref", 2, 30, 29651))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-2000:]
    first = launch(config(tmp, tmp / "out", 2, 20, 29652))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    return tmp


def _flat(shards: list[Path], key: str, group: int) -> torch.Tensor:
    """One parameter group's flat state over the ranks' ZeRO partitions, in rank order."""
    parts = []
    for s in shards:
        osd = torch.load(s, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        if key == "fp32":
            parts.append(osd["single_partition_of_fp32_groups"][group])
        else:
            parts.append(osd["base_optimizer_state"]["state"][group][key])
    return torch.cat([p.flatten() for p in parts])


def test_the_universal_conversion_holds_the_saved_weights_and_moments(runs, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(runs / "out", out)
    r = launch(config(tmp_path, out, 1, 30, 29653), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "was saved by 2 processes, this job has 1: it resumes from its universal checkpoint" in r.stdout
    assert "the global batch stays 8 (batch.global_batch_size; accumulation 4)" in r.stdout
    assert "deepspeed.checkpoint.ds_to_universal --input_folder" in r.stdout
    convert = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                              str(out / "checkpoint-20" / "global_step20"), "--output_folder",
                              str(out / "checkpoint-20" / "global_step20_universal"), "--inject_missing_state"],
                             capture_output=True, text=True, timeout=300)
    assert convert.returncode == 0, convert.stdout[-2000:] + convert.stderr[-2000:]
    step = out / "checkpoint-20" / "global_step20"
    shards = sorted(step.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    assert len(shards) == 2
    shapes = torch.load(step / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["param_shapes"]
    uni = out / "checkpoint-20" / "global_step20_universal" / "zero"
    compared = 0
    for group, names in enumerate(shapes):  # the optimizer's groups (weight decay or not), in order
        for key, file in (("fp32", "fp32.pt"), ("exp_avg", "exp_avg.pt"), ("exp_avg_sq", "exp_avg_sq.pt")):
            saved = _flat(shards, key, group)
            converted = torch.cat([torch.load(uni / n / file, map_location="cpu", weights_only=False)["param"]
                                   .flatten() for n in names])
            assert converted.numel() <= saved.numel()  # the shards end with alignment padding
            assert torch.allclose(converted, saved[:converted.numel()], atol=1e-6, rtol=0), (group, key)
            compared += converted.numel()
    assert compared == 3 * sum(torch.Size(s).numel() for names in shapes for s in names.values())


@pytest.mark.parametrize("nproc", [1, 4])
def test_resumes_at_another_world_size_with_the_same_losses(runs, tmp_path, nproc):
    out = tmp_path / "out"
    shutil.copytree(runs / "out", out)
    r = launch(config(tmp_path, out, nproc, 30, 29654 + nproc))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ds_to_universal" in r.stdout and "hfscale: done in" in r.stdout
    assert f"resuming from {out / 'checkpoint-20'}" in r.stdout
    assert (out / "checkpoint-20" / "latest_universal").read_text().strip() == "global_step20_universal"
    got, want = losses(out / "checkpoint-30"), losses(runs / "ref" / "checkpoint-30")
    assert sorted(got) == list(range(1, 31))  # steps 1-20 from the checkpoint, 21-30 trained here
    worst = max(abs(got[s] - want[s]) for s in range(21, 31))
    print(f"{nproc} process(es): largest loss difference over steps 21-30: {worst:.2e} (step 21: "
          f"{abs(got[21] - want[21]):.2e})")
    assert worst < 1e-3


def test_an_unchanged_trainer_script_resumes_at_another_world_size(tmp_path):
    """The same for a YAML-driven HfArgumentParser script (tests/scripts/hf_clm.py): 2 processes to
    step 20, then 1 to step 30, resumed from the universal conversion of checkpoint-20."""
    model = "n_layer=2,n_head=2,n_embd=32,vocab_size=256,n_positions=64,bos_token_id=0,eos_token_id=0"

    def script_config(nproc: int, steps: int) -> Path:
        doc = yaml.safe_load(config(tmp_path, tmp_path / "out", nproc, steps, 29660 + nproc).read_text())
        doc["training"] = {"script": str(ROOT / "tests" / "scripts" / "hf_clm.py"), "output_dir": "out",
                           "max_steps": steps, "save_steps": 10, "logging_steps": 5, "learning_rate": 1.0e-3,
                           "script_args": ["--model_type", "gpt2", "--config_overrides", model, "--block_size", "32",
                                           "--report_file", "report.json", "--disable_tqdm", "true"]}
        doc["runner"]["workdir"] = str(tmp_path)
        path = tmp_path / f"script-{nproc}-{steps}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    r = launch(script_config(2, 20))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = launch(script_config(1, 30))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ds_to_universal" in r.stdout and "hfscale: resuming from out/checkpoint-20" in r.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["global_step"] == 30 and report["world_size"] == 1
    assert report["args"]["resume_from_checkpoint"] == "out/checkpoint-20"
