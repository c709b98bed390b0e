"""What reaches a user's training script, and the rules that keep it what ``hfscale check`` reports.

``training.pass_args: trainer`` (the default): the script is an HfArgumentParser /
TrainingArguments script (transformers' examples, TRL's). It runs as

    python -m hfscale.training.run_script SCRIPT [script_args] [flags from this YAML] [-- ARGS]

where the flags are ``hfscale.rules.trainer_args.trainer_flags`` (batch, steps, schedule, saving,
logging, precision, clipping, seed, output_dir, ``--deepspeed <generated JSON>``) and
``hfscale.training.run_script`` adds what only the rank can decide (``--use_cpu``, ``--resume_from_checkpoint``)
before it becomes the script. A flag the YAML determines may also appear in ``script_args`` or
after ``--`` only with the same value; another value is an error naming both places.

``training.pass_args: none``: a plain script (an accelerate loop) gets ``script_args`` and the
``HFSCALE_*`` variables only; ``check`` warns about every ``training`` value it will not receive.
A TrainingArguments flag in its ``script_args`` (or after ``--``) that disagrees with the YAML is an
error where the generated files carry the value too (the batch geometry, precision, clipping, and
what the DeepSpeed JSON's optimizer and scheduler hold: the script and the engine would disagree),
and a warning naming both values where only the script reads it (the script trains with its flag).
Its steps reach the hang watchdog only if it calls ``hfscale.step(n)``: without
``watchdog.script_reports_steps: true`` a ``watchdog.first_step`` is an error (it would stop the
healthy job) and a ``watchdog.timeout`` the YAML sets a warning (the watchdog waits for a first step that
never comes; left at its default, ``check``'s summary says the watchdog idles).

Under ZeRO-3 without ``gather_16bit_weights_on_model_save`` a script's own model save holds only
shards: a warning names ``hfscale export`` (the built-in entry point saves checkpoints only).

Pure: paths come back relative to the YAML (for ``Problem``), nothing is read or started here.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Sequence

from hfscale.config.errors import Problem
from hfscale.config.yaml_source import dotted
from hfscale.rules.trainer_args import GivenFlag, TrainerArg, flag_conflicts, given_flags, trainer_args, trainer_flags

if TYPE_CHECKING:  # job.py calls script_problems while it builds the Job
    from hfscale.rules.resolved import Job

SCRIPT_ENTRY = "hfscale.training.run_script"
PLAIN_FLAG = "--plain"  # SCRIPT_ENTRY's mode for a plain script (pass_args none): its own arguments only
EXTRA_ARGS = "arguments after --"
# What only the built-in entry point reads; a script builds its own model and data.
BUILTIN_ONLY = (("training", "model"), ("training", "data"), ("training", "peak_tflops"))
# check runs before there is a run directory; no --deepspeed a user writes can name the generated JSON
_UNKNOWN_DS_PATH = "<run directory>/ds_config.json"

Found = list[tuple[tuple, str]]


def _shown(a: TrainerArg) -> str:
    return " ".join(trainer_flags([a])) or f"no {a.flag}"


def _conflict_message(job: "Job", given: str, a: TrainerArg) -> str:
    if a.name == "deepspeed":
        if job.deepspeed is not None:
            return (f"{given}: hfscale passes --deepspeed with the JSON it generates from distributed.deepspeed; "
                    "a second one would replace it (set DeepSpeed options under distributed.deepspeed)")
        return (f"{given}: distributed.backend is {job.config.distributed.backend!r}; --deepspeed would train "
                "with DeepSpeed instead (set distributed.backend: deepspeed)")
    if not job.is_set(a.source):
        return (f"{given} disagrees with {dotted(a.source)}, not set in the YAML ({_shown(a)}): set "
                f"{dotted(a.source)} there instead; the YAML is the one place for it")
    return (f"{given} disagrees with {job.where(a.source)} ({_shown(a)}): the YAML is the one place for it "
            "(remove it here, or change it there)")


def script_problems(job: "Job") -> tuple[Found, Found]:
    """(problems, warnings) about what the training script receives, as (YAML path, message)."""
    cfg = job.config
    t = cfg.training
    problems: Found = []
    warnings: Found = []
    if cfg.watchdog.script_reports_steps and (t.script is None or t.pass_args != "none"):
        problems.append((("watchdog", "script_reports_steps"),
                         "only with training.pass_args: none (hfscale adds hfscale.ProgressCallback to a "
                         "Trainer script's Trainer and to the built-in entry point's)"))
    if t.script is None:
        if t.script_args:
            problems.append((("training", "script_args"), "arguments for training.script; the built-in entry "
                                                          "point takes its settings from this file only"))
        if t.pass_args != "trainer":
            problems.append((("training", "pass_args"), "only for training.script"))
        return problems, warnings
    ds = job.deepspeed
    if ds is not None and ds.stage == 3 and not ds.zero3_init:
        problems.append((("distributed", "deepspeed", "zero3_init"),
                         "false is honoured by the built-in entry point only: transformers builds a script's model "
                         "with deepspeed.zero.Init whenever its TrainingArguments or Accelerator name a stage-3 "
                         "config; remove it, or leave training.script null"))
    if ds is not None and ds.stage == 3 and not ds.gather_16bit_weights_on_model_save:
        warnings.append((("distributed", "deepspeed", "gather_16bit_weights_on_model_save"), _shards_only(job)))
    builtin = [p for p in BUILTIN_ONLY if job.is_set(p)]
    if t.pass_args == "none":
        errors, notes = plain_conflicts(job, t.script_args)
        problems += [(("training", "script_args", g.index), m) for g, m in errors]
        warnings += [(("training", "script_args", g.index), m) for g, m in notes]
        given = {g.name for g in given_flags(t.script_args, {a.name for a in trainer_args(job, None)})}
        sent = {a.source for a in trainer_args(job, None) if a.name in given}
        unsent = [a.source for a in trainer_args(job, None) if a.source[0] == "training" and a.source not in sent]
        named = [job.where(p) for p in dict.fromkeys(unsent + builtin) if job.is_set(p)]
        if named:
            warnings.append((("training", "pass_args"),
                             f"none: {t.script} gets no flags for {', '.join(named)}; it sees them only if it "
                             "reads $HFSCALE_CONFIG (hfscale.load_job)"))
        problems_w, warnings_w = _watchdog_rules(job)
        problems += problems_w
        warnings += warnings_w
        if cfg.runner.launcher == "torchrun" and cfg.distributed.backend in ("deepspeed", "fsdp"):
            what = "$HFSCALE_DS_CONFIG" if ds is not None else "$HFSCALE_RUN_DIR/accelerate_config.yaml"
            warnings.append((("runner", "launcher"),
                             f"torchrun: a plain script gets the {cfg.distributed.backend} settings only by reading "
                             f"{what}; an Accelerator reads them under accelerate launch only (else it trains DDP)"))
        return problems, warnings
    for path in builtin:
        if path == ("training", "peak_tflops"):  # MFU's figure: hfscale.instrument(trainer) reads it too
            warnings.append((path, f"read by the built-in entry point and hfscale.instrument(trainer) only: {t.script} "
                                   "gets it if it adds the callbacks with hfscale.instrument"))
            continue
        warnings.append((path, f"read only by the built-in entry point; {t.script} builds its own model and data "
                               "(pass its own flags, e.g. --model_name_or_path, in training.script_args)"))
    if len(t.report_to) > 1:
        problems.append((("training", "report_to"), "a script's command line takes one --report_to value "
                                                    "(TrainingArguments parses a single word): name one logger, or "
                                                    "'all'"))
    if cfg.runner.launcher == "torchrun" and cfg.distributed.backend == "fsdp":
        problems.append((("runner", "launcher"), "torchrun gives a Trainer script no FSDP settings (they live in the "
                                                 "accelerate config, read under accelerate launch only): it would "
                                                 "train plain DDP; use launcher: accelerate"))
    conflicts, _ = flag_conflicts(trainer_args(job, _UNKNOWN_DS_PATH), t.script_args)
    for given, a in conflicts:
        problems.append((("training", "script_args", given.index), _conflict_message(job, given.text, a)))
    return problems, warnings


_STEP_LINE = ("add `import hfscale` and `hfscale.step(n)` after each optimizer step (n: the step "
              "number; a Trainer: trainer.add_callback(hfscale.ProgressCallback())), then set "
              "watchdog.script_reports_steps: true")


def _shards_only(job: "Job") -> str:
    """What a script's own model save holds under ZeRO-3 without the 16-bit gather (transformers'
    Trainer.save_model catches accelerate's ValueError and writes model_wrapped.save_checkpoint;
    accelerate's save_model and get_state_dict raise it)."""
    said = "false" if job.is_set(("distributed", "deepspeed", "gather_16bit_weights_on_model_save")) else \
        "false (DeepSpeed's default)"
    return (f"{said} under ZeRO-3: when {job.config.training.script} saves its model, the output holds only "
            "DeepSpeed's per-rank shards, no model file from_pretrained loads (the Trainer's save_model writes "
            "global_step*/ instead; accelerate's save_model and get_state_dict raise). Set it true to gather a 16-bit "
            "model at each save (TRL's ZeRO-3 config does), or make one from the newest checkpoint afterwards: "
            f"hfscale export {shlex.quote(job.config.training.output_dir)} --out MODEL_DIR")


def _watchdog_rules(job: "Job") -> tuple[Found, Found]:
    """A plain script's steps reach the watchdog only through hfscale.training.heartbeat.step: hfscale.launch.attempt.watchdog
    counts watchdog.first_step from the start (a job that never reports is stopped as "never finished
    a step"), watchdog.timeout only from the first step reported (a job that never reports is never
    judged). Kubernetes jobs are not watched."""
    cfg, script = job.config, job.config.training.script
    w = cfg.watchdog
    if w.script_reports_steps or cfg.runner.type == "kubernetes":
        return [], []
    if w.first_step is not None:
        return [(("watchdog", "first_step"),
                 f"{script} runs with training.pass_args none, so hfscale sees its steps only if it reports them: "
                 f"the watchdog would stop the job after {w.first_step} s as 'never finished a step', healthy or "
                 f"not. In {script}, {_STEP_LINE}; or remove watchdog.first_step")], []
    if w.timeout is not None and job.is_set(("watchdog", "timeout")):  # the default: check's summary says it idles
        return [], [(("watchdog", "timeout"),
                     f"the hang watchdog starts counting at the first step {script} reports, so it watches nothing "
                     f"unless {script} reports its steps: {_STEP_LINE} (or set watchdog.timeout: null)")]
    return [], []


def _carried(job: "Job") -> dict[str, str]:
    """TrainingArguments names whose YAML value the generated files carry too, and where (as
    hfscale.render.deepspeed writes them): a plain script's own flag with another value makes the
    script and the engine disagree."""
    ds = job.deepspeed
    geometry = "the batch geometry hfscale checks and sizes (global batch = micro x accumulation x world size)"
    if ds is None:
        precision = "the accelerate config's mixed_precision"
        return {"per_device_train_batch_size": geometry, "gradient_accumulation_steps": geometry,
                "bf16": precision, "fp16": precision}
    json_ = "the DeepSpeed JSON's "
    out = {"per_device_train_batch_size": json_ + "train_micro_batch_size_per_gpu",
           "gradient_accumulation_steps": json_ + "gradient_accumulation_steps",
           "max_grad_norm": json_ + "gradient_clipping", "bf16": json_ + "bf16.enabled", "fp16": json_ + "fp16.enabled"}
    if job.config.precision == "fp8":  # no bf16/fp16 in the JSON: accelerate launch is given the precision
        out.update(bf16="accelerate launch's --mixed_precision fp8", fp16="accelerate launch's --mixed_precision fp8")
    if ds.optimizer is not None:  # render_deepspeed._optimizer
        out.update(learning_rate=json_ + "optimizer.params.lr", weight_decay=json_ + "optimizer.params.weight_decay",
                   adam_beta1=json_ + "optimizer.params.betas", adam_beta2=json_ + "optimizer.params.betas")
        if ds.optimizer is None or ds.optimizer.type != "Lion":
            out["adam_epsilon"] = json_ + "optimizer.params.eps"
    if ds.scheduler is not None:  # render_deepspeed._scheduler
        out["warmup_steps"] = json_ + "scheduler.params.warmup_num_steps"
        if ds.scheduler.type != "WarmupCosineLR":
            out.setdefault("learning_rate", json_ + "scheduler.params.warmup_max_lr")
        if ds.scheduler.type != "WarmupLR":
            out["max_steps"] = json_ + "scheduler.params.total_num_steps"
    return out


Flagged = list[tuple[GivenFlag, str]]


def plain_conflicts(job: "Job", words: Sequence[str]) -> tuple[Flagged, Flagged]:
    """(errors, warnings) for a plain script's arguments (pass_args none) with a TrainingArguments
    name and another value than the YAML's: errors where the generated files carry the value too,
    warnings where only the script reads it and the YAML sets it. ``--deepspeed`` names a file,
    not a value of the YAML, and is left to the script."""
    script = job.config.training.script
    carried = _carried(job)
    conflicts, _ = flag_conflicts([a for a in trainer_args(job, None) if a.name != "deepspeed"], words)
    errors: Flagged = []
    notes: Flagged = []
    for g, a in conflicts:
        yaml_value = f"{job.where(a.source)} ({_shown(a)})" if job.is_set(a.source) else \
            f"{dotted(a.source)}, not set in the YAML ({_shown(a)})"
        if a.name in carried:
            errors.append((g, f"{g.text} disagrees with {yaml_value}, which {carried[a.name]} carries too: {script} "
                              "and the engine would train with different values; the YAML is the one place for it "
                              "(remove it here, or change it there)"))
        elif job.is_set(a.source):
            notes.append((g, f"{g.text} disagrees with {yaml_value}: with pass_args none {script} trains with "
                             f"{g.text}, not with the YAML's value (which it sees only in $HFSCALE_CONFIG); make "
                             "them agree"))
    return errors, notes


def extra_args_warnings(job: "Job", extra_args: Sequence[str]) -> list[str]:
    """Warnings about the arguments after ``--`` for a plain script: values only it reads, given
    with another value than the YAML's (``hfscale launch`` prints them before it starts)."""
    t = job.config.training
    if t.script is None or t.pass_args != "none" or not extra_args:
        return []
    return [f"{EXTRA_ARGS}: {m}" for _, m in plain_conflicts(job, extra_args)[1]]


def extra_args_problems(job: "Job", extra_args: Sequence[str], deepspeed_config_file: str) -> list[Problem]:
    """Problems with the arguments given after ``--`` on the command line (exit 2 before anything starts)."""
    t = job.config.training
    if not extra_args:
        return []
    if t.script is None:
        return [Problem(EXTRA_ARGS, f"{' '.join(extra_args)}: the built-in entry point takes no arguments; set "
                                    "its values in the YAML (or name your own training.script)")]
    if t.pass_args == "none":
        return [Problem(EXTRA_ARGS, m) for _, m in plain_conflicts(job, extra_args)[0]]
    conflicts, _ = flag_conflicts(trainer_args(job, deepspeed_config_file), extra_args)
    return [Problem(EXTRA_ARGS, _conflict_message(job, given.text, a)) for given, a in conflicts]


def script_argv(job: "Job", deepspeed_config_file: str, extra_args: Sequence[str]) -> list[str]:
    """SCRIPT and its arguments: script_args, the YAML's flags (except those given already with the
    same value), the arguments after ``--``."""
    t = job.config.training
    assert t.script is not None
    if t.pass_args == "none":
        return [t.script, *t.script_args, *extra_args]
    args = trainer_args(job, deepspeed_config_file)
    _, same_in_yaml = flag_conflicts(args, t.script_args)
    _, same_extra = flag_conflicts(args, extra_args)
    return [t.script, *t.script_args, *trainer_flags(args, skip=same_in_yaml | same_extra), *extra_args]
