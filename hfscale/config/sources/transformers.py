"""The config classes of the installed transformers, read from its source without importing it.

Importing a transformers config class imports torch (seconds), and ``hfscale check`` must stay
fast and torch-free. The classes are declarations that can be read as data: transformers 5
declares every field with a type annotation and a default (a strict dataclass), transformers 4 as
keyword arguments of ``__init__``. This module finds the class of a ``model_type`` (the file its
name leads to, else ``CONFIG_MAPPING_NAMES``), and reads with :mod:`ast` its fields (which YAML
kinds each takes, literal choices, defaults), its base config classes', its ``attribute_map``
aliases and the legacy keyword names it reads from ``**kwargs``. ``schema`` returns None for a
class it cannot read; hfscale.config.model_config checks a mapping against what it returns.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from hfscale.config.sources.engine import package_root, parse_source

_BASES = {"PreTrainedConfig", "PretrainedConfig"}
UNKNOWN = object()
_MODEL_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,79}$")  # a default that is not a literal
# Keys every config accepts whatever its declarations say (PreTrainedConfig's own keywords).
COMMON = frozenset({"model_type", "torch_dtype", "dtype", "num_labels", "id2label", "label2id", "tie_word_embeddings",
                     "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                     "use_cache", "attn_implementation", "output_attentions", "output_hidden_states", "return_dict",
                     "architectures", "problem_type", "is_encoder_decoder", "chunk_size_feed_forward"})
KIND_OF = {bool: "bool", int: "int", float: "float", str: "str", type(None): "none", list: "list", dict: "dict"}


@dataclass(frozen=True)
class FieldSpec:
    """One declared field: which YAML kinds it takes (None: anything), literal choices, default."""

    name: str
    kinds: frozenset[str] | None
    literals: tuple[Any, ...] | None = None
    items: frozenset[str] | None = None  # element kinds of list[...] fields
    default: Any = UNKNOWN


@dataclass(frozen=True)
class ConfigSchema:
    """What a config class accepts, read from transformers' source."""

    model_type: str
    class_name: str
    fields: dict[str, FieldSpec]
    aliases: dict[str, str] = field(default_factory=dict)  # attribute_map: alias -> field
    keywords: frozenset[str] = frozenset()  # legacy keyword names the class reads from **kwargs

    def accepted(self) -> set[str]:
        return set(self.fields) | set(self.aliases) | set(self.keywords) | COMMON

    def spec(self, key: str) -> FieldSpec | None:
        return self.fields.get(self.aliases.get(key, key))


# ---- reading transformers' source ----------------------------------------------------------------


def _root() -> Path | None:
    return package_root("transformers")


_module = parse_source


def _string_pairs(node: ast.AST) -> list[tuple[str, str]]:
    """Every ``"a": "b"`` or ``("a", "b")`` inside ``node``, in source order."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Dict):
            out += [(k.value, v.value) for k, v in zip(n.keys, n.values)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
                    and isinstance(k.value, str) and isinstance(v.value, str)]
        elif isinstance(n, ast.Tuple) and len(n.elts) == 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in n.elts):
            out.append((n.elts[0].value, n.elts[1].value))  # type: ignore[union-attr]
    return out


def _named_pairs(tree: ast.Module, name: str) -> dict[str, str]:
    """String pairs assigned to, or ``.update``d into, the module-level mapping ``name``."""
    out: dict[str, str] = {}
    for stmt in tree.body:
        target = None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            target = stmt.targets[0].id
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            f = stmt.value.func
            if isinstance(f, ast.Attribute) and f.attr == "update" and isinstance(f.value, ast.Name):
                target = f.value.id
        if target == name:
            out.update(_string_pairs(stmt))
    return out


@lru_cache(maxsize=1)
def _mappings() -> tuple[dict[str, str], dict[str, str]]:
    """(model_type -> config class name, model_type -> module name) of the installed transformers."""
    root = _root()
    names: dict[str, str] = {}
    modules: dict[str, str] = {}
    if root is None:
        return names, modules
    for rel in ("models/auto/auto_mappings.py", "models/auto/configuration_auto.py"):
        tree = _module(root / rel)
        if tree is not None:
            names.update(_named_pairs(tree, "CONFIG_MAPPING_NAMES"))
            modules.update(_named_pairs(tree, "SPECIAL_MODEL_TYPE_TO_MODULE_NAME"))
    return names, modules


def model_types() -> list[str]:
    """Every model_type the installed transformers knows (empty if it is not installed)."""
    return sorted(_mappings()[0])


def _kinds(node: ast.AST | None) -> tuple[frozenset[str] | None, tuple | None, frozenset[str] | None]:
    """(kinds, literal choices, list item kinds) of a type annotation; kinds None: anything."""
    if node is None:
        return None, None, None
    if isinstance(node, ast.Constant):
        if node.value is None:
            return frozenset({"none"}), None, None
        if isinstance(node.value, str):  # a forward reference such as "PreTrainedConfig"
            try:
                return _kinds(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return None, None, None
        return None, None, None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union([node.left, node.right])
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    if name is not None:
        simple = {"int": "int", "float": "float", "bool": "bool", "str": "str", "list": "list", "tuple": "list",
                  "Sequence": "list", "set": "list", "dict": "dict", "Mapping": "dict"}
        return (frozenset({simple[name]}), None, None) if name in simple else (None, None, None)
    if isinstance(node, ast.Subscript):
        head = node.value.id if isinstance(node.value, ast.Name) else (
            node.value.attr if isinstance(node.value, ast.Attribute) else "")
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Optional":
            kinds, lits, items = _kinds(args[0])
            return (kinds | {"none"} if kinds is not None else None), lits, items
        if head == "Union":
            return _union(args)
        if head == "Literal":
            values = tuple(a.value for a in args if isinstance(a, ast.Constant))
            if len(values) != len(args):
                return None, None, None
            kinds = frozenset(KIND_OF.get(type(v), "str") for v in values)
            return kinds, values, None
        if head == "Annotated":
            return _kinds(args[0])
        if head in ("list", "tuple", "Sequence", "set", "List", "Tuple"):
            item = _kinds(args[0])[0] if head in ("list", "List", "Sequence", "set") else None
            return frozenset({"list"}), None, item
        if head in ("dict", "Dict", "Mapping"):
            return frozenset({"dict"}), None, None
    return None, None, None


def _union(parts: list[ast.AST]) -> tuple[frozenset[str] | None, tuple | None, frozenset[str] | None]:
    kinds: set[str] = set()
    literals: list[Any] = []
    items: set[str] = set()
    free = False  # a member that is not a Literal (e.g. str | Literal[...]) lifts the choices
    for p in parts:
        k, lits, it = _kinds(p)
        if k is None:
            return None, None, None
        kinds |= k
        if lits is not None:
            literals += lits
        elif k != {"none"}:
            free = True
        items |= it or set()
    return frozenset(kinds), (tuple(literals) if literals and not free else None), (frozenset(items) or None)


def _literal(node: ast.AST | None) -> Any:
    try:
        return ast.literal_eval(node) if node is not None else UNKNOWN
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return UNKNOWN


def _popped_keywords(cls: ast.ClassDef) -> set[str]:
    """Names the instance methods read with ``kwargs.pop("name", ...)`` / ``kwargs.get("name", ...)``
    (legacy keywords such as ``rope_scaling``; loading and saving options are not config keys)."""
    out = set()
    for f in cls.body:
        if not (isinstance(f, ast.FunctionDef) and f.args.args and f.args.args[0].arg == "self"
                and not f.name.startswith(("save", "push", "to_"))):
            continue
        for n in ast.walk(f):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("pop", "get")
                    and isinstance(n.func.value, ast.Name) and n.func.value.id == "kwargs" and n.args
                    and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)
                    and not n.args[0].value.startswith("_")):
                out.add(n.args[0].value)
    return out


@dataclass
class _ClassInfo:
    fields: dict[str, FieldSpec]
    aliases: dict[str, str]
    keywords: set[str]


def _is_classvar(ann: ast.AST) -> bool:
    head = ann.value if isinstance(ann, ast.Subscript) else ann
    return (isinstance(head, ast.Name) and head.id == "ClassVar") or (
        isinstance(head, ast.Attribute) and head.attr == "ClassVar")


def _class_info(cls: ast.ClassDef) -> _ClassInfo:
    fields: dict[str, FieldSpec] = {}
    aliases: dict[str, str] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            name = stmt.target.id
            if name.startswith("__") or _is_classvar(stmt.annotation):
                continue
            kinds, lits, items = _kinds(stmt.annotation)
            fields[name] = FieldSpec(name, kinds, lits, items, _literal(stmt.value))
        elif isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "attribute_map" for t in stmt.targets):
            aliases.update(_string_pairs(stmt.value))
        elif isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            # transformers 4: the fields are __init__'s keyword arguments (types from the defaults)
            a = stmt.args
            named = a.args[1:] + a.kwonlyargs
            defaults = [None] * (len(a.args) - 1 - len(a.defaults)) + list(a.defaults) + list(a.kw_defaults)
            for arg, default in zip(named, defaults):
                value = _literal(default)
                if arg.annotation is not None:
                    kinds, lits, items = _kinds(arg.annotation)
                else:
                    kinds, lits, items = _kinds_of_default(value), None, None
                fields[arg.arg] = FieldSpec(arg.arg, kinds, lits, items, value)
    return _ClassInfo(fields, aliases, _popped_keywords(cls))


def _kinds_of_default(value: Any) -> frozenset[str] | None:
    # transformers 4 keyword defaults say little: a number default still takes the other number kind
    if value is UNKNOWN or value is None:
        return None
    kind = KIND_OF.get(type(value))
    if kind in ("int", "float"):
        return frozenset({"int", "float"})
    return frozenset({kind}) if kind else None


def _find_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _import_source(tree: ast.Module, name: str, here: Path) -> Path | None:
    """The file a module-level ``from .x import name`` takes ``name`` from (relative imports only)."""
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.level and any(a.name == name and a.asname is None for a in stmt.names):
            base = here.parent
            for _ in range(stmt.level - 1):
                base = base.parent
            path = base.joinpath(*(stmt.module or "").split("."))
            for candidate in (path.with_suffix(".py"), path / "__init__.py"):
                if candidate.is_file():
                    return candidate
    return None


def _locate(path: Path, name: str, depth: int = 0) -> tuple[Path, ast.ClassDef] | None:
    """Class ``name`` as seen from module ``path``: defined there, or imported (relatively) into it."""
    tree = _module(path)
    if tree is None or depth > 8:
        return None
    cls = _find_class(tree, name)
    if cls is not None:
        return path, cls
    source = _import_source(tree, name, path)
    return _locate(source, name, depth + 1) if source is not None else None


def _merged(path: Path, name: str, depth: int = 0, bases: bool = True) -> _ClassInfo | None:
    """Fields of class ``name`` (seen from ``path``) with its bases' (None when unreadable).
    ``bases`` False: the class's own declarations only, when its one base is PreTrainedConfig."""
    found = _locate(path, name)
    if found is None or depth > 8:
        return None
    path, cls = found
    merged = _ClassInfo({}, {}, set())
    for base in cls.bases:
        bname = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if bname is None:
            return None
        if bname in ("object", "PushToHubMixin", "Generic"):
            continue
        if not bases and bname in _BASES:
            continue
        info = _merged(path, bname, depth + 1)
        if info is None:
            return None
        merged.fields.update(info.fields)
        merged.aliases.update(info.aliases)
        merged.keywords |= info.keywords
    own = _class_info(cls)
    merged.fields.update(own.fields)
    merged.aliases.update(own.aliases)
    merged.keywords |= own.keywords
    return merged


def _declares(cls: ast.ClassDef, model_type: str) -> bool:
    return any(isinstance(s, (ast.Assign, ast.AnnAssign)) and isinstance(getattr(s, "value", None), ast.Constant)
               and s.value.value == model_type  # type: ignore[union-attr]
               and any(isinstance(t, ast.Name) and t.id == "model_type"
                       for t in (s.targets if isinstance(s, ast.Assign) else [s.target]))
               for s in cls.body)


def _class_of(model_type: str) -> tuple[Path, str] | None:
    """(file, class name) of ``model_type``'s config class: the file its name leads to, when a class
    there declares that model_type (most do: no need to read the mapping of all 800), else the mapping."""
    root = _root()
    if root is None or not _MODEL_TYPE.match(model_type):  # it becomes part of a path: no '/', no '..'
        return None
    module = model_type.replace("-", "_")
    guess = root / "models" / module / f"configuration_{module}.py"
    tree = _module(guess) if guess.is_file() else None
    for cls in (tree.body if tree is not None else []):
        if isinstance(cls, ast.ClassDef) and _declares(cls, model_type):
            return guess, cls.name
    names, modules = _mappings()
    if model_type not in names:
        return None
    module = modules.get(model_type, module)
    path = root / "models" / Path(*module.split(".")) / f"configuration_{module.split('.')[-1]}.py"
    return path, names[model_type]


@lru_cache(maxsize=None)
def schema(model_type: str, bases: bool = True) -> ConfigSchema | None:
    """The schema of ``model_type``'s config class, or None when it cannot be read from source.
    ``bases`` False: without PreTrainedConfig's own fields (enough when every key is the class's)."""
    found = _class_of(model_type)
    info = _merged(*found, bases=bases) if found is not None else None
    if info is None or not info.fields:
        return None
    return ConfigSchema(model_type, found[1], info.fields, info.aliases, frozenset(info.keywords))  # type: ignore[index]
