"""Callbacks for the HF Trainer on a cluster: throughput, stragglers, preemption, complete checkpoints.

Each one works on its own in any Trainer script::

    from hfscale.callbacks import (CheckpointCompleteCallback, MetricsCallback, PreemptionCallback,
                                   StragglerCallback)
    from hfscale.resume import latest_checkpoint

    trainer.add_callback(MetricsCallback(seq_len=2048, peak_flops_per_device=989e12, trainer=trainer))
    trainer.add_callback(StragglerCallback(threshold=1.2, trainer=trainer))
    trainer.add_callback(PreemptionCallback())
    trainer.add_callback(CheckpointCompleteCallback())
    trainer.train(resume_from_checkpoint=latest_checkpoint(args.output_dir))

This module imports torch and transformers (it is for training scripts); nothing else in hfscale
imports it.

Collectives. MetricsCallback and StragglerCallback each run one small ``all_gather`` every
``every`` optimizer steps (default: the Trainer's logging steps) and nothing on the other steps: no
collective and no device synchronisation. PreemptionCallback runs one 1-element ``all_reduce`` per
optimizer step (that is how every rank learns that any rank was signalled).
CheckpointCompleteCallback runs one barrier per save. Tensors for collectives live on the GPU with
NCCL and on the CPU otherwise (gloo, ccl).

Exit. When training ends normally (``on_train_end``), each of these callbacks registers one
``atexit`` hook that calls ``torch.distributed.destroy_process_group()`` if the script has not done
so itself. The Trainer never leaves the process group; with gloo, a process group still alive at
interpreter finalization can abort a rank that finished its work (SIGABRT, "terminate called
without an active exception", pytorch/pytorch#190489), which the launcher then reports as a failed
job. The hook is not registered when training raised: destroying a group while other ranks may
still be inside a collective can hang. The hook makes that abort rarer, not impossible: end the
script with ``exit_cleanly()`` (hfscale.shutdown) to skip interpreter teardown altogether.

Loggers. The metrics are recorded in ``trainer.state.log_history`` and passed to the Trainer's logger
callbacks (``report_to``: TensorBoard, W&B, MLflow, ...). The Trainer calls callbacks in the order
they were added and creates its ``report_to`` loggers before any callback you add, so a callback
added later cannot put values into a log those loggers have already written. Pass ``trainer=`` and
the metrics are logged with ``trainer.log()`` (their own entry, same step, seen by every logger).
Without it they are merged into the Trainer's own log of that step: ``log_history`` and callbacks
added after this one see them, the ``report_to`` loggers do not. Either way the values go out with
the Trainer's next log (the same step when ``every`` equals the logging steps); the JSON lines are
written at once.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import resource
import signal
import socket
import statistics
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from .resume import MARKER, rotate_checkpoints, write_marker
from .shutdown import exit_cleanly

logger = logging.getLogger(__name__)

METRICS_FILE = "hfscale_metrics.jsonl"
LOG_PREFIX = "hfscale/"

__all__ = [
    "METRICS_FILE",
    "CheckpointCompleteCallback",
    "MetricsCallback",
    "PreemptionCallback",
    "StragglerCallback",
    "exit_cleanly",
]


# ---- distributed helpers -------------------------------------------------------------------------


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _comm_device() -> torch.device:
    """Where a tensor for a collective must live: the current GPU with NCCL, else the CPU."""
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_exit_hook_registered = False


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _leave_process_group_at_exit() -> None:
    """Register (once per process) the atexit hook described in the module docstring."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_destroy_process_group)
        _exit_hook_registered = True


def _all_gather(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (same length everywhere), in rank order. One collective."""
    _, world = _rank_world()
    if world == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def _peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank: CUDA allocator peak on a GPU, else the process's peak RSS."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def _append_jsonl(path: str, record: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _count_params(model: Any) -> int:
    # ZeRO-3 leaves empty placeholders in p.data; the real size is p.ds_numel.
    return sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in model.parameters())


# ---- shared machinery of the two reporting callbacks ---------------------------------------------


class _Reporter(TrainerCallback):
    """Times optimizer steps and, every ``every`` steps, gathers numbers from all ranks.

    Step time is wall time between the ends of consecutive optimizer steps; time spent saving a
    checkpoint or evaluating is left out. Subclasses implement ``_report`` (called on every rank at a
    due step, it runs the collective) and get their log values into the Trainer's logs.
    """

    def __init__(self, every: int | None, trainer: Any, filename: str) -> None:
        if every is not None and every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.every = every
        self.trainer = trainer
        self.filename = filename
        self._every = every or 1
        self._pending: dict[str, float] = {}
        self._emitting = False
        self._reset_window()

    def _reset_window(self) -> None:
        self._t_last = time.perf_counter()
        self._window_s = 0.0
        self._window_steps = 0

    def jsonl_path(self, args: Any) -> str:
        return os.path.join(args.output_dir, self.filename)

    def on_train_begin(self, args, state, control, **kwargs):
        self._every = self.every or max(1, int(state.logging_steps or args.logging_steps or 1))
        self._pending = {}
        self._reset_window()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self._window_s += now - self._t_last
        self._t_last = now
        self._window_steps += 1
        if state.global_step % self._every == 0:
            self._report(args, state, **kwargs)
            self._reset_window()

    def on_save(self, args, state, control, **kwargs):
        self._t_last = time.perf_counter()

    def on_evaluate(self, args, state, control, **kwargs):
        self._t_last = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        _leave_process_group_at_exit()

    def _report(self, args, state, **kwargs) -> None:
        raise NotImplementedError

    def _write(self, args, state, record: dict[str, Any]) -> None:
        if state.is_world_process_zero:
            _append_jsonl(self.jsonl_path(args), record)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._emitting or not self._pending:
            return
        values, self._pending = self._pending, {}
        if self.trainer is not None:
            # A log entry of its own, through the Trainer: log_history and every report_to logger.
            self._emitting = True
            try:
                self.trainer.log(dict(values))
            finally:
                self._emitting = False
        elif logs is not None:
            logs.update(values)
            # Trainer.log() appended a copy of `logs` to log_history just before calling on_log.
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(values)


class MetricsCallback(_Reporter):
    """Throughput, ETA, peak memory and MFU, global over all ranks.

    Every ``every`` optimizer steps (default: the Trainer's logging steps) each rank contributes its
    step time and peak memory in one ``all_gather``; rank 0 appends one JSON line to
    ``<output_dir>/hfscale_metrics.jsonl`` and the numbers go to the Trainer's loggers (keys
    ``hfscale/step_time_s``, ``hfscale/samples_per_s``, ``hfscale/tokens_per_s``, ``hfscale/eta_s``,
    ``hfscale/mem_peak_mb``, ``hfscale/mfu``; see the module docstring for ``trainer=``).

    Args:
        every: optimizer steps between reports; default ``state.logging_steps``.
        seq_len: tokens per sample (e.g. the packed block size). Without it, tokens are taken from
            the Trainer's own count when ``include_num_input_tokens_seen`` is on, else unknown.
        peak_flops_per_device: peak FLOP/s of one device at the training precision (e.g. 989e12 for
            an H100 SXM in bf16 dense). Needed for MFU.
        n_params: parameter count for the FLOPs estimate; default: counted from the model.
        flops_per_token: model FLOPs per trained token; default ``6 * n_params``.
        trainer: the Trainer, so the metrics reach its ``report_to`` loggers.
        filename: JSON-lines file name inside ``args.output_dir``.

    JSON-lines fields (one object per report):

    ``event`` ``"metrics"``; ``step`` global step; ``epoch``; ``time`` Unix time; ``world_size``;
    ``window_steps`` steps since the previous report; ``step_time_s`` mean wall time per optimizer
    step in that window (slowest rank's clock; saving and evaluation excluded); ``samples_per_s``
    and ``tokens_per_s`` over all ranks (``tokens_per_s`` null when unknown); ``eta_s`` remaining
    steps x ``step_time_s``; ``mem_peak_mb`` max over ranks and ``mem_peak_mb_per_rank`` (CUDA
    ``max_memory_allocated`` on GPUs, else peak RSS of the process); ``flops_per_token``;
    ``mfu`` achieved model FLOP/s over ``world_size x peak_flops_per_device`` (null when a figure
    is missing).
    """

    def __init__(
        self,
        every: int | None = None,
        seq_len: int | None = None,
        peak_flops_per_device: float | None = None,
        n_params: int | None = None,
        flops_per_token: float | None = None,
        trainer: Any = None,
        filename: str = METRICS_FILE,
    ) -> None:
        super().__init__(every, trainer, filename)
        self.seq_len = seq_len
        self.peak_flops_per_device = peak_flops_per_device
        self.n_params = n_params
        self.flops_per_token = flops_per_token
        self._flops_per_token: float | None = None
        self._tokens_at_window_start = 0
        self.last: dict[str, Any] | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        n = self.n_params if self.n_params is not None else (_count_params(model) if model is not None else None)
        self._flops_per_token = self.flops_per_token if self.flops_per_token is not None else (6.0 * n if n else None)
        self._tokens_at_window_start = state.num_input_tokens_seen or 0

    def _report(self, args, state, **kwargs) -> None:
        mine = [self._window_s, float(self._window_steps), _peak_memory_mb(args.device)]
        rows = _all_gather(mine)
        world = len(rows)
        steps = self._window_steps
        window_s = max(r[0] for r in rows)
        step_time = window_s / steps if steps else float("nan")
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps * world * steps
        samples_per_s = samples / window_s if window_s > 0 else None
        tokens_per_s = None
        if self.seq_len is not None and samples_per_s is not None:
            tokens_per_s = samples_per_s * self.seq_len
        elif args.include_num_input_tokens_seen not in ("no", False) and window_s > 0:
            # The Trainer's count is already summed over ranks.
            tokens_per_s = (state.num_input_tokens_seen - self._tokens_at_window_start) / window_s
        self._tokens_at_window_start = state.num_input_tokens_seen or 0
        mfu = None
        if tokens_per_s is not None and self._flops_per_token and self.peak_flops_per_device:
            mfu = tokens_per_s * self._flops_per_token / (world * self.peak_flops_per_device)
        mem = [r[2] for r in rows]
        remaining = max(0, (state.max_steps or 0) - state.global_step)
        record = {
            "event": "metrics",
            "step": state.global_step,
            "epoch": state.epoch,
            "time": time.time(),
            "world_size": world,
            "window_steps": steps,
            "step_time_s": step_time,
            "samples_per_s": samples_per_s,
            "tokens_per_s": tokens_per_s,
            "eta_s": remaining * step_time,
            "mem_peak_mb": max(mem),
            "mem_peak_mb_per_rank": mem,
            "flops_per_token": self._flops_per_token,
            "mfu": mfu,
        }
        self.last = record
        self._write(args, state, record)
        for key in ("step_time_s", "samples_per_s", "tokens_per_s", "eta_s", "mem_peak_mb", "mfu"):
            if record[key] is not None and math.isfinite(record[key]):
                self._pending[LOG_PREFIX + key] = float(record[key])


class StragglerCallback(_Reporter):
    """Names the rank that holds the others back.

    In synchronous data-parallel training every rank waits for the slowest one inside the
    collectives, so wall time per step is the same everywhere. What differs is the work a rank does
    by itself: this callback times the model's forward passes on each rank (CUDA events on a GPU,
    no synchronisation; a clock on CPU) and, every ``every`` optimizer steps, gathers those times and
    the wall step times in one ``all_gather``. When the slowest rank's forward time per step exceeds
    ``threshold`` x the median, rank 0 warns with the rank and its host name.

    Forward passes that contain collectives themselves (ZeRO-3, FSDP) make the spread smaller than
    the real one.

    JSON-lines fields (``event`` ``"straggler"``, one object per report, same file as
    MetricsCallback): ``step``, ``time``, ``world_size``, ``forward_s_per_rank`` (forward seconds
    per optimizer step), ``step_time_s_per_rank`` (wall seconds per optimizer step),
    ``hosts`` (host name of each rank), ``median_forward_s``, ``slowest_rank``, ``slowest_host``,
    ``ratio`` (slowest / median), ``threshold``, ``straggler`` (ratio > threshold). Logged values:
    ``hfscale/straggler_ratio`` and ``hfscale/slowest_rank``.
    """

    def __init__(
        self, threshold: float = 1.2, every: int | None = None, trainer: Any = None, filename: str = METRICS_FILE
    ) -> None:
        if threshold < 1:
            raise ValueError(f"threshold is a ratio slowest/median and must be at least 1, got {threshold}")
        super().__init__(every, trainer, filename)
        self.threshold = threshold
        self.hosts: list[str] = []
        self.last: dict[str, Any] | None = None
        self._hooks: list[Any] = []
        self._forward_s = 0.0
        self._t_fwd: float | None = None
        self._events: list[tuple[Any, Any]] = []
        self._open_event: Any = None
        self._cuda = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        _, world = _rank_world()
        host = socket.gethostname()
        if world > 1:
            hosts: list[Any] = [None] * world
            dist.all_gather_object(hosts, host)  # once per train() call, not per step
            self.hosts = [str(h) for h in hosts]
        else:
            self.hosts = [host]
        self._remove_hooks()
        if model is not None:
            # looked up once: a per-forward next(parameters()) costs more than the timing itself
            first = next(model.parameters(), None)
            self._cuda = first is not None and first.device.type == "cuda"
            self._hooks = [
                model.register_forward_pre_hook(self._before_forward),
                model.register_forward_hook(self._after_forward),
            ]
        self._forward_s, self._events = 0.0, []

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hooks()
        super().on_train_end(args, state, control, **kwargs)

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _before_forward(self, module, inputs):
        if not module.training:
            return
        if self._cuda:
            self._open_event = torch.cuda.Event(enable_timing=True)
            self._open_event.record()
        else:
            self._t_fwd = time.perf_counter()

    def _after_forward(self, module, inputs, output):
        if not module.training:
            return
        if self._open_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._open_event, end))
            self._open_event = None
        elif self._t_fwd is not None:
            self._forward_s += time.perf_counter() - self._t_fwd
            self._t_fwd = None

    def _report(self, args, state, **kwargs) -> None:
        forward_s = self._forward_s
        for start, end in self._events:  # waits for these events only, not the device
            end.synchronize()
            forward_s += start.elapsed_time(end) / 1000.0
        self._forward_s, self._events = 0.0, []
        steps = max(1, self._window_steps)
        rows = _all_gather([forward_s / steps, self._window_s / steps])
        fwd = [r[0] for r in rows]
        wall = [r[1] for r in rows]
        median = statistics.median(fwd)
        slowest = max(range(len(fwd)), key=fwd.__getitem__)
        ratio = fwd[slowest] / median if median > 0 else 1.0
        host = self.hosts[slowest] if slowest < len(self.hosts) else "?"
        record = {
            "event": "straggler",
            "step": state.global_step,
            "time": time.time(),
            "world_size": len(rows),
            "forward_s_per_rank": fwd,
            "step_time_s_per_rank": wall,
            "hosts": self.hosts,
            "median_forward_s": median,
            "slowest_rank": slowest,
            "slowest_host": host,
            "ratio": ratio,
            "threshold": self.threshold,
            "straggler": ratio > self.threshold,
        }
        self.last = record
        if record["straggler"] and state.is_world_process_zero:
            logger.warning(
                "straggler at step %d: rank %d on host %s takes %.3f s of forward per step, %.2fx the median "
                "%.3f s (threshold %.2f)", state.global_step, slowest, host, fwd[slowest], ratio, median,
                self.threshold,
            )
        self._write(args, state, record)
        self._pending[LOG_PREFIX + "straggler_ratio"] = float(ratio)
        self._pending[LOG_PREFIX + "slowest_rank"] = float(slowest)


# ---- preemption ----------------------------------------------------------------------------------


class PreemptionCallback(TrainerCallback):
    """On SIGTERM/SIGUSR1, save a checkpoint at the next step boundary on every rank, then stop.

    The signal handler only sets a flag. At the end of every optimizer step the ranks combine their
    flags with one 1-element ``all_reduce`` (MAX), so all of them agree on the same step even when
    only one rank was signalled; then the Trainer saves ``checkpoint-<step>`` and ``train()``
    returns normally. ``preempted`` tells the script; ``exit_if_preempted()`` ends the process with
    status 0 (skip it and the script just goes on after ``train()``). A signal that comes after the
    last step boundary is agreed on once more at ``on_train_end`` (no extra save: the Trainer has
    just saved the final checkpoint when ``save_strategy`` is ``"steps"``).

    Under torchrun: a signal sent to torchrun itself is forwarded to the workers (SIGTERM, SIGINT,
    SIGHUP, SIGQUIT; more with ``TORCHELASTIC_SIGNALS_TO_HANDLE``), torchrun then waits
    ``--shutdown-timeout`` seconds (default 30) before SIGKILL, and exits 1 (it re-raises the
    signal as an exception) even when every worker exited 0. The save must fit in that time.
    torchrun does not handle SIGUSR1 unless it is listed there: sent to torchrun, it kills it.
    When every process gets the signal (``scancel``, ``kill`` of the process group), the workers get
    it twice (directly and forwarded); that is harmless. Signals sent to the workers only leave
    torchrun running, and it exits 0 once the workers did.

    The handlers are installed at ``on_train_begin`` (main thread only) and the previous ones are
    restored at ``on_train_end``, except after a preemption: then they stay, so that a second copy
    of the signal (torchrun forwards what it receives) cannot kill the process while it finishes.

    Args:
        signals: the signals that mean "save and stop".
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.preempted = False
        self.received: signal.Signals | None = None
        self.stop_step: int | None = None
        self._flag = False
        self._previous: dict[signal.Signals, Any] = {}

    def _handler(self, signum, frame):  # async-signal-safe: only plain assignments
        self._flag = True
        if self.received is None:
            self.received = signal.Signals(signum)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("PreemptionCallback: not in the main thread, signal handlers not installed")
            return
        for s in self.signals:
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._handler)

    def restore(self) -> None:
        """Put the signal handlers that were there before back."""
        for s, old in self._previous.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        self._previous = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self._flag = False
        self.received = None
        self.preempted = False
        self.stop_step = None
        self.install()

    def _any_rank_signalled(self) -> bool:
        _, world = _rank_world()
        if world == 1:
            return self._flag
        t = torch.tensor([1 if self._flag else 0], dtype=torch.int32, device=_comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def on_step_end(self, args, state, control, **kwargs):
        if self._any_rank_signalled() and not self.preempted:
            self.preempted = True
            self.stop_step = state.global_step
            control.should_save = True
            control.should_training_stop = True
            here = self.received.name if self.received is not None else "no signal here (another rank got one)"
            logger.warning("preemption: saving checkpoint-%d and stopping (%s)", state.global_step, here)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        # A signal after the last step boundary: training is over (the final save is done), but the
        # job is still being stopped; agree once more so every rank reports it the same way.
        if not self.preempted and self._any_rank_signalled():
            self.preempted = True
            self.stop_step = state.global_step
        if not self.preempted:
            self.restore()
        _leave_process_group_at_exit()

    def exit_if_preempted(self, code: int = 0) -> None:
        """After ``train()``: end the process with ``code`` if training was stopped by a signal."""
        if not self.preempted:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(code)


# ---- complete checkpoints ------------------------------------------------------------------------


class CheckpointCompleteCallback(TrainerCallback):
    """Marks a checkpoint complete once every rank finished saving it; rotates only after that.

    After each save, all ranks meet at a barrier; then the process that saves (rank 0, or each
    node's local rank 0 with ``save_on_each_node``) writes ``hfscale_complete.json`` into
    ``checkpoint-<step>``: every file's relative path and size, the global step and the world size.
    :func:`hfscale.resume.latest_checkpoint` resumes only from folders with a verified marker.

    Rotation. In transformers 5.23, ``Trainer._save_checkpoint`` deletes old checkpoints
    (``save_total_limit``) right after the saving process wrote its own files, before the other
    ranks finished theirs and before ``on_save``: with ``save_total_limit=1`` a kill at that moment
    leaves no complete checkpoint. This callback therefore takes the limit over: at ``on_train_begin``
    it moves ``args.save_total_limit`` (or uses ``save_total_limit=`` given here) into itself and sets
    the argument to ``None`` (TrainingArguments are mutable in this version; the value is put back at
    ``on_train_end``), and deletes old checkpoints itself after writing the marker. It never deletes
    the newest complete checkpoint, the best model checkpoint, or anything newer than the newest
    complete one; incomplete folders older than it are deleted. (``training_args.bin`` inside the
    checkpoints records ``save_total_limit=None``.)

    At each step end the saving process also removes a stale marker from a ``checkpoint-<step>``
    folder of the current step, left by an earlier run that went further, so that a save into that
    folder is never taken for complete before it is.

    Args:
        save_total_limit: checkpoints to keep; default: ``args.save_total_limit``.
        fsync: flush every file to disk before writing the marker (against power loss; slower).
    """

    def __init__(self, save_total_limit: int | None = None, fsync: bool = False) -> None:
        self.save_total_limit = save_total_limit
        self.fsync = fsync
        self.keep: int | None = None
        self.marked: list[str] = []
        self._args_limit: int | None = None
        self._took_over = False
        self._marked_steps: set[int] = set()

    def on_train_begin(self, args, state, control, **kwargs):
        self._marked_steps = {
            int(name.removeprefix("checkpoint-"))
            for name in (os.listdir(args.output_dir) if os.path.isdir(args.output_dir) else [])
            if name.removeprefix("checkpoint-").isdigit() and os.path.exists(os.path.join(args.output_dir, name, MARKER))
        }
        self._args_limit = args.save_total_limit
        self.keep = self.save_total_limit if self.save_total_limit is not None else args.save_total_limit
        if args.save_total_limit is not None:
            args.save_total_limit = None  # the Trainer's own rotation runs before the save is complete
            self._took_over = True

    def on_train_end(self, args, state, control, **kwargs):
        if self._took_over:
            args.save_total_limit = self._args_limit
            self._took_over = False
        _leave_process_group_at_exit()

    def on_step_end(self, args, state, control, **kwargs):
        # steps only go forward, so the markers that can go stale are known at train begin
        if state.global_step in self._marked_steps and args.should_save:
            self._marked_steps.discard(state.global_step)
            stale = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", MARKER)
            if os.path.exists(stale):
                os.remove(stale)

    def on_save(self, args, state, control, **kwargs):
        _, world = _rank_world()
        if world > 1:
            dist.barrier()  # every rank has written (and closed) its part of the checkpoint
        if not args.should_save:
            return
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(ckpt):
            logger.warning("CheckpointCompleteCallback: %s not found (hyperparameter search runs are not supported)", ckpt)
            return
        write_marker(ckpt, state.global_step, args.world_size, fsync=self.fsync)
        self.marked.append(ckpt)
        protect = [state.best_model_checkpoint] if state.best_model_checkpoint else []
        for path in rotate_checkpoints(args.output_dir, self.keep, protect=protect):
            logger.info("Deleted old checkpoint %s (save_total_limit=%s)", path, self.keep)
