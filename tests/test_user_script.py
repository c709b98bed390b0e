"""Real 2-process CPU runs of an unchanged HfArgumentParser script (tests/scripts/hf_clm.py, in the
style of transformers' run_clm.py) driven by an hfscale YAML: the YAML's values reach it, it trains
with DeepSpeed under both launchers, a relaunch resumes (and says what the schedule does), a finished
run is not started again, incomplete checkpoints stop the launch and --restart moves them aside.
The built-in entry point trains ZeRO-3 with zero3_init true and false.

About 15 s per training run on 2 cores (DeepSpeed on the CPU, gloo)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hfscale.checkpoints.lr_schedule import rate
from hfscale.checkpoints.resume import checkpoint_problem
from hfscale.config.model import TrainingConfig

from conftest import ROOT

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "scripts" / "hf_clm.py"
MODEL = "n_layer=2,n_head=2,n_embd=64,vocab_size=256,n_positions=64,bos_token_id=0,eos_token_id=0"


def write_config(tmp_path: Path, port: int, launcher: str = "accelerate", **training) -> Path:
    doc = {
        "name": "hfclm",
        "cluster": {"nproc_per_node": 2, "master_port": port},
        "runner": {"launcher": launcher},
        "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2, "steps_per_print": 100000}},
        "precision": "no",
        "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
        "training": {"script": str(SCRIPT),
                     "script_args": ["--model_type", "gpt2", "--config_overrides", MODEL, "--report_file",
                                     "report.json", "--disable_tqdm", "true"],
                     "output_dir": "out", "save_steps": 10, "logging_steps": 5, "learning_rate": 1.0e-3,
                     "seed": 7, **training},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def launch(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config), *args], cwd=config.parent,
                          capture_output=True, text=True, timeout=400)


def report(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "report.json").read_text())


def run_dirs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "runs").glob("hfclm-*")) if (tmp_path / "runs").exists() else []


def test_the_yaml_drives_an_unchanged_trainer_script_and_a_relaunch_resumes(tmp_path):
    config = write_config(tmp_path, 29641, max_steps=20)
    r = launch(config)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    seen = report(tmp_path)
    args = seen["args"]
    assert {k: args[k] for k in (
        "output_dir", "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "learning_rate",
        "lr_scheduler_type", "warmup_steps", "seed", "logging_steps", "save_steps", "save_total_limit", "bf16",
        "fp16", "max_grad_norm", "use_cpu", "deepspeed", "report_to", "resume_from_checkpoint")} == {
        "output_dir": "out", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 20,
        "learning_rate": 1e-3, "lr_scheduler_type": "linear", "warmup_steps": 0, "seed": 7, "logging_steps": 5,
        "save_steps": 10, "save_total_limit": None, "bf16": False, "fp16": False, "max_grad_norm": 1.0,
        "use_cpu": True, "deepspeed": str(run_dir / "ds_config.json"), "report_to": [],
        "resume_from_checkpoint": None}
    assert (seen["world_size"], seen["deepspeed_enabled"], seen["zero_stage"]) == (2, True, 2)
    ckpt = tmp_path / "out" / "checkpoint-20"
    assert {p.name for p in (ckpt / "global_step20").iterdir()} >= {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert not (ckpt / "hfscale_complete.json").exists()  # the unchanged script writes no marker...
    assert checkpoint_problem(ckpt, 2) is None  # ...and its files show it complete
    assert (ckpt / "hfscale_loss_guard.json").is_file()  # its Trainer got the loss guard (trainer_hook), unchanged
    # the hang watchdog's steps: hfscale.training.run_script added ProgressCallback to the script's Trainer
    steps = {p.name: p.read_text().split()[0] for p in (run_dir / "progress").glob("rank-*")}
    assert steps == {"rank-0": "20", "rank-1": "20"}

    # relaunch with more steps: the plan says what the restored schedule does, the run resumes at 20
    config = write_config(tmp_path, 29641, max_steps=30)
    dry = launch(config, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "note: resumes from out/checkpoint-20" in dry.stdout
    assert "max_steps 20 -> 30" in dry.stdout and "so step 21 trains at 0.000333" in dry.stdout
    r = launch(config)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "hfscale: resuming from out/checkpoint-20" in r.stdout
    seen = report(tmp_path)
    assert seen["global_step"] == 30 and seen["args"]["resume_from_checkpoint"] == "out/checkpoint-20"
    logged = [(e["step"], e["learning_rate"]) for e in seen["log_history"] if "learning_rate" in e]
    assert [s for s, _ in logged] == [5, 10, 15, 20, 25, 30]  # no step trained twice
    t = TrainingConfig(max_steps=30, learning_rate=1e-3)
    assert logged[4][1] == pytest.approx(rate(t, 25))  # the rebuilt schedule, as the note said

    # a third launch has nothing to train: nothing starts (the Trainer would take one more step)
    before = run_dirs(tmp_path)
    r = launch(config)
    assert r.returncode == 0, r.stderr
    assert "nothing to train: out/checkpoint-30 is at step 30, max_steps is 30" in r.stderr
    assert run_dirs(tmp_path) == before and not (tmp_path / "out" / "checkpoint-31").exists()


def test_torchrun_trains_with_deepspeed_and_restart_moves_incomplete_checkpoints_aside(tmp_path):
    config = write_config(tmp_path, 29643, launcher="torchrun", max_steps=10)
    r = launch(config)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    seen = report(tmp_path)
    assert (seen["deepspeed_enabled"], seen["zero_stage"], seen["args"]["output_dir"]) == (True, 2, "out")
    shards = tmp_path / "out" / "checkpoint-10" / "global_step10"
    assert sorted(p.name for p in shards.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]

    # rank 1's save "never finished", in an output_dir hfscale did not start (the lineage rank 0 wrote at the
    # fresh start removed: as another tool's checkpoints): the only checkpoint is incomplete, and the launch
    # refuses to start over (one the job started itself sets its own save aside: tests/test_healing_trips*.py)
    assert (tmp_path / "out" / "_hfscale-lineage.json").is_file()
    (tmp_path / "out" / "_hfscale-lineage.json").unlink()
    (tmp_path / "out" / "checkpoint-10" / "rng_state_1.pth").unlink()
    before = run_dirs(tmp_path)
    r = launch(config)
    assert r.returncode == 2
    assert "training.output_dir (line " in r.stderr and "holds 1 checkpoint(s) but none is complete" in r.stderr
    assert "DeepSpeed shards of 2 ranks but RNG states of 1" in r.stderr and "--restart" in r.stderr
    assert run_dirs(tmp_path) == before

    r = launch(config, "--restart")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (moved,) = (tmp_path / "out").glob("restarted-*/checkpoint-10")
    assert not (moved / "rng_state_1.pth").exists()  # the old one, moved aside, not deleted
    assert "resuming" not in r.stdout
    seen = report(tmp_path)
    assert seen["global_step"] == 10 and seen["args"]["resume_from_checkpoint"] is None
    assert checkpoint_problem(tmp_path / "out" / "checkpoint-10", 2) is None


@pytest.mark.parametrize("zero3_init", [True, False])
def test_builtin_entry_point_trains_zero3_on_cpu(tmp_path, zero3_init):
    doc = yaml.safe_load((ROOT / "examples" / "tiny_cpu" / "config.yaml").read_text())
    doc["cluster"]["master_port"] = 29645 + int(zero3_init)
    doc["distributed"]["deepspeed"].update(stage=3, zero3_init=zero3_init)
    doc["training"].update(max_steps=30, save_steps=30, logging_steps=10, warmup_steps=0, save_total_limit=None)
    doc["training"]["model"]["config"].update(n_layer=2, n_embd=64, n_head=2)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(doc))
    # --verbose: the Trainer's log dicts (the losses read below) are on the terminal too
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config), "--verbose"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=400, env={**os.environ})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    built = "partitioned (zero.Init)" if zero3_init else "whole"
    assert f"HFSCALE_TRAIN model built {built}" in r.stdout
    assert "HFSCALE_TRAIN done step=30" in r.stdout
    losses = [float(x) for x in re.findall(r"'loss': '([\d.]+)'", r.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses
    shards = tmp_path / "output" / "tiny_cpu" / "checkpoint-30" / "global_step30"
    assert sorted(p.name for p in shards.glob("*model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]  # ZeRO-3 layout
