"""The job a relaunch runs (hfscale.launch.recovery.supervisor): the same job on a subset of its hosts,
derived and checked again by ``hfscale.rules.check`` (pure)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hfscale.config.model import HfscaleConfig, HostSpec, ParallelismConfig
from hfscale.rules.check import resolve
from hfscale.rules.recovery import ranks_at
from hfscale.rules.resolved import Job


def _parallelism_at(p: ParallelismConfig, ranks: int) -> dict[str, Any]:
    """``p`` with ``ranks`` data-parallel ranks: replicas go first, then shards."""
    data = p.model_dump(exclude_unset=True)
    if ranks * p.dp_replicate_size % p.data_parallel == 0:
        data["dp_replicate_size"] = ranks * p.dp_replicate_size // p.data_parallel
    elif ranks * p.dp_shard_size % p.data_parallel == 0:
        data["dp_shard_size"] = ranks * p.dp_shard_size // p.data_parallel
    else:
        data["dp_shard_size"] = ranks
        data["dp_replicate_size"] = 1
    return data


def job_on(job: Job, hosts: tuple[HostSpec, ...], spares: tuple[HostSpec, ...] | None = None) -> Job:
    """The same job on ``hosts`` (some of its hosts and spares, in node-rank order; for slurm, as many
    nodes of its allocation), with ``spares`` (marked spare; None: the job's own) still free:
    the global batch kept when ``recovery.keep_global_batch`` (accumulation derived again), else the
    accumulation kept; ``cluster.master_addr`` moved to ``hosts[0]`` when it names a host left out.
    Derived and checked again; ``ConfigError`` with every problem when the smaller job is not valid."""
    spares = job.spares if spares is None else tuple(spares)
    if tuple(hosts) == job.hosts and spares == job.spares:
        return job
    cfg = job.config
    data = cfg.model_dump(exclude_unset=True)
    cluster = data.setdefault("cluster", {})
    changed = len(hosts) != job.num_nodes
    if job.scheduled:
        cluster["num_nodes"] = len(hosts)
    else:
        cluster["hosts"] = [h.model_dump(exclude_defaults=True) for h in hosts + spares]
        cluster["hostfile"] = None
        if cfg.recovery.spares is not None:
            data.setdefault("recovery", {})["spares"] = len(spares)
    names = {h.host.lower() for h in hosts}
    left_out = {h.host.lower() for h in job.hosts} - names
    if cfg.cluster.master_addr is not None and cfg.cluster.master_addr.lower() in left_out and hosts:
        cluster["master_addr"] = hosts[0].host  # an address of a host still in the job is kept
    per_host = data.get("env", {}).get("per_host")
    if per_host and not job.scheduled:
        kept = names | {h.host.lower() for h in spares}  # a free spare keeps its variables for when it trains
        data["env"]["per_host"] = {h: v for h, v in per_host.items() if h.lower() in kept}
    if changed:
        batch = data["batch"]
        if cfg.recovery.keep_global_batch:
            batch.update(global_batch_size=job.global_batch_size, gradient_accumulation_steps=None)
        else:
            batch.update(global_batch_size=None, gradient_accumulation_steps=job.gradient_accumulation_steps)
        p, ranks = cfg.distributed.parallelism, ranks_at(job, len(hosts))
        if p is not None and p.total == job.world_size and ranks:
            data["distributed"]["parallelism"] = _parallelism_at(p, ranks)
    new = resolve(HfscaleConfig.model_validate(data), job.source, job.line_of)
    if job.scheduled and job.hosts:  # the hosts of a Slurm allocation (hfscale.launch.runners.slurm_step)
        kept = tuple(h.model_copy(update={"spare": False}) for h in hosts)
        master = cfg.cluster.master_addr if cfg.cluster.master_addr and cfg.cluster.master_addr.lower() in names else None
        new = replace(new, hosts=kept, spares=tuple(h.model_copy(update={"spare": True}) for h in spares),
                      master_addr=master or (kept[0].host if kept else ""))
    return new
