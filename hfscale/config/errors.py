"""The one error type of hfscale: every problem found in a config, each with its place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where (dotted YAML path, line) and what."""

    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = self.path or "<document>"
        if self.line is not None:
            where = f"{where} (line {self.line})"
        return f"{where}: {self.message}"


class ConfigError(Exception):
    """Raised with every problem of a config at once, never just the first."""

    def __init__(self, source: str, problems: list[Problem] | tuple[Problem, ...]):
        self.source = source
        self.problems = tuple(problems)
        super().__init__(self.render())

    def render(self) -> str:
        n = len(self.problems)
        head = f"{self.source}: {n} problem{'s' if n != 1 else ''}"
        return "\n".join([head] + [f"  - {p}" for p in self.problems])
