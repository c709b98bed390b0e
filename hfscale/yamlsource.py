"""Read YAML text into plain data plus a map from each key's dotted path to its line.

Stricter than ``yaml.safe_load`` where silence would hide a mistake: duplicate keys are an
error, keys must be strings, and ``3e-4`` is a float (YAML 1.2) rather than the string
PyYAML's YAML 1.1 rules make of it.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from .errors import Problem

Path = tuple[str | int, ...]


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys."""

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


class Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings _Loader would read as numbers (e.g. '1e-3')."""


# YAML 1.2 floats without a dot (1e-4, 5E8): YAML 1.1 and so PyYAML read them as strings.
for _cls in (_Loader, Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )


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
    """Parsed YAML: ``data`` plus the line of every key and list item."""

    def __init__(self, data: Any, lines: dict[Path, int]):
        self.data = data
        self.lines = lines

    def line(self, path: Path) -> int | None:
        """Line of ``path`` or of its nearest ancestor that is in the file."""
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None


def parse(text: str) -> tuple[Document | None, list[Problem]]:
    """Parse YAML text; problems (syntax, duplicates, non-mapping top level) come back as a list."""
    loader = None
    try:
        loader = _Loader(text)  # reads the stream: bad characters raise here already
        # one pass: the node tree gives the lines, the same tree is constructed into data
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        msg = " ".join(str(x) for x in (e.context, e.problem) if x) or str(e)
        return None, [Problem("", f"invalid YAML: {msg}", mark.line + 1 if mark else None)]
    except yaml.YAMLError as e:
        return None, [Problem("", f"invalid YAML: {e}")]
    except RecursionError:
        return None, [Problem("", "invalid YAML: nested too deeply")]
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        return None, [Problem("", "the file is empty; `hfscale init` writes a template to start from")]
    if not isinstance(data, dict):
        line = root.start_mark.line + 1 if root is not None else None
        return None, [Problem("", f"the top level must be a mapping of keys, not a {type(data).__name__}", line)]
    lines: dict[Path, int] = {}
    problems: list[Problem] = []
    _line_map(root, (), lines, problems)
    return Document(data, lines), problems
