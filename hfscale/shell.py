"""Processes as data, and the one place where argv becomes a shell line.

Every word is quoted with ``shlex.quote`` unless it is a ``Raw`` word that hfscale wrote itself
(an operator or a ``"$VAR"`` reference); values from configs are never ``Raw``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Iterable, Mapping


class Raw(str):
    """A shell word hfscale composed itself and that must not be quoted."""


def quote(word: str) -> str:
    return word if isinstance(word, Raw) else shlex.quote(word)


def join(words: Iterable[str]) -> str:
    """A shell line from words: every word quoted except ``Raw`` ones."""
    return " ".join(quote(w) for w in words)


def exports(env: Mapping[str, str]) -> str:
    """``export K='v' ...`` for ``env`` (names are validated identifiers, values quoted)."""
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) if env else ""


@dataclass(frozen=True)
class Command:
    """One local process: argv, the variables added to the environment, and the directory."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    stdin: str | None = None  # text fed to the process (kept off disk: it may hold secrets)

    def shell(self) -> str:
        """The command as one shell line a person can read and paste."""
        parts = []
        if self.cwd:
            parts.append(f"cd {shlex.quote(self.cwd)} &&")
        if self.env:
            parts.append(" ".join(f"{k}={shlex.quote(v)}" for k, v in self.env))
        parts.append(join(self.argv))
        return " ".join(parts)
