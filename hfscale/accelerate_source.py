"""The keys of the installed accelerate's config file, read from its source (no import: it would
import torch): the dataclass the file is loaded into (``ClusterConfig``), and for the nested
sections accelerate copies onto its launch arguments, the ``add_argument("--key")`` calls of
``accelerate launch``.

``accelerate launch`` fills an argument from the file only while the argument is None; a flag
whose default is not None (``--enable_cpu_affinity``, ``--same_network``, ``--downcast_bf16``,
``--rdzv_backend``) never takes the file's value. Such keys are marked ``unread``.
"""

from __future__ import annotations

import ast
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from .engine_source import _SCALAR, OPEN, UNKNOWN, Key, Section, _annotation, _literal, _model_file, package_root, parse_source

# launch_command reads these itself, beside the generic merge (launch.py: debug, mixed precision, TPU)
_HANDLED = {"debug", "mixed_precision", "tpu_use_cluster"}
_ACCELERATE_GROUPS = {  # launch argument group variable -> nested section of the config file
    "deepspeed_args": "deepspeed_config", "fsdp_args": "fsdp_config", "megatron_lm_args": "megatron_lm_config",
    "fp8_args": "fp8_config", "mpirun_args": "mpirun_config", "parallelism_config_args": "parallelism_config",
}
_ARG_KINDS = {"int": frozenset({"int"}), "float": frozenset({"int", "float"})}


def _launch_groups(path: Path) -> tuple[dict[str, dict[str, Key]], set[str]]:
    """(config section -> {key: Key}, top-level arguments with a default other than None) from the
    ``add_argument`` calls of ``accelerate launch``."""
    tree = parse_source(path)
    out: dict[str, dict[str, Key]] = {}
    defaulted: set[str] = set()
    if tree is None:
        return out, defaulted
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument" and isinstance(node.func.value, ast.Name)):
            continue
        section = _ACCELERATE_GROUPS.get(node.func.value.id)
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        long = [f[2:] for f in flags if f.startswith("--")]
        kw = {k.arg: k.value for k in node.keywords}
        if long and section is None:
            action = _literal(kw.get("action"), {}) if "action" in kw else None
            default = _literal(kw.get("default"), {}) if "default" in kw else None
            dest = _literal(kw["dest"], {}) if "dest" in kw else long[0].replace("-", "_")
            if action in ("store_true", "store_false") or default not in (None,):
                defaulted.add(str(dest))
        if section is None or not long:
            continue
        kind = kw.get("type")
        kinds = _ARG_KINDS.get(kind.id) if isinstance(kind, ast.Name) else None
        choices = _literal(kw.get("choices"), {}) if "choices" in kw else UNKNOWN
        key = Key(kinds or (_SCALAR if "action" not in kw else frozenset({"bool"})),
                  tuple(choices) if isinstance(choices, list) else None)
        out.setdefault(section, {})[long[0].replace("-", "_")] = key
    return out, defaulted


@lru_cache(maxsize=1)
def accelerate_keys() -> Section | None:
    """The keys of accelerate's config file (``ClusterConfig``), or None when accelerate is not
    installed here. Nested sections hold the launch arguments accelerate copies them onto."""
    root = package_root("accelerate")
    if root is None:
        return None
    f = _model_file(root, root / "commands" / "config" / "config_args.py")
    keys: dict[str, Key] = {}
    for name in ("BaseConfig", "ClusterConfig"):
        cls = f.classes.get(name)
        for stmt in cls.body if cls else []:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                kinds, choices, _ = _annotation(root, f, stmt.annotation, 8)
                keys[stmt.target.id] = Key(kinds, choices, default=_literal(stmt.value, f.constants))
    if not keys:
        return Section(open=True)
    groups, defaulted = _launch_groups(root / "commands" / "launch.py")
    for name in defaulted & set(keys) - _HANDLED:
        keys[name] = replace(keys[name], unread=f"accelerate launch never reads it from a config file: its --{name} "
                             "argument has a default, and the file only fills arguments left unset")
    for section, sub in groups.items():
        if section == "fsdp_config":  # accelerate adds the fsdp_ prefix where the file leaves it out
            sub.update({k.removeprefix("fsdp_"): Key(renamed_to=k) for k in list(sub) if k.startswith("fsdp_")})
        if section in keys:
            keys[section] = replace(keys[section], kinds=frozenset({"dict", "none"}), section=Section(sub))
    keys["dynamo_config"] = replace(keys.get("dynamo_config", Key()), section=OPEN)
    return Section(keys)
