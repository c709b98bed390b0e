"""Asynchronous checkpoint saves with DeepSpeed's own decoupled checkpoint engine, made safe to mark.

``training.async_save`` renders ``checkpoint.writer`` (hfscale.rules.deepspeed.ASYNC_WRITER) into the
DeepSpeed JSON. DeepSpeed then builds a ``DecoupledCheckpointEngine`` on every rank: each rank starts
one writer process (torch.multiprocessing, spawn), ``save_checkpoint`` hands the state dicts to it
through a queue (the tensors move to shared memory, nothing is copied twice) and returns, and the
engine *commits* at the next optimizer step (``DeepSpeedEngine.step`` ->
``_commit_decoupled_checkpoint``: wait for this rank's writer, write ``latest`` on rank 0, barrier),
before the step changes the weights and optimizer state being written. Until the commit a checkpoint
has no ``latest``, and hfscale's marker is written only after it (hfscale.training.callbacks.checkpoints).

What this module adds, each for a reason seen with DeepSpeed 0.19.8 under the HF Trainer on CPU:

- ``cross_env``: the writer factory reads ``CROSS_RANK``/``CROSS_SIZE`` (set by DeepSpeed's own
  launcher only); under torchrun and accelerate launch they come from torchrun's variables.
- ``detached``: ZeRO-1/2's ``state_dict()`` holds the fp32 partitions as slices of tensors that
  require grad (non-leaf), which torch.multiprocessing refuses to send ("Cowardly refusing to
  serialize non-leaf tensor which requires_grad"); the same tensors, detached, are sent instead.
- ``writer_main``: the writer process dies with its rank (Linux ``PR_SET_PDEATHSIG``); otherwise a
  rank killed mid-run leaves its writer waiting on the queue for ever (it holds both ends). It
  ignores SIGTERM, SIGINT and SIGUSR1: a scheduler signals the whole process group, and a writer
  that died of it would fail the save the rank then makes (PreemptionCallback's).
- ``writes_model_states``: the decoupled engine makes every rank a writer of the model states, and
  under ZeRO-1/2 every rank's writer wrote the same ``mp_rank_00_model_states.pt`` at once (a file
  of the right size that did not load, seen with slowed writes); only the rank DeepSpeed's torch
  engine picks writes it.
- the decoupled engine's ``load`` calls ``torch.load`` with torch's ``weights_only`` default, which
  refuses DeepSpeed's ``LossScaler`` in every ZeRO shard, so no resume worked; it loads as DeepSpeed's
  torch engine loads every synchronous checkpoint (the job's own files, the same trust).
- ``commit_pending``: the last save of a run has no next optimizer step; it is committed at the end
  of training with DeepSpeed's own ``_commit_decoupled_checkpoint``.
- ``stop_writers`` (at exit): the writers are not daemons, and multiprocessing joins them at exit;
  a writer with nothing pending is stopped by DeepSpeed's ``cleanup``, one with an uncommitted save
  (training raised) is killed, its checkpoint left unmarked.

Imports deepspeed only inside functions.
"""

from __future__ import annotations

import atexit
import copy
import os
import signal
import weakref
from collections.abc import Mapping
from typing import Any

_ENGINES: weakref.WeakSet = weakref.WeakSet()  # DeepSpeed engines that saved through a decoupled writer
_INSTALLED: list[bool] = []
PR_SET_PDEATHSIG = 1
# what PreemptionCallback and a Ctrl-C handle in the rank; a writer killed by one fails the rank's save
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def cross_env(env: Mapping[str, str]) -> dict[str, str]:
    """``CROSS_RANK`` (this node's rank) and ``CROSS_SIZE`` (the nodes) from torchrun's variables, for
    those of the two ``env`` lacks (DeepSpeed's launcher sets them itself)."""
    out: dict[str, str] = {}
    if "CROSS_RANK" not in env:
        out["CROSS_RANK"] = env.get("GROUP_RANK") or env.get("NODE_RANK") or "0"
    if "CROSS_SIZE" not in env:
        world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
        nodes = int(world) // int(local) if world.isdigit() and local.isdigit() and int(local) > 0 else 0
        out["CROSS_SIZE"] = str(max(1, nodes))
    return out


def prepare_env() -> None:
    """Set ``CROSS_RANK``/``CROSS_SIZE`` in this process (before the Trainer builds the DeepSpeed engine)."""
    os.environ.update(cross_env(os.environ))


def detached(obj: Any) -> Any:
    """``obj`` with every tensor that requires grad in its dicts, lists and tuples replaced by
    ``tensor.detach()`` (the same storage: nothing is copied); containers without one are returned
    as they are, and a changed dict keeps its type and attributes (a module state dict's ``_metadata``)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach() if obj.requires_grad else obj
    if isinstance(obj, dict):
        changed = {k: d for k, v in obj.items() if (d := detached(v)) is not v}
        if not changed:
            return obj
        out = copy.copy(obj)
        out.update(changed)
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        items = [detached(v) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return items if isinstance(obj, list) else tuple(items)
    return obj


def writer_main(*args: Any) -> None:
    """The writer process: die with the rank that started it, let the rank alone handle the signals
    that stop a job, then run DeepSpeed's writer loop."""
    for sig in STOP_SIGNALS:  # a scheduler signals the whole process group: the rank saves, then stops
        signal.signal(sig, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the writer outlives a killed rank, as in DeepSpeed
        pass
    from deepspeed.runtime.checkpoint_engine import decoupled_checkpoint_engine as dce

    if os.getppid() == 1:  # the rank died before prctl took effect
        return
    getattr(dce, "_hfscale_writer_main", dce.init_decoupled_checkpoint)(*args)


def install() -> None:
    """Patch DeepSpeed's decoupled engine as this module's docstring says (once per process; it must
    run before the engine is built for ``writer_main`` to apply)."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    from deepspeed.runtime import engine as ds_engine
    from deepspeed.runtime.checkpoint_engine import decoupled_checkpoint_engine as dce
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    dce._hfscale_writer_main = dce.init_decoupled_checkpoint  # noqa: SLF001 - DeepSpeed's loop, run by writer_main
    dce.init_decoupled_checkpoint = writer_main
    save = dce.DecoupledCheckpointEngine.save

    def save_detached(self, state_dict, path):
        return save(self, detached(state_dict), path)

    dce.DecoupledCheckpointEngine.save = save_detached
    # the decoupled engine's own load calls torch.load with torch's weights_only default, which refuses
    # DeepSpeed's LossScaler in every ZeRO shard: a resume failed. DeepSpeed's torch engine, which loads
    # every synchronous checkpoint, loads them with weights_only=False: the same files, the same trust
    dce.DecoupledCheckpointEngine.load = TorchCheckpointEngine.load
    save_checkpoint = ds_engine.DeepSpeedEngine.save_checkpoint

    def save_checkpoint_noted(self, *args, **kwargs):
        if self.checkpoint_engine.is_decoupled():
            _ENGINES.add(self)
            self.save_non_zero_checkpoint = writes_model_states(self)
        return save_checkpoint(self, *args, **kwargs)

    ds_engine.DeepSpeedEngine.save_checkpoint = save_checkpoint_noted
    atexit.register(stop_writers)


def writes_model_states(engine: Any) -> bool:
    """Whether this rank writes the engine's model-states file, as DeepSpeed decides it for its torch
    engine (``DeepSpeedEngine._configure_checkpointing``): data-parallel rank 0 (node-local rank 0 with
    node-local storage), and under ZeRO-3 every rank of the first weights partition group (each its
    own file). The decoupled engine makes every rank a writer, and under ZeRO-1/2 they all wrote the
    one ``mp_rank_00_model_states.pt`` at once: a checkpoint whose file was whole but did not load."""
    from deepspeed.utils import groups

    rank = engine.local_rank if engine.use_node_local_storage() else groups._get_sequence_data_parallel_rank()  # noqa: SLF001
    return rank == 0 or bool(engine.zero_optimization_partition_weights() and engine.is_first_weights_partition_group())


def pending() -> list[Any]:
    """The DeepSpeed engines of this process with a save not committed yet."""
    return [e for e in list(_ENGINES) if e.checkpoint_engine.get_commit_info() is not None]


def commit_pending() -> int:
    """Commit every pending save (DeepSpeed's ``_commit_decoupled_checkpoint``: wait for the writer,
    ``latest`` on rank 0, a barrier: call it on every rank); the number committed."""
    engines = pending()
    for engine in engines:
        engine._commit_decoupled_checkpoint()  # noqa: SLF001 - what DeepSpeedEngine.step calls
    return len(engines)


def stop_writers() -> None:
    """At exit: end the writer processes (see the module docstring)."""
    for engine in list(_ENGINES):
        ce = engine.checkpoint_engine
        proc = getattr(ce, "ckpt_process", None)
        if proc is None:
            continue
        if ce.get_commit_info() is not None:  # a save never committed: no collective now, no marker
            proc.kill()
            proc.join(5)
            ce.ckpt_process = None
            ce.commit_info = None
        ce.cleanup()
