"""Host files: ``host slots=N`` lines, as DeepSpeed's launcher and MPI read them."""

from __future__ import annotations

import re

from .config import HOST_RE, HostSpec
from .errors import Problem

_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S+)$")


def parse_hostfile(text: str, path: str) -> tuple[tuple[HostSpec, ...], list[Problem]]:
    """Parse host file text; blank lines and ``#`` comments are skipped, each bad line is quoted."""
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
            problems.append(Problem(where, f"expected 'host slots=N', got {raw.strip()!r}"))
            continue
        host, slots = m["host"], m["slots"]
        if not HOST_RE.match(host) or ".." in host:
            problems.append(Problem(where, f"{host!r} is not a host name"))
            continue
        if not slots.isdigit() or int(slots) < 1:
            problems.append(Problem(where, f"slots must be a whole number >= 1, got {slots!r}"))
            continue
        if host in seen:
            problems.append(Problem(where, f"duplicate host {host!r} (first on line {seen[host]})"))
            continue
        seen[host] = n
        hosts.append(HostSpec(host=host, slots=int(slots)))
    if not hosts and not problems:
        problems.append(Problem(path, "the host file lists no hosts"))
    return tuple(hosts), problems


def render_hostfile(hosts: tuple[HostSpec, ...]) -> str:
    """Host file text for ``hosts``."""
    return "".join(f"{h.host} slots={h.slots}\n" for h in hosts)
