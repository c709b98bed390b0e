"""Read YAML text into plain data plus a map from each key's dotted path to its line.

Stricter than ``yaml.safe_load`` where silence would hide a mistake: duplicate keys are an
error, keys must be strings, and ``3e-4`` is a float (YAML 1.2) rather than the string
PyYAML's YAML 1.1 rules make of it. Where a value is text for another program (a script's
arguments, an environment variable: ``AS_WRITTEN``), an unquoted number is its text as written:
``1.0e-3``, ``007`` and ``0x10`` reach the script as such, not as ``0.001``, ``7`` and ``16``.

Bounded, for a document from anywhere (a colleague's YAML): at most ``MAX_NODES`` values once
aliases are expanded (a few hundred bytes of nested aliases would otherwise expand to billions),
no alias that contains itself, nesting at most ``MAX_DEPTH`` deep, integers of at most 30 digits in any base,
strings of at most ``MAX_STRING`` characters, no control characters (NUL, newline, ESC, ...) or
lone surrogates in any key or string, and every float finite.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from hfscale.config.errors import Problem

Path = tuple[str | int, ...]
MAX_NODES = 100_000  # a 3,000-host config is about 10,000
MAX_DEPTH = 32
MAX_STRING = 4096  # PATH_MAX
MAX_DIGITS = 30
# C0 controls but tab, DEL, C1 controls, line/paragraph separators, lone surrogates
CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


class _Checks:
    """What hfscale's loaders add to PyYAML's safe constructor: no duplicate keys, no huge numbers."""

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    raise yaml.constructor.ConstructorError(
                        None, None, "a key must be a plain value, not a list or mapping", key_node.start_mark
                    ) from None
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first defined on line {first})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):  # type: ignore[override]
        value = str(node.value).replace("_", "").lstrip("+-")
        body = value[2:] if value[:2].lower() in ("0x", "0o", "0b") else value  # 0x of 5,000 digits too
        digits = sum(c.isalnum() for c in body)
        if digits > MAX_DIGITS:
            raise _BigNumber(node, f"a number of {digits:,} digits (at most {MAX_DIGITS})")
        return super().construct_yaml_int(node)


class _BigNumber(yaml.constructor.ConstructorError):
    """An integer too long to be a setting (int() of more than 4,300 digits raises); ``node`` is
    found in the document for its key."""

    def __init__(self, node: yaml.Node, message: str):
        super().__init__(None, None, message, node.start_mark)
        self.node = node


def _path_to(root: yaml.Node, target: yaml.Node) -> Path:
    """The path of ``target`` in the tree under ``root`` (of its mapping, for a key); () if absent."""
    stack: list[tuple[yaml.Node, Path]] = [(root, ())]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if key_node is target:
                    return path
                stack.append((value_node, path + (str(key_node.value),)))
        elif isinstance(node, yaml.SequenceNode):
            stack += [(item, path + (i,)) for i, item in enumerate(node.value)]
    return ()


class _PyLoader(_Checks, yaml.SafeLoader):
    """PyYAML's own parser: the clearer error messages."""


# libyaml's parser (bundled with PyYAML's wheels) reads a 3,000-host config several times faster;
# a document it refuses is read again by the Python parser, for its message
_Loader = type("_Loader", (_Checks, getattr(yaml, "CSafeLoader", yaml.SafeLoader)), {})

for _cls in (_PyLoader, _Loader):
    _cls.add_constructor("tag:yaml.org,2002:int", _cls.construct_yaml_int)


class Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # type: ignore[misc]
    """SafeDumper (libyaml's emitter where there is one: a 3,000-host config in a tenth of the time)
    that quotes strings _Loader would read as numbers (e.g. '1e-3')."""


# YAML 1.2 floats without a dot (1e-4, 5E8): YAML 1.1 and so PyYAML read them as strings.
for _cls in (_PyLoader, _Loader, Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )


# The config's command-line words and environment values (config_base.Word, EnvValue): text for
# another program, so a number there is passed as written ("*": any key or index).
AS_WRITTEN: tuple[Path, ...] = (("training", "script_args", "*"), ("env", "vars", "*"),
                                ("env", "per_host", "*", "*"), ("network", "env", "*"))
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _as_written(node: yaml.Node, data: Any, pattern: Path) -> Any:
    """``data`` with each plain (unquoted) number at ``pattern`` below ``node`` replaced by its text
    as written; containers on the way are copied (an alias may share them with other places)."""
    if not pattern:
        # a plain scalar: style None (PyYAML's parser) or "" (libyaml's)
        plain_number = isinstance(node, yaml.ScalarNode) and not node.style and node.tag in _NUMBER_TAGS
        return node.value if plain_number and isinstance(data, (int, float)) and not isinstance(data, bool) else data
    head, rest = pattern[0], pattern[1:]
    if isinstance(node, yaml.MappingNode) and isinstance(data, dict):
        last = {k.value: v for k, v in node.value if isinstance(k, yaml.ScalarNode)}  # merged, then own: last wins
        changed = {k: new for k, v in last.items() if (head == "*" or k == head) and k in data
                   and (new := _as_written(v, data[k], rest)) is not data[k]}
        return {**data, **changed} if changed else data
    if isinstance(node, yaml.SequenceNode) and isinstance(data, list) and head == "*" and len(node.value) == len(data):
        items = [_as_written(n, d, rest) for n, d in zip(node.value, data)]
        return items if any(a is not b for a, b in zip(items, data)) else data
    return data


def dump(data: Any) -> str:
    """YAML text that ``parse`` reads back as the same data."""
    return yaml.dump(data, Dumper=Dumper, sort_keys=False)


def dotted(path: Path) -> str:
    """Render a path the way users write it: ``cluster.hosts[1].slots``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _line_map(node: yaml.Node, path: Path, lines: dict[Path, int], problems: list[Problem]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not (isinstance(key_node, yaml.ScalarNode) and key_node.tag == "tag:yaml.org,2002:str"):
                problems.append(
                    Problem(dotted(path), f"key {key_node.value} must be a string (quote it)", key_node.start_mark.line + 1)
                )
                continue
            child = path + (key_node.value,)
            lines[child] = key_node.start_mark.line + 1
            _line_map(value_node, child, lines, problems)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            child = path + (i,)
            lines[child] = item.start_mark.line + 1
            _line_map(item, child, lines, problems)


class Document:
    """Parsed YAML: ``data`` plus the line of every key and list item, and the problems of single
    values (control characters, length, non-finite numbers) to report beside the model's."""

    def __init__(self, data: Any, lines: dict[Path, int], value_problems: list[Problem] | None = None):
        self.data = data
        self.lines = lines
        self.value_problems = value_problems or []

    def line(self, path: Path) -> int | None:
        """Line of ``path`` or of its nearest ancestor that is in the file."""
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None


def _bounds(root: yaml.Node) -> Problem | None:
    """Why the node graph is too big, too deep or recursive once aliases are expanded, or None."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    # iterative depth-first walk: (node, depth, children done?)
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        if done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[key] > MAX_NODES:
                return Problem("", f"the document holds more than {MAX_NODES:,} values once its aliases are expanded",
                               node.start_mark.line + 1)
            continue
        if key in sizes:
            continue
        if key in on_path:
            return Problem("", "an alias refers to a node that contains it", node.start_mark.line + 1)
        if depth > MAX_DEPTH:
            return Problem("", f"nested more than {MAX_DEPTH} levels deep", node.start_mark.line + 1)
        on_path.add(key)
        stack.append((node, depth, True))
        stack += [(c, depth + 1, False) for c in children if id(c) not in sizes]
    return None


def _value_problems(data: Any, lines: dict[Path, int]) -> list[Problem]:
    """Control characters, over-long strings and non-finite numbers, each with its path and line."""
    out: list[Problem] = []
    stack: list[tuple[Path, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        where = dotted(path)
        line = lines.get(path)
        if isinstance(value, str):
            m = CONTROL.search(value)
            if m:
                out.append(Problem(where, f"holds the control character U+{ord(m.group()):04X} (at {m.start()}): "
                                          "values are single lines of printable text", line))
            elif len(value) > MAX_STRING:
                out.append(Problem(where, f"is {len(value):,} characters long (at most {MAX_STRING})", line))
        elif isinstance(value, float) and not math.isfinite(value):
            out.append(Problem(where, f"must be a finite number, got {value}", line))
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and (CONTROL.search(k) or len(k) > 256):
                    out.append(Problem(where, f"a key holds a control character or is too long: {k[:40]!r}", line))
                    continue
                stack.append((path + (k,), v))
        elif isinstance(value, list):
            stack += [(path + (i,), v) for i, v in enumerate(value)]
    return sorted(out, key=lambda p: (p.line is None, p.line or 0))


def _nesting(text: str, loader_cls: type) -> Problem | None:
    """Why ``text`` nests collections deeper than MAX_DEPTH, from the parser's events alone: libyaml
    builds nodes recursively, in C, so 100,000 ``[`` would overflow the stack (a crash, not an
    error) before _bounds could look at the tree. The event parser itself keeps its own stack."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=loader_cls):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    return Problem("", f"nested more than {MAX_DEPTH} levels deep", event.start_mark.line + 1)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError:
        return None  # composing reports it, with its line
    return None


def _documents(text: str, loader_cls: type, single: bool) -> list[tuple[yaml.Node | None, Any]]:
    """(root node, data) of each document of ``text`` (``single``: exactly one, PyYAML's rule), each
    checked for nesting, size and recursion before it is constructed; raises PyYAML's errors and
    ``_TooBig``."""
    too_deep = _nesting(text, loader_cls)
    if too_deep is not None:
        raise _TooBig(too_deep)
    loader = loader_cls(text)  # reads the stream: bad characters raise here already
    try:
        out = []
        while (single and not out) or (not single and loader.check_node()):
            root = loader.get_single_node() if single else loader.get_node()
            too_big = _bounds(root) if root is not None else None
            if too_big is not None:
                raise _TooBig(too_big)
            # one pass: the node tree gives the lines, the same tree is constructed into data
            try:
                out.append((root, loader.construct_document(root) if root is not None else None))
            except _BigNumber as e:  # told under its key, not as the document's
                raise _TooBig(Problem(dotted(_path_to(root, e.node)), str(e.problem), e.node.start_mark.line + 1)
                              ) from None
        return out
    finally:
        loader.dispose()


def _compose(text: str, loader_cls: type) -> tuple[yaml.Node | None, Any]:
    """(root node, data) of a one-document ``text``."""
    return _documents(text, loader_cls, single=True)[0]


class _TooBig(Exception):
    def __init__(self, problem: Problem):
        self.problem = problem


def parse(text: str) -> tuple[Document | None, list[Problem]]:
    """Parse YAML text; problems that stop everything (syntax, duplicates, non-mapping top level,
    size) come back as a list, those of single values in ``Document.value_problems``."""
    try:
        try:
            root, data = _compose(text, _Loader)
        except yaml.YAMLError:
            root, data = _compose(text, _PyLoader)  # for its message; it refuses the same documents
    except _TooBig as e:
        return None, [e.problem]
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        msg = " ".join(str(x) for x in (e.context, e.problem) if x) or str(e)
        return None, [Problem("", f"invalid YAML: {msg}", mark.line + 1 if mark else None)]
    except yaml.YAMLError as e:
        return None, [Problem("", f"invalid YAML: {e}")]
    except (RecursionError, ValueError, OverflowError) as e:
        return None, [Problem("", f"invalid YAML: {e}"[:200])]
    if data is None:
        return None, [Problem("", "the file is empty; `hfscale init` writes a template to start from")]
    if not isinstance(data, dict):
        line = root.start_mark.line + 1 if root is not None else None
        return None, [Problem("", f"the top level must be a mapping of keys, not a {type(data).__name__}", line)]
    lines: dict[Path, int] = {}
    problems: list[Problem] = []
    _line_map(root, (), lines, problems)
    for pattern in AS_WRITTEN:
        data = _as_written(root, data, pattern)
    return Document(data, lines, _value_problems(data, lines)), problems


def dump_all(docs: list[Any]) -> str:
    """Documents as multi-document YAML (``---`` between them)."""
    return "---\n".join(dump(d) for d in docs)


def parse_all(text: str) -> list[Any]:
    """Every document of a multi-document YAML text (``---`` between them), each as bounded as
    :func:`parse` makes one (size once aliases are expanded, depth, no recursive alias, number
    size). Raises ValueError with the reason."""
    try:
        return [data for _, data in _documents(text, _Loader, single=False)]
    except _TooBig as e:
        raise ValueError(f"{e.problem.path}: {e.problem.message}" if e.problem.path else e.problem.message) from None
    except (yaml.YAMLError, RecursionError, OverflowError) as e:
        raise ValueError(f"invalid YAML: {e}"[:300]) from None
