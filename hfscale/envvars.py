"""The job's environment: network presets, explicit values, names forwarded from the shell.

Pure functions: the launching shell's environment comes in as a mapping, nothing is read here
(but ``installed_torch``, the installed torch's version from its package metadata).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from typing import Collection, Iterable, Mapping

from .config import HfscaleConfig

# Known-good starting points; every key can be overridden in network.env (null removes it).
NETWORK_PRESETS: dict[str, dict[str, str]] = {
    "none": {},
    "ethernet": {
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "^lo,docker0",
    },
    "infiniband": {
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_HCA": "mlx5",
        "NCCL_SOCKET_IFNAME": "^lo,docker0",
        "UCX_NET_DEVICES": "mlx5_0:1",
    },
    "roce": {
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_HCA": "mlx5",
        # RoCE v2 needs a routable GID; index 3 is RoCE v2 over IPv4 on most Mellanox setups
        "NCCL_IB_GID_INDEX": "3",
        "NCCL_SOCKET_IFNAME": "^lo,docker0",
        "UCX_NET_DEVICES": "mlx5_0:1",
    },
    "efa": {
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "FI_EFA_FORK_SAFE": "1",
        "NCCL_SOCKET_IFNAME": "^lo,docker0",
    },
}

RDMA_PRESETS = frozenset({"infiniband", "roce"})

_SECRET = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)
MASK = "***"


def is_secret(name: str) -> bool:
    """Names whose values are never printed or written to generated files."""
    return bool(_SECRET.search(name))


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def secret_names(cfg: HfscaleConfig, names: Iterable[str], shell_env: Mapping[str, str]) -> set[str]:
    """The names among ``names`` whose values are secret: by their name (``is_secret``), or because
    they come from the launching shell (``env.forward``) and are not declared ``env.public``."""
    pub = cfg.env.public
    came = set(forwarded(cfg.env.forward, shell_env)) - set(cfg.env.vars)  # env.vars win over forwarded values
    return {n for n in names if is_secret(n) or (n in came and not _matches(n, pub))}


def host_secret(cfg: HfscaleConfig, name: str) -> bool:
    """Whether a per-host value of ``name`` is secret (every per-host value is, unless public)."""
    return is_secret(name) or not _matches(name, cfg.env.public)


def forwarded(patterns: tuple[str, ...], shell_env: Mapping[str, str]) -> dict[str, str]:
    """The launching shell's variables whose names match ``patterns`` (exact names or globs)."""
    return {k: shell_env[k] for k in sorted(shell_env) if _matches(k, patterns)}


def job_env(cfg: HfscaleConfig, shell_env: Mapping[str, str]) -> dict[str, str]:
    """Environment every rank gets, in order of precedence (later wins): network preset,
    network.env overrides, names forwarded from the launching shell, env.vars."""
    env = dict(NETWORK_PRESETS[cfg.network.preset])
    for k, v in cfg.network.env.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    env.update(forwarded(cfg.env.forward, shell_env))
    env.update(cfg.env.vars)
    return env


# The flight recorder keeps each rank's last collectives (the hang report reads them). torch 2.8 made
# it backend-neutral (gloo too) and renamed its variables; since then the old NCCL names still work
# but make every rank print "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated; use TORCH_FR_BUFFER_SIZE".
# The new names alone are enough there: the recorder reads TORCH_FR_BUFFER_SIZE first, and
# ProcessGroupNCCL's own buffer size (TORCH_NCCL_TRACE_BUFFER_SIZE, read without a deprecation)
# defaults to the same 2000 entries (torch 2.13: FlightRecorder.hpp). Before 2.8 only the NCCL names exist.
FLIGHT_RECORDER_RENAMED = (2, 8)
_FLIGHT_NAMES = {"size": ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
                 "dump": ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")}


def flight_recorder_env(entries: str, dump_prefix: str, torch_version: str | None,
                        given: Collection[str] = ()) -> dict[str, str]:
    """The flight recorder's variables under the names ``torch_version`` reads (None: unknown, the
    current names); a setting the job's own environment ``given`` holds under either name is left to it."""
    m = re.match(r"(\d+)\.(\d+)", torch_version or "")
    old = m is not None and (int(m[1]), int(m[2])) < FLIGHT_RECORDER_RENAMED
    out = {}
    for what, value in (("size", entries), ("dump", dump_prefix)):
        names = _FLIGHT_NAMES[what]
        if not any(n in given for n in names):
            out[names[1] if old else names[0]] = value
    return out


@functools.lru_cache(maxsize=1)
def installed_torch() -> str | None:
    """The version of the torch installed beside hfscale, from its package metadata (torch is not
    imported); None when there is none."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def host_env(cfg: HfscaleConfig, host: str) -> dict[str, str]:
    """Per-host overrides for ``host`` (applied on top of ``job_env``)."""
    return dict(cfg.env.per_host.get(host, {}))


def masked(env: Mapping[str, str | None]) -> dict[str, str | None]:
    """``env`` with secret values replaced by ``***`` (None, a preset variable removed, stays None)."""
    return {k: (MASK if v is not None and is_secret(k) else v) for k, v in env.items()}


# DeepSpeed's launcher wraps values in double quotes when they hold anything beyond this set,
# so `$`, backquote, `"` and `\` would still be expanded by the remote shell.
_DS_SAFE = re.compile(r"^[^$`\"\\\n]*$")


def deepspeed_env_file(env: Mapping[str, str]) -> tuple[str, list[str]]:
    """Text of a ``.deepspeed_env`` file, and the names left out (secrets, values DeepSpeed
    cannot pass safely)."""
    lines, left_out = [], []
    for k, v in env.items():
        if is_secret(k) or not _DS_SAFE.match(v):
            left_out.append(k)
        else:
            lines.append(f"{k}={v}\n")
    return "".join(lines), left_out
