"""The job's environment: network presets, explicit values, names forwarded from the shell.

Pure functions: the launching shell's environment comes in as a mapping, nothing is read here
(but ``installed_torch``, the installed torch's version from its package metadata).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from typing import TYPE_CHECKING, Collection, Iterable, Mapping

if TYPE_CHECKING:  # annotations only: a rank imports this module before torch starts (flight_recorder_on_node)
    from hfscale.config.model import HfscaleConfig

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
# The launching machine's torch picks the names; a node with another torch renames hfscale's own
# values (flight_recorder_on_node, in each rank before torch starts).
FLIGHT_RECORDER_RENAMED = (2, 8)
FLIGHT_ENTRIES = "2000"  # collectives the flight recorder keeps per rank
FLIGHT_DUMP_NAME = "nccl_rank_"  # NCCL's dump on its own timeout: <run dir>/flight/nccl_rank_<rank>
_FLIGHT_NAMES = {"size": ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
                 "dump": ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")}


def flight_recorder_env(entries: str, dump_prefix: str, torch_version: str | None,
                        given: Collection[str] = ()) -> dict[str, str]:
    """The flight recorder's variables under the names ``torch_version`` reads (None: unknown, the
    current names); a setting the job's own environment ``given`` holds under either name is left to it."""
    out = {}
    for what, value in (("size", entries), ("dump", dump_prefix)):
        if not any(n in given for n in _FLIGHT_NAMES[what]):
            out[_flight_name(what, torch_version)[0]] = value
    return out


def _flight_name(what: str, torch_version: str | None) -> tuple[str, str]:
    """(the name ``torch_version`` reads for ``what``, the other one); None: unknown, the current names."""
    m = re.match(r"(\d+)\.(\d+)", torch_version or "")
    new, old = _FLIGHT_NAMES[what]
    return (old, new) if m is not None and (int(m[1]), int(m[2])) < FLIGHT_RECORDER_RENAMED else (new, old)


def flight_recorder_on_node(env: Mapping[str, str], torch_version: str | None, entries: str,
                            dump_prefix: str) -> dict[str, str | None]:
    """Changes to a rank's environment (None: remove the variable) that move the flight recorder values
    hfscale set (``entries``, ``dump_prefix``) to the names the node's torch reads, where the launching
    machine's torch chose the other names: an old torch would lose the setting, a new one warn on every
    rank. A value hfscale did not set, or one already set under the node's name, is left alone."""
    changes: dict[str, str | None] = {}
    if torch_version is None:  # no torch beside hfscale here: nothing to go by
        return changes
    for what, value in (("size", entries), ("dump", dump_prefix)):
        name, other = _flight_name(what, torch_version)
        if name not in env and env.get(other) == value:
            changes.update({name: value, other: None})
    return changes


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
