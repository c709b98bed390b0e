"""Every cross-field rule of a config, run by one ``check(job) -> Findings`` on the ``Job`` that
``hfscale.rules.resolved.derive`` built; ``resolve`` derives, checks, and raises one ``ConfigError``
listing every problem with its YAML path and line (pure)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hfscale.config.base import ipv4_shorthand
from hfscale.config.errors import ConfigError, Problem
from hfscale.config.model import HfscaleConfig, HostSpec
from hfscale.config.yaml_source import dotted
from hfscale.rules import accelerate as accelerate_rules
from hfscale.rules import deepspeed as deepspeed_rules
from hfscale.rules.checkpoint_tiers import local_tier_findings
from hfscale.rules.recovery import recovery_findings
from hfscale.rules.resolved import SCHEDULERS, Job, LineOf, batch, derive, geometry
from hfscale.rules.script import script_problems


@dataclass(frozen=True)
class Findings:
    """What the rules found: problems stop the job, warnings are shown."""

    problems: tuple[Problem, ...] = ()
    warnings: tuple[Problem, ...] = ()


def _cluster_problems(cfg: HfscaleConfig, hosts: tuple[HostSpec, ...], hosts_key: str) -> list[tuple[tuple, str]]:
    out: list[tuple[tuple, str]] = []
    c = cfg.cluster
    if c.hosts is not None and c.hostfile is not None:
        out.append((("cluster", "hostfile"), "set either 'hosts' or 'hostfile', not both"))
    if c.nproc_per_node is not None and (c.hosts is not None or c.hostfile is not None):
        out.append((("cluster", "nproc_per_node"), "only for one local node; with hosts, 'slots' sets processes per host"))
    if c.hosts is not None and not c.hosts:
        out.append((("cluster", "hosts"), "the host list is empty; use null for one local node"))
    elif hosts and all(h.spare for h in hosts):
        out.append((("cluster", hosts_key), "every host is marked spare: none would train"))
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


def _training_problems(cfg: HfscaleConfig) -> list[tuple[tuple, str]]:
    t = cfg.training
    out: list[tuple[tuple, str]] = []
    if t.max_steps is not None and t.warmup_steps > t.max_steps:
        out.append((("training", "warmup_steps"), f"{t.warmup_steps} warm-up steps exceed max_steps {t.max_steps}"))
    if t.async_save and cfg.distributed.backend != "deepspeed":
        out.append((("training", "async_save"), f"needs distributed.backend: deepspeed (its decoupled checkpoint "
                    f"writer); with {cfg.distributed.backend} the Trainer saves synchronously"))
    if t.model.path is not None and t.model.config is not None:
        out.append((("training", "model", "config"), "set either 'path' or 'config', not both"))
    return out


def check(job: Job) -> Findings:
    """Run every rule on ``job``; each finding carries its YAML path and line."""
    cfg, line_of = job.config, job.line_of
    g = geometry(cfg, job.hosts + job.spares)  # the config's hosts, else the host file's
    found = _cluster_problems(cfg, g.hosts + g.spares, g.hosts_key) + _launch_problems(cfg, g.hosts) + _engine_problems(cfg)
    ds_found, ds_warnings = deepspeed_rules.problems(cfg, g.world_size)
    found += ds_found + accelerate_rules.problems(cfg, g.world_size, g.procs_per_node)
    found += batch(cfg, g.world_size, g.world_how).problems
    found += _training_problems(cfg)
    script_found, script_warnings = script_problems(job)
    recovery_found, recovery_warnings = recovery_findings(job)
    tier_found, tier_warnings = local_tier_findings(job)
    problems = [Problem(dotted(p), m, line_of(p)) for p, m in found + script_found + recovery_found + tier_found]
    warnings = [Problem(dotted(p), m, line_of(p)) for p, m in script_warnings + ds_warnings +
                accelerate_rules.warnings(cfg) + _shorthand_warnings(cfg) + recovery_warnings + tier_warnings]
    return Findings(tuple(problems), tuple(warnings))


def _by_line(problems: list[Problem]) -> tuple[Problem, ...]:
    return tuple(sorted(problems, key=lambda p: (p.line is None, p.line or 0)))


def resolve(
    cfg: HfscaleConfig,
    source: str,
    line_of: LineOf,
    file_hosts: tuple[HostSpec, ...] | None = None,
    extra: list[Problem] | None = None,
    extra_warnings: tuple[Problem, ...] = (),
) -> Job:
    """Derive the job and check it; raise one ConfigError with every problem.

    ``file_hosts`` are the hosts read from ``cluster.hostfile`` (the caller reads the file);
    ``extra`` are problems found while reading it or the model config, ``extra_warnings`` the
    warnings found there.
    """
    job = derive(cfg, source, line_of, file_hosts)
    found = check(job)
    problems = _by_line(list(extra or []) + list(found.problems))
    if problems:
        raise ConfigError(source, list(problems))
    return replace(job, warnings=_by_line(list(extra_warnings) + list(found.warnings)))
