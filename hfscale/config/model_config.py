"""``training.model.config`` checked against its model type's transformers config class.

The class is read from transformers' source (hfscale.config.sources.transformers: no transformers or
torch import, so ``hfscale check`` stays fast), and the mapping checked against it:

- ``model_type`` is required and must be one transformers knows (with a did-you-mean);
- every key must be a field, an alias or a keyword the class reads (with a did-you-mean): a typo
  such as ``n_layr`` would otherwise be stored as an attribute and ignored;
- values must have the field's type, with the strict dataclass's rules (``1`` is not a float,
  ``true`` is not an int);
- sizes (layers, heads, widths, vocabulary, positions, experts) must be at least 1, and the hidden
  size must divide by the number of attention heads (where the class has no ``head_dim``), the
  heads by the key/value heads: the model constructors raise otherwise, on every rank.

When a class cannot be read this way (an unusual declaration), :func:`check` says so in a warning
and the config is checked when the model is built.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from hfscale.config.sources.transformers import KIND_OF, UNKNOWN, ConfigSchema, FieldSpec, model_types, schema

__all__ = ["check", "model_types", "schema"]

_SIZE = re.compile(r"^(n_|num_)|(_size|_dim|_layers|_heads|_positions|_embeddings|_experts)$|^n_(embd|head|layer|inner|ctx)$")
_KIND_WORDS = {"bool": "true or false", "int": "a whole number", "float": "a number with a decimal point",
               "str": "a string", "none": "null", "list": "a list", "dict": "a mapping"}


# ---- checking a mapping --------------------------------------------------------------------------


def _kind(value: Any) -> str:
    return KIND_OF.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _value_problem(spec: FieldSpec, value: Any) -> str | None:
    if spec.kinds is not None and _kind(value) not in spec.kinds:
        want = " or ".join(_KIND_WORDS.get(k, k) for k in sorted(spec.kinds, key=list(_KIND_WORDS).index))
        return f"must be {want}, got {_show(value)} ({_KIND_WORDS.get(_kind(value), _kind(value))})"
    if spec.literals is not None and value is not None and value not in spec.literals:
        return f"must be one of {', '.join(map(repr, spec.literals))}, got {_show(value)}"
    if spec.items is not None and isinstance(value, list):
        bad = next((x for x in value if _kind(x) not in spec.items), UNKNOWN)
        if bad is not UNKNOWN:
            return f"every item must be {' or '.join(_KIND_WORDS.get(k, k) for k in sorted(spec.items))}, got {_show(bad)}"
    if _SIZE.search(spec.name) and _kind(value) == "int" and value < 1 and not (
            isinstance(spec.default, int) and not isinstance(spec.default, bool) and spec.default < 1):
        return f"is a size and must be at least 1, got {value}"
    return None


def _resolved(s: ConfigSchema, cfg: dict[str, Any], name: str) -> tuple[Any, str | None]:
    """(value of field ``name``, the YAML key that set it or None for the default)."""
    for key, value in cfg.items():
        if s.aliases.get(key, key) == name:
            return value, key
    spec = s.fields.get(name)
    return (spec.default if spec is not None else UNKNOWN), None


def _field_of(s: ConfigSchema, canonical: str) -> str | None:
    """The class's own field behind a canonical name (``hidden_size`` is ``n_embd`` in GPT-2)."""
    if canonical in s.fields:
        return canonical
    target = s.aliases.get(canonical)
    return target if target in s.fields else None


def _architecture_problems(s: ConfigSchema, cfg: dict[str, Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    hidden_f, heads_f, kv_f = (_field_of(s, n) for n in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    if hidden_f is None or heads_f is None:
        return out
    hidden, hidden_key = _resolved(s, cfg, hidden_f)
    heads, heads_key = _resolved(s, cfg, heads_f)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads)):
        return out
    where = hidden_key or heads_key
    if where is not None and "head_dim" not in s.fields and hidden % heads:
        out.append((where, f"{hidden_f} {hidden} must divide by {heads_f} {heads} (each head gets "
                           f"{hidden_f} / {heads_f} dimensions); the model cannot be built"))
    if kv_f is not None:
        kv, kv_key = _resolved(s, cfg, kv_f)
        if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0 and heads % kv and (kv_key or heads_key):
            out.append((kv_key or heads_key, f"{heads_f} {heads} must divide by {kv_f} {kv} (grouped-query "
                                             "attention shares each key/value head among a whole group)"))
    return out


def check(cfg: dict[str, Any]) -> tuple[list[tuple[tuple, str]], list[str]]:
    """(problems as (path inside the mapping, message), warnings) for a ``training.model.config``."""
    mt = cfg.get("model_type")
    if "model_type" not in cfg:
        near = [k for k in cfg if isinstance(k, str) and difflib.get_close_matches(k, ["model_type"], n=1, cutoff=0.75)]
        if near:  # model_typ: the key is there, misspelt
            return [((near[0],), f"unknown key {near[0]!r}; did you mean 'model_type'? (it picks the transformers "
                                 "config class)")], []
        return [((), "needs model_type (e.g. gpt2, llama, mistral): it picks the transformers config class")], []
    if not isinstance(mt, str):
        return [(("model_type",), f"must be a string such as gpt2 or llama, got {_show(mt)}")], []
    own = schema(mt, bases=False)  # the class's own declarations: enough for most configs
    s = own if own is not None and all(k in own.fields or k in own.aliases for k in cfg if k != "model_type") \
        else schema(mt)
    if s is None:
        known = model_types()
        if not known:
            return [], ["transformers is not installed here: training.model.config is checked when the model is built"]
        if mt not in known:
            close = difflib.get_close_matches(mt, known, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            return [(("model_type",), f"transformers has no model_type {mt!r}{hint}")], []
        return [], [f"the {mt} config class could not be read from transformers' source: training.model.config "
                    "is checked when the model is built"]
    problems: list[tuple[tuple, str]] = []
    accepted = sorted(s.accepted())
    for key, value in cfg.items():
        if key == "model_type":
            continue
        if not isinstance(key, str) or key not in s.accepted():
            close = difflib.get_close_matches(str(key), accepted, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(((key,), f"{s.class_name} has no field {key!r}{hint} (an unknown key would be stored "
                                     "and ignored)"))
            continue
        spec = s.spec(key)
        if spec is not None:
            why = _value_problem(spec, value)
            if why:
                problems.append(((key,), why))
    if not problems:
        problems += [((k,), m) for k, m in _architecture_problems(s, cfg)]
    return problems, []
