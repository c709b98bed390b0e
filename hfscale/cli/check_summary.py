"""What ``hfscale check`` prints: the few numbers people check before they launch."""

from __future__ import annotations

from hfscale.memory.estimate import bucket_bytes
from hfscale.rules.checkpoint_tiers import tiers_line
from hfscale.rules.resolved import Job
from hfscale.rules.trainer_args import trainer_args


def summary(job: Job) -> str:
    """The few numbers people check before they launch."""
    cfg = job.config
    if job.hosts:
        names = ", ".join(h.host for h in job.hosts[:4]) + (", ..." if len(job.hosts) > 4 else "")
        nodes = f"{job.num_nodes} ({names}) x {job.procs_per_node} processes"
        if job.spares:
            k = len(job.spares)
            spare_names = ", ".join(h.host for h in job.spares[:4]) + (", ..." if k > 4 else "")
            nodes += f" + {k} spare{'s' * (k != 1)} ({spare_names})"
    elif job.scheduled:
        nodes = f"{job.num_nodes} (allocated by {cfg.runner.type}) x {job.procs_per_node} processes"
        if _allocation_spares(job):  # hfscale.launch.runners.slurm_step: the allocation's last nodes
            nodes += f" + {_allocation_spares(job)} spare(s) (the allocation's last)"
    else:
        nodes = f"1 (local) x {job.procs_per_node} processes"
    backend = cfg.distributed.backend
    if job.deepspeed is not None:
        ds = job.deepspeed
        engine = f"deepspeed ZeRO-{ds.stage}"
        offloads = [f"{k}={getattr(ds, 'offload_' + k).device}" for k in ("optimizer", "param")
                    if getattr(ds, "offload_" + k).device != "none"]
        if offloads:
            engine += f" (offload {', '.join(offloads)})"
    else:
        engine = backend
    b = cfg.batch
    rows = [
        ("job", cfg.name),
        ("nodes", nodes),
        ("world size", str(job.world_size)),
        ("engine", engine),
        ("precision", cfg.precision),
        ("global batch", f"{job.global_batch_size} = micro {b.micro_batch_size} x accumulation "
                         f"{job.gradient_accumulation_steps} x " + (f"world {job.world_size}" if job.data_parallel_size
                         == job.world_size else f"data-parallel {job.data_parallel_size}")),
        *([("comm buckets", buckets)] if (buckets := bucket_memory(job)) else []),
        *([("memory", memory_line(job))] if cfg.cluster.gpu_memory is not None else []),
        ("runner", f"{cfg.runner.type} ({cfg.runner.launcher})"),
        ("watchdog", _watchdog(job)),
        *([("recovery", _recovery(job))] if cfg.recovery.max_restarts else []),
        ("loss guard", loss_guard_line(job)),
        *([("health", health_line(job))] if cfg.runner.type in ("pdsh", "slurm") else []),
        *([("slow nodes", slow_nodes_line(job))] if cfg.recovery.max_restarts and job.num_nodes > 1 else []),
        *([("checkpoints", tiers)] if (tiers := tiers_line(job)) else []),
        ("entry", _entry(job)),
    ]
    return "\n".join(f"  {k:<13}{v}" for k, v in rows)


def memory_line(job: Job) -> str:
    """hfscale plan's verdict against cluster.gpu_memory, in one line."""
    from hfscale.memory.plan_command import SizingError, plan_memory, sizing

    try:
        _, verdict = plan_memory(sizing(job))
    except SizingError as e:
        return f"not estimated: {e}"
    assert verdict is not None  # cluster.gpu_memory is set
    return verdict.line() + " (hfscale plan for the table)"


def _watchdog(job: Job) -> str:
    w, t = job.config.watchdog, job.config.training
    if w.timeout is None:
        return "off"
    if job.config.runner.type == "kubernetes":
        return "off: hfscale hands the job to Kubernetes"
    if t.script is not None and t.pass_args == "none" and not w.script_reports_steps:
        # hfscale.rules.script._watchdog_rules: the timeout counts from the first reported step
        return (f"idle: {t.script} reports no steps (pass_args: none), and the watchdog counts from the first one "
                "(hfscale.step(n) in the script, then watchdog.script_reports_steps: true)")
    first = f", or none in the first {w.first_step} s" if w.first_step else ""
    what = f"no step for {w.timeout} s{first}: every rank's stack, the stuck rank named, the job stopped (exit 4)"
    if job.config.runner.type == "slurm" and not job.config.recovery.max_restarts:
        return f"a submitted job: off; launched inside an allocation (salloc): {what}"
    return what


def health_line(job: Job) -> str:
    """What a node passes before its ranks start, and a spare or an excluded host before it is admitted."""
    check = job.config.recovery.health_check
    site = f"; site check {check.command!r} (timeout {check.timeout} s)" if check else ""
    return ("each node before its ranks start, each spare or excluded host before it is admitted: the GPUs its "
            f"slots need, no uncorrected ECC error, no row remapping pending (nvidia-smi, where present){site}")


def slow_nodes_line(job: Job) -> str:
    """Whether a slow node is watched for (recovery.slow_nodes), and what happens to one."""
    from hfscale.rules.recovery import slow_nodes_unwatched

    s = job.config.recovery.slow_nodes
    why_not = slow_nodes_unwatched(job)
    if why_not is not None:
        return why_not
    by = "a spare takes its place" if job.spares or job.scheduled and job.config.recovery.spares else \
        f"it is left out (down to recovery.min_nodes {job.config.recovery.min_nodes})"
    return (f"a node whose ranks' forward passes take > {s.factor:g}x the other nodes' in {s.windows} window(s) of "
            f"{s.window} s running stops the job at its next checkpoint (nothing recomputed); {by}; slow again, it is "
            "struck")


def loss_guard_line(job: Job) -> str:
    """What the loss guard watches (training.loss_guard) and what an alarm does, in one line."""
    g, t = job.config.training.loss_guard, job.config.training
    if not g.enabled:
        return "off"
    if t.script is not None and t.pass_args == "none":
        return "off: a plain loop (pass_args: none) has no Trainer to watch"
    spikes = [f"loss > {g.loss_factor:g}x median (+{g.loss_rise:g})"] if g.loss_factor is not None else []
    spikes += [f"grad norm > {g.grad_norm_factor:g}x"] if g.grad_norm_factor is not None else []
    watched = (["NaN/inf"] if g.nan else []) + ([f"{' or '.join(spikes)}, {g.patience} steps running"] if spikes else [])
    heal = (f"an alarm rolls back before it, replays, skips its batches (+{g.skip_margin}) if it comes back; at most "
            f"{g.max_rollbacks} rollbacks") if job.config.recovery.max_restarts else \
        "an alarm stops the job unsaved (recovery.max_restarts 0); a relaunch rolls back and replays"
    return f"every step: {'; '.join(watched) or 'nothing'}; {heal}"


def _recovery(job: Job) -> str:
    """What the supervisor (hfscale.launch.recovery.supervisor) will do, with the batch at each node count."""
    r = job.config.recovery
    window = f" in {r.window} s" if r.window else ""
    what = f"up to {r.max_restarts} restart(s){window} from the newest checkpoint; a host left out after {r.strikes} failure(s)"
    if r.in_process:
        k = len(job.spares)
        standbys = (f"the spare{'s' * (k != 1)}' {k * job.procs_per_node} standby rank(s), imports done, take lost ranks' "
                    "places, and " if k else "")
        what = (f"in process first: the ranks of healthy nodes keep their processes and rejoin; {standbys}a killed "
                f"rank's node starts it again as a standby (up to {r.max_restarts} in-process restart(s) per launch); "
                "when that cannot go on, " + what)
    return what + _spares(job) + _shrink(job, "; then" if job.spares or _allocation_spares(job) else ";")


def _allocation_spares(job: Job) -> int:
    """Spares a supervised Slurm job asks its allocation for (its last nodes; none are named yet)."""
    r = job.config.recovery
    return (r.spares or 0) if job.config.runner.type == "slurm" and r.max_restarts and not job.hosts else 0


def _spares(job: Job) -> str:
    k = len(job.spares) or _allocation_spares(job)
    if not k:
        return ""
    names = (", ".join(h.host for h in job.spares[:8]) + (f" and {k - 8} more" if k > 8 else "") if job.spares
             else f"(the allocation's last {k} node(s))")
    return (f"; spare{'s' * (k != 1)} {names}: a failed host is replaced at once by a spare that passes its probe, "
            f"so the first {k} failure(s) cost a restart at {job.num_nodes} node(s), world size {job.world_size}, "
            "nothing converted")


def _shrink(job: Job, lead: str) -> str:
    from hfscale.rules.recovery import accumulation_at

    r = job.config.recovery
    if r.min_nodes is None:
        return f"{lead} never shrinking (a failed host is retried)"
    if r.min_nodes >= job.num_nodes:
        return f"{lead} never shrinking (min_nodes {r.min_nodes}: a host at its strikes ends the job)"
    what = f"{lead} shrinking" if job.spares or _allocation_spares(job) else ""
    what += f", down to {r.min_nodes} node(s)"
    if not r.keep_global_batch:
        return what + "; the global batch shrinks with the ranks"
    per = ", ".join(f"{accumulation_at(job, n)} at {n}" for n in range(job.num_nodes, r.min_nodes - 1, -1))
    return what + f"; global batch {job.global_batch_size} kept: accumulation {per} node(s)"


def _entry(job: Job) -> str:
    t = job.config.training
    if t.script is None:
        return "built-in entry point (python -m hfscale.training.train)"
    if t.pass_args == "none":
        return f"{t.script} with script_args only (pass_args: none)"
    n = sum(a.value is not None for a in trainer_args(job, "ds_config.json"))
    return f"{t.script} + {n} TrainingArguments flags from this file (launch --dry-run shows its argv)"


def _e(n: int) -> str:
    return f"{n:.0e}".replace("e+0", "e").replace("e+", "e") if n >= 10_000 else str(n)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def bucket_memory(job: Job) -> str | None:
    """DeepSpeed's communication buckets per GPU, as one line; None without ZeRO.

    Stages 1-2: DeepSpeed's documented estimate, (reduce + allgather bucket) x element size, 4.5
    times that with overlap_comm (5e8 + 5e8 elements in 16 bits: 9 GB). Stage 3: the reduce bucket
    (one buffer, contiguous_gradients) and the prefetch bucket; parameters gathered for compute can
    add up to stage3_max_live_parameters more, shown beside."""
    ds = job.deepspeed
    if ds is None or ds.stage == 0:
        return None
    size, overlap = ds.comm_bytes(job.config.precision), ds.overlap()
    if ds.stage in (1, 2):
        total = bucket_bytes(ds.stage, ds.reduce_bucket_size, ds.allgather_bucket_size, overlap, size)
        how = (f"(reduce {_e(ds.reduce_bucket_size)} + allgather {_e(ds.allgather_bucket_size)} elements) x {size} B"
               + (" x 4.5 with overlap_comm" if overlap else ""))
        return f"~{_gib(total)} per GPU = {how}"
    total = bucket_bytes(ds.stage, ds.reduce_bucket_size, ds.stage3_prefetch_bucket_size, overlap, size)
    return (f"~{_gib(total)} per GPU = (reduce {_e(ds.reduce_bucket_size)} + prefetch "
            f"{_e(ds.stage3_prefetch_bucket_size)} elements) x {size} B; gathered parameters up to "
            f"{_gib(ds.stage3_max_live_parameters * size)} more (stage3_max_live_parameters)")
