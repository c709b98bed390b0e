"""What reaches a user's training script, and the rules that keep it what ``hfscale check`` reports.

``training.pass_args: trainer`` (the default): the script is an HfArgumentParser /
TrainingArguments script (transformers' examples, TRL's). It runs as

    python -m hfscale.run_script SCRIPT [script_args] [flags from this YAML] [-- ARGS]

where the flags are ``hfscale.trainer_args.trainer_flags`` (batch, steps, schedule, saving,
logging, precision, clipping, seed, output_dir, ``--deepspeed <generated JSON>``) and
``hfscale.run_script`` adds what only the rank can decide (``--use_cpu``, ``--resume_from_checkpoint``)
before it becomes the script. A flag the YAML determines may also appear in ``script_args`` or
after ``--`` only with the same value; another value is an error naming both places.

``training.pass_args: none``: a plain script (an accelerate loop) gets ``script_args`` and the
``HFSCALE_*`` variables only; ``check`` warns about every ``training`` value it will not receive.

Pure: paths come back relative to the YAML (for ``Problem``), nothing is read or started here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .errors import Problem
from .trainer_args import TrainerArg, flag_conflicts, trainer_args, trainer_flags
from .yamlsource import dotted

if TYPE_CHECKING:  # job.py calls script_problems while it builds the Job
    from .job import Job

SCRIPT_ENTRY = "hfscale.run_script"
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
    builtin = [p for p in BUILTIN_ONLY if job.is_set(p)]
    if t.pass_args == "none":
        unsent = [a.source for a in trainer_args(job, None) if a.source[0] == "training"] + builtin
        named = [job.where(p) for p in dict.fromkeys(unsent) if job.is_set(p)]
        if named:
            warnings.append((("training", "pass_args"),
                             f"none: {t.script} gets no flags for {', '.join(named)}; it sees them only if it "
                             "reads $HFSCALE_CONFIG (hfscale.load.load_job)"))
        if cfg.watchdog.timeout is not None:
            warnings.append((("watchdog", "timeout"),
                             f"the hang watchdog sees {t.script}'s steps only if it calls hfscale.progress.step(n) "
                             "after each optimizer step (one line; a Trainer gets hfscale.callbacks.ProgressCallback)"))
        if cfg.runner.launcher == "torchrun" and cfg.distributed.backend in ("deepspeed", "fsdp"):
            what = "$HFSCALE_DS_CONFIG" if ds is not None else "$HFSCALE_RUN_DIR/accelerate_config.yaml"
            warnings.append((("runner", "launcher"),
                             f"torchrun: a plain script gets the {cfg.distributed.backend} settings only by reading "
                             f"{what}; an Accelerator reads them under accelerate launch only (else it trains DDP)"))
        return problems, warnings
    for path in builtin:
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


def extra_args_problems(job: "Job", extra_args: Sequence[str], deepspeed_config_file: str) -> list[Problem]:
    """Problems with the arguments given after ``--`` on the command line (exit 2 before anything starts)."""
    t = job.config.training
    if not extra_args:
        return []
    if t.script is None:
        return [Problem(EXTRA_ARGS, f"{' '.join(extra_args)}: the built-in entry point takes no arguments; set "
                                    "its values in the YAML (or name your own training.script)")]
    if t.pass_args == "none":
        return []
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
