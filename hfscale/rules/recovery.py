"""The ``recovery:`` section: the rules ``hfscale check`` applies to it, and the job a relaunch runs.

After a rank failure, a lost node or a hang, hfscale's supervisor stops the job and relaunches it from
the newest complete checkpoint, possibly on fewer hosts (a host that failed ``recovery.strikes`` times
is left out, down to ``recovery.min_nodes``). This module owns what that needs from the config:
``recovery_findings`` (the rules, wired into ``hfscale.rules.check.check``) and ``accumulation_at`` (the
gradient accumulation that keeps the global batch on fewer nodes); hfscale.rules.relaunch builds the
job a relaunch runs. Pure: nothing is read or started here.
"""

from __future__ import annotations

from math import lcm

from hfscale.rules.resolved import Job

Found = list[tuple[tuple, str]]
HERE = ("recovery",)
SUPPORTED = ("the runners whose jobs hfscale runs itself: local, pdsh and pdsh_docker, and slurm (supervised inside "
             "the allocation)")


def _group(job: Job) -> int | None:
    """Ranks that share their samples (tensor x context x sequence parallel), or None when every rank
    is a data-parallel rank of its own (as ``hfscale.rules.resolved.batch`` counts them)."""
    p = job.config.distributed.parallelism
    if p is not None and p.total == job.world_size and (p.tp_size > 1 or p.cp_size > 1 or p.sp_size > 1):
        return p.tp_size * p.cp_size * p.sp_size
    return None


def ranks_at(job: Job, nodes: int) -> int | None:
    """Data-parallel ranks of ``job`` on ``nodes`` nodes (same processes per node), or None when its
    parallel groups do not fit a whole number of times."""
    procs = job.procs_per_node * nodes
    group = _group(job) or 1
    return procs // group if procs % group == 0 else None


def _data_parallel(job: Job) -> int:
    return job.world_size // (_group(job) or 1)


def accumulation_at(job: Job, nodes: int) -> int | None:
    """The gradient accumulation that keeps ``job.global_batch_size`` on ``nodes`` nodes (same
    processes per node), or None when no whole accumulation keeps it exactly."""
    ranks = ranks_at(job, nodes) if nodes >= 1 else None
    if ranks is None:
        return None
    per_step = job.config.batch.micro_batch_size * ranks
    return job.global_batch_size // per_step if job.global_batch_size % per_step == 0 else None


def _nodes(counts: list[int]) -> str:
    return f"{', '.join(map(str, counts))} node{'' if counts == [1] else 's'}"


def _batch_problem(job: Job, low: int) -> str | None:
    """Why the global batch cannot be kept at some node count in ``low``..``job.num_nodes``, or None."""
    nodes, micro = job.num_nodes, job.config.batch.micro_batch_size
    cannot = [n for n in range(low, nodes) if accumulation_at(job, n) is None]
    if not cannot:
        return None
    can = [n for n in range(1, nodes + 1) if accumulation_at(job, n) is not None]
    raise_to, dp = max(cannot) + 1, _data_parallel(job)
    text = (f"the global batch {job.global_batch_size} (micro {micro} x accumulation "
            f"{job.gradient_accumulation_steps} x {dp} rank{'' if dp == 1 else 's'}) cannot be kept at "
            f"{_nodes(cannot)}; it can at {_nodes(can) if can else 'no node count'}: raise recovery.min_nodes to "
            f"{raise_to}" + (" (the job then never shrinks)" if raise_to == nodes else ""))
    if any(ranks_at(job, n) for n in cannot):  # a global batch every node count from low up divides
        every = lcm(*(micro * (ranks_at(job, n) or 1) for n in range(low, nodes + 1)))
        text += (f", or choose a global batch that {every} divides (micro {micro} x the ranks at each of "
                 f"{low} to {nodes} nodes)")
    split = [n for n in cannot if not ranks_at(job, n)]
    if split:
        text += (f"; at {_nodes(split)} the processes do not split into whole tensor x context x sequence "
                 f"parallel groups of {_group(job) or 1} ranks")
    return text


def _checkpoint_warnings(job: Job) -> Found:
    t = job.config.training
    if t.script is not None and t.pass_args == "none":
        return [(HERE + ("max_restarts",),
                 f"hfscale cannot see a plain script's checkpoints (training.pass_args: none): each restart runs "
                 f"{t.script} again as it is, so it must resume from its own newest checkpoint by itself")]
    if t.max_steps is not None and t.save_steps >= t.max_steps:
        return [(("training", "save_steps"),
                 f"{t.save_steps} >= max_steps {t.max_steps}: no checkpoint is saved before the job ends, so a "
                 "restart (recovery.max_restarts) starts again at step 0; save more often to resume from one")]
    return []


def _spare_findings(job: Job) -> tuple[Found, Found]:
    """The hot spares: marked hosts (pdsh, pdsh_docker), counted by recovery.spares when it is set."""
    r, marked, runner = job.config.recovery, len(job.spares), job.config.runner.type
    key = ("cluster", "hosts") if job.config.cluster.hosts is not None else ("cluster", "hostfile")
    if runner == "slurm":  # the allocation asks for num_nodes + spares; its last spares nodes are the spares
        if r.spares and not r.max_restarts:
            return [], [(HERE + ("spares",), f"{r.spares} spare node(s) not asked for: only recovery "
                         "(recovery.max_restarts) asks Slurm for them and puts one in place of a failed node")]
        return [], []
    if runner in ("kubernetes", "local"):
        if marked or r.spares:
            why = {"local": "one node has none to replace", "kubernetes": "the operator replaces pods"}[runner]
            return [(HERE + ("spares",) if r.spares else key, f"spares with runner {runner}: {why}")], []
        return [], []
    if r.spares is not None and r.spares != marked:
        return [(HERE + ("spares",), f"{r.spares}, but {marked} host(s) of cluster.{key[1]} are marked spare: mark the "
                 "spares there ('spare: true', or 'host slots=N spare' in a host file)")], []
    if marked and not r.max_restarts:
        return [], [(key, f"{marked} spare host(s) idle: only recovery (recovery.max_restarts) puts a spare in place "
                     "of a failed host")]
    return [], []


IN_PROCESS_RUNNERS = ("local", "pdsh", "slurm")


def _in_process_findings(job: Job) -> tuple[Found, Found]:
    """recovery.in_process: what it needs (hfscale.training.inprocess), and what it cannot do yet."""
    cfg, key = job.config, HERE + ("in_process",)
    if not cfg.recovery.in_process:
        return [], []
    problems: Found = []
    if not cfg.recovery.max_restarts:
        problems.append((key, "needs recovery.max_restarts > 0: it bounds the in-process restarts of each launch, and "
                         "the relaunches when one cannot complete"))
    if cfg.runner.type not in IN_PROCESS_RUNNERS:
        problems.append((key, f"runner {cfg.runner.type}: in-process restarts work with runners "
                         f"{', '.join(IN_PROCESS_RUNNERS[:-1])} and {IN_PROCESS_RUNNERS[-1]} so far"))
    if cfg.runner.launcher != "torchrun":
        problems.append((key, "hfscale starts the ranks itself (hfscale.training.inprocess.node_agent), with torchrun's "
                         "environment: set runner.launcher to torchrun"))
    warnings: Found = []
    if cfg.training.script is not None:
        said = _opt_in(cfg.training.script, cfg.runner.workdir)
        (problems if said and not said.startswith("cannot read") else warnings).extend(
            [(key, f"training.script {cfg.training.script}: {said}")] if said else [])
    if cfg.watchdog.timeout is None:
        warnings.append((key, "without watchdog.timeout a frozen or cut-off node holds the others in their collective "
                         "for torch's default timeout (30 min) before they restart: set watchdog.timeout"))
    return problems, warnings


OPT_IN = "restart_in_process"
SCRIPT_CAP = 4 << 20  # bytes of a script read to find its opt-in


def _opt_in(script: str, workdir: str | None) -> str | None:
    """Whether a user script opts in to in-process restarts (it calls hfscale.restart_in_process, which
    runs its training function in attempts): None when it does, else what to say. A script run
    without it would form one process group of every launched process, the standbys too."""
    import os

    from hfscale.core.untrusted import Missing, Unreadable, read_bytes

    path = script if os.path.isabs(script) or not workdir else os.path.join(workdir, script)
    try:
        text = read_bytes(path, SCRIPT_CAP).decode("utf-8", "replace")
    except (Missing, Unreadable) as e:
        return f"cannot read it here ({e}): it must call hfscale.{OPT_IN}(main) for in-process restarts"
    if OPT_IN not in text:
        return (f"does not call hfscale.{OPT_IN}: in-process restarts run its training function in attempts, "
                f"so the script opts in with sys.exit(hfscale.{OPT_IN}(main)), main building and resuming its "
                "training at every call (docs/recovery.md)")
    return None


def recovery_findings(job: Job) -> tuple[Found, Found]:
    """(problems, warnings) of the ``recovery`` section, as (YAML key path, message) pairs."""
    r, nodes = job.config.recovery, job.num_nodes
    problems, warnings = _spare_findings(job)
    more = _in_process_findings(job)
    problems, warnings = problems + more[0], warnings + more[1]
    if not r.max_restarts:
        if r.min_nodes is not None:
            warnings.append((HERE + ("min_nodes",), "has no effect while recovery.max_restarts is 0 "
                             "(hfscale relaunches nothing)"))
        return problems, warnings
    if job.config.runner.type == "kubernetes":
        problems.append((HERE + ("max_restarts",), "restarts on Kubernetes are the operator's (the PyTorchJob's "
                         f"restartPolicy and runner.kubernetes.elastic); hfscale's recovery works with {SUPPORTED}"))
        return problems, warnings
    if r.min_nodes is not None and r.min_nodes > nodes:
        problems.append((HERE + ("min_nodes",), f"{r.min_nodes} is more than the {_nodes([nodes])} of the job"))
    elif r.min_nodes is not None and r.min_nodes < nodes:
        if r.keep_global_batch:
            found = _batch_problem(job, r.min_nodes)
            if found:
                problems.append((HERE + ("min_nodes",), found))
        else:
            warnings.append((HERE + ("keep_global_batch",),
                             f"false: when the job shrinks below its {_nodes([nodes])} (down to recovery.min_nodes "
                             f"{r.min_nodes}), the global batch {job.global_batch_size} shrinks with the ranks, and so "
                             "the loss curve changes; set it to true to keep the global batch"))
    return problems, warnings + _checkpoint_warnings(job)


SLOW_NODE_RUNNERS = ("pdsh", "slurm")


def slow_nodes_unwatched(job: Job) -> str | None:
    """Why the ranks of ``job`` (as an attempt runs it: its free spares) do not watch for a slow node
    (recovery.slow_nodes, hfscale.training.slow_nodes); None when they do: a slow node can be replaced,
    by a spare or by the job shrinking (recovery.min_nodes). The launch tells the ranks
    (hfscale.launch.node.command.rank_env); check says it of the job as written."""
    r = job.config.recovery
    if not r.slow_nodes.enabled:
        return "off (recovery.slow_nodes.enabled: false)"
    if not r.max_restarts:
        return "off: recovery is off (recovery.max_restarts: 0) and only a relaunch replaces a node"
    if job.config.runner.type not in SLOW_NODE_RUNNERS:
        return f"off: runner {job.config.runner.type} (watched with runners {' and '.join(SLOW_NODE_RUNNERS)})"
    if job.num_nodes < 2:
        return "off: one node, no other to compare it with"
    if job.config.training.script is not None and job.config.training.pass_args == "none":
        return "off: a plain loop (pass_args: none) has no Trainer to time"
    # a Slurm job's spares are named inside its allocation (hfscale.launch.runners.slurm_step), counted before
    spares = r.spares or 0 if job.scheduled and not job.hosts else len(job.spares)
    if not spares and (r.min_nodes is None or job.num_nodes - 1 < r.min_nodes):
        return "off: no spare to take a slow node's place, and recovery.min_nodes does not let the job shrink"
    return None
