"""Commands as data, with typed words, and the one place where words become text.

A word is literal text (``str``), a ``Secret`` (a value that must never be shown), a ``Var`` (a
variable set where the command runs: ``"$NAME"`` in a shell, ``$(NAME)`` for Kubernetes) or a
``Cat`` of those. A shell line hfscale composes (for ``bash -c``, srun, pdsh) is a ``Line`` of
words, ``NAME=word`` assignments and ``Sh`` syntax. A plan holds the real values once; rendering
decides what they become: ``shown=True`` for everything printed or written (secrets as ``***``),
``shown=False`` for the process itself. Literal text is always quoted in a shell line; only
``Sh`` (shell syntax hfscale wrote, and ``runner.setup``) is emitted as written. The types are not
``str``: joining a secret into plain text is a TypeError, not a silent leak.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Union

MASK = "***"


@dataclass(frozen=True)
class Secret:
    """A secret value: real for the process, ``***`` wherever it is shown or written."""

    name: str
    value: str = field(repr=False)

    def __str__(self) -> str:  # never the value, wherever a secret is formatted by mistake
        return MASK


@dataclass(frozen=True)
class Var:
    """A reference to a variable set where the command runs."""

    name: str


Part = Union[str, Secret, Var]


@dataclass(frozen=True)
class Cat:
    """One word made of parts, e.g. ``"hfscale-<job id>-" + Var("HFSCALE_NODE_RANK")``."""

    parts: tuple[Part, ...]


Word = Union[str, Secret, Var, Cat]


@dataclass(frozen=True)
class Sh:
    """Shell syntax, emitted as written: hfscale's own operators, or ``runner.setup``.
    ``glue``: no space before it (``cmd; next``)."""

    text: str
    glue: bool = False


@dataclass(frozen=True)
class Assign:
    """``NAME=word`` (the name is a validated identifier, the word quoted)."""

    name: str
    value: Word


@dataclass(frozen=True)
class PdshHost:
    """pdsh's ``%h`` (the host a line runs on): the one ``%`` not doubled in a pdsh line.
    ``glue``: no space before it (``NAME=%h``)."""

    glue: bool = False


@dataclass(frozen=True)
class Script:
    """A whole line as one quoted word (``bash -c '<line>'``). In a pdsh line its ``%`` are
    doubled, and its ``PdshHost`` kept, before it is quoted: pdsh expands ``%h`` anywhere."""

    line: "Line"


Item = Union[Word, Sh, Assign, PdshHost, Script, "Line"]


@dataclass(frozen=True)
class Line:
    """A shell line, items joined by single spaces. ``pdsh``: the line pdsh sends to every host,
    whose ``%`` are doubled (pdsh expands ``%h``, ``%n``, ``%u`` anywhere in it) except ``PdshHost``."""

    items: tuple[Item, ...]
    pdsh: bool = False

    @staticmethod
    def of(*items: Item, pdsh: bool = False) -> "Line":
        return Line(tuple(i for i in items if not (isinstance(i, Line) and not i.items)), pdsh)


Arg = Union[str, Secret, Line]  # one argument of a process


def value(part: Part, shown: bool = True) -> str:
    """A literal or secret as plain text (no quoting): ``***`` for a secret when ``shown``."""
    if isinstance(part, Secret):
        return MASK if shown else part.value
    if isinstance(part, str):
        return part
    raise TypeError(f"{part!r} has no value where no shell or Kubernetes expands it")


def quote(word: Word, shown: bool = True) -> str:
    """``word`` in a shell line: literal text and secrets quoted, variables as ``"$NAME"``."""
    if isinstance(word, Cat):
        return "".join(quote(p, shown) for p in word.parts)
    if isinstance(word, Var):
        return f'"${word.name}"'
    return shlex.quote(value(word, shown))


def render(line: Line, shown: bool = True, pdsh: bool = False) -> str:
    """The text of ``line`` (``shown``: secrets as ``***``)."""
    pdsh = pdsh or line.pdsh
    out = ""
    for item in line.items:
        if isinstance(item, Line):
            text = render(item, shown, pdsh)
        elif isinstance(item, PdshHost):
            text = "%h"
        elif isinstance(item, Script):
            text = shlex.quote(render(item.line, shown, pdsh))
        else:
            if isinstance(item, Sh):
                text = item.text
            elif isinstance(item, Assign):
                text = f"{item.name}={quote(item.value, shown)}"
            else:
                text = quote(item, shown)
            text = text.replace("%", "%%") if pdsh else text
        if text:
            glued = isinstance(item, (Sh, PdshHost)) and item.glue
            out += text if not out or glued else " " + text
    return out


def arg_text(arg: Arg, shown: bool = True) -> str:
    """One process argument as the process gets it (``shown``: with secrets masked)."""
    return render(arg, shown) if isinstance(arg, Line) else value(arg, shown)


def words(items: Iterable[Word]) -> Line:
    """A line of words, each quoted."""
    return Line(tuple(items))


def exports(env: Mapping[str, Word]) -> Line:
    """``export K=v ...``; an empty line for no variables."""
    return Line.of(Sh("export"), *(Assign(k, v) for k, v in env.items())) if env else Line(())


def and_then(*lines: Line) -> Line:
    """``a && b && ...`` of the non-empty lines."""
    out: list[Item] = []
    for line in lines:
        if line.items:
            if out:
                out.append(Sh("&&"))
            out.append(line)
    return Line(tuple(out))


@dataclass(frozen=True)
class Command:
    """One local process: argv, the variables added to its environment, its directory and input."""

    argv: tuple[Arg, ...]
    env: tuple[tuple[str, str | Secret], ...] = ()
    cwd: str | None = None
    stdin: "Text | None" = None  # fed to the process, never written to disk (it may hold secrets)

    def real_argv(self) -> list[str]:
        """The argv the process gets."""
        return [arg_text(a, shown=False) for a in self.argv]

    def real_env(self) -> dict[str, str]:
        """The variables added to the process's environment, real values."""
        return {k: value(v, shown=False) for k, v in self.env}

    def shown_argv(self) -> list[str]:
        """The argv as printed: secrets as ``***``."""
        return [arg_text(a) for a in self.argv]

    def shell(self) -> str:
        """The command as one shell line a person can read and paste, secrets as ``***``."""
        parts = []
        if self.cwd:
            parts.append(f"cd {shlex.quote(self.cwd)} &&")
        if self.env:
            parts.append(" ".join(f"{k}={quote(v)}" for k, v in self.env))
        parts.append(" ".join(shlex.quote(a) for a in self.shown_argv()))
        return " ".join(parts)


class Ran(NamedTuple):
    """What a finished command answered: its exit code (124 on a timeout), its output and its errors."""

    exit_code: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Text:
    """A text with a real and a shown form (e.g. manifests whose secrets the record masks)."""

    real: str = field(repr=False)
    shown: str
