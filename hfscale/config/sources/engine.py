"""The config keys of the installed DeepSpeed, and the readers for libraries' declarations.

Importing either imports torch (seconds), and ``hfscale check`` must stay fast and torch-free. Both
declare their keys as data that :mod:`ast` can read: DeepSpeed as pydantic models (fields, aliases,
``Field(ge=...)`` bounds, deprecated fields with their ``new_param``) and as ``NAME = "key"`` /
``NAME_DEFAULT = value`` constants; accelerate as the dataclass its config file is loaded into
(``ClusterConfig``) and the ``add_argument("--key")`` calls of ``accelerate launch``
(hfscale.config.sources.accelerate). What cannot be read stays open (any key accepted there) rather than
refused.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

UNKNOWN = object()
_SCALAR = frozenset({"bool", "int", "float", "str", "none"})
_KINDS = {"bool": {"bool"}, "int": {"int"}, "float": {"int", "float"}, "str": {"str"}, "Path": {"str"},
          "list": {"list"}, "List": {"list"}, "tuple": {"list"}, "dict": {"dict"}, "Dict": {"dict"}}
KIND_OF = {bool: "bool", int: "int", float: "float", str: "str", type(None): "none", list: "list", dict: "dict"}


@dataclass(frozen=True)
class Key:
    """One key: the YAML kinds it takes (None: any), literal choices, bounds, default, a nested
    section, and for a deprecated or alternative name the key it stands for."""

    kinds: frozenset[str] | None = None
    choices: tuple[Any, ...] | None = None
    bounds: tuple[tuple[str, float], ...] = ()
    default: Any = UNKNOWN
    section: Section | None = None
    renamed_to: str | None = None  # an old or alternative spelling of this key
    deprecated: bool = False  # with renamed_to: DeepSpeed still reads it, under a new name
    transformed: bool = False  # deprecated, and its value means something else under the new name
    unread: str | None = None  # why the library never reads this key where it stands
    any_case: bool = False  # the library folds the value's case before comparing it with the choices


@dataclass(frozen=True)
class Section:
    """The keys of one mapping; ``open``: others are accepted too (not readable from source)."""

    keys: dict[str, Key] = field(default_factory=dict)
    open: bool = False
    ignores_unknown: bool = False  # the library skips keys it does not know here (DeepSpeed's top level)

    def canonical(self, name: str) -> str:
        """``name`` after following renames (``bfloat16`` -> ``bf16``)."""
        seen = set()
        while name in self.keys and self.keys[name].renamed_to and name not in seen:
            seen.add(name)
            name = self.keys[name].renamed_to  # type: ignore[assignment]
        return name


OPEN = Section(open=True)


@lru_cache(maxsize=None)
def package_root(name: str) -> Path | None:
    """The directory of installed package ``name``, found without running it; None if absent."""
    try:
        spec = importlib.util.find_spec(name)  # finds the package without running it
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=None)
def parse_source(path: Path) -> ast.Module | None:
    """The syntax tree of a source file; None if it cannot be read or parsed."""
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _constants(tree: ast.Module) -> dict[str, Any]:
    """Module-level ``NAME = literal`` assignments."""
    out: dict[str, Any] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value = _literal(stmt.value, out)
            if value is not UNKNOWN:
                out[stmt.targets[0].id] = value
    return out


def _literal(node: ast.AST | None, names: dict[str, Any]) -> Any:
    """The value of a literal expression (names of known constants, ``pp_int(5e8)`` included)."""
    if node is None:
        return UNKNOWN
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("pp_int", "int", "float"):
        inner = _literal(node.args[0], names) if node.args else UNKNOWN
        if isinstance(inner, (int, float)) and not isinstance(inner, bool):
            return float(inner) if node.func.id == "float" else int(inner)
        return UNKNOWN
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return UNKNOWN


def _kinds_of_value(value: Any) -> frozenset[str] | None:
    kind = KIND_OF.get(type(value))
    if kind is None or kind == "none":
        return None
    return frozenset({"int", "float"}) if kind == "float" else frozenset({kind})


# ---- pydantic models (DeepSpeed) -------------------------------------------------------------------


class _ModelFile:
    """The classes, enums and imports of one source file, to read pydantic models from."""

    def __init__(self, root: Path, path: Path):
        self.root, self.path = root, path
        tree = parse_source(path)
        self.tree = tree
        self.classes: dict[str, ast.ClassDef] = {}
        self.enums: dict[str, tuple[Any, ...]] = {}
        self.imports: dict[str, Path] = {}
        self.constants = _constants(tree) if tree else {}
        if tree is None:
            return
        for stmt in tree.body:
            if isinstance(stmt, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in stmt.bases}
                if "Enum" in bases:
                    self.enums[stmt.name] = tuple(
                        v for s in stmt.body if isinstance(s, ast.Assign)
                        for v in [_literal(s.value, self.constants)] if v is not UNKNOWN)
                else:
                    self.classes[stmt.name] = stmt
            elif isinstance(stmt, ast.ImportFrom):
                target = self._module_path(stmt)
                if target is not None:
                    for alias in stmt.names:
                        self.imports[alias.asname or alias.name] = target
                    imported = parse_source(target)
                    if imported is not None:  # defaults named by imported constants (from .constants import *)
                        names = _constants(imported)
                        wanted = {a.name for a in stmt.names}
                        self.constants.update({k: v for k, v in names.items() if "*" in wanted or k in wanted})

    def _module_path(self, stmt: ast.ImportFrom) -> Path | None:
        parts = (stmt.module or "").split(".") if stmt.module else []
        if stmt.level:
            base = self.path.parent
            for _ in range(stmt.level - 1):
                base = base.parent
        elif parts and parts[0] == self.root.name:
            base, parts = self.root, parts[1:]
        else:
            return None
        candidate = base.joinpath(*parts).with_suffix(".py") if parts else base / "__init__.py"
        if parts and not candidate.is_file():  # a package: its __init__.py
            candidate = base.joinpath(*parts) / "__init__.py"
        return candidate if candidate.is_file() else None


@lru_cache(maxsize=None)
def _model_file(root: Path, path: Path) -> _ModelFile:
    return _ModelFile(root, path)


def read_model(root: Path, path: Path, name: str, depth: int = 0) -> Section:
    """The keys of pydantic model ``name`` defined (or imported) in ``path``; OPEN if unreadable."""
    f = _model_file(root, path)
    if name not in f.classes:
        if name in f.imports and depth < 8:
            return read_model(root, f.imports[name], name, depth + 1)
        return OPEN
    cls = f.classes[name]
    keys: dict[str, Key] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id not in ("DeepSpeedConfigModel", "BaseModel") and depth < 8:
            keys.update(read_model(root, path, base.id, depth + 1).keys)
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            keys.update(_field(root, f, stmt, depth))
    # an old name's new_param may be a field name with an alias: point it at the alias
    aliases = {n: k.renamed_to for n, k in keys.items() if k.renamed_to and not k.deprecated}
    for n, k in list(keys.items()):
        if k.deprecated and k.renamed_to in aliases:
            keys[n] = replace(k, renamed_to=aliases[k.renamed_to])
    return Section(keys)


def _field(root: Path, f: _ModelFile, stmt: ast.AnnAssign, depth: int) -> dict[str, Key]:
    name = stmt.target.id  # type: ignore[union-attr]
    kinds, choices, section = _annotation(root, f, stmt.annotation, depth)
    default: Any = UNKNOWN
    bounds: list[tuple[str, float]] = []
    alias = renamed = None
    deprecated = transformed = False
    value = stmt.value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Field":
        if value.args:
            default = _literal(value.args[0], f.constants)
        for kw in value.keywords:
            if kw.arg == "default":
                default = _literal(kw.value, f.constants)
            elif kw.arg == "alias":
                alias = _literal(kw.value, f.constants)
            elif kw.arg in ("ge", "gt", "le", "lt"):
                bound = _literal(kw.value, f.constants)
                if isinstance(bound, (int, float)):
                    bounds.append((kw.arg, bound))
            elif kw.arg in ("json_schema_extra", "deprecated"):
                extra = kw.value
                if isinstance(extra, ast.Dict):
                    meta = {k.value: v for k, v in zip(extra.keys, extra.values) if isinstance(k, ast.Constant)}
                    deprecated = _literal(meta.get("deprecated"), {}) is True
                    new = _literal(meta.get("new_param"), {})
                    renamed = new if isinstance(new, str) and new.isidentifier() else None
                    transformed = "new_param_fn" in meta or _literal(meta.get("set_new_param"), {}) is False
                elif _literal(extra, {}) is True:
                    deprecated = True
    elif value is not None:
        default = _literal(value, f.constants)
    key = Key(kinds, choices, tuple(bounds), default, section, renamed, deprecated, transformed)
    if isinstance(alias, str):
        return {alias: key, name: Key(kinds, choices, tuple(bounds), default, section, renamed_to=alias)}
    return {name: key}


def _annotation(root: Path, f: _ModelFile, node: ast.AST | None, depth: int
                ) -> tuple[frozenset[str] | None, tuple[Any, ...] | None, Section | None]:
    """(kinds, choices, nested section) of a type annotation; kinds None means any."""
    if isinstance(node, ast.Constant) and node.value is None:
        return frozenset({"none"}), None, None
    if isinstance(node, ast.Name):
        if node.id in _KINDS:
            return frozenset(_KINDS[node.id]), None, None
        if node.id in f.enums:
            values = f.enums[node.id]
            return frozenset(KIND_OF.get(type(v), "str") for v in values), values, None
        if depth < 8 and (node.id in f.classes or node.id in f.imports):
            sub = read_model(root, f.path, node.id, depth + 1)
            if sub is not OPEN:
                return frozenset({"dict"}), None, sub
        return None, None, None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        parts = [_annotation(root, f, n, depth) for n in (node.left, node.right)]
        return _union(parts)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        outer = node.value.id
        inner = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if outer == "Optional":
            kinds, choices, sub = _annotation(root, f, inner[0], depth)
            return (kinds | {"none"} if kinds is not None else None), (choices + (None,) if choices else None), sub
        if outer == "Union":
            return _union([_annotation(root, f, n, depth) for n in inner])
        if outer == "Literal":
            values = tuple(_literal(n, f.constants) for n in inner)
            return frozenset(KIND_OF.get(type(v), "str") for v in values), values, None
        if outer in _KINDS:
            return frozenset(_KINDS[outer]), None, None
    return None, None, None


def _union(parts: list[tuple[frozenset[str] | None, tuple[Any, ...] | None, Section | None]]
           ) -> tuple[frozenset[str] | None, tuple[Any, ...] | None, Section | None]:
    if any(kinds is None for kinds, _, _ in parts):
        return None, None, None
    kinds = frozenset().union(*(k for k, _, _ in parts))  # type: ignore[arg-type]
    sections = [s for _, _, s in parts if s is not None]
    return kinds, None, sections[0] if sections else None


# ---- constants modules (DeepSpeed's dict-based sections) --------------------------------------------


def read_constants(path: Path, prefix: str) -> Section:
    """Keys ``NAME = "key"`` with ``NAME`` starting with ``prefix``; their kind from ``NAME_DEFAULT``."""
    tree = parse_source(path)
    if tree is None:
        return OPEN
    names = _constants(tree)
    keys: dict[str, Key] = {}
    for name, value in names.items():
        if (name.startswith(prefix) and not name.endswith(("_DEFAULT", "_FORMAT")) and isinstance(value, str)
                and value.isidentifier() and value.islower()):
            default = names.get(name + "_DEFAULT", UNKNOWN)
            keys[value] = Key(_kinds_of_value(default) if default is not UNKNOWN else None, default=default)
    return Section(keys) if keys else OPEN
