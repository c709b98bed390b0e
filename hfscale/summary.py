"""What ``hfscale check`` prints: the few numbers people check before they launch."""

from __future__ import annotations

from .job import Job
from .trainer_args import trainer_args


def summary(job: Job) -> str:
    """The few numbers people check before they launch."""
    cfg = job.config
    if job.hosts:
        names = ", ".join(h.host for h in job.hosts[:4]) + (", ..." if len(job.hosts) > 4 else "")
        nodes = f"{job.num_nodes} ({names}) x {job.procs_per_node} processes"
    elif job.scheduled:
        nodes = f"{job.num_nodes} (allocated by {cfg.runner.type}) x {job.procs_per_node} processes"
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
                         f"{job.gradient_accumulation_steps} x world {job.world_size}"),
        ("runner", f"{cfg.runner.type} ({cfg.runner.launcher})"),
        ("entry", _entry(job)),
    ]
    return "\n".join(f"  {k:<13}{v}" for k, v in rows)


def _entry(job: Job) -> str:
    t = job.config.training
    if t.script is None:
        return "built-in entry point (python -m hfscale.train)"
    if t.pass_args == "none":
        return f"{t.script} with script_args only (pass_args: none)"
    n = sum(a.value is not None for a in trainer_args(job, "ds_config.json"))
    return f"{t.script} + {n} TrainingArguments flags from this file (launch --dry-run shows its argv)"
