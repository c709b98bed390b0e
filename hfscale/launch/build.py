"""config -> an immutable launch plan (pure: no process is started and no file is written here).

``build_plan`` computes what every runner shares once (run directory, generated files, the
ranks' environment, what to do with existing checkpoints) and hands it to the runner of
``runner.type`` (hfscale.launch.runners). The plan is what ``--dry-run`` prints and what
``hfscale.launch.attempt.execute`` runs: the same object, holding real values, shown with secrets as ``***``.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, replace

from hfscale.checkpoints.lineage import LINEAGE_FILE
from hfscale.checkpoints.lr_schedule import schedule_note
from hfscale.checkpoints.reshard import conversion
from hfscale.checkpoints.resume import OutputScan, decide
from hfscale.config.envvars import MASK, deepspeed_env_file, host_secret, masked
from hfscale.config.errors import ConfigError, Problem
from hfscale.config.yaml_source import dump
from hfscale.core.shell import Command, Secret
from hfscale.launch.context import Common, LaunchContext, output_dir_to_scan
from hfscale.launch.node.command import CONFIG_COPY, STORE_HOST, in_process, rank_env, watched
from hfscale.launch.run_dir import HANG_REPORT, STORE_ADDR
from hfscale.launch.runners import RUNNERS
from hfscale.launch.spec import NOTHING_TO_TRAIN, LaunchPlan, HangWatch
from hfscale.render.artifacts import DEEPSPEED_FILE, render_artifacts
from hfscale.rules.resolved import Job
from hfscale.rules.script import extra_args_problems
from hfscale.rules.trainer_args import given_flags
from hfscale.training.heartbeat import PROGRESS_DIR, STACKS_DIR


__all__ = ["LaunchPlan", "build_plan", "resolved_config_yaml"]

IN_PROCESS_MARGIN_S = 30  # see build_plan's watch
INCOMPLETE_DIR = "_hfscale-incomplete"  # in the output_dir: the job's own saves cut short, a folder per launch
ROLLED_BACK_DIR = "_hfscale-rolled-back"  # in the output_dir: saved after a loss spike began, a folder per launch


def resolved_config_yaml(job: Job) -> str:
    """The config with hosts resolved (host file read) and secret values masked."""
    data = job.config.model_dump(mode="json")
    # a scheduler's nodes (a Slurm allocation's, hfscale.launch.runners.slurm_step) stay cluster.num_nodes
    data["cluster"]["hosts"] = None if job.scheduled else [{"host": h.host, "slots": h.slots} for h in job.hosts] + [
        {"host": h.host, "slots": h.slots, "spare": True} for h in job.spares] or None
    data["cluster"]["hostfile"] = None
    data["env"]["vars"] = masked(data["env"]["vars"])
    data["env"]["per_host"] = {h: {k: MASK if host_secret(job.config, k) else x for k, x in v.items()}
                               for h, v in data["env"]["per_host"].items()}
    data["network"]["env"] = masked(data["network"]["env"])
    head = f"# Resolved from {job.source} by hfscale (host file read, secrets masked).\n"
    return head + dump(data)


@dataclass(frozen=True)
class _ResumeStep:
    """What a launch does with the checkpoints already in training.output_dir: plan notes, moves
    (--restart), nothing to do (``done``), and the lines it tells on the terminal (``told``)."""

    notes: list[str]
    moves: tuple[tuple[str, str], ...] = ()
    done: bool = False
    told: tuple[str, ...] = ()


def _resume_step(job: Job, ctx: LaunchContext) -> _ResumeStep:
    """What this launch does with the checkpoints in training.output_dir.

    Raises ConfigError where the job would start over silently in an output_dir whose checkpoints
    are all incomplete and not its own (hfscale.checkpoints.lineage); its own saves cut short move
    to ``<output_dir>/_hfscale-incomplete/<job id>/`` first."""
    scan, t = ctx.output, job.config.training
    chosen = given_flags([*t.script_args, *ctx.extra_args], {"resume_from_checkpoint"}) if t.script else []
    if scan is None or chosen:  # a checkpoint named by hand is the user's choice
        return _ResumeStep([])
    if ctx.restart:
        dest = posixpath.join(scan.output_dir, f"restarted-{ctx.job_id}")
        moves = tuple((posixpath.join(scan.output_dir, n), posixpath.join(dest, n)) for n in scan.found)
        if scan.lineage:  # the local tier's steps belong to the run started over: the new run starts its own
            moves += ((posixpath.join(scan.output_dir, LINEAGE_FILE), posixpath.join(dest, LINEAGE_FILE)),)
        return _ResumeStep([f"--restart: training starts at step 0; the {len(scan.found)} checkpoint(s) of "
                            f"{t.output_dir} move to {dest} first"] if moves else [], moves)
    if scan.rollbacks_problem is not None:
        raise ConfigError(job.source, [Problem("training.output_dir", f"{scan.rollbacks_problem}: the loss guard's "
                                               "record of rollbacks and skipped batches cannot be read; restore it, or "
                                               "move it aside to start a new one", job.line_of(("training", "output_dir")))])
    d = decide(scan, t.max_steps)
    if d.action == "refuse":
        path = ("training", "output_dir")
        raise ConfigError(job.source, [Problem("training.output_dir", f"{d.reason}. Resume one by hand with -- "
                                               "--resume_from_checkpoint PATH, or start over with --restart "
                                               "(the checkpoints are moved aside, not deleted)", job.line_of(path))])
    if d.action == "done":
        return _ResumeStep([f"{NOTHING_TO_TRAIN}: {d.reason} (raise training.max_steps to go on, or start over "
                            "with --restart)"], done=True)
    aside = posixpath.join(scan.output_dir, INCOMPLETE_DIR, ctx.job_id)
    moves = tuple((posixpath.join(scan.output_dir, n), posixpath.join(aside, n)) for n in d.set_aside)
    back = posixpath.join(scan.output_dir, ROLLED_BACK_DIR, ctx.job_id)
    moves += tuple((posixpath.join(scan.output_dir, n), posixpath.join(back, n)) for n in d.rolled_back)
    notes = []
    if d.action == "resume":
        notes.append(f"resumes from {d.checkpoint} (each rank checks again when it starts, so a restart "
                     "resumes from the newest complete checkpoint then)")
        if scan.state is not None:
            notes += [n for n in [schedule_note(t, scan.state, d.checkpoint or "")] if n]
        if reshards(job, ctx):
            notes.append(reshard_note(job, scan.saved_world or 0, d.checkpoint or "", scan.universal))
    local = t.local_checkpoints
    if local is not None:
        notes.append(f"the ranks first look at the nodes' local checkpoints ({local.dir}): the newest step complete "
                     "between them, newer than the durable one and saved at this world size, is restored into "
                     f"{t.output_dir} and resumed from")
    if d.rolled_back:
        notes.append(f"rolls back: {', '.join(d.rolled_back)} (saved after the loss spike began) move to {back}")
    return _ResumeStep(notes, moves, told=_skipped(scan, aside if d.set_aside else None))


def reshards(job: Job, ctx: LaunchContext) -> bool:
    """Whether this launch resumes a DeepSpeed checkpoint written by another number of processes."""
    scan = ctx.output
    return (job.deepspeed is not None and scan is not None and scan.resume is not None and not ctx.restart
            and bool(scan.saved_world) and scan.saved_world != job.world_size)


def reshard_note(job: Job, saved: int, ckpt: str, ready: bool) -> str:
    how = "already converted" if ready else "converted by DeepSpeed's ds_to_universal before the job starts"
    ranks = f"{job.world_size} processes" if job.data_parallel_size == job.world_size else \
        f"{job.data_parallel_size} data-parallel ranks"
    batch = (f"the global batch stays {job.global_batch_size} (batch.global_batch_size; accumulation "
             f"{job.gradient_accumulation_steps})" if job.is_set(("batch", "global_batch_size")) else
             f"the global batch is {job.global_batch_size} = micro x accumulation x {ranks}; set "
             "batch.global_batch_size to keep the one the checkpoint was trained with")
    return (f"{ckpt} was saved by {saved} processes, this job has {job.world_size}: it resumes from its universal "
            f"checkpoint ({how}; the DeepSpeed JSON says checkpoint.load_universal); {batch}")


def build_plan(job: Job, ctx: LaunchContext) -> LaunchPlan:
    """The launch plan for ``job``: real values inside, ``render()`` shows secrets as ``***``.

    Raises ConfigError for arguments after ``--`` that contradict the YAML, and where the job would
    start over in an output_dir holding only incomplete checkpoints."""
    r = job.config.runner
    runner = RUNNERS[r.type]
    base = r.run_dir if os.path.isabs(r.run_dir) else posixpath.join(ctx.cwd, r.run_dir)
    run_dir = posixpath.normpath(posixpath.join(base, f"{job.config.name}-{ctx.run_id or ctx.job_id}"))
    rank_dir = runner.RANK_DIR or run_dir
    problems = extra_args_problems(job, ctx.extra_args, posixpath.join(rank_dir, DEEPSPEED_FILE))
    if problems:
        raise ConfigError(job.source, problems)
    step = _resume_step(job, ctx)
    notes, moves, done = step.notes, step.moves, step.done
    env = rank_env(job, rank_dir, ctx)
    universal = reshards(job, ctx) and not done
    files = dict(render_artifacts(job, posixpath.join(rank_dir, DEEPSPEED_FILE), load_universal=universal))
    prepare: tuple = ()
    if universal:
        assert ctx.output is not None and ctx.output.resume is not None
        convert = None if ctx.output.universal else conversion(ctx.output.resume, r.python or ctx.python)
        prepare = (convert,) if convert is not None else ()
    files[CONFIG_COPY] = resolved_config_yaml(job)
    if rank_dir == run_dir:  # DeepSpeed's own launcher, started by hand from the run directory
        ds_env, unsafe = deepspeed_env_file({k: v for k, v in env.items() if not isinstance(v, Secret)})
        files[".deepspeed_env"] = ds_env
        left_out = [k for k, v in env.items() if isinstance(v, Secret)] + unsafe
        if left_out:
            notes.append(f".deepspeed_env leaves out {', '.join(left_out)} (secret, or a value DeepSpeed's "
                         "launcher would pass to the shell unsafely)")
    w = job.config.watchdog
    # in-process restarts: the ranks' collectives time out after watchdog.timeout and they restart by
    # themselves; the watchdog gives them IN_PROCESS_MARGIN_S more before it stops the job
    timeout = None if w.timeout is None else w.timeout + (IN_PROCESS_MARGIN_S if in_process(job) else 0)
    watch = None if not watched(job, ctx) or timeout is None else HangWatch(
        posixpath.join(run_dir, PROGRESS_DIR), posixpath.join(run_dir, STACKS_DIR),
        posixpath.join(run_dir, HANG_REPORT), timeout, w.first_step, job.world_size)
    common = Common(run_dir, rank_dir, r.workdir or ctx.cwd, r.python or ctx.python, env, tuple(files.items()),
                    tuple(notes), moves, done, watch)
    plan = runner.plan(job, ctx, common)
    where = output_dir_to_scan(job)
    output_dir = posixpath.normpath(posixpath.join(ctx.cwd, where)) if where is not None else None
    store = Command((ctx.python, "-m", STORE_HOST, "--file", posixpath.join(run_dir, STORE_ADDR)), (), ctx.cwd) \
        if in_process(job) and plan.mode == "stream" else None
    return replace(plan, prepare=prepare, output_dir=output_dir, told=step.told, store=store)


def _skipped(scan: OutputScan, aside: str | None = None) -> tuple[str, ...]:
    """What resuming skipped, one line per checkpoint, newest first: "checkpoint-40 skipped:
    rng_state_1.pth is missing ...; resuming from checkpoint-35" (shown by --dry-run and on the
    terminal; only when the launch resumes on its own: not for a checkpoint named by hand).
    ``aside``: where the job's own incomplete saves move ("set aside in ..."; "starting at step 0"
    when none is complete)."""
    if not scan.skipped or (scan.resume is None and aside is None):
        return ()
    how = "this job's own save, cut short" if aside is not None else "skipped"
    lines = [f"{name} {how}: {why}" for name, why in scan.skipped]
    if aside is not None:
        lines[-1] += f"; set aside in {aside}"
    lines[-1] += (f"; resuming from {posixpath.basename(scan.resume)}" if scan.resume is not None else
                  "; no complete checkpoint: starting at step 0")
    return tuple(lines)
