"""The config keys of the installed DeepSpeed, found in its source: the sections its pydantic
models and constants modules declare (hfscale.config.sources.engine reads them), and every top-level key
``DeepSpeedConfig`` reads.

``runtime/config.py`` reads the JSON it is given (``param_dict``) directly (``param_dict.get(KEY)``,
``param_dict[KEY]``, ``KEY in param_dict``, ``get_scalar_param(param_dict, KEY, ...)``) and through
helpers that take ``param_dict`` (``get_data_efficiency_config(param_dict)``, defined there or in
another module of DeepSpeed). Each such read names a key; names are resolved through the
constants of the module and of the modules it imports from. Nothing is imported or run.
"""

from __future__ import annotations

import ast
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from hfscale.config.sources.engine import (
    OPEN,
    UNKNOWN,
    Key,
    Section,
    _constants,
    _kinds_of_value,
    _model_file,
    _ModelFile,
    package_root,
    parse_source,
    read_constants,
    read_model,
)

_DEPTH = 3


def _key(node: ast.AST, f: _ModelFile) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and isinstance(f.constants.get(node.id), str):
        return f.constants[node.id]
    return None


@lru_cache(maxsize=None)  # _ModelFile objects are cached per file (engine_source._model_file)
def _functions(f: _ModelFile) -> dict[str, ast.FunctionDef]:
    """Functions by name; a class by name stands for its ``__init__``."""
    out: dict[str, ast.FunctionDef] = {}
    for node in ast.walk(f.tree) if f.tree is not None else ():
        if isinstance(node, ast.FunctionDef):
            out.setdefault(node.name, node)
        elif isinstance(node, ast.ClassDef):
            init = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
            if init is not None:
                out[node.name] = init
    return out


def _text(node: ast.AST, f: _ModelFile) -> str | None:
    """A string constant, an f-string of constants, or implicitly joined parts."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.FormattedValue):
                name = v.value.id if isinstance(v.value, ast.Name) else None
                parts.append(str(f.constants.get(name, "")) if name else "")
            else:
                parts.append(_text(v, f) or "")
        return "".join(parts)
    return None


@lru_cache(maxsize=None)
def string_dicts(f: _ModelFile) -> dict[str, dict[str, str]]:
    """Module-level ``NAME = {"key": "text", ...}`` mappings (keys and texts)."""
    out: dict[str, dict[str, str]] = {}
    for stmt in f.tree.body if f.tree is not None else ():
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                and isinstance(stmt.value, ast.Dict):
            items = {_key(k, f): _text(v, f) for k, v in zip(stmt.value.keys, stmt.value.values) if k is not None}
            if items and all(isinstance(k, str) for k in items):
                out[stmt.targets[0].id] = {k: v or "" for k, v in items.items()}  # type: ignore[misc]
    return out


def _bound(body: ast.AST, f: _ModelFile) -> list[tuple[ast.AST, str, list[str]]]:
    """Loop variables bound to literal keys, each with the part of ``body`` where it holds them:
    ``for key in ("a", "b"): ...``, ``for k, m in DICT.items(): ...``, ``{k: d.get(k) for k in (...)}``."""
    dicts = string_dicts(f)
    out: list[tuple[ast.AST, str, list[str]]] = []
    for scope in ast.walk(body):
        loops = [scope] if isinstance(scope, ast.For) else [g for g in getattr(scope, "generators", [])]
        for node in loops:
            it, target = node.iter, node.target
            if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in ("items", "keys"):
                it = it.func.value
            if isinstance(target, ast.Tuple) and target.elts:
                target = target.elts[0]
            if not isinstance(target, ast.Name):
                continue
            if isinstance(it, ast.Name) and it.id in dicts:
                out.append((scope, target.id, list(dicts[it.id])))
            elif isinstance(it, (ast.Tuple, ast.List)):
                values = [_key(e, f) for e in it.elts]
                if all(isinstance(v, str) for v in values):
                    out.append((scope, target.id, values))  # type: ignore[arg-type]
    return out


def _is_dict(node: ast.AST, names: set[str]) -> bool:
    """``node`` is the JSON being read: one of ``names``, or ``self._param_dict``."""
    return (isinstance(node, ast.Name) and node.id in names) or (
        isinstance(node, ast.Attribute) and node.attr == "_param_dict")


def _reads(f: _ModelFile, body: ast.AST, names: set[str], depth: int, seen: set[tuple[Path, str]],
           defaults: dict[str, list[str]] | None = None) -> set[str]:
    """Keys read from the dict bound to any of ``names`` in ``body`` (helpers followed)."""
    keys: set[str] = set()
    if isinstance(body, ast.Module):  # each function with its own loop variables
        for node in ast.walk(body):
            if isinstance(node, ast.FunctionDef):
                keys |= _reads(f, node, names, depth, seen, defaults)
        return keys
    scopes = _bound(body, f) + [(body, name, values) for name, values in (defaults or {}).items()]
    for scope, var, values in scopes:  # a variable holding keys, read as a key: all its values
        for node in ast.walk(scope):
            for sub in ast.iter_child_nodes(node):
                if isinstance(sub, ast.Name) and sub.id == var and _reads_key(node, sub, names):
                    keys.update(values)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.startswith("get_") \
                    and len(node.args) >= 2 and _is_dict(node.args[0], names) \
                    and isinstance(node.args[1], ast.Name) and node.args[1].id == var:
                keys.update(values)
    for node in ast.walk(body):
        key = None
        if isinstance(node, ast.Subscript) and _is_dict(node.value, names):
            key = _key(node.slice, f)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and isinstance(node.comparators[0], ast.Name) and node.comparators[0].id in names:
            key = _key(node.left, f)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") \
                    and _is_dict(func.value, names) and node.args:
                key = _key(node.args[0], f)
            elif isinstance(func, ast.Name) and func.id.startswith("get_") and len(node.args) >= 2 \
                    and _is_dict(node.args[0], names) and _key(node.args[1], f) is not None:
                key = _key(node.args[1], f)  # get_scalar_param(param_dict, KEY, DEFAULT) and its kin
            elif isinstance(func, ast.Name) and depth < _DEPTH:
                passed = [i for i, a in enumerate(node.args) if isinstance(a, ast.Name) and a.id in names]
                if passed:
                    keys |= _helper(f, func.id, passed[0], depth + 1, seen)
        if key is not None:
            keys.add(key)
    return keys


def _reads_key(node: ast.AST, name: ast.Name, names: set[str]) -> bool:
    """Whether ``node`` reads key ``name`` from one of the dicts ``names``."""
    if isinstance(node, ast.Compare) and node.left is name and len(node.comparators) == 1:
        return isinstance(node.comparators[0], ast.Name) and node.comparators[0].id in names
    if isinstance(node, ast.Call) and node.args and node.args[0] is name and isinstance(node.func, ast.Attribute):
        return node.func.attr in ("get", "pop") and isinstance(node.func.value, ast.Name) \
            and node.func.value.id in names
    return isinstance(node, ast.Subscript) and node.slice is name and isinstance(node.value, ast.Name) \
        and node.value.id in names


def _helper(f: _ModelFile, name: str, position: int, depth: int, seen: set[tuple[Path, str]]) -> set[str]:
    """Keys a helper ``name`` (of this module or imported into it, re-exports followed) reads from
    its argument ``position``."""
    target = f
    for _ in range(_DEPTH):
        if name in _functions(target) or name not in target.imports:
            break
        target = _model_file(target.root, target.imports[name])
    if (target.path, name) in seen:
        return set()
    seen.add((target.path, name))
    func = _functions(target).get(name)
    if func is None:
        return set()
    params = [a.arg for a in func.args.args]
    if params and params[0] == "self":
        params = params[1:]
    if position >= len(params):
        return set()
    # a parameter whose default names a key: get_communication_data_type(param_dict, comm_type=KEY)
    with_defaults = params[len(params) - len(func.args.defaults):] if func.args.defaults else []
    defaults = {p: [k] for p, d in zip(with_defaults, func.args.defaults) for k in [_key(d, target)] if k}
    return _reads(target, func, {params[position]}, depth, seen, defaults)


@lru_cache(maxsize=1)
def deepspeed_read_keys() -> frozenset[str]:
    """The top-level keys ``DeepSpeedConfig`` reads; empty when DeepSpeed is not installed here."""
    root = package_root("deepspeed")
    if root is None:
        return frozenset()
    f = _model_file(root, root / "runtime" / "config.py")
    if f.tree is None:
        return frozenset()
    seen: set[tuple[Path, str]] = set()  # the JSON is param_dict in the readers, config in DeepSpeedConfig.__init__
    return frozenset(_reads(f, f.tree, {"param_dict"}, 0, seen) | _helper(f, "DeepSpeedConfig", 0, 0, seen))


def model_sections(f: _ModelFile) -> dict[str, tuple[Path, str]]:
    """Keys read into a pydantic model, ``Model(**param_dict.get(KEY, {}))`` or
    ``Model(**param_dict[KEY])``, anywhere in ``f``: key -> (module of the model, its name)."""
    out: dict[str, tuple[Path, str]] = {}
    for node in ast.walk(f.tree) if f.tree is not None else ():
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        for kw in node.keywords:
            value, key = kw.value, None
            if kw.arg is not None:
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "get" \
                    and value.args:
                key = _key(value.args[0], f)
            elif isinstance(value, ast.Subscript):
                key = _key(value.slice, f)
            name = node.func.id
            if key is not None and name in f.imports:
                out[key] = (f.imports[name], name)
    return out


@lru_cache(maxsize=1)
def deepspeed_removed_keys() -> dict[str, str]:
    """Top-level keys DeepSpeed refuses (a feature it removed), with its own message."""
    root = package_root("deepspeed")
    if root is None:
        return {}
    dicts = string_dicts(_model_file(root, root / "runtime" / "config.py"))
    return dict(dicts.get("_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))


# ---- DeepSpeed --------------------------------------------------------------------------------------

_DS_MODELS = {  # section -> (file, pydantic class)
    "zero_optimization": ("runtime/zero/config.py", "DeepSpeedZeroConfig"),
    "bf16": ("runtime/precision_config.py", "DeepSpeedBF16Config"),
    "fp16": ("runtime/precision_config.py", "DeepSpeedFP16Config"),
    "tensorboard": ("monitor/config.py", "TensorBoardConfig"),
    "wandb": ("monitor/config.py", "WandbConfig"),
    "csv_monitor": ("monitor/config.py", "CSVConfig"),
    "comet": ("monitor/config.py", "CometConfig"),
    "comms_logger": ("comm/config.py", "CommsLoggerConfig"),
}
_DS_CONSTANTS = {  # section -> (constants file, prefix of its key names)
    "aio": ("runtime/swap_tensor/constants.py", "AIO_"),
    "activation_checkpointing": ("runtime/activation_checkpointing/config.py", "ACT_CHKPT_"),
    "flops_profiler": ("profiling/constants.py", "FLOPS_PROFILER_"),
}
_DTYPE = Key(frozenset({"str"}), choices=("fp32", "fp16", "bf16"))


@lru_cache(maxsize=1)
def deepspeed_keys() -> Section | None:
    """DeepSpeed's config keys as a tree, or None when DeepSpeed is not installed here."""
    root = package_root("deepspeed")
    if root is None:
        return None
    keys: dict[str, Key] = {}
    read = deepspeed_read_keys()
    tree = parse_source(root / "runtime" / "constants.py")
    if tree is not None:  # the kind and default of a key DeepSpeedConfig reads: NAME = "key", NAME_DEFAULT = value
        names = _constants(tree)
        for name, value in names.items():
            if not name.endswith(("_DEFAULT", "_FORMAT")) and isinstance(value, str) and value in read:
                default = names.get(name + "_DEFAULT", UNKNOWN)
                keys[value] = Key(_kinds_of_value(default) if default is not UNKNOWN else None, default=default)
    for section, (file, cls) in _DS_MODELS.items():
        keys[section] = Key(frozenset({"dict"}), section=read_model(root, root / file, cls))
    for section, (file, prefix) in _DS_CONSTANTS.items():
        keys[section] = Key(frozenset({"dict"}), section=read_constants(root / file, prefix))
    keys["bfloat16"] = replace(keys["bf16"], renamed_to="bf16", deprecated=True)
    keys["optimizer"] = Key(frozenset({"dict"}), section=Section({
        "type": Key(frozenset({"str"})), "params": Key(frozenset({"dict"}), section=OPEN),
        "legacy_fusion": Key(frozenset({"bool"}))}))
    keys["scheduler"] = Key(frozenset({"dict"}), section=Section({
        "type": Key(frozenset({"str"})), "params": Key(frozenset({"dict"}), section=OPEN)}))
    keys["data_types"] = Key(frozenset({"dict"}), section=Section({"grad_accum_dtype": _DTYPE}, open=True))
    keys["communication_data_type"] = _DTYPE
    config = _model_file(root, root / "runtime" / "config.py")
    for name, (path, cls) in model_sections(config).items():  # e.g. compile: CompileConfig(**param_dict.get(...))
        if name not in keys:
            keys[name] = Key(frozenset({"dict"}), section=read_model(root, path, cls))
    for name in read - set(keys):  # read by DeepSpeedConfig, its form not declared: any value
        keys[name] = Key()
    # deepspeed.initialize (deepspeed/__init__.py) builds a (data_parallel_size, sequence_parallel_size)
    # mesh of the processes when the config has both
    keys.setdefault("data_parallel_size", Key())
    for name, message in deepspeed_removed_keys().items():
        keys[name] = Key(unread=f"DeepSpeed refuses it: {message}")
    return Section(keys, ignores_unknown=True)  # DeepSpeedConfig reads what it knows, ignores the rest


@lru_cache(maxsize=1)
def deepspeed_optimizers() -> frozenset[str] | None:
    """The optimizer types DeepSpeed builds itself (``DEEPSPEED_OPTIMIZERS`` in runtime/config.py, in
    lower case; the engine looks any other type up in torch.optim); None when DeepSpeed is not
    installed here or the list cannot be read."""
    root = package_root("deepspeed")
    if root is None:
        return None
    f = _model_file(root, root / "runtime" / "config.py")
    for stmt in f.tree.body if f.tree is not None else ():
        if isinstance(stmt, ast.Assign) and [getattr(t, "id", None) for t in stmt.targets] == ["DEEPSPEED_OPTIMIZERS"] \
                and isinstance(stmt.value, (ast.List, ast.Tuple)):
            names = [_key(e, f) for e in stmt.value.elts]
            return frozenset(n for n in names if n is not None) if None not in names else None
    return None
