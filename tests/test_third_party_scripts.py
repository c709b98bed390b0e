"""Scripts nobody here wrote, run unchanged (tests/scripts/third_party, sources in SOURCES.md there)
through the real ``hfscale launch`` on 2 CPU ranks with DeepSpeed:

- TRL's ``sft.py`` loads its model with ``from_pretrained``: under ZeRO-3 that happens inside
  ``deepspeed.zero.Init``, whose DeepSpeedConfig reads the world size from DeepSpeed's communication
  layer (hfscale.training.run_script joins it first on the CPU); a relaunch resumes; ZeRO-2 trains too; a
  conflicting ``--learning_rate`` in training.script_args is refused naming both places;
- transformers' ``run_clm.py`` with ``--model_name_or_path`` and ``--train_file`` under ZeRO-3;
- accelerate's ``deepspeed_with_config_support.py`` (``pass_args: none``) trains as one group of 2,
  each rank on its own part of the data (accelerate picks no backend on the CPU by itself), under
  DeepSpeed, and as DDP (MULTI_CPU) under accelerate launch and torchrun; an FSDP job without GPUs
  is refused before the script runs (accelerate has no FSDP on the CPU).

Nothing is downloaded: the scripts get a tiny GPT-2 and a byte-level BPE tokenizer written with
``save_pretrained``, and generated data, through their own flags. About 40 s per launch on 2 cores."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from hfscale.training.run_script import FSDP_ON_CPU, joins_group_first, plain_mode

from conftest import ROOT

THIRD_PARTY = ROOT / "tests" / "scripts" / "third_party"
SFT = THIRD_PARTY / "huggingface__trl" / "trl" / "scripts" / "sft.py"
RUN_CLM = THIRD_PARTY / "huggingface__transformers" / "examples" / "pytorch" / "language-modeling" / "run_clm.py"
ACCELERATE_LOOP = THIRD_PARTY / "huggingface__accelerate" / "examples" / "by_feature" / \
    "deepspeed_with_config_support.py"
WORDS = "the model trains on two ranks with zero stage three and a tiny vocabulary of words".split()
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """``model/`` (a tiny GPT-2 and its tokenizer, from save_pretrained), ``data/train.jsonl`` (a
    dataset folder: ``{"text": ...}`` lines) and ``train.txt`` (the same texts, one a line)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("third_party")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    end = "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=end, bos_token=end, unk_token=end,
                                        pad_token=end, model_max_length=64)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (root / "train.txt").write_text("\n".join(texts) + "\n")
    return root


def write_config(tmp_path: Path, port: int, script: Path, script_args: list[str], stage: int = 2,
                 **training) -> Path:
    doc = {
        "name": "thirdparty",
        "cluster": {"nproc_per_node": 2, "master_port": port},
        "runner": {"launcher": "accelerate"},
        "distributed": {"backend": "deepspeed", "deepspeed": {"stage": stage, "steps_per_print": 100000}},
        "precision": "no",
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        "training": {"script": str(script), "script_args": script_args, **training},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def trainer_config(tmp_path: Path, port: int, script: Path, script_args: list[str], stage: int,
                   max_steps: int) -> Path:
    return write_config(tmp_path, port, script, [*script_args, "--disable_tqdm", "true"], stage, output_dir="out",
                        max_steps=max_steps, save_steps=max_steps, logging_steps=2, learning_rate=1.0e-3, seed=7)


def launch(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=config.parent,
                          capture_output=True, text=True, timeout=400)


def ok(r: subprocess.CompletedProcess, tmp_path: Path) -> str:
    """Every line the ranks printed (the newest run's log: the terminal leaves library logs out),
    once the launch is known to have succeeded."""
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
    newest = sorted((tmp_path / "runs").glob("thirdparty-*"))[-1]
    out = "".join(p.read_text() for p in sorted((newest / "logs").glob("*.log")))
    assert "train_batch_size is not equal" not in out
    return out


def shards(checkpoint: Path, step: int) -> list[str]:
    return sorted(p.name for p in (checkpoint / f"global_step{step}").iterdir())


ZERO3_SHARDS = ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def sft_args(assets: Path) -> list[str]:
    return ["--model_name_or_path", str(assets / "model"), "--dataset_name", str(assets / "data"),
            "--max_length", "64"]


@pytest.mark.slow
def test_trl_sft_loads_its_model_under_zero3_and_a_relaunch_resumes(tmp_path, assets):
    out = ok(launch(trainer_config(tmp_path, 29741, SFT, sft_args(assets), stage=3, max_steps=4)), tmp_path)
    assert "Training completed" in out
    assert shards(tmp_path / "out" / "checkpoint-4", 4) == ZERO3_SHARDS  # every rank holds a part of the model

    r = launch(trainer_config(tmp_path, 29741, SFT, sft_args(assets), stage=3, max_steps=6))
    ok(r, tmp_path)
    assert "hfscale: resuming from out/checkpoint-4" in r.stdout
    state = json.loads((tmp_path / "out" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [2, 4, 6]  # no step trained twice
    assert shards(tmp_path / "out" / "checkpoint-6", 6) == ZERO3_SHARDS


@pytest.mark.slow
def test_trl_sft_trains_under_zero2_and_refuses_a_second_learning_rate(tmp_path, assets):
    conflicting = trainer_config(tmp_path, 29742, SFT, [*sft_args(assets), "--learning_rate", "5e-5"], stage=2,
                                 max_steps=4)
    r = launch(conflicting)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "training.script_args[6] (line " in r.stderr
    assert "--learning_rate 5e-5 disagrees with training.learning_rate (line " in r.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()  # nothing started

    out = ok(launch(trainer_config(tmp_path, 29742, SFT, sft_args(assets), stage=2, max_steps=4)), tmp_path)
    assert "Training completed" in out
    # ZeRO-2: the model whole in one file, the optimizer state split over the two ranks
    assert shards(tmp_path / "out" / "checkpoint-4", 4) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


@pytest.mark.slow
def test_transformers_run_clm_loads_its_model_under_zero3(tmp_path, assets):
    args = ["--model_name_or_path", str(assets / "model"), "--train_file", str(assets / "train.txt"), "--do_train",
            "--block_size", "32"]
    out = ok(launch(trainer_config(tmp_path, 29743, RUN_CLM, args, stage=3, max_steps=4)), tmp_path)
    assert "Detected DeepSpeed ZeRO-3: activating zero.init() for this model" in out
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    assert results["train_loss"] > 0
    assert shards(tmp_path / "out" / "checkpoint-4", 4) == ZERO3_SHARDS


def loop_config(tmp_path: Path, port: int, assets: Path, backend: str = "deepspeed",
                launcher: str = "accelerate") -> Path:
    """accelerate's loop script (pass_args none), one epoch of the generated text, 2 examples a batch."""
    args = ["--model_name_or_path", str(assets / "model"), "--train_file", str(assets / "train.txt"),
            "--block_size", "32", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
            "--num_train_epochs", "1", "--output_dir", "out", "--seed", "1"]
    path = write_config(tmp_path, port, ACCELERATE_LOOP, args, stage=2, pass_args="none")
    doc = yaml.safe_load(path.read_text())
    doc["runner"]["launcher"] = launcher
    if backend != "deepspeed":
        doc["distributed"] = {"backend": backend}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def assert_one_group_of_two(out: str, tmp_path: Path, distributed_type: str) -> None:
    for rank in (0, 1):  # accelerate's state, printed by every rank
        assert (f"[RANK {rank}] Distributed environment: DistributedType.{distributed_type}  Backend: gloo\n"
                f"Num processes: 2\nProcess index: {rank}\n") in out
    assert "Num processes: 1" not in out
    # each rank its own part of the data: one epoch of N examples is N / (2 per batch x 2 ranks) steps
    examples = int(out.split("Num examples = ", 1)[1].split()[0])
    assert f"Total optimization steps = {math.ceil(examples / 4)}\n" in out
    assert "Total train batch size (w. parallel, distributed & accumulation) = 4\n" in out
    # the evaluation gathers every rank's losses (with ranks on their own, gloo's allgather failed there)
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert math.isfinite(results["perplexity"]) and results["eval_loss"] > 0


@pytest.mark.slow
def test_an_unchanged_accelerate_loop_trains_as_one_group_of_two(tmp_path, assets):
    out = ok(launch(loop_config(tmp_path, 29744, assets)), tmp_path)
    assert_one_group_of_two(out, tmp_path, "DEEPSPEED")


@pytest.mark.slow
@pytest.mark.parametrize("backend, launcher", [("ddp", "accelerate"), ("ddp", "torchrun"), ("deepspeed", "torchrun")])
def test_an_unchanged_accelerate_loop_trains_ddp_as_one_group_of_two(tmp_path, assets, backend, launcher):
    """Without GPUs accelerate counts each rank alone unless told to use the CPU: the rank sets
    ACCELERATE_USE_CPU, and the script's Accelerator takes MULTI_CPU (DDP over gloo). Under torchrun
    the Accelerator reads no accelerate config, so a DeepSpeed job trains DDP too (check warns)."""
    port = {"accelerate": 29745, "torchrun": 29746}[launcher] + (2 if backend == "deepspeed" else 0)
    out = ok(launch(loop_config(tmp_path, port, assets, backend, launcher)), tmp_path)
    assert_one_group_of_two(out, tmp_path, "MULTI_CPU")


@pytest.mark.slow
def test_an_accelerate_loop_under_fsdp_without_a_gpu_is_refused_before_it_runs(tmp_path, assets):
    """accelerate has no FSDP on the CPU (it drops the plugin): the ranks stop before the script."""
    r = launch(loop_config(tmp_path, 29749, assets, "fsdp", "accelerate"))
    assert r.returncode != 0
    assert FSDP_ON_CPU in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Distributed environment" not in r.stdout + r.stderr and not (tmp_path / "out").exists()


def test_which_ranks_join_the_process_group_before_the_script():
    ds = ["--deepspeed", "ds.json"]
    assert joins_group_first([*ds, "--use_cpu", "true"], {"WORLD_SIZE": "2"})
    assert joins_group_first([*ds, "--use_cpu"], {"WORLD_SIZE": "2"})
    assert not joins_group_first([*ds, "--use_cpu", "true"], {"WORLD_SIZE": "1"})  # one process: no group
    assert not joins_group_first([*ds, "--use_cpu", "false"], {"WORLD_SIZE": "2"})  # a GPU: accelerate does it
    assert not joins_group_first(["--use_cpu", "true"], {"WORLD_SIZE": "2"})  # no DeepSpeed
    launched = {"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2", **NO_GPU}
    assert plain_mode(launched) == "deepspeed"
    assert plain_mode({**launched, "WORLD_SIZE": "1"}) != "deepspeed"
    assert plain_mode({**launched, "ACCELERATE_USE_DEEPSPEED": "false"}) != "deepspeed"  # torchrun, DDP
    assert plain_mode({**launched, "ACCELERATE_USE_CPU": "true"}) != "deepspeed"  # accelerate's own CPU mode
    # a plain script's rank: what accelerate needs so that it counts every rank
    two = {"WORLD_SIZE": "2", **NO_GPU}
    assert plain_mode(launched) == "deepspeed"
    assert plain_mode({**two, "ACCELERATE_USE_CPU": "False"}) == "cpu"  # accelerate launch, DDP config
    assert plain_mode(two) == "cpu"  # torchrun: no accelerate variables at all
    assert plain_mode({**two, "ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_CPU": "False"}) == "fsdp"
    assert plain_mode({**two, "ACCELERATE_USE_CPU": "true"}) is None  # told to use the CPU already
    assert plain_mode({**two, "WORLD_SIZE": "1"}) is None


def _run_script(tmp_path: Path, text: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(text))
    return subprocess.run([sys.executable, "-m", "hfscale.training.run_script", *args[:1], str(script), *args[1:]],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, **NO_GPU, **(env or {})})


def test_a_plain_script_gets_its_own_arguments_only(tmp_path):
    r = _run_script(tmp_path, "import sys; print('ARGV', sys.argv[1:])", "--plain", "--output_dir", "out", "--x")
    assert r.returncode == 0, r.stderr
    assert "ARGV ['--output_dir', 'out', '--x']" in r.stdout  # no --use_cpu, no resume decision


def test_a_plain_rank_without_a_gpu_tells_accelerate_to_use_the_cpu(tmp_path):
    r = _run_script(tmp_path, "import os; print('CPU', os.environ.get('ACCELERATE_USE_CPU'))", "--plain",
                    env={"WORLD_SIZE": "2", "RANK": "0", "ACCELERATE_USE_CPU": "False"})
    assert r.returncode == 0, r.stderr
    assert "CPU true" in r.stdout


def test_a_plain_rank_under_accelerates_fsdp_without_a_gpu_stops_before_the_script(tmp_path):
    r = _run_script(tmp_path, "print('RAN')", "--plain",
                    env={"WORLD_SIZE": "2", "RANK": "0", "ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_CPU": "False"})
    assert r.returncode == 2 and "RAN" not in r.stdout
    assert FSDP_ON_CPU in r.stderr


def test_a_plain_rank_that_accelerate_counted_alone_fails(tmp_path):
    """The guard behind plain_mode: a script whose first PartialState() is not told to use the CPU
    counts one process; the rank says so and exits 1 instead of passing."""
    r = _run_script(tmp_path, """
        from accelerate import PartialState
        print("COUNTED", PartialState().num_processes)
    """, "--plain", env={"WORLD_SIZE": "2", "RANK": "0"})
    assert "COUNTED 1" in r.stdout
    assert r.returncode == 1
    assert "hfscale: accelerate counted 1 process(es) but the job started WORLD_SIZE 2" in r.stderr


def test_deepspeeds_batch_assertion_says_which_world_size_it_read(tmp_path):
    # a DeepSpeedConfig built before DeepSpeed's communication layer, as zero.Init does in from_pretrained
    r = _run_script(tmp_path, """
        from deepspeed.runtime.config import DeepSpeedConfig
        DeepSpeedConfig({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1})
    """, env={"WORLD_SIZE": "2", "RANK": "0"})
    assert r.returncode == 1
    assert "AssertionError: Check batch related parameters" in r.stderr and "4 != 2 * 1 * 1" in r.stderr
    assert ("hfscale: DeepSpeed compared train_batch_size in its config with micro batch x accumulation x the world "
            "size it read from its communication layer (1); this job has WORLD_SIZE 2") in r.stderr
