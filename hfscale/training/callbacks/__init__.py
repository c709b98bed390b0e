"""Callbacks for the HF Trainer on a cluster: throughput, stragglers, preemption, complete checkpoints.

``hfscale.instrument(trainer)`` adds them as the launch's YAML says (hfscale.training.instrument).
Each one works on its own in any Trainer script (scripts import them from ``hfscale``, the public
face, which stays put when modules move)::

    from hfscale import (CheckpointCompleteCallback, DataStateCallback, MetricsCallback, PreemptionCallback,
                         ProgressCallback, StragglerCallback, latest_checkpoint)

    trainer.add_callback(DataStateCallback(trainer))  # a streaming dataset resumes without replay
    trainer.add_callback(MetricsCallback(seq_len=2048, peak_flops_per_device=989e12, trainer=trainer))
    trainer.add_callback(StragglerCallback(threshold=1.2, trainer=trainer))
    trainer.add_callback(PreemptionCallback())
    trainer.add_callback(CheckpointCompleteCallback())
    trainer.add_callback(ProgressCallback())  # steps for hfscale launch's hang watchdog
    trainer.train(resume_from_checkpoint=latest_checkpoint(args.output_dir))

This module imports torch and transformers (it is for training scripts); nothing else in hfscale
imports it.

Collectives. MetricsCallback and StragglerCallback each run one small ``all_gather`` every
``every`` optimizer steps (default: the Trainer's logging steps) and nothing on the other steps: no
collective and no device synchronisation. PreemptionCallback runs one 1-element ``all_reduce`` per
optimizer step (that is how every rank learns that any rank was signalled).
CheckpointCompleteCallback runs one barrier per save. LossGuardCallback (hfscale.training.callbacks.loss_guard,
which ``hfscale.instrument`` adds) runs one 2-element ``all_reduce`` per optimizer step, and one gather
of each rank's host at a NaN. Tensors for collectives live on the GPU with
NCCL and on the CPU otherwise (gloo, ccl).

Exit. When training ends normally (``on_train_end``), each of these callbacks registers one
``atexit`` hook that calls ``torch.distributed.destroy_process_group()`` if the script has not done
so itself. The Trainer never leaves the process group; with gloo, a process group still alive at
interpreter finalization can abort a rank that finished its work (SIGABRT, "terminate called
without an active exception", pytorch/pytorch#190489), which the launcher then reports as a failed
job. The hook is not registered when training raised: destroying a group while other ranks may
still be inside a collective can hang. The hook makes that abort rarer, not impossible: end the
script with ``hfscale.exit_cleanly()`` to skip interpreter teardown altogether.

Loggers. The metrics are recorded in ``trainer.state.log_history`` and passed to the Trainer's logger
callbacks (``report_to``: TensorBoard, W&B, MLflow, ...). The Trainer calls callbacks in the order
they were added and creates its ``report_to`` loggers before any callback you add, so a callback
added later cannot put values into a log those loggers have already written. Pass ``trainer=`` and
the metrics are logged with ``trainer.log()`` (their own entry, same step, seen by every logger).
Without it they are merged into the Trainer's own log of that step: ``log_history`` and callbacks
added after this one see them, the ``report_to`` loggers do not. Either way the values go out with
the Trainer's next log (the same step when ``every`` equals the logging steps); the JSON lines are
written at once.

Part of the training layer: may import hfscale.core, config, checkpoints, rules, render and
hfscale.training; the only modules that import torch and transformers at module level.
"""

from __future__ import annotations

from hfscale.training.callbacks.checkpoints import CheckpointCompleteCallback
from hfscale.training.callbacks.collectives import METRICS_FILE
from hfscale.training.callbacks.data_state import DataStateCallback
from hfscale.training.callbacks.preemption import PreemptionCallback
from hfscale.training.callbacks.reporting import MetricsCallback, StragglerCallback
from hfscale.training.callbacks.steps import ProgressCallback
from hfscale.training.shutdown import exit_cleanly

__all__ = [
    "METRICS_FILE",
    "CheckpointCompleteCallback",
    "DataStateCallback",
    "MetricsCallback",
    "PreemptionCallback",
    "ProgressCallback",
    "StragglerCallback",
    "exit_cleanly",
]
