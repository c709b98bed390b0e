"""The building blocks of the config model: a strict frozen base, field helpers and validators."""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
K8S_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # RFC 1123 label (namespaces)
K8S_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_INT = 2**31 - 1  # no count in a training job comes near; larger numbers are mistakes
# element counts (bucket sizes, tile sizes): DeepSpeed sets no upper bound and keeps them in
# Python ints and int64 tensor sizes; transformers' own test config writes sub_group_size 1e14
MAX_COUNT = 2**63 - 1


_IPV4_SHORTHAND = re.compile(r"^(0[xX][0-9a-fA-F]+|[0-9]+)(\.(0[xX][0-9a-fA-F]+|[0-9]+)){0,3}$")


def ipv4_shorthand(name: str) -> str | None:
    """The dotted IPv4 address that ``name`` reads as where it is inet_aton's shorthand
    ('1234' is 0.0.4.210, '10.1' is 10.0.0.1), as getaddrinfo (ssh, torch's TCPStore) reads it;
    None for a canonical address or anything else."""
    if not _IPV4_SHORTHAND.match(name):
        return None
    try:
        ipaddress.IPv4Address(name)
        return None  # already canonical
    except ValueError:
        pass
    try:
        return socket.inet_ntoa(socket.inet_aton(name))
    except OSError:
        return None


def host_problem(name: str) -> str | None:
    """Why ``name`` is neither an IP address nor an RFC 1123 host name, or None. inet_aton's
    shorthand ('1234') is an address to ssh and torch, so it is one here too (check warns)."""
    try:
        ipaddress.ip_address(name)
        return None
    except ValueError:
        pass
    if ipv4_shorthand(name):
        return None
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.match(label) for label in labels) or labels[-1].isdigit():
        return (f"{name!r} is not a host name (RFC 1123: labels of letters, digits and inner '-', up to 63 "
                "characters each, joined by '.') or an IP address")
    return None


def _host(value: str) -> str:
    why = host_problem(value)
    if why:
        raise ValueError(why)
    return value


HostName = Annotated[str, AfterValidator(_host)]


def must_match(value: str | None, pattern: re.Pattern[str] | str, problem: str) -> str | None:
    """``value`` unchanged when it is None or ``pattern`` matches it; else a ValueError saying
    ``<value!r><problem>``."""
    if value is not None and not re.match(pattern, value):
        raise ValueError(f"{value!r}{problem}")
    return value


def _integral(value: Any) -> Any:
    # DeepSpeed users write bucket sizes as 5e8; accept a float only when it is a whole number.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _no_bool(value: Any) -> Any:
    # YAML's true is Python's 1: a Literal[0, 1, ...] would take it as a number
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got {value!r} (true or false)")
    return value


Count = Annotated[int, BeforeValidator(_integral), Field(ge=0, le=MAX_COUNT)]
PositiveInt = Annotated[int, Field(ge=1, le=MAX_INT)]
# a DeepSpeed integer: its pydantic models and get_scalar_param take 1e5 (a JSON float) as 100000
WholeInt = Annotated[int, BeforeValidator(_integral), Field(ge=1, le=MAX_INT)]

_SIZE_RE = re.compile(r"^(?P<n>[0-9]{1,7}(\.[0-9]{1,3})?) ?(?P<unit>[KMGT]i?B)$")
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def size_bytes(text: str) -> int:
    """Bytes of a memory size such as ``80GiB``, ``81559 MiB`` or ``80GB`` (GB = 10^9 bytes)."""
    m = _SIZE_RE.match(text)
    if m is None:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(f"{shown!r} is not a memory size such as 80GiB, 81559MiB or 80GB")
    return int(float(m["n"]) * _UNITS[m["unit"]])


def _size(value: str) -> str:
    size_bytes(value)
    return value


MemorySize = Annotated[str, AfterValidator(_size)]
NoBool = BeforeValidator(_no_bool)
Integral = BeforeValidator(_integral)  # 4.0 read as 4, as DeepSpeed's own models read it


def _seq(default: Any = (), **kw: Any) -> Any:
    """A list field: YAML lists are accepted and stored as tuples (frozen)."""
    return Field(default, strict=False, **kw)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]{0,31}$")


def _env_value(value: Any) -> Any:
    # YAML reads NCCL_IB_GID_INDEX: 3 as a number; environment values are text.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


EnvValue = Annotated[str, BeforeValidator(_env_value)]
Word = EnvValue  # a command-line word: numbers written without quotes become their text


def _check_env_names(names: dict[str, Any]) -> dict[str, Any]:
    for name in names:
        if not ENV_NAME_RE.match(name):
            raise ValueError(f"{name!r} is not an environment variable name")
    return names
