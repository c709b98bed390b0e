"""Asynchronous checkpoint saves with DeepSpeed's own decoupled checkpoint engine, made safe to mark.

``training.async_save`` renders ``checkpoint.writer`` (hfscale.rules.deepspeed.ASYNC_WRITER) into the
DeepSpeed JSON. DeepSpeed then builds a ``DecoupledCheckpointEngine`` on every rank: each rank starts
one writer process (torch.multiprocessing, spawn), ``save_checkpoint`` hands the state dicts to it
through a queue and returns, and the engine *commits* at the next optimizer step
(``DeepSpeedEngine.step`` -> ``_commit_decoupled_checkpoint``: wait for this rank's writer, write
``latest`` on rank 0, barrier). Until the commit a checkpoint has no ``latest``, and hfscale's
marker is written only after it (hfscale.training.callbacks.checkpoints).

DeepSpeed hands the writer the live tensors (moved to shared memory), so its commit must wait, at
the very next step, until the writer has written them all, before the step changes them: the save
then pauses training for the write minus one step. hfscale hands the writer a snapshot instead
(``snapshot``: one copy of each storage into shared CPU memory, on a GPU the device-to-host copy,
into buffers reused from save to save) and commits without waiting (``commit``): at each optimizer
step the ranks agree, with one small all-reduce, whether every writer has finished, and commit
when they all have. Training pauses for the copy, not the write. The price: host memory for one
copy of each rank's shard of the checkpoint (what PyTorch DCP's ``async_save`` and
nvidia-resiliency-ext stage the same way). A save waits for the previous one's commit, so at most
one is in flight.

What this module adds, each for a reason seen with DeepSpeed 0.19.8 under the HF Trainer on CPU:

- ``cross_env``: the writer factory reads ``CROSS_RANK``/``CROSS_SIZE`` (set by DeepSpeed's own
  launcher only); under torchrun and accelerate launch they come from torchrun's variables.
- ``snapshot`` also makes the state sendable: ZeRO-1/2's ``state_dict()`` holds the fp32 partitions
  as slices of tensors that require grad (non-leaf), which torch.multiprocessing refuses to send
  ("Cowardly refusing to serialize non-leaf tensor which requires_grad"); the copies do not.
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
- a write that fails (a full local disk: ``torch.save`` raises ``OSError`` or, from its C++ stream,
  ``RuntimeError``) ended DeepSpeed's writer loop, and with it the process: every later save of the
  rank, durable ones included, was dropped without a word and the next commit raised ``Cannot
  commit checkpoint: checkpoint process is not running``, which failed the rank. In the writer a
  failed file is now removed, said in the node's log, and the loop goes on (``surviving_save``);
  the rank learns it at the commit, from the files it handed over that are not there
  (``unwritten``: the local tier says the step is not kept, the durable tier leaves the checkpoint
  unmarked). A writer that died anyway (killed, out of memory) is replaced at the next save or
  commit (``replace_writer``), its save's files removed: the rank goes on, and so do its saves.
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
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any

_ENGINES: weakref.WeakSet = weakref.WeakSet()  # DeepSpeed engines that saved through a decoupled writer
_INSTALLED: list[bool] = []
_UNWRITTEN: list[str] = []  # files handed to a writer that were not on disk at their save's commit
UNWRITTEN_CAP = 10_000  # the newest kept; the callbacks take theirs off at each commit
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


def snapshot(obj: Any, pool: dict[int, Any], seen: dict[tuple[str, int], Any] | None = None) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples replaced by a copy in shared CPU memory
    that no longer requires grad; containers without a tensor are returned as they are, and a changed
    dict keeps its type and attributes (a module state dict's ``_metadata``). Each storage is copied
    once, whole, and the tensors that were views of it are views of the copy (same offset, size and
    stride: torch.save writes what it would have written from the live tensors). ``pool``: the
    copies of the previous save of the same file, reused when their size matches (the writer has
    finished with them: a save waits for the previous commit), so steady saves allocate nothing."""
    import torch

    if seen is None:
        seen = {}
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        key = (str(st.device), st.data_ptr())
        copy_ = seen.get(key)
        if copy_ is None:
            slot = len(seen)
            copy_ = pool.get(slot)
            if copy_ is None or copy_.nbytes() != st.nbytes():
                copy_ = torch.UntypedStorage(st.nbytes()).share_memory_()
                pool[slot] = copy_
            copy_.copy_(st)  # on a GPU: the device-to-host copy, the whole pause of the save
            seen[key] = copy_
        return torch.empty(0, dtype=obj.dtype).set_(copy_, obj.storage_offset(), obj.size(), obj.stride())
    if isinstance(obj, dict):
        changed = {k: d for k, v in obj.items() if (d := snapshot(v, pool, seen)) is not v}
        if not changed:
            return obj
        out = copy.copy(obj)
        out.update(changed)
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        items = [snapshot(v, pool, seen) for v in obj]
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
    dce.FastCheckpointEngine.save = surviving_save(dce.FastCheckpointEngine.save)
    getattr(dce, "_hfscale_writer_main", dce.init_decoupled_checkpoint)(*args)


def surviving_save(save: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed's ``FastCheckpointEngine.save`` in the writer process, made to outlive a failed write:
    the file that could not be written is removed (a part of it is no checkpoint's file), the failure
    goes to the node's log, and the writer takes the next request. The rank finds the file missing at
    the commit (``unwritten``)."""

    def save_or_say(self: Any, state_dict: Any, path: str) -> Any:
        try:
            return save(self, state_dict, path)
        except Exception as e:  # noqa: BLE001 - any failed write costs this file, never the writer
            factory = getattr(self, "_writer", None)
            writer = getattr(factory, "_writer", None)
            if writer is not None:  # DeepSpeed's factory holds one writer at a time, released after each save
                try:
                    writer.close()
                except Exception:  # noqa: BLE001 - closing a file on a full disk fails again
                    pass
                factory._writer = None
            try:
                os.unlink(path)
            except OSError:
                pass
            print(f"hfscale: the asynchronous checkpoint writer could not write {path}: {type(e).__name__}: "
                  f"{str(e)[:300]}; the file is removed, the writer goes on", file=sys.stderr, flush=True)
            return None

    return save_or_say


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

    def save_snapshot(self, state_dict, path):
        if self.ckpt_process is not None:
            self.__dict__.setdefault("_hfscale_handed", []).append(str(path))  # looked for at the commit
        pools = self.__dict__.setdefault("_hfscale_pools", {})
        return save(self, snapshot(state_dict, pools.setdefault(os.path.basename(path), {})), path)

    dce.DecoupledCheckpointEngine.save = save_snapshot
    init = dce.DecoupledCheckpointEngine.__init__

    def init_noted(self, config_params, dp_writer_config, optimize_dp_state):
        init(self, config_params, dp_writer_config, optimize_dp_state)
        self._hfscale_args = (config_params, dp_writer_config, optimize_dp_state)  # to start a writer again

    dce.DecoupledCheckpointEngine.__init__ = init_noted
    # the decoupled engine's own load calls torch.load with torch's weights_only default, which refuses
    # DeepSpeed's LossScaler in every ZeRO shard: a resume failed. DeepSpeed's torch engine, which loads
    # every synchronous checkpoint, loads them with weights_only=False: the same files, the same trust
    dce.DecoupledCheckpointEngine.load = TorchCheckpointEngine.load
    save_checkpoint = ds_engine.DeepSpeedEngine.save_checkpoint

    def save_checkpoint_noted(self, *args, **kwargs):
        if self.checkpoint_engine.is_decoupled():
            _ENGINES.add(self)
            self.save_non_zero_checkpoint = writes_model_states(self)
            commit(self, wait=True)  # the previous save first: its commit info, its copies in the pool
            if not writer_alive(self.checkpoint_engine):  # died between saves: this save gets a new one
                replace_writer(self.checkpoint_engine)
        return save_checkpoint(self, *args, **kwargs)

    ds_engine.DeepSpeedEngine.save_checkpoint = save_checkpoint_noted
    # at each optimizer step: commit the pending save once every rank's writer has finished, never wait
    ds_engine.DeepSpeedEngine._commit_decoupled_checkpoint = lambda self: commit(self, wait=False)  # noqa: SLF001
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


def unwritten(under: str | os.PathLike[str]) -> list[str]:
    """The files under ``under`` that this process handed to its writers and that were not on disk
    when their save was committed (a write that failed, a writer that died), taken off the record."""
    prefix = os.path.join(os.path.abspath(under), "")
    found = [p for p in _UNWRITTEN if os.path.abspath(p).startswith(prefix)]
    _UNWRITTEN[:] = [p for p in _UNWRITTEN if not os.path.abspath(p).startswith(prefix)]
    return found


def writer_alive(ce: Any) -> bool:
    """Whether ``ce`` (a decoupled engine) has no writer by design or a writer that runs."""
    proc = getattr(ce, "ckpt_process", None)
    return proc is None or proc.is_alive()


def replace_writer(ce: Any) -> None:
    """Start a new writer process for ``ce`` in place of its dead one, as DeepSpeed's
    ``DecoupledCheckpointEngine.__init__`` starts the first (new event and queue: the old ones may be
    broken with the process). The dead writer's pending files are removed and recorded as unwritten."""
    import torch.multiprocessing as mp
    from deepspeed.runtime.checkpoint_engine import decoupled_checkpoint_engine as dce

    old = ce.ckpt_process
    handed = ce.__dict__.pop("_hfscale_handed", [])
    for path in handed:  # whatever the dead writer left of them is not a checkpoint's file
        try:
            os.unlink(path)
        except OSError:
            pass
    _UNWRITTEN.extend(handed)
    if "_hfscale_args" not in ce.__dict__:  # built before install(): DeepSpeed's own refusal
        raise RuntimeError(f"[{ce.name}] Cannot commit checkpoint: checkpoint process is not running.")
    config_params, dp_writer_config, optimize = ce.__dict__["_hfscale_args"]
    ce.save_event, ce.save_queue = mp.Event(), mp.SimpleQueue()
    ce.ckpt_process = mp.Process(target=dce.init_decoupled_checkpoint,
                                 args=(config_params, dp_writer_config, ce.save_event, ce.save_queue, optimize))
    ce.ckpt_process.start()
    ce._hfscale_asked = False
    print(f"hfscale: warning: rank {ce.global_rank}'s asynchronous checkpoint writer had ended (exit code "
          f"{old.exitcode}); a new one is started" + (f", and the {len(handed)} file(s) of its save in progress "
          "are not kept" if handed else ""), file=sys.stderr, flush=True)


def commit_pending() -> int:
    """Commit every pending save, waiting for the writers (call it on every rank); the number committed."""
    return sum(commit(engine, wait=True) for engine in pending())


def commit(engine: Any, wait: bool) -> bool:
    """Commit ``engine``'s pending save: DeepSpeed 0.19.8's ``_commit_decoupled_checkpoint`` and
    ``DecoupledCheckpointEngine.commit`` (the commit info cleared, the size noted once, ``latest``
    on rank 0, a barrier), with the wait made optional. The writer is asked once per save (a commit
    event behind the save in its queue; it sets ``save_event`` when it gets there). ``wait=False``
    (each optimizer step): one all-reduce of "my writer has finished" over the ranks, and the commit
    only if every rank's has; otherwise training goes on and a later step asks again. Call it on
    every rank at the same point. Whether it committed."""
    from deepspeed import comm as dist
    from deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledEvent
    from deepspeed.runtime.utils import get_checkpoint_folder_size

    ce = engine.checkpoint_engine
    info = ce.get_commit_info()
    if info is None:
        return False
    proc = ce.ckpt_process
    if proc is not None and proc.is_alive() and not ce.__dict__.get("_hfscale_asked"):
        ce.save_queue.put((None, DecoupledEvent.COMMIT_EVENT))
        ce._hfscale_asked = True
    if wait:
        if proc is not None and proc.is_alive():
            try:
                ce._wait_for_event_with_timeout()  # noqa: SLF001 - DeepSpeed's wait, with its health checks
            except RuntimeError:
                if proc.is_alive():  # timed out: DeepSpeed's own message
                    raise
    elif not _everywhere(proc is None or ce.save_event.is_set() or not proc.is_alive()):
        return False  # a dead writer has ended too: its files are looked for now, it is replaced
    if proc is not None and not proc.is_alive():
        replace_writer(ce)
    elif proc is not None:
        ce.save_event.clear()
        handed = ce.__dict__.pop("_hfscale_handed", [])
        _UNWRITTEN.extend(p for p in handed if not os.path.isfile(p))
    del _UNWRITTEN[:-UNWRITTEN_CAP]
    ce._hfscale_asked = False
    ce.commit_info = None
    if ce.checkpoint_size.gb_size() is None:
        dist.barrier()
        ce.checkpoint_size.set_post_size(get_checkpoint_folder_size(info.save_dir, info.tag, ce.local_rank))
    if engine.global_rank == 0 and info.save_latest:
        with open(os.path.join(info.save_dir, "latest"), "w") as fd:
            fd.write(info.tag)
    dist.barrier()
    return True


def _everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (a one-element MIN all-reduce on the accelerator)."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    t = torch.tensor([int(flag)], dtype=torch.int32, device=get_accelerator().current_device_name())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


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
