"""``hfscale.instrument(trainer)``: hfscale's callbacks on a Trainer in one call, set up as the launch's
YAML says, and the checkpoint to resume from::

    import hfscale

    trainer = Trainer(model=model, args=args, train_dataset=data)
    resume = hfscale.instrument(trainer)
    trainer.train(resume_from_checkpoint=resume)
    hfscale.exit_cleanly()

Under ``hfscale launch`` (``$HFSCALE_CONFIG`` names the run's copy of the YAML) the YAML decides:

- ``MetricsCallback``: MFU from ``training.peak_tflops`` (null: looked up for known GPUs, none at
  ``precision: "no"``); tokens per sample from ``training.data.block_size`` when the built-in entry
  point trains (``training.script: null``), else ``seq_len=`` or the Trainer's own token count;
- ``StragglerCallback`` when the job has more than one rank;
- ``PreemptionCallback``, ``CheckpointCompleteCallback`` (it takes ``save_total_limit`` over, and with
  ``training.async_save`` sets DeepSpeed's decoupled writer up: hfscale.training.async_save),
  ``ProgressCallback`` (the hang watchdog's steps, the terminal's progress line) and
  ``DataStateCallback`` (a streaming ``datasets.IterableDataset`` resumes from the position saved with
  the checkpoint instead of being replayed: hfscale.training.callbacks.data_state) always;
- ``SlowNodeCallback`` when the launch can replace a slow node (``recovery.slow_nodes``, a spare or
  ``recovery.min_nodes``: hfscale.rules.recovery.slow_nodes_unwatched, said in ``$HFSCALE_SLOW_NODES``): a node found slow stops the job
  at its next checkpoint, and the relaunch replaces it (hfscale.training.callbacks.slow_nodes);
- ``LossGuardCallback`` as ``training.loss_guard`` says (on by default: a loss spike or a NaN stops
  training without saving, for a rollback: hfscale.training.callbacks.loss_guard).

Outside it, the defaults: all six, MFU looked up for known GPUs at the Trainer's bf16/fp16. A
callback of a kind the Trainer already has is not added twice. Returns the newest complete
checkpoint in ``args.output_dir`` (hfscale.checkpoints.resume.latest_checkpoint), or None.

Imports torch and the callbacks only when called.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from hfscale.checkpoints.resume import latest_checkpoint

if TYPE_CHECKING:
    from hfscale.rules.resolved import Job

# Dense bf16/fp16 peak FLOP/s of known data-centre GPUs, for MFU when training.peak_tflops is null.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "V100": 125.0}
KINDS = ("metrics", "stragglers", "preemption", "checkpoints", "progress")


@dataclass(frozen=True)
class Chosen:
    """What the YAML (or the defaults) asks for: the callbacks by kind, and the metrics' settings."""

    kinds: tuple[str, ...] = KINDS
    seq_len: int | None = None
    peak_tflops: float | None = None  # from the YAML; None: looked up by GPU name
    # look the peak up by GPU name: the YAML's precision is not "no" (None: the Trainer's bf16/fp16 decides)
    lookup_peak: bool | None = None
    async_save: bool = False  # training.async_save: CheckpointCompleteCallback sets DeepSpeed's writer up
    loss_guard: Any = None  # training.loss_guard (None: its defaults; enabled false: no guard)
    slow_nodes: Any = None  # recovery.slow_nodes when the job watches for a slow node (None: it does not)


def choose(job: Job | None, seq_len: int | None = None, env: Mapping[str, str] = os.environ) -> Chosen:
    """The callbacks ``job`` asks for (None: outside hfscale launch, the defaults); ``seq_len``:
    the caller's tokens per sample, which the built-in entry point's block size replaces. The
    slow-node watch where the launch said this attempt can replace a slow node (``env``: its
    ``HFSCALE_SLOW_NODES``, set from the attempt's own hosts and spares, which the YAML copy a
    supervised Slurm job's ranks read does not have)."""
    if job is None:
        return Chosen(seq_len=seq_len)
    from hfscale.training.slow_nodes import ENV_WATCH

    t = job.config.training
    kinds = tuple(k for k in KINDS if k != "stragglers" or job.world_size > 1)
    slow = job.config.recovery.slow_nodes if "stragglers" in kinds and env.get(ENV_WATCH) == "1" else None
    return Chosen(kinds, t.data.block_size if t.script is None else seq_len, t.peak_tflops,
                  job.config.precision != "no", t.async_save, t.loss_guard, slow)


def peak_flops(chosen: Chosen, half_precision: bool) -> float | None:
    """Peak FLOP/s of one device: the YAML's figure, else looked up by CUDA device name."""
    if chosen.peak_tflops is not None:
        return chosen.peak_tflops * 1e12
    if not (half_precision if chosen.lookup_peak is None else chosen.lookup_peak):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS.items() if key in name), None)


def launch_job() -> Job | None:
    """The job of the ``hfscale launch`` this process runs in (``$HFSCALE_CONFIG``), else None."""
    path = os.environ.get("HFSCALE_CONFIG")
    if not path:
        return None
    from hfscale.rules.config_file import load_job

    return load_job(path)


def add_callbacks(trainer: Any, chosen: Chosen) -> list[Any]:
    """Add the callbacks ``chosen`` names to ``trainer`` (not a kind it already has); the added ones."""
    from hfscale.training.callbacks import (CheckpointCompleteCallback, MetricsCallback, PreemptionCallback,
                                            ProgressCallback, StragglerCallback)

    args = trainer.args
    make = {
        "metrics": lambda: MetricsCallback(seq_len=chosen.seq_len, trainer=trainer,
                                           peak_flops_per_device=peak_flops(chosen, bool(args.bf16 or args.fp16))),
        "stragglers": lambda: StragglerCallback(trainer=trainer),
        "preemption": PreemptionCallback,
        "checkpoints": lambda: CheckpointCompleteCallback(async_save=chosen.async_save),
        "progress": ProgressCallback,
    }
    kind_of = {"metrics": MetricsCallback, "stragglers": StragglerCallback, "preemption": PreemptionCallback,
               "checkpoints": CheckpointCompleteCallback, "progress": ProgressCallback}
    have = list(trainer.callback_handler.callbacks)
    added = []
    for kind in chosen.kinds:
        if not any(isinstance(cb, kind_of[kind]) for cb in have):
            cb = make[kind]()
            trainer.add_callback(cb)
            added.append(cb)
    from hfscale.training.callbacks.data_state import attach

    stream = attach(trainer)  # ahead of CheckpointCompleteCallback: its marker lists the position's file
    added += [stream] if stream is not None else []
    if chosen.loss_guard is None or chosen.loss_guard.enabled:
        from hfscale.training.callbacks.loss_guard import attach as guard

        watching = guard(trainer, chosen.loss_guard)  # ahead of it too: the marker lists the judgement's file
        added += [watching] if watching is not None else []
    if chosen.slow_nodes is not None:
        from hfscale.training.callbacks.slow_nodes import attach as watch_nodes

        slow = watch_nodes(trainer, chosen.slow_nodes)  # after the StragglerCallback, whose reports it judges
        added += [slow] if slow is not None else []
    return added


def instrument(trainer: Any, *, seq_len: int | None = None) -> str | None:
    """Add hfscale's callbacks to ``trainer`` as the launch's YAML asks (outside ``hfscale launch``:
    the defaults) and return the checkpoint to resume from (None: start from scratch).
    ``seq_len``: tokens per sample, for tokens/s and MFU (default: the Trainer's own count when
    ``include_num_input_tokens_seen`` is on, else unknown)."""
    job = launch_job()
    add_callbacks(trainer, choose(job, seq_len))
    resume = latest_checkpoint(trainer.args.output_dir)
    if job is not None and job.config.training.local_checkpoints is not None:
        resume = with_local_tier(trainer, job.config.training.local_checkpoints, resume)
    return resume


def with_local_tier(trainer: Any, local: Any, resume: str | None) -> str | None:
    """The local tier (``training.local_checkpoints``) on every rank: restore its newest step complete
    across the nodes when it is newer than ``resume`` (the durable tier's), start or keep the run's
    lineage, and save every ``local.every`` steps from now on; the checkpoint to resume from."""
    from hfscale.training.callbacks.local_restore import restore
    from hfscale.training.callbacks.local_tier import LocalCheckpointCallback, start_lineage

    out = trainer.args.output_dir
    resume = restore(out, local.dir, resume) or resume
    lineage = start_lineage(out, fresh=resume is None)
    trainer.add_callback(LocalCheckpointCallback(trainer, local.every, local.dir, local.keep, local.buddy, lineage))
    return resume
