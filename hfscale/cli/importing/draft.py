"""The hfscale YAML that ``hfscale import`` builds: values at dotted paths, a comment per value,
and the problems (what the source files hold that hfscale cannot express), then emitted as text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from hfscale.config.errors import Problem

AUTO = "auto"
TRUE_WORDS = {"true": True, "false": False, "yes": True, "no": False}


def as_bool(value: Any) -> Any:
    """accelerate writes some booleans as text ('true'); anything else unchanged."""
    return TRUE_WORDS.get(value.lower(), value) if isinstance(value, str) else value


@dataclass
class Draft:
    """What the import has found so far."""

    data: dict[str, Any] = field(default_factory=dict)
    comments: dict[tuple[str, ...], str] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # printed at the top of the file
    source: str = ""  # the file being read now, for origins
    origins: dict[tuple[str, ...], str] = field(default_factory=dict)  # hfscale path -> "file: key as written"
    renames: dict[str, tuple[dict[str, str], str]] = field(default_factory=dict)  # see rename

    def set(self, path: tuple[str, ...], value: Any, comment: str | None = None, key: str | None = None) -> None:
        """``value`` at ``path``; ``key``: the source key it comes from, as written in ``source``."""
        node = self.data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        if comment:
            self.comments[path] = comment
        if key is not None:
            self.origins[path] = f"{self.source}: {key}"

    def rename(self, source: str, names: dict[str, str], to: str, since: int = 0) -> None:
        """Keys read from ``source`` are told under the names ``names`` maps them to, in file
        ``to``: in the problems from index ``since`` on now, and in origins when a problem is
        traced (accelerate's inline DeepSpeed keys, which hfscale reads as the DeepSpeed config
        accelerate builds from them)."""
        self.renames[source] = (names, to)
        self.problems[since:] = [Problem(self._told(p.path), p.message, p.line) for p in self.problems[since:]]

    def _told(self, where: str) -> str:
        for source, (names, to) in self.renames.items():
            if where.startswith(f"{source}: "):
                key = where[len(source) + 2:]
                for name in sorted(names, key=len, reverse=True):
                    if key == name or key.startswith(name + "."):
                        return f"{to}: {names[name]}{key[len(name):]}"
                return f"{to}: {key}"
        return where

    def origin_of(self, problem: Problem) -> Problem:
        """A problem found in the YAML the import wrote, told as a problem of the file and key it
        came from (that YAML was never written, so its lines mean nothing to the user)."""
        parts = tuple(problem.path.split(".")) if problem.path else ()
        for n in range(len(parts), 0, -1):
            if parts[:n] in self.origins:
                rest = ".".join(parts[n:])
                return Problem(self._told(self.origins[parts[:n]] + (f".{rest}" if rest else "")), problem.message)
        return Problem(f"{problem.path or '<document>'} (hfscale's key; no key of the sources sets it)", problem.message)

    def get(self, path: tuple[str, ...], default: Any = None) -> Any:
        node: Any = self.data
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def refuse(self, where: str, message: str) -> None:
        self.problems.append(Problem(where, message))


def _scalar(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _emit(node: dict[str, Any], path: tuple[str, ...], comments: dict, out: list[str]) -> None:
    pad = "  " * len(path)
    for key, value in node.items():
        here = path + (key,)
        note = f"  # {comments[here]}" if here in comments else ""
        if isinstance(value, dict) and value and not (len(here) >= 2 and here[-2] == "extra"):
            out.append(f"{pad}{key}:{note}")
            _emit(value, here, comments, out)
        else:
            out.append(f"{pad}{key}: {_scalar(value)}{note}")


def render_draft(draft: Draft, header: list[str]) -> str:
    """The YAML text: header lines, notes, then the values with their comments."""
    out = [f"# {line}" for line in header]
    if draft.notes:
        out.append("#")
        out += [f"# - {n}" for n in draft.notes]
    out.append("")
    _emit(draft.data, (), draft.comments, out)
    return "\n".join(out) + "\n"
