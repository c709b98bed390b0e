"""The TrainingArguments the YAML determines: one table, used three ways.

- ``training_arguments`` builds a ``transformers.TrainingArguments`` (the built-in entry point);
- ``trainer_flags`` renders the same values as command-line flags for an unchanged
  HfArgumentParser script (``training.pass_args: trainer``);
- ``flag_conflicts`` finds flags a user also gave (``training.script_args``, ``-- ARGS``) with
  another value, naming both places.

Every value the HF Trainer compares with the DeepSpeed JSON (batch sizes, accumulation, clipping,
precision, AdamW settings) comes from the same field the JSON was rendered from, so the two always
agree. Pure: no transformers import except in ``training_arguments``.
"""

from __future__ import annotations

import math
import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # job.py uses this module for its script rules
    from hfscale.rules.resolved import Job

YamlPath = tuple[str, ...]

# What HfArgumentParser accepts as a boolean value (transformers.hf_argparser.string_to_bool).
_TRUE = {"yes", "true", "t", "y", "1"}
_FALSE = {"no", "false", "f", "n", "0"}


@dataclass(frozen=True)
class TrainerArg:
    """One TrainingArguments field the YAML determines, and the YAML key it comes from."""

    name: str  # the TrainingArguments field, e.g. "learning_rate"
    value: Any  # None: the YAML leaves it unset (no flag is passed; another value is a conflict)
    source: YamlPath  # e.g. ("training", "learning_rate")

    @property
    def flag(self) -> str:
        return f"--{self.name}"


def trainer_args(job: Job, deepspeed_config_file: str | None) -> tuple[TrainerArg, ...]:
    """The table, in flag order. ``deepspeed_config_file``: the generated JSON's path (deepspeed backend)."""
    cfg = job.config
    t, b = cfg.training, cfg.batch
    accumulation = ("batch", "global_batch_size") if b.gradient_accumulation_steps is None and \
        b.global_batch_size is not None else ("batch", "gradient_accumulation_steps")
    rows = [
        ("output_dir", t.output_dir, ("training", "output_dir")),
        ("per_device_train_batch_size", b.micro_batch_size, ("batch", "micro_batch_size")),
        ("gradient_accumulation_steps", job.gradient_accumulation_steps, accumulation),
        ("max_steps", t.max_steps if t.max_steps is not None else -1, ("training", "max_steps")),
        ("num_train_epochs", t.num_train_epochs, ("training", "num_train_epochs")),
        ("learning_rate", t.learning_rate, ("training", "learning_rate")),
        ("weight_decay", t.weight_decay, ("training", "weight_decay")),
        ("adam_beta1", t.adam_beta1, ("training", "adam_beta1")),
        ("adam_beta2", t.adam_beta2, ("training", "adam_beta2")),
        ("adam_epsilon", t.adam_epsilon, ("training", "adam_epsilon")),
        ("lr_scheduler_type", t.lr_scheduler_type, ("training", "lr_scheduler_type")),
        ("warmup_steps", t.warmup_steps, ("training", "warmup_steps")),
        ("seed", t.seed, ("training", "seed")),
        ("logging_steps", t.logging_steps, ("training", "logging_steps")),
        ("save_strategy", "steps", ("training", "save_steps")),
        ("save_steps", t.save_steps, ("training", "save_steps")),
        ("save_total_limit", t.save_total_limit, ("training", "save_total_limit")),
        ("report_to", list(t.report_to), ("training", "report_to")),
        ("bf16", cfg.precision == "bf16", ("precision",)),
        ("fp16", cfg.precision == "fp16", ("precision",)),
        ("max_grad_norm", cfg.gradient_clipping or 0.0, ("gradient_clipping",)),
        # only when on: transformers 5 renamed it (activation_checkpointing) and warns about the old name
        ("gradient_checkpointing", True if t.gradient_checkpointing else None, ("training", "gradient_checkpointing")),
        ("deepspeed", deepspeed_config_file if job.deepspeed is not None else None, ("distributed", "backend")),
    ]
    return tuple(TrainerArg(*row) for row in rows)


def training_arguments_kwargs(job: Job, deepspeed_config_file: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments`` (pure; no transformers import)."""
    # None: not set (TrainingArguments' own default), as trainer_flags leaves it off a command line
    return {a.name: a.value for a in trainer_args(job, deepspeed_config_file) if a.value is not None}


def training_arguments(job: Job, deepspeed_config_file: str | None = None, **overrides: Any):
    """A ``transformers.TrainingArguments`` for ``job``; ``overrides`` win (e.g. ``use_cpu=True``)."""
    from transformers import TrainingArguments

    args = TrainingArguments(**{**training_arguments_kwargs(job, deepspeed_config_file), **overrides})
    bf16_under_fp8(job, args)
    return args


def bf16_under_fp8(job: Job, args: Any) -> None:
    """precision fp8 under DeepSpeed: the JSON has no bf16 section (accelerate adds bf16 on when the
    Accelerator is built, after the model), so deepspeed.zero.Init (ZeRO-3, in from_pretrained /
    from_config) would partition fp32 weights that DeepSpeed never casts. Once TrainingArguments have
    checked the JSON against their --bf16 false, bf16 goes into the config they hold, which zero.Init,
    the DeepSpeedPlugin and deepspeed.initialize all read (transformers' HfTrainerDeepSpeedConfig)."""
    hf = getattr(args, "hf_deepspeed_config", None)
    if job.deepspeed is None or job.config.precision != "fp8" or hf is None:
        return
    import torch

    hf.config.setdefault("bf16", {"enabled": True})
    hf._dtype = torch.bfloat16  # what trainer_config_process set from the JSON (float32); the Trainer reads it


def _word(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def trainer_flags(args: Sequence[TrainerArg], skip: frozenset[str] = frozenset()) -> list[str]:
    """``--name value`` words for every value set, except the names in ``skip`` (given already)."""
    words: list[str] = []
    for a in args:
        if a.value is None or a.name in skip:
            continue
        values = a.value if isinstance(a.value, list) else [a.value]
        words += [a.flag, *(_word(v) for v in values)]
    return words


@dataclass(frozen=True)
class GivenFlag:
    """A flag found in a user's argument list: where (index of its first word), its text, its value."""

    index: int
    name: str  # normalized: dashes read as underscores, as HfArgumentParser accepts both
    text: str  # as written, e.g. "--learning_rate 1e-3"
    words: tuple[str, ...]  # the value words ((): the flag alone)


def given_flags(words: Sequence[str], names: set[str]) -> list[GivenFlag]:
    """The flags among ``words`` whose normalized name is in ``names``, with their value words
    (``--x=v`` or ``--x v [v ...]`` up to the next ``-``-word)."""
    out = []
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("--") or len(w) < 3:
            i += 1
            continue
        head, eq, tail = w[2:].partition("=")
        name = head.replace("-", "_")
        j = i + 1
        if eq:
            values: tuple[str, ...] = (tail,)
        else:
            while j < len(words) and not (words[j].startswith("-") and not _is_number(words[j])):
                j += 1
            values = tuple(words[i + 1:j])
        if name in names:
            out.append(GivenFlag(i, name, " ".join([w, *([] if eq else values)]), values))
        i = j if not eq else i + 1
    return out


def _is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def same_value(arg: TrainerArg, words: tuple[str, ...]) -> bool:
    """Whether the value ``words`` given for ``arg``'s flag means the YAML's value."""
    ours = arg.value
    if ours is None:
        return False
    if isinstance(ours, bool):
        text = words[0].lower() if len(words) == 1 else ("true" if not words else "")
        return (text in _TRUE and ours) or (text in _FALSE and not ours)
    if isinstance(ours, list):
        return [w.lower() for w in words] == [str(v).lower() for v in ours]
    if len(words) != 1:
        return False
    given = words[0]
    if isinstance(ours, (int, float)):
        try:
            return math.isclose(float(given), float(ours), rel_tol=1e-12, abs_tol=0.0) and (
                not isinstance(ours, int) or float(given).is_integer())
        except ValueError:
            return False
    if arg.name == "output_dir":
        return posixpath.normpath(given) == posixpath.normpath(ours)
    return given.lower() == str(ours).lower() if arg.name in ("lr_scheduler_type", "save_strategy") else given == ours


def flag_conflicts(args: Sequence[TrainerArg], words: Sequence[str]) -> tuple[list[tuple[GivenFlag, TrainerArg]], frozenset[str]]:
    """(flags given with another value than the YAML's, names given with the same value)."""
    table = {a.name: a for a in args}
    conflicts, same = [], set()
    for g in given_flags(words, set(table)):
        a = table[g.name]
        if same_value(a, g.words):
            same.add(g.name)
        else:
            conflicts.append((g, a))
    return conflicts, frozenset(same)
