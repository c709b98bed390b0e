"""What reaches a user's training script: the TrainingArguments flags the YAML determines, conflicts
with script_args and `-- ARGS` refused with both places named, warnings for what a script will not
receive, and the final argv in the plan (local, Kubernetes, Slurm)."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from hfscale.config.errors import ConfigError
from hfscale.launch.build import build_plan
from hfscale.launch.context import LaunchContext
from hfscale.launch.runners.kubernetes_manifest import launcher_command
from hfscale.rules.trainer_args import (
    TrainerArg,
    given_flags,
    same_value,
    trainer_args,
    trainer_flags,
    training_arguments_kwargs,
)

from conftest import job_of, run_cli

JOB_ID = "20261123-120000-abcdef"
CTX = LaunchContext.of("/work", "/py", JOB_ID, {})
RUN = f"/work/runs/sft-{JOB_ID}"

SFT = """
    name: sft
    cluster: {nproc_per_node: 2}
    distributed: {backend: deepspeed, deepspeed: {stage: 2}}
    precision: bf16
    batch: {micro_batch_size: 4, global_batch_size: 32}
    gradient_clipping: 0.5
    training:
      script: run_clm.py
      script_args: [--model_name_or_path, ./tiny, --train_file, data.txt]
      output_dir: out/sft
      max_steps: 200
      learning_rate: 2.0e-5
      weight_decay: 0.1
      lr_scheduler_type: cosine
      warmup_steps: 20
      seed: 7
      logging_steps: 5
      save_steps: 50
      save_total_limit: 2
      report_to: [tensorboard]
"""

FLAGS = [
    "--output_dir", "out/sft", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4",
    "--max_steps", "200", "--num_train_epochs", "1.0", "--learning_rate", "2e-05", "--weight_decay", "0.1",
    "--adam_beta1", "0.9", "--adam_beta2", "0.999", "--adam_epsilon", "1e-08", "--lr_scheduler_type", "cosine",
    "--warmup_steps", "20", "--seed", "7", "--logging_steps", "5", "--save_strategy", "steps", "--save_steps", "50",
    "--save_total_limit", "2", "--report_to", "tensorboard", "--bf16", "true", "--fp16", "false",
    "--max_grad_norm", "0.5", "--deepspeed", f"{RUN}/ds_config.json",
]


def test_flags_exact():
    job = job_of(SFT)
    assert trainer_flags(trainer_args(job, f"{RUN}/ds_config.json")) == FLAGS


def test_gradient_checkpointing_is_passed_only_when_on_and_a_scripts_own_flag_is_a_conflict():
    on = job_of(SFT.replace("      seed: 7", "      seed: 7\n      gradient_checkpointing: true"))
    flags = trainer_flags(trainer_args(on, f"{RUN}/ds_config.json"))
    assert flags[flags.index("--gradient_checkpointing") + 1] == "true"
    assert training_arguments_kwargs(on)["gradient_checkpointing"] is True
    assert "gradient_checkpointing" not in training_arguments_kwargs(job_of(SFT))
    with pytest.raises(ConfigError) as e:
        job_of(SFT.replace("--train_file, data.txt]", "--train_file, data.txt, --gradient_checkpointing]"))
    assert "--gradient_checkpointing disagrees with training.gradient_checkpointing, not set in the YAML" in str(e.value)


def test_hf_argument_parser_reads_the_flags_as_the_kwargs_the_built_in_entry_point_uses():
    """The real consumer: transformers' own parser turns the flags into the same TrainingArguments
    values as the keyword arguments (one table behind both)."""
    from transformers import HfArgumentParser, TrainingArguments

    job = job_of(SFT.replace("precision: bf16", 'precision: "no"').replace("      seed: 7", "      seed: 7\n      gradient_checkpointing: true"))
    kw = training_arguments_kwargs(job, None)
    assert "deepspeed" not in kw  # no file given: left out, as trainer_flags leaves it off the command line
    flags = trainer_flags([a for a in trainer_args(job, None) if a.name != "deepspeed"])
    fields = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    parser = HfArgumentParser(TrainingArguments)
    ns, _ = parser.parse_known_args(flags)  # the namespace before TrainingArguments' own __post_init__
    for name, value in kw.items():
        assert name in fields, name
        parsed = getattr(ns, name)
        parsed = [parsed] if name == "report_to" and isinstance(parsed, str) else parsed
        assert parsed == value or str(parsed) == str(value), (name, parsed, value)


def test_given_flags_reads_every_form():
    words = ["--model_name_or_path", "m", "--learning-rate=3e-4", "--max_steps", "-1", "--bf16", "--seed", "9",
             "pos", "--report_to", "wandb"]
    got = {(g.name, g.words, g.index) for g in given_flags(words, {"learning_rate", "max_steps", "bf16", "seed",
                                                                   "report_to"})}
    assert got == {("learning_rate", ("3e-4",), 2), ("max_steps", ("-1",), 3), ("bf16", (), 5),
                   ("seed", ("9", "pos"), 6), ("report_to", ("wandb",), 9)}


@pytest.mark.parametrize("value,words,same", [
    (1e-3, ("1e-3",), True), (1e-3, ("0.001",), True), (1e-3, ("0.002",), False), (4, ("4",), True),
    (4, ("4.0",), True), (4, ("4.5",), False), (4, ("four",), False), (True, (), True), (True, ("yes",), True),
    (False, ("0",), True), (False, ("true",), False), ("cosine", ("COSINE",), True), (["none"], ("none",), True),
    (["none"], ("wandb",), False), (None, ("3",), False), ("out/x", ("out/./x",), True),
])
def test_same_value(value, words, same):
    name = "output_dir" if value == "out/x" else "lr_scheduler_type" if value == "cosine" else "x"
    assert same_value(TrainerArg(name, value, ("training", name)), words) is same


def test_same_value_in_script_args_is_fine_and_not_repeated():
    job = job_of(SFT.replace("--train_file, data.txt]", "--train_file, data.txt, --learning_rate, '0.00002']"))
    plan = build_plan(job, CTX)
    argv = list(plan.nodes[0].command.items)  # the launcher (main is a shell that starts the keeper, then execs it)
    assert argv.count("--learning_rate") == 1 and argv[argv.index("--learning_rate") + 1] == "0.00002"


def test_dry_run_shows_the_final_argv_of_the_script():
    plan = build_plan(job_of(SFT), LaunchContext.of("/work", "/py", JOB_ID, {}, ["--trust_remote_code"]))
    assert plan.nodes[0].command.items == (
        "/py", "-m", "hfscale.training.warm_launcher", "--preload", "trainer,deepspeed",
        "accelerate.commands.launch", "--config_file", f"{RUN}/accelerate_config.yaml",
        "--module", "hfscale.training.run_script", "run_clm.py", "--model_name_or_path", "./tiny", "--train_file", "data.txt",
        *FLAGS, "--trust_remote_code",
    )
    assert f"run_clm.py --model_name_or_path ./tiny --train_file data.txt {' '.join(FLAGS)} --trust_remote_code" \
        in plan.render()


def test_torchrun_passes_deepspeed_to_a_trainer_script():
    job = job_of(SFT.replace("cluster: {nproc_per_node: 2}", "cluster: {nproc_per_node: 2}\n    runner: {launcher: torchrun}"))
    argv = build_plan(job, CTX).nodes[0].command.items
    assert argv[:11] == ("/py", "-m", "hfscale.training.warm_launcher", "--preload", "trainer,deepspeed",
                         "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--node_rank")
    assert argv[argv.index("-m", 3):argv.index("-m", 3) + 3] == ("-m", "hfscale.training.run_script", "run_clm.py")
    assert argv[-2:] == ("--deepspeed", f"{RUN}/ds_config.json")


def test_kubernetes_container_gets_the_flags_with_the_configmap_paths():
    job = job_of(SFT.replace("cluster: {nproc_per_node: 2}", "cluster: {nproc_per_node: 2}\n"
                             "    runner: {type: kubernetes, kubernetes: {image: 'train:1'}}"))
    cmd = launcher_command(job, CTX)
    assert cmd[:10] == ["python", "-m", "hfscale.training.warm_launcher", "--preload", "trainer,deepspeed",
                        "accelerate.commands.launch", "--config_file", "/etc/hfscale/accelerate_config.yaml", "--module",
                        "hfscale.training.run_script"]
    assert cmd[10:] == ["run_clm.py", "--model_name_or_path", "./tiny", "--train_file", "data.txt",
                       *FLAGS[:-1], "/etc/hfscale/ds_config.json"]


def test_slurm_node_line_runs_the_script_through_run_script():
    job = job_of(SFT.replace("cluster: {nproc_per_node: 2}", "cluster: {num_nodes: 2, nproc_per_node: 2}\n"
                             "    runner: {type: slurm}"))
    sbatch = dict(build_plan(job, CTX).files)["job.sbatch"]
    assert "--module hfscale.training.run_script run_clm.py --model_name_or_path ./tiny" in sbatch
    assert f"--deepspeed {RUN}/ds_config.json" in sbatch


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        job_of(text)
    return [str(p) for p in e.value.problems]


def test_script_args_conflicts_name_both_places_with_lines():
    text = SFT.replace("--train_file, data.txt]", "--train_file, data.txt, --learning_rate, '1e-3', --bf16,\n"
                       "                     --per-device-train-batch-size=8, --deepspeed, other.json]")
    assert _problems(text) == [
        "training.script_args[4] (line 10): --learning_rate 1e-3 disagrees with training.learning_rate (line 14) "
        "(--learning_rate 2e-05): the YAML is the one place for it (remove it here, or change it there)",
        "training.script_args[7] (line 11): --per-device-train-batch-size=8 disagrees with batch.micro_batch_size "
        "(line 6) (--per_device_train_batch_size 4): the YAML is the one place for it (remove it here, or change it "
        "there)",
        "training.script_args[8] (line 11): --deepspeed other.json: hfscale passes --deepspeed with the JSON it "
        "generates from distributed.deepspeed; a second one would replace it (set DeepSpeed options under "
        "distributed.deepspeed)",
    ]


def test_a_flag_for_a_default_value_points_to_the_key_to_set():
    text = SFT.replace("--train_file, data.txt]", "--train_file, data.txt, --adam_beta2, '0.95', --fp16]")
    assert _problems(text) == [
        "training.script_args[4] (line 10): --adam_beta2 0.95 disagrees with training.adam_beta2, not set in the "
        "YAML (--adam_beta2 0.999): set training.adam_beta2 there instead; the YAML is the one place for it",
        "training.script_args[6] (line 10): --fp16 disagrees with precision (line 5) (--fp16 false): the YAML is "
        "the one place for it (remove it here, or change it there)",
    ]


def test_check_refuses_a_conflict_with_exit_2(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(textwrap.dedent(SFT).replace("data.txt]", "data.txt, --max_steps, '10']"))
    r = run_cli("check", str(cfg))
    assert r.returncode == 2 and r.stdout == ""
    assert "training.script_args[4] (line 10): --max_steps 10 disagrees with training.max_steps (line 12)" in r.stderr
    assert "Traceback" not in r.stderr


def test_arguments_after_dashes_that_contradict_the_yaml_stop_the_launch(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(textwrap.dedent(SFT))
    for args in (["--dry-run"], []):
        r = run_cli("launch", str(cfg), *args, "--", "--max_steps", "5", "--seed=7", cwd=tmp_path)
        assert r.returncode == 2, r.stderr
        assert ("arguments after --: --max_steps 5 disagrees with training.max_steps (line 12) (--max_steps 200)"
                in r.stderr)
        assert "--seed" not in r.stderr  # the same value is fine
    assert not (tmp_path / "runs").exists()  # nothing was started or written


def test_built_in_entry_point_takes_no_script_arguments(tmp_path):
    assert _problems("name: b\nbatch: {micro_batch_size: 1}\ntraining: {script_args: [--x], pass_args: none}\n") == [
        "training.script_args (line 3): arguments for training.script; the built-in entry point takes its "
        "settings from this file only",
        "training.pass_args (line 3): only for training.script",
    ]
    cfg = tmp_path / "b.yaml"
    cfg.write_text("name: b\nbatch: {micro_batch_size: 1}\n")
    r = run_cli("launch", str(cfg), "--dry-run", "--", "--learning_rate", "1", cwd=tmp_path)
    assert r.returncode == 2 and "the built-in entry point takes no arguments" in r.stderr


def test_rules_a_script_cannot_honour():
    base = SFT.replace("deepspeed: {stage: 2}", "deepspeed: {stage: 3, zero3_init: false}")
    base = base.replace("report_to: [tensorboard]", "report_to: [tensorboard, wandb]")
    assert [p.split(":")[0] for p in _problems(base)] == ["distributed.deepspeed.zero3_init (line 4)",
                                                           "training.report_to (line 21)"]
    fsdp = SFT.replace("cluster: {nproc_per_node: 2}", "cluster: {nproc_per_node: 2}\n    runner: {launcher: torchrun}")
    fsdp = fsdp.replace("distributed: {backend: deepspeed, deepspeed: {stage: 2}}", "distributed: {backend: fsdp}")
    assert _problems(fsdp) == ["runner.launcher (line 4): torchrun gives a Trainer script no FSDP settings (they "
                               "live in the accelerate config, read under accelerate launch only): it would train "
                               "plain DDP; use launcher: accelerate"]
    builtin = "name: b\ndistributed: {deepspeed: {stage: 3, zero3_init: false}}\nbatch: {micro_batch_size: 1}\n"
    assert job_of(builtin).deepspeed.zero3_init is False  # the built-in entry point honours it


def test_warnings_say_what_a_script_will_not_receive():
    job = job_of(SFT + "      model: {config: {model_type: gpt2}}\n")
    assert [str(w) for w in job.warnings] == [
        "training.model (line 22): read only by the built-in entry point; run_clm.py builds its own model and "
        "data (pass its own flags, e.g. --model_name_or_path, in training.script_args)"]
    plain = job_of("name: p\nrunner: {launcher: torchrun}\nbatch: {micro_batch_size: 1}\n"
                   "training: {script: loop.py, pass_args: none, max_steps: 9, learning_rate: 0.1}\n")
    assert [str(w) for w in plain.warnings] == [
        "runner.launcher (line 2): torchrun: a plain script gets the deepspeed settings only by reading "
        "$HFSCALE_DS_CONFIG; an Accelerator reads them under accelerate launch only (else it trains DDP)",
        "training.pass_args (line 4): none: loop.py gets no flags for training.max_steps (line 4), "
        "training.learning_rate (line 4); it sees them only if it reads $HFSCALE_CONFIG (hfscale.load_job)",
    ]
    assert build_plan(plain, CTX).nodes[0].command.items[-1] == "loop.py"  # script_args only: none here


def test_a_watchdog_timeout_is_a_warning_only_where_the_yaml_sets_it():
    plain = "name: p\nbatch: {micro_batch_size: 1}\ntraining: {script: loop.py, pass_args: none}\n"
    assert [str(w) for w in job_of(plain).warnings] == []  # the default: check's summary says it idles
    timed = job_of(plain + "watchdog: {timeout: 300}\n")
    assert [str(w) for w in timed.warnings] == [
        "watchdog.timeout (line 4): the hang watchdog starts counting at the first step loop.py reports, so it watches "
        "nothing unless loop.py reports its steps: add `import hfscale` and `hfscale.step(n)` after each "
        "optimizer step (n: the step number; a Trainer: trainer.add_callback(hfscale.ProgressCallback())), "
        "then set watchdog.script_reports_steps: true (or set watchdog.timeout: null)",
    ]
    from hfscale.cli.check_summary import summary

    assert "watchdog     idle: loop.py reports no steps" in summary(job_of(plain))
    assert job_of(plain + "watchdog: {timeout: 300, script_reports_steps: true}\n").warnings == ()


ZERO3 = "name: z\nbatch: {micro_batch_size: 1}\ndistributed: {deepspeed: {stage: 3}}\n"


@pytest.mark.parametrize("training", ["{script: train.py}", "{script: train.py, pass_args: none}"])
def test_zero3_without_the_16bit_gather_says_a_script_saves_shards_and_names_export(training):
    job = job_of(ZERO3 + f"training: {training}\n")
    assert [str(w) for w in job.warnings] == [
        "distributed.deepspeed.gather_16bit_weights_on_model_save (line 3): false (DeepSpeed's default) under ZeRO-3: when "
        "train.py saves its model, the output holds only DeepSpeed's per-rank shards, no model file from_pretrained "
        "loads (the Trainer's save_model writes global_step*/ instead; accelerate's save_model and get_state_dict "
        "raise). Set it true to gather a 16-bit model at each save (TRL's ZeRO-3 config does), or make one from the "
        "newest checkpoint afterwards: hfscale export output --out MODEL_DIR"]
    written = job_of(ZERO3.replace("stage: 3", "stage: 3, gather_16bit_weights_on_model_save: false") +
                     f"training: {training[:-1]}, output_dir: 'my out'}}\n")
    said = [str(w) for w in written.warnings if str(w).startswith("distributed.")]
    assert [w.split(": ", 1)[1][:16] for w in said] == ["false under ZeRO"]  # the YAML's own false
    assert said[0].endswith("hfscale export 'my out' --out MODEL_DIR")
    gathered = ZERO3.replace("stage: 3", "stage: 3, gather_16bit_weights_on_model_save: true")
    assert job_of(gathered + f"training: {training}\n").warnings == ()
    assert job_of(ZERO3.replace("stage: 3", "stage: 2") + f"training: {training}\n").warnings == ()
    assert job_of(ZERO3).warnings == ()  # the built-in entry point saves checkpoints only: export reads them


def test_check_prints_warnings_on_stderr_and_the_entry(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(textwrap.dedent(SFT) + "  data: {block_size: 64}\n")
    r = run_cli("check", str(cfg))
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("warning: training.data (line 22): read only by the built-in entry point")
    assert "  entry        run_clm.py + 22 TrainingArguments flags from this file" in r.stdout


def test_a_checkpoint_named_by_hand_skips_the_launch_decision(tmp_path):
    from hfscale.checkpoints.resume import scan_output

    from test_checkpoint_files import trainer_checkpoint

    (trainer_checkpoint(tmp_path, 10) / "rng_state_1.pth").unlink()
    scan = scan_output(tmp_path, 2)
    job = job_of(SFT)
    with pytest.raises(ConfigError, match="none is complete"):
        build_plan(job, LaunchContext.of("/work", "/py", JOB_ID, {}, output=scan))
    chosen = LaunchContext.of("/work", "/py", JOB_ID, {}, ["--resume_from_checkpoint", "other/checkpoint-8"], scan)
    plan = build_plan(job, chosen)
    assert plan.mode == "stream" and plan.nodes[0].command.items[-2:] == ("--resume_from_checkpoint", "other/checkpoint-8")
