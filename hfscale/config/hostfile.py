"""Host files: ``host slots=N`` lines, as DeepSpeed's launcher and MPI read them; ``host slots=N spare``
marks a hot spare (hfscale's recovery: hfscale.config.model.RecoveryConfig.spares)."""

from __future__ import annotations

import re

from hfscale.config.base import host_problem
from hfscale.config.errors import Problem
from hfscale.config.model import HostSpec

_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S+)(?P<spare>\s+spare)?$")
_SLOTS = re.compile(r"^[0-9]{1,4}$")  # ASCII digits only: int() would also read other scripts' digits
MAX_SLOTS = 1024


def _excerpt(raw: str) -> str:
    """A short view of a line that is not a host line: the file may be anything (e.g. a list of
    secrets), so never more than its first characters, and nothing after a '='."""
    text = raw.strip().split("=", 1)[0][:12]
    text = "".join(c if c.isprintable() else "?" for c in text)
    return f"{text!r}..." if len(raw.strip()) > len(text) else repr(text)


def parse_hostfile(text: str, path: str) -> tuple[tuple[HostSpec, ...], list[Problem]]:
    """Parse host file text; blank lines and ``#`` comments are skipped, each bad line is named."""
    hosts: list[HostSpec] = []
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        where = f"{path}:{n}"
        if not m:
            problems.append(Problem(where, f"expected 'host slots=N' (or 'host slots=N spare'), got {_excerpt(raw)}"))
            continue
        host, slots = m["host"], m["slots"]
        why = host_problem(host)
        if why:
            problems.append(Problem(where, why if len(host) <= 64 else f"{_excerpt(host)} is not a host name"))
            continue
        if not _SLOTS.match(slots) or not 1 <= int(slots) <= MAX_SLOTS:
            problems.append(Problem(where, f"slots must be a whole number from 1 to {MAX_SLOTS} (ASCII digits), "
                                           f"got {_excerpt(slots)}"))
            continue
        key = host.lower()  # host names are case-insensitive: node0 and NODE0 are one host
        if key in seen:
            problems.append(Problem(where, f"duplicate host {host!r} (first on line {seen[key]})"))
            continue
        seen[key] = n
        hosts.append(HostSpec(host=host, slots=int(slots), spare=bool(m["spare"])))
    if not hosts and not problems:
        problems.append(Problem(path, "the host file lists no hosts"))
    return tuple(hosts), problems


def render_hostfile(hosts: tuple[HostSpec, ...]) -> str:
    """Host file text for ``hosts``."""
    return "".join(f"{h.host} slots={h.slots}{' spare' if h.spare else ''}\n" for h in hosts)
