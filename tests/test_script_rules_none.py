"""A plain script (training.pass_args: none): its own TrainingArguments flags against the YAML, its
steps against the hang watchdog, and its arguments as the YAML writes them."""

from __future__ import annotations

import re
import textwrap

import pytest

from hfscale.config.errors import ConfigError
from hfscale.launch.attempt.watchdog import Watchdog
from hfscale.launch.build import build_plan
from hfscale.launch.context import LaunchContext
from hfscale.launch.spec import HangWatch
from hfscale.render.deepspeed import deepspeed_config

from conftest import job_of, run_cli

CTX = LaunchContext.of("/work", "/py", "20261126-120000-abcdef", {})

PLAIN = """
    name: plain
    cluster: {nproc_per_node: 2}
    distributed: {backend: deepspeed, deepspeed: {stage: 2}}
    precision: "no"
    batch: {micro_batch_size: 4, gradient_accumulation_steps: 1}
    watchdog: {script_reports_steps: true}
    training:
      script: loop.py
      pass_args: none
      script_args: [--data, d.txt]
      max_steps: 20
      learning_rate: 1.0e-3
"""


def _with_args(*args: str, text: str = PLAIN) -> str:
    return text.replace("[--data, d.txt]", "[--data, d.txt, " + ", ".join(args) + "]")


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        job_of(text)
    return [str(p) for p in e.value.problems]


def test_batch_flags_that_disagree_with_the_deepspeed_json_are_errors():
    assert _problems(_with_args("--per_device_train_batch_size, 3", "--gradient-accumulation-steps=2")) == [
        "training.script_args[2] (line 11): --per_device_train_batch_size 3 disagrees with batch.micro_batch_size "
        "(line 6) (--per_device_train_batch_size 4), which the DeepSpeed JSON's train_micro_batch_size_per_gpu "
        "carries too: loop.py and the engine would train with different values; the YAML is the one place for it "
        "(remove it here, or change it there)",
        "training.script_args[4] (line 11): --gradient-accumulation-steps=2 disagrees with "
        "batch.gradient_accumulation_steps (line 6) (--gradient_accumulation_steps 1), which the DeepSpeed JSON's "
        "gradient_accumulation_steps carries too: loop.py and the engine would train with different values; the "
        "YAML is the one place for it (remove it here, or change it there)",
    ]


def test_a_value_only_the_script_reads_is_a_warning_naming_both_values():
    job = job_of(_with_args("--learning_rate, 2e-4", "--max_steps, '20'"))
    assert [str(w) for w in job.warnings] == [
        "training.script_args[2] (line 11): --learning_rate 2e-4 disagrees with training.learning_rate (line 13) "
        "(--learning_rate 0.001): with pass_args none loop.py trains with --learning_rate 2e-4, not with the YAML's "
        "value (which it sees only in $HFSCALE_CONFIG); make them agree",
    ]  # and no "gets no flags for" the two keys it does get (max_steps with the same value)
    plain = job_of(PLAIN)
    assert any("gets no flags for training.max_steps (line 12), training.learning_rate (line 13)" in str(w)
               for w in plain.warnings)


def test_flags_for_keys_the_yaml_leaves_unset_are_the_scripts_own():
    job = job_of(_with_args("--seed, '3'", "--weight_decay, '0.1'", "--output_dir, elsewhere"))
    assert not [w for w in job.warnings if w.path.startswith("training.script_args")]


def test_check_exits_2_for_the_batch_and_0_with_a_warning_for_the_rate(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(textwrap.dedent(_with_args("--per_device_train_batch_size, 3")))
    r = run_cli("check", str(cfg))
    assert r.returncode == 2 and "--per_device_train_batch_size 3 disagrees with batch.micro_batch_size" in r.stderr
    cfg.write_text(textwrap.dedent(_with_args("--learning_rate, 2e-4")))
    r = run_cli("check", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "warning: training.script_args[2] (line 11): --learning_rate 2e-4 disagrees with" in r.stderr


def test_arguments_after_dashes_for_a_plain_script(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(textwrap.dedent(PLAIN))
    r = run_cli("launch", str(cfg), "--dry-run", "--", "--per_device_train_batch_size", "8", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "arguments after --: --per_device_train_batch_size 8 disagrees with batch.micro_batch_size" in r.stderr
    r = run_cli("launch", str(cfg), "--dry-run", "--", "--learning_rate", "3e-4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert ("warning: arguments after --: --learning_rate 3e-4 disagrees with training.learning_rate (line 13) "
            "(--learning_rate 0.001)") in r.stderr
    assert "loop.py --data d.txt --learning_rate 3e-4" in r.stdout  # the script's own flag is passed on


def test_what_the_deepspeed_json_carries_follows_the_json_itself():
    """Each value named as carried by the DeepSpeed JSON is in the JSON hfscale renders, with the YAML's
    value; optimizer and scheduler parameters only when DeepSpeed owns them."""
    from hfscale.rules.script import _carried

    base = PLAIN.replace("deepspeed: {stage: 2}", "deepspeed: {stage: 2, optimizer: {type: AdamW}, "
                         "scheduler: {type: WarmupDecayLR}}")
    for text, extra in ((PLAIN, set()), (base, {"learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
                                                "adam_epsilon", "warmup_steps", "max_steps"})):
        job = job_of(text)
        carried = _carried(job)
        assert set(carried) == {"per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm",
                                "bf16", "fp16"} | extra
        ds = deepspeed_config(job)
        for name, where in carried.items():
            node = ds
            for part in re.fullmatch(r"the DeepSpeed JSON's ([\w.]+)", where)[1].split("."):
                node = node[part]
            assert node is not None, name
    lr = _problems(_with_args("--learning_rate, 2e-4", text=base))
    assert lr[0].startswith("training.script_args[2] (line 11): --learning_rate 2e-4 disagrees with "
                            "training.learning_rate (line 13) (--learning_rate 0.001), which the DeepSpeed JSON's "
                            "optimizer.params.lr carries too")


def test_ddp_carries_the_batch_geometry_and_the_precision():
    ddp = PLAIN.replace("distributed: {backend: deepspeed, deepspeed: {stage: 2}}", "distributed: {backend: ddp}")
    found = _problems(_with_args("--per_device_train_batch_size, 2", "--bf16", text=ddp))
    assert "which the batch geometry hfscale checks and sizes (global batch = micro x accumulation x world size) " \
           "carries too" in found[0]
    assert found[1].startswith("training.script_args[4] (line 11): --bf16 disagrees with precision (line 5) "
                               "(--bf16 false), which the accelerate config's mixed_precision carries too")
    clipped = ddp.replace('precision: "no"', 'precision: "no"\n    gradient_clipping: 1.0')
    job = job_of(_with_args("--max_grad_norm, '0.5'", text=clipped))  # under DDP the script clips by itself
    assert [str(w) for w in job.warnings if w.path.startswith("training.script_args")] == [
        "training.script_args[2] (line 12): --max_grad_norm 0.5 disagrees with gradient_clipping (line 6) "
        "(--max_grad_norm 1.0): with pass_args none loop.py trains with --max_grad_norm 0.5, not with the YAML's "
        "value (which it sees only in $HFSCALE_CONFIG); make them agree"]


# --- the hang watchdog and a plain script's steps


def test_first_step_without_reported_steps_is_refused_and_says_the_line_to_add():
    text = PLAIN.replace("watchdog: {script_reports_steps: true}", "watchdog: {first_step: 8}")
    assert _problems(text) == [
        "watchdog.first_step (line 7): loop.py runs with training.pass_args none, so hfscale sees its steps only "
        "if it reports them: the watchdog would stop the job after 8 s as 'never finished a step', healthy or not. "
        "In loop.py, add `import hfscale` and `hfscale.step(n)` after each optimizer step (n: the step "
        "number; a Trainer: trainer.add_callback(hfscale.ProgressCallback())), then set "
        "watchdog.script_reports_steps: true; or remove watchdog.first_step"]
    ok = job_of(PLAIN.replace("{script_reports_steps: true}", "{first_step: 8, script_reports_steps: true}"))
    assert not [w for w in ok.warnings if w.path.startswith("watchdog")]
    k8s = text.replace("cluster: {nproc_per_node: 2}", "cluster: {nproc_per_node: 2}\n"
                       "    runner: {type: kubernetes, kubernetes: {image: 'i:1'}}")
    assert job_of(k8s).config.watchdog.first_step == 8  # not watched: nothing to refuse


def test_timeout_without_reported_steps_is_a_warning_and_the_acknowledgement_is_for_plain_scripts_only():
    job = job_of(PLAIN.replace("    watchdog: {script_reports_steps: true}\n", "    watchdog: {timeout: 300}\n"))
    assert [w.path for w in job.warnings if w.path.startswith("watchdog")] == ["watchdog.timeout"]
    unset = job_of(PLAIN.replace("    watchdog: {script_reports_steps: true}\n", ""))  # not the YAML's: no warning
    assert [w.path for w in unset.warnings if w.path.startswith("watchdog")] == []
    trainer = PLAIN.replace("      pass_args: none\n", "").replace(", --data, d.txt]", "]")
    assert _problems(trainer) == [
        "watchdog.script_reports_steps (line 7): only with training.pass_args: none (hfscale adds "
        "hfscale.ProgressCallback to a Trainer script's Trainer and to the built-in entry point's)"]


def test_the_rules_match_how_the_watchdog_judges_a_job_that_reports_nothing(tmp_path):
    """first_step counts from the start: a job that never reports is stopped; the timeout counts from
    the first reported step: such a job is never judged (so a timeout alone is a warning)."""
    (tmp_path / "progress").mkdir()

    def watch(timeout: int, first_step: int | None) -> HangWatch:
        return HangWatch(str(tmp_path / "progress"), str(tmp_path / "stacks"), str(tmp_path / "r.txt"), timeout,
                     first_step, 2)

    assert Watchdog(watch(5, 8), now=0).poll(8) == "no rank finished a step in the first 8 s"
    assert Watchdog(watch(5, None), now=0).poll(10_000) is None


def test_checks_summary_claims_no_watchdog_a_plain_script_cannot_feed():
    from hfscale.cli.check_summary import summary

    def line(text: str) -> str:
        return next(x for x in summary(job_of(text)).splitlines() if x.startswith("  watchdog"))

    silent = PLAIN.replace("    watchdog: {script_reports_steps: true}\n", "")
    assert line(silent) == (
        "  watchdog     idle: loop.py reports no steps (pass_args: none), and the watchdog counts from the first one "
        "(hfscale.step(n) in the script, then watchdog.script_reports_steps: true)")
    assert line(PLAIN) == ("  watchdog     no step for 600 s: every rank's stack, the stuck rank named, the job "
                           "stopped (exit 4)")
    assert line(silent.replace("pass_args: none", "pass_args: trainer").replace(", --data, d.txt]", "]")) == \
        line(PLAIN)  # a Trainer script: hfscale adds the callback that reports


# --- numbers as written


def test_unquoted_numbers_reach_the_script_as_written():
    text = _with_args("--lr, 1.0e-3", "--eps, 2e+5", "--frac, 0.0010", "--id, 007", "--hex, 0x10", "--rate, 1e-3",
                      "--n, 3")
    text = text.replace("    training:", "    env: {vars: {NCCL_IB_TIMEOUT: 022, RATIO: 0.50}}\n    training:")
    job = job_of(text)
    assert job.config.training.script_args == ("--data", "d.txt", "--lr", "1.0e-3", "--eps", "2e+5", "--frac",
                                               "0.0010", "--id", "007", "--hex", "0x10", "--rate", "1e-3", "--n", "3")
    assert dict(job.config.env.vars) == {"NCCL_IB_TIMEOUT": "022", "RATIO": "0.50"}  # not 18 (octal) and 0.5
    argv = build_plan(job, CTX).nodes[0].command.items
    assert argv[argv.index("loop.py"):][-14:] == ("--lr", "1.0e-3", "--eps", "2e+5", "--frac", "0.0010", "--id", "007",
                                                  "--hex", "0x10", "--rate", "1e-3", "--n", "3")
    assert job.config.training.learning_rate == 1e-3  # a number where the config wants one


def test_the_run_directorys_config_copy_keeps_the_text():
    """The resolved copy a script reads through $HFSCALE_CONFIG gives the same words back."""
    from hfscale.launch.build import resolved_config_yaml

    job = job_of(_with_args("--lr, 1.0e-3", "--id, 007"))
    again = job_of(resolved_config_yaml(job))
    assert again.config.training.script_args == job.config.training.script_args == (
        "--data", "d.txt", "--lr", "1.0e-3", "--id", "007")


def test_an_alias_shared_with_another_key_is_left_intact():
    from hfscale.config.yaml_source import parse

    doc, problems = parse("name: x\nlr: &lr 1.0e-3\ntraining: {script_args: [--lr, *lr], learning_rate: *lr}\n")
    assert not problems
    assert doc.data["lr"] == 1e-3 and doc.data["training"]["learning_rate"] == 1e-3
    assert doc.data["training"]["script_args"] == ["--lr", "1.0e-3"]
