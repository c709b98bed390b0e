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
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from hfscale.config.sources.engine import _SCALAR, OPEN, UNKNOWN, Key, Section, _annotation, _literal, _model_file, package_root, parse_source

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


_FP8_RECIPES = ("TERecipeKwargs", "MSAMPRecipeKwargs", "AORecipeKwargs")


def _fp8_keys(root: Path, sub: dict[str, Key]) -> dict[str, Key]:
    """fp8_config's keys as a run reads them. accelerate launch copies them onto its --fp8_*
    arguments without their choices (the file skips the parser) and hands each on as
    ACCELERATE_FP8_<NAME> (utils/launch.py, setup_fp8_env: override_linear_precision as its three
    values); the recipe classes read those (utils/dataclasses.py): the backend as
    ``FP8BackendType(value)``, exactly as spelled ('TE': the command line's lower-case 'te' fails
    there), fp8_format and amax_compute_algo in any case, and variables no argument names
    (use_mxfp8_block_scaling)."""
    f = _model_file(root, root / "utils" / "dataclasses.py")
    out = dict(sub)
    if "fp8_backend" in out and f.enums.get("FP8BackendType"):
        out["fp8_backend"] = Key(frozenset({"str"}), tuple(f.enums["FP8BackendType"]))
    if "fp8_override_linear_precision" in out:  # (fprop, dgrad, wgrad); checked by accelerate_rules
        out["fp8_override_linear_precision"] = Key(frozenset({"list"}))
    for name in ("fp8_format", "fp8_amax_compute_algo"):  # upper()/lower() before the check
        if name in out:
            out[name] = replace(out[name], any_case=True)
    for cls in (f.classes.get(c) for c in _FP8_RECIPES):
        fields = {s.target.id: s.annotation for s in cls.body if isinstance(s, ast.AnnAssign)
                  and isinstance(s.target, ast.Name)} if cls else {}
        for node in ast.walk(cls) if cls else ():  # env_prefix + "NAME"
            if (isinstance(node, ast.BinOp) and isinstance(node.right, ast.Constant)
                    and isinstance(node.right.value, str) and getattr(node.left, "id", "") == "env_prefix"):
                name = node.right.value.lower()
                if f"fp8_{name}" not in out and name in fields:
                    kinds, choices, _ = _annotation(root, f, fields[name], 8)
                    out[f"fp8_{name}"] = Key(kinds, choices)
    return out


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
    if "fp8_config" in groups:
        groups["fp8_config"] = _fp8_keys(root, groups["fp8_config"])
    for section, sub in groups.items():
        prefix = {"fsdp_config": "fsdp_", "fp8_config": "fp8_"}.get(section)  # (dynamo_config: any key, below)
        if prefix:  # accelerate launch adds the prefix where the file leaves it out (_validate_launch_command)
            sub.update({k.removeprefix(prefix): Key(renamed_to=k) for k in list(sub) if k.startswith(prefix)})
        if section in keys:
            keys[section] = replace(keys[section], kinds=frozenset({"dict", "none"}), section=Section(sub))
    keys["dynamo_config"] = replace(keys.get("dynamo_config", Key()), section=OPEN)
    return Section(keys)


@dataclass(frozen=True)
class Fsdp2Mapping:
    """How ``accelerate to-fsdp2`` (accelerate/commands/to_fsdp2.py) turns an FSDP1 fsdp_config
    into FSDP2: each FSDP1 key's FSDP2 key, or why it is dropped; the values it translates."""

    keys: dict[str, str]
    dropped: dict[str, str]  # key -> "removed in FSDP2" | "not yet implemented in FSDP2"
    values: dict[str, dict[Any, Any]]
    strategies: tuple[str, ...] = ()  # FSDP1's sharding strategies in order (accelerate/utils/constants.py)

    def convert(self, fsdp: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """(the FSDP2 fsdp_config, the keys dropped) as ``convert_config_to_fsdp2`` makes them."""
        out: dict[str, Any] = {}
        dropped = []
        for key, value in fsdp.items():
            if key in self.dropped:
                dropped.append(key)
            elif key in self.keys:
                table = self.values.get(key, {})
                out[self.keys[key]] = table.get(value, value) if isinstance(value, (str, int, float, bool)) else value
            else:
                out[key] = value
        out["fsdp_version"] = 2
        return out, dropped


_STATUS = {"REMOVED": "removed in FSDP2", "NOT_YET_IMPLEMENTED": "not yet implemented in FSDP2"}


@lru_cache(maxsize=1)
def fsdp2_mapping() -> Fsdp2Mapping | None:
    """The installed accelerate's FSDP1 -> FSDP2 mapping, read from its source; None when
    accelerate (or a readable to_fsdp2.py) is not there."""
    root = package_root("accelerate")
    tree = parse_source(root / "commands" / "to_fsdp2.py") if root is not None else None
    if tree is None:
        return None
    keys: dict[str, str] = {}
    dropped: dict[str, str] = {}
    values: dict[str, dict[Any, Any]] = {}
    for stmt in tree.body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value, ast.Dict)):
            continue
        name = stmt.targets[0].id
        for k, v in zip(stmt.value.keys, stmt.value.values):
            key = _literal(k, {})
            if not isinstance(key, str):
                continue
            if name == "ARGUMENT_KEY_MAPPING":
                if isinstance(v, ast.Attribute) and v.attr in _STATUS:
                    dropped[key] = _STATUS[v.attr]
                elif isinstance(_literal(v, {}), str):
                    keys[key] = _literal(v, {})
            elif name == "ARGUMENT_VALUE_MAPPING" and isinstance(_literal(v, {}), dict):
                values[key] = _literal(v, {})
    constants = parse_source(root / "utils" / "constants.py")  # type: ignore[operator]
    strategies: tuple[str, ...] = ()
    for stmt in constants.body if constants is not None else ():
        if isinstance(stmt, ast.Assign) and [getattr(t, "id", "") for t in stmt.targets] == ["FSDP_SHARDING_STRATEGY"]:
            found = _literal(stmt.value, {})
            strategies = tuple(found) if isinstance(found, list) else ()
    return Fsdp2Mapping(keys, dropped, values, strategies) if keys else None
