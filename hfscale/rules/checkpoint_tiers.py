"""The rules ``hfscale check`` applies to ``training.local_checkpoints`` (the local tier: frequent
checkpoints on each node's disk, copied to a buddy node; hfscale.checkpoints.local_tier), and the
line ``check`` prints of what each tier bounds."""

from __future__ import annotations

from hfscale.rules.resolved import Job

Found = list[tuple[tuple, str]]
HERE = ("training", "local_checkpoints")


def local_tier_findings(job: Job) -> tuple[Found, Found]:
    """(problems, warnings) as (YAML key path, message) pairs."""
    t, local = job.config.training, job.config.training.local_checkpoints
    if local is None:
        return [], []
    warnings: Found = []
    if local.every >= t.save_steps:
        warnings.append((HERE + ("every",), f"{local.every} >= training.save_steps {t.save_steps}: the durable tier "
                         "saves at least as often, so the local tier adds nothing"))
    if t.script is not None and t.pass_args == "none":
        return [], warnings + [(HERE, "has no effect on a plain script (training.pass_args: none), which saves and "
                                "resumes by itself: the local tier needs the Trainer (the built-in entry point, or a "
                                "script that calls hfscale.instrument(trainer))")]
    if t.script is not None:
        warnings.append((HERE, f"only if {t.script} calls hfscale.instrument(trainer) and resumes from what it returns; "
                         "a script that resumes from --resume_from_checkpoint alone gets the durable tier's checkpoint"))
    if local.buddy and job.num_nodes < 2:
        warnings.append((HERE + ("buddy",), "one node has no buddy: its local checkpoints outlive its processes, not "
                         "the node"))
    return [], warnings


def tiers_line(job: Job) -> str | None:
    """``durable every 50 steps on the shared file system; local every 5 steps on /nvme/{host}, each node's
    part also on the next node: a failure recomputes at most 5 steps (50 when a node and its buddy
    are lost together)``; None without a local tier."""
    t, local = job.config.training, job.config.training.local_checkpoints
    if local is None:
        return None
    durable = f"durable every {t.save_steps} steps in {t.output_dir}"
    if not local.buddy or job.num_nodes < 2:
        return (f"{durable}; local every {local.every} steps in {local.dir} (no buddy copy): a failure recomputes "
                f"at most {local.every} steps while the failed node's disk is there, else {t.save_steps}")
    return (f"{durable}; local every {local.every} steps in {local.dir}, each node's part also on the next node: a "
            f"failure recomputes at most {local.every} steps ({t.save_steps} when a node and the one after it are "
            "lost together, or when the job restarts at another world size)")
