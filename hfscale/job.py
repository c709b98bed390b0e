"""A validated config plus everything derived from it: hosts, world size, batch geometry.

``resolve`` is pure: it takes the parsed config and the host list (already read from a host file
where the config names one) and either returns a ``Job`` or raises one ``ConfigError`` listing
every cross-field problem with its YAML path and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from pydantic import BaseModel

from . import accelerate_rules, deepspeed_rules
from .config import DeepSpeedSection, FsdpSection, HfscaleConfig, HostSpec
from .config_base import ipv4_shorthand
from .errors import ConfigError, Problem
from .script_rules import script_problems
from .yamlsource import dotted

LineOf = Callable[[tuple], "int | None"]
SCHEDULERS = ("slurm", "kubernetes")


@dataclass(frozen=True)
class Job:
    """Everything the renderers and launchers need, derived once from the config."""

    config: HfscaleConfig
    source: str
    hosts: tuple[HostSpec, ...]  # empty: one local node, or nodes a scheduler picks
    num_nodes: int
    procs_per_node: int
    master_addr: str  # "" when a scheduler decides it at run time
    gradient_accumulation_steps: int
    global_batch_size: int
    line_of: LineOf = field(compare=False, repr=False)  # the YAML line of a key path, for messages
    warnings: tuple[Problem, ...] = ()  # things check reports but that do not stop the job

    def is_set(self, path: tuple) -> bool:
        """Whether the YAML sets ``path`` itself (rather than leaving it to its default)."""
        node: object = self.config
        for part in path:
            if not isinstance(node, BaseModel) or part not in node.model_fields_set:
                return False
            node = getattr(node, part)
        return True

    def where(self, path: tuple) -> str:
        """``path`` as people read it in a message, with its line."""
        line = self.line_of(path)
        return f"{dotted(path)} (line {line})" if line is not None else dotted(path)

    @property
    def scheduled(self) -> bool:
        """True when Slurm or Kubernetes, not hfscale, places the nodes."""
        return self.config.runner.type in SCHEDULERS

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.procs_per_node

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples: the world size, unless tensor, context or sequence
        parallelism makes groups of ranks share them."""
        p = self.config.distributed.parallelism
        return p.data_parallel if p is not None and p.total == self.world_size else self.world_size

    @property
    def deepspeed(self) -> DeepSpeedSection | None:
        c = self.config.distributed
        return (c.deepspeed or DeepSpeedSection()) if c.backend == "deepspeed" else None

    @property
    def fsdp(self) -> FsdpSection | None:
        c = self.config.distributed
        return (c.fsdp or FsdpSection()) if c.backend == "fsdp" else None


def _cluster_problems(cfg: HfscaleConfig, hosts: tuple[HostSpec, ...], hosts_key: str) -> list[tuple[tuple, str]]:
    out: list[tuple[tuple, str]] = []
    c = cfg.cluster
    if c.hosts is not None and c.hostfile is not None:
        out.append((("cluster", "hostfile"), "set either 'hosts' or 'hostfile', not both"))
    if c.nproc_per_node is not None and (c.hosts is not None or c.hostfile is not None):
        out.append((("cluster", "nproc_per_node"), "only for one local node; with hosts, 'slots' sets processes per host"))
    if c.hosts is not None and not c.hosts:
        out.append((("cluster", "hosts"), "the host list is empty; use null for one local node"))
    seen: dict[str, int] = {}
    for i, h in enumerate(c.hosts or ()):
        key = h.host.lower()  # host names are case-insensitive
        if key in seen:
            out.append((("cluster", "hosts", i, "host"), f"duplicate host {h.host!r} (also cluster.hosts[{seen[key]}])"))
        else:
            seen[key] = i
    slots = sorted({h.slots for h in hosts})
    if len(slots) > 1:
        desc = ", ".join(f"{h.host}={h.slots}" for h in hosts)
        out.append((("cluster", hosts_key), f"every host needs the same slots (accelerate and torchrun start the same "
                                  f"number of processes on each node); got {desc}"))
    if cfg.runner.type == "local" and len(hosts) > 1:
        out.append((("runner", "type"), f"'local' runs on this node only but the cluster has {len(hosts)} hosts; "
                                        "use 'pdsh' or 'pdsh_docker'"))
    return out


def _shorthand_warnings(cfg: HfscaleConfig) -> list[tuple[tuple, str]]:
    """Addresses written in inet_aton's shorthand: valid to ssh and torch, and often a placeholder."""
    named = [(("cluster", "master_addr"), cfg.cluster.master_addr)]
    named += [(("cluster", "hosts", i, "host"), h.host) for i, h in enumerate(cfg.cluster.hosts or ())]
    return [(path, f"{name!r} reads as the IPv4 address {ipv4_shorthand(name)} (inet_aton shorthand, as ssh and "
                   "torch read it); if it is a template's placeholder, put the main node's address here")
            for path, name in named if name and ipv4_shorthand(name)]


def _launch_problems(cfg: HfscaleConfig, hosts: tuple[HostSpec, ...]) -> list[tuple[tuple, str]]:
    out: list[tuple[tuple, str]] = []
    r = cfg.runner
    if r.type == "pdsh_docker" and r.docker is None:
        out.append((("runner", "docker"), "runner type pdsh_docker needs a docker section (at least 'image')"))
    if r.type != "pdsh_docker" and r.docker is not None:
        out.append((("runner", "docker"), f"container settings but runner.type is {r.type!r}"))
    if r.docker is not None and r.docker.ipc == "host" and r.docker.shm_size is not None:
        out.append((("runner", "docker", "shm_size"), "has no effect with ipc: host (the container uses the "
                    "host's /dev/shm; podman refuses the pair): remove it, or set runner.docker.ipc: private"))
    if r.type == "pdsh" and not hosts:
        out.append((("runner", "type"), "'pdsh' needs cluster.hosts or cluster.hostfile"))
    if r.type == "kubernetes" and r.kubernetes is None:
        out.append((("runner", "kubernetes"), "runner type kubernetes needs a kubernetes section (at least 'image')"))
    for kind in ("slurm", "kubernetes"):
        if r.type != kind and getattr(r, kind) is not None:
            out.append((("runner", kind), f"{kind} settings but runner.type is {r.type!r}"))
    c = cfg.cluster
    if r.type in SCHEDULERS:
        for key in ("hosts", "hostfile"):
            if getattr(c, key) is not None:
                out.append((("cluster", key), f"{r.type} picks the hosts; give cluster.num_nodes instead"))
    elif c.num_nodes is not None:
        out.append((("cluster", "num_nodes"), "only for runner types slurm and kubernetes; list hosts instead"))
    k = r.kubernetes
    if r.type == "kubernetes" and r.setup:
        out.append((("runner", "setup"), "the kubernetes runner starts no shell; put setup steps in the image"))
    if k is not None and k.elastic is not None and r.launcher != "torchrun":
        out.append((("runner", "kubernetes", "elastic"), "elastic training needs runner.launcher: torchrun"))
    if k is not None:
        for i, m in enumerate(k.mounts):
            if (m.host_path is None) == (m.claim is None):
                out.append((("runner", "kubernetes", "mounts", i), "set exactly one of host_path and claim"))
        if k.elastic is not None and not (k.elastic.min_nodes <= (c.num_nodes or 1) <= k.elastic.max_nodes):
            out.append((("runner", "kubernetes", "elastic"),
                        f"cluster.num_nodes {c.num_nodes or 1} must lie within min_nodes..max_nodes"))
    if r.max_restarts and r.launcher != "torchrun":
        out.append((("runner", "max_restarts"), "restarts need launcher: torchrun (a c10d rendezvous per round); "
                                                "accelerate launch's static rendezvous does not reconnect restarted workers"))
    names = {h.host for h in hosts}
    for host in cfg.env.per_host:
        if host not in names:
            out.append((("env", "per_host", host), f"{host!r} is not a host of this cluster"))
    return out


def _engine_problems(cfg: HfscaleConfig) -> list[tuple[tuple, str]]:
    out: list[tuple[tuple, str]] = []
    d = cfg.distributed
    for other in ("deepspeed", "fsdp"):
        if getattr(d, other) is not None and d.backend != other:
            out.append((("distributed", other), f"settings for {other} but distributed.backend is {d.backend!r}"))
    fs = d.fsdp
    if d.backend == "fsdp" and fs is not None:
        if fs.transformer_layer_cls_to_wrap and fs.auto_wrap_policy != "TRANSFORMER_BASED_WRAP":
            out.append((("distributed", "fsdp", "transformer_layer_cls_to_wrap"),
                        f"only used with TRANSFORMER_BASED_WRAP, policy is {fs.auto_wrap_policy}"))
    return out


def _batch(cfg: HfscaleConfig, world: int, world_how: str) -> tuple[int, int, list[tuple[tuple, str]]]:
    p = cfg.distributed.parallelism
    if p is not None and p.total == world and (p.tp_size > 1 or p.cp_size > 1 or p.sp_size > 1):
        # tensor-, context- and sequence-parallel ranks share their samples: the batch is per data-parallel rank
        world, world_how = p.data_parallel, "data-parallel ranks: distributed.parallelism dp_replicate_size x dp_shard_size"
    b = cfg.batch
    per_step = b.micro_batch_size * world
    if b.global_batch_size is None:
        ga = b.gradient_accumulation_steps or 1
        return ga, per_step * ga, []
    if b.gradient_accumulation_steps is not None:
        ga = b.gradient_accumulation_steps
        if per_step * ga != b.global_batch_size:
            return ga, per_step * ga, [(("batch", "global_batch_size"),
                f"{b.global_batch_size} != micro_batch_size {b.micro_batch_size} x gradient_accumulation_steps "
                f"{ga} x world size {world} ({world_how}) = {per_step * ga}")]
        return ga, b.global_batch_size, []
    if b.global_batch_size % per_step:
        return 1, per_step, [(("batch", "global_batch_size"),
            f"{b.global_batch_size} is not a multiple of micro_batch_size {b.micro_batch_size} x world size "
            f"{world} ({world_how}) = {per_step}, so no whole gradient_accumulation_steps gives it")]
    return b.global_batch_size // per_step, b.global_batch_size, []


def _training_problems(cfg: HfscaleConfig) -> list[tuple[tuple, str]]:
    t = cfg.training
    out: list[tuple[tuple, str]] = []
    if t.max_steps is not None and t.warmup_steps > t.max_steps:
        out.append((("training", "warmup_steps"), f"{t.warmup_steps} warm-up steps exceed max_steps {t.max_steps}"))
    if t.model.path is not None and t.model.config is not None:
        out.append((("training", "model", "config"), "set either 'path' or 'config', not both"))
    return out


def resolve(
    cfg: HfscaleConfig,
    source: str,
    line_of: LineOf,
    file_hosts: tuple[HostSpec, ...] | None = None,
    extra: list[Problem] | None = None,
    extra_warnings: tuple[Problem, ...] = (),
) -> Job:
    """Check ``cfg`` across fields and derive the job; raise one ConfigError with every problem.

    ``file_hosts`` are the hosts read from ``cluster.hostfile`` (the caller reads the file);
    ``extra`` are problems found while reading it or the model config, ``extra_warnings`` the
    warnings found there.
    """
    hosts = cfg.cluster.hosts if cfg.cluster.hosts is not None else (file_hosts or ())
    hosts_key = "hosts" if cfg.cluster.hosts is not None else "hostfile"
    nodes = max(1, len(hosts))
    if cfg.runner.type in SCHEDULERS:
        hosts, nodes = (), cfg.cluster.num_nodes or 1
        procs = cfg.cluster.nproc_per_node or 1
        world_how = "cluster.num_nodes x cluster.nproc_per_node"
        world = nodes * procs
    elif hosts:
        procs = hosts[0].slots
        world_how = f"sum of slots in cluster.{hosts_key}"
        world = sum(h.slots for h in hosts)
    else:
        procs = cfg.cluster.nproc_per_node or 1
        world_how = "cluster.nproc_per_node" if cfg.cluster.nproc_per_node else "one local process"
        world = procs
    ga, global_batch, batch_problems = _batch(cfg, world, world_how)
    found = _cluster_problems(cfg, hosts, hosts_key) + _launch_problems(cfg, hosts) + _engine_problems(cfg)
    ds_found, ds_warnings = deepspeed_rules.problems(cfg, world)
    found += ds_found + accelerate_rules.problems(cfg, world, procs)
    found += batch_problems
    found += _training_problems(cfg)
    if cfg.runner.type in SCHEDULERS:
        master = cfg.cluster.master_addr or ""
    else:
        master = cfg.cluster.master_addr or (hosts[0].host if hosts else "127.0.0.1")
    job = Job(cfg, source, tuple(hosts), nodes, procs, master, ga, global_batch, line_of)
    script_found, script_warnings = script_problems(job)
    problems = list(extra or []) + [Problem(dotted(p), m, line_of(p)) for p, m in found + script_found]
    problems.sort(key=lambda p: (p.line is None, p.line or 0))
    if problems:
        raise ConfigError(source, problems)
    warnings = list(extra_warnings) + [Problem(dotted(p), m, line_of(p)) for p, m in
                                       script_warnings + ds_warnings + accelerate_rules.warnings(cfg)
                                       + _shorthand_warnings(cfg)]
    warnings.sort(key=lambda p: (p.line is None, p.line or 0))
    return replace(job, warnings=tuple(warnings))
