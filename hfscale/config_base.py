"""The building blocks of the config model: a strict frozen base, field helpers and validators."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

HOST_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _integral(value: Any) -> Any:
    # DeepSpeed users write bucket sizes as 5e8; accept a float only when it is a whole number.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Count = Annotated[int, BeforeValidator(_integral), Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]


def _seq(default: Any = (), **kw: Any) -> Any:
    """A list field: YAML lists are accepted and stored as tuples (frozen)."""
    return Field(default, strict=False, **kw)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, validate_default=True)


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
