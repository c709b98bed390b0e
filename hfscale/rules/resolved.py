"""A validated config plus everything derived from it: hosts, world size, batch geometry.

``derive`` only derives (pure, no rule runs here): it takes the parsed config and the host list
(already read from a host file where the config names one) and returns a ``Job``. The rules read
that ``Job``: ``hfscale.rules.check.check`` runs them all, ``hfscale.rules.check.resolve`` is the
two in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from pydantic import BaseModel

from hfscale.config.errors import Problem
from hfscale.config.model import DeepSpeedSection, FsdpSection, HfscaleConfig, HostSpec
from hfscale.config.yaml_source import dotted

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
    spares: tuple[HostSpec, ...] = ()  # hot spares (marked spare): not in hosts, not counted in the world size

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


class Geometry(NamedTuple):
    """Where the ranks run: the hosts, how many nodes and processes, and how the world size was counted;
    ``spares``: the hosts marked spare, which it leaves out."""

    hosts: tuple[HostSpec, ...]
    hosts_key: str  # "hosts" or "hostfile": the key messages name
    num_nodes: int
    procs_per_node: int
    world_size: int
    world_how: str
    spares: tuple[HostSpec, ...] = ()


class Batch(NamedTuple):
    gradient_accumulation_steps: int
    global_batch_size: int
    problems: list[tuple[tuple, str]]


def geometry(cfg: HfscaleConfig, file_hosts: tuple[HostSpec, ...] | None = None) -> Geometry:
    listed = cfg.cluster.hosts if cfg.cluster.hosts is not None else (file_hosts or ())
    hosts = tuple(h for h in listed if not h.spare)
    spares = tuple(h for h in listed if h.spare)
    hosts_key = "hosts" if cfg.cluster.hosts is not None else "hostfile"
    nodes = max(1, len(hosts))
    if cfg.runner.type in SCHEDULERS:
        hosts, nodes, spares = (), cfg.cluster.num_nodes or 1, ()
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
    return Geometry(tuple(hosts), hosts_key, nodes, procs, world, world_how, spares)


def batch(cfg: HfscaleConfig, world: int, world_how: str) -> Batch:
    """Gradient accumulation and global batch, with the problems of a batch that does not add up."""
    p = cfg.distributed.parallelism
    if p is not None and p.total == world and (p.tp_size > 1 or p.cp_size > 1 or p.sp_size > 1):
        # tensor-, context- and sequence-parallel ranks share their samples: the batch is per data-parallel rank
        world, world_how = p.data_parallel, "data-parallel ranks: distributed.parallelism dp_replicate_size x dp_shard_size"
    b = cfg.batch
    per_step = b.micro_batch_size * world
    if b.global_batch_size is None:
        ga = b.gradient_accumulation_steps or 1
        return Batch(ga, per_step * ga, [])
    if b.gradient_accumulation_steps is not None:
        ga = b.gradient_accumulation_steps
        if per_step * ga != b.global_batch_size:
            return Batch(ga, per_step * ga, [(("batch", "global_batch_size"),
                f"{b.global_batch_size} != micro_batch_size {b.micro_batch_size} x gradient_accumulation_steps "
                f"{ga} x world size {world} ({world_how}) = {per_step * ga}")])
        return Batch(ga, b.global_batch_size, [])
    if b.global_batch_size % per_step:
        return Batch(1, per_step, [(("batch", "global_batch_size"),
            f"{b.global_batch_size} is not a multiple of micro_batch_size {b.micro_batch_size} x world size "
            f"{world} ({world_how}) = {per_step}, so no whole gradient_accumulation_steps gives it")])
    return Batch(b.global_batch_size // per_step, b.global_batch_size, [])


def derive(cfg: HfscaleConfig, source: str, line_of: LineOf, file_hosts: tuple[HostSpec, ...] | None = None,
           warnings: tuple[Problem, ...] = ()) -> Job:
    """The ``Job`` of ``cfg``: derived only, nothing checked (``hfscale.rules.check`` checks it)."""
    g = geometry(cfg, file_hosts)
    b = batch(cfg, g.world_size, g.world_how)
    if cfg.runner.type in SCHEDULERS:
        master = cfg.cluster.master_addr or ""
    else:
        master = cfg.cluster.master_addr or (g.hosts[0].host if g.hosts else "127.0.0.1")
    return Job(cfg, source, g.hosts, g.num_nodes, g.procs_per_node, master, b.gradient_accumulation_steps,
               b.global_batch_size, line_of, warnings, g.spares)
