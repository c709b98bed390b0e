"""Turn pydantic's validation errors into hfscale problems a person can act on."""

from __future__ import annotations

import difflib
import typing
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ValidationError

from hfscale.config.errors import Problem
from hfscale.config.yaml_source import Document, dotted

# Names people bring from accelerate, DeepSpeed and TrainingArguments, and where hfscale keeps them.
KNOWN_ELSEWHERE = {
    "zero_stage": "distributed.deepspeed.stage",
    "mixed_precision": "precision",
    "bf16": "precision",
    "fp16": "precision",
    "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
    "per_device_train_batch_size": "batch.micro_batch_size",
    "train_batch_size": "batch.global_batch_size",
    "max_grad_norm": "gradient_clipping",
    "num_processes": "cluster.nproc_per_node",
    "num_machines": "cluster.hosts",
    "main_process_ip": "cluster.master_addr",
    "main_process_port": "cluster.master_port",
    "zero_optimization": "distributed.deepspeed",
    "deepspeed_config": "distributed.deepspeed",
    "fsdp_config": "distributed.fsdp",
    "lr": "training.learning_rate",
}

_TYPE_WORDS = {
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "tuple_type": "a list",
    "list_type": "a list",
}

_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out.extend(_models_in(arg))
    return out


def _model_at(root: type[BaseModel], loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int):
            continue  # list index: same element model
        if model is None or part not in model.model_fields:
            return None
        found = _models_in(model.model_fields[part].annotation)
        model = found[0] if found else None
    return model


@lru_cache(maxsize=None)
def _all_paths(root: type[BaseModel]) -> tuple[str, ...]:
    paths: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            path = f"{prefix}.{name}" if prefix else name
            paths.append(path)
            for sub in _models_in(field.annotation):
                walk(sub, path)

    walk(root, "")
    return tuple(paths)


def unknown_key_hint(root: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    """A 'did you mean' for an unknown key at ``loc``, or ''."""
    key = str(loc[-1])
    here = dotted(loc[:-1])
    model = _model_at(root, loc[:-1])
    if key in KNOWN_ELSEWHERE:
        return f"; hfscale sets this with {KNOWN_ELSEWHERE[key]!r}"
    if model is not None:
        close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.75)
        if close:
            return f"; did you mean {close[0]!r}?"
    library = _library_key_hint(here, key)
    if library:
        return library
    # a key of another section, when only one section has it (several 'extra's: no guess)
    same = [p for p in _all_paths(root) if p.rsplit(".", 1)[-1] == key]
    if len(same) == 1 and same[0].rsplit(".", 1)[0] != here:
        return f"; did you mean {same[0]!r}?"
    if model is not None:
        return f"; allowed here: {', '.join(model.model_fields)}"
    return ""


def _library_key_hint(here: str, key: str) -> str:
    """For an unknown key in distributed.deepspeed that DeepSpeed itself knows: where it goes."""
    if here != "distributed.deepspeed":
        return ""
    from hfscale.config.sources.deepspeed import deepspeed_keys

    keys = deepspeed_keys()
    if keys is None:
        return ""
    zero = keys.keys["zero_optimization"].section
    if zero is not None and key in zero.keys:
        return f"; a DeepSpeed zero_optimization key hfscale does not type: set it in 'extra: {{zero_optimization: {{{key}: ...}}}}'"
    if key in keys.keys:
        return f"; a DeepSpeed key hfscale does not type: set it in 'extra: {{{key}: ...}}'"
    return ""


def _describe(value: Any) -> str:
    kind = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "a list",
            dict: "a mapping", type(None): "null"}.get(type(value), type(value).__name__)
    try:
        text = repr(value)
    except ValueError:  # an int of more than 4,300 digits (sys.get_int_max_str_digits)
        text = f"a number of about {int(value.bit_length() * 0.30103):,} digits"
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({kind})"


def problems_from_validation(root: type[BaseModel], err: ValidationError, doc: Document) -> list[Problem]:
    """One problem per pydantic error, with dotted path, line and a plain message."""
    out: list[Problem] = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        kind = e["type"]
        if kind == "extra_forbidden":
            msg = f"unknown key {str(loc[-1])!r}{unknown_key_hint(root, loc)}"
        elif kind == "missing":
            msg = "required key is missing"
        elif kind in _TYPE_WORDS:
            msg = f"must be {_TYPE_WORDS[kind]}, got {_describe(e.get('input'))}"
        elif kind == "literal_error":
            msg = f"must be one of {e['ctx']['expected']}, got {_describe(e.get('input'))}"
        elif kind in _BOUNDS:
            op, key = _BOUNDS[kind]
            msg = f"must be {op} {e['ctx'][key]}, got {_describe(e.get('input'))}"
        elif kind == "value_error":
            msg = str(e["ctx"]["error"]) if "ctx" in e else e["msg"]
        else:
            msg = f"{e['msg'][0].lower()}{e['msg'][1:]}, got {_describe(e.get('input'))}"
        out.append(Problem(dotted(loc), msg, doc.line(loc)))
    return sorted(out, key=lambda p: (p.line is None, p.line or 0))

