"""MetricsCallback and StragglerCallback, and the machinery they share: timing optimizer steps
and, every N steps, one gather across ranks (see the package docstring)."""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import torch
from transformers import TrainerCallback

from hfscale.training.callbacks import collectives
from hfscale.training.callbacks.collectives import LOG_PREFIX, METRICS_FILE, logger


def _launch() -> dict[str, str]:
    """``{"job": <job id>}`` under ``hfscale launch`` (launches sharing an output_dir append to one
    file; the report tells them apart by it), else nothing."""
    job = os.environ.get("HFSCALE_JOB_ID")
    return {"job": job} if job else {}


class _Reporter(TrainerCallback):
    """Times optimizer steps and, every ``every`` steps, gathers numbers from all ranks.

    Step time is wall time between the ends of consecutive optimizer steps; time spent saving a
    checkpoint or evaluating is left out, and so is the first step of each start (``train()`` call)
    from the time window: it carries the start-up (lazy communicator and allocator set-up, the first
    batches, a resumed run's data fast-forward), and after a relaunch it made the first window's
    step time 1.6x the steady one (0.081 s against 0.050 s, 2 CPU ranks, ZeRO-2). It stays in the
    record: a due first step is reported with its window empty (``_report_start``: the metrics
    record without throughput). Subclasses implement ``_report`` (called on every rank at a due
    step, it runs the collective) and get their log values into the Trainer's logs.
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
        self._opened = False  # the window opens at the end of a start's first optimizer step
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
        self._opened = False
        self._reset_window()

    def _open_window(self, state) -> None:
        """At the end of a start's first optimizer step: measuring begins here."""
        self._reset_window()

    def on_step_end(self, args, state, control, **kwargs):
        if not self._opened:  # every rank skips the same step: no rank waits in a collective alone
            self._opened = True
            self._open_window(state)
            if state.global_step % self._every == 0:
                self._report_start(args, state, **kwargs)  # in the record, out of the window
            return
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
        collectives.leave_process_group_at_exit()

    def _report(self, args, state, **kwargs) -> None:
        raise NotImplementedError

    def _report_start(self, args, state, **kwargs) -> None:
        """A start's first step when it is due: nothing measured yet (a subclass may record it)."""

    def _write(self, args, state, record: dict[str, Any]) -> None:
        if state.is_world_process_zero:
            collectives.append_jsonl(self.jsonl_path(args), record)

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


def sharing_ranks(trainer: Any = None) -> int:
    """Ranks that work on the same samples: tp_size x cp_size x sp_size of accelerate's
    parallelism_config (the trainer's Accelerator's, else the process's AcceleratorState); 1 without."""
    pc = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if pc is None:
        from accelerate.state import AcceleratorState

        pc = AcceleratorState._shared_state.get("parallelism_config")
    size = getattr(pc, "non_data_parallel_size", 1)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 1


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
    and ``tokens_per_s`` over all ranks, each sample counted once (micro batch x accumulation x the
    data-parallel ranks: world size / (tp x cp x sp), as the Trainer's total batch; ``tokens_per_s``
    null when unknown); ``eta_s`` remaining
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
        n = self.n_params if self.n_params is not None else (collectives.count_params(model) if model is not None else None)
        self._flops_per_token = self.flops_per_token if self.flops_per_token is not None else (6.0 * n if n else None)
        self._tokens_at_window_start = state.num_input_tokens_seen or 0

    def _open_window(self, state) -> None:
        super()._open_window(state)
        self._tokens_at_window_start = state.num_input_tokens_seen or 0

    def _report_start(self, args, state, **kwargs) -> None:
        self._report(args, state, **kwargs)  # the window is empty: memory, no throughput

    def _report(self, args, state, **kwargs) -> None:
        mine = [self._window_s, float(self._window_steps), collectives.peak_memory_mb(args.device)]
        rows = collectives.all_gather(mine)
        world = len(rows)
        steps = self._window_steps
        window_s = max(r[0] for r in rows)
        step_time = window_s / steps if steps else None  # a start's first step: no window
        # tensor, context and sequence parallel ranks share their samples: only data-parallel ranks add some
        data_parallel = max(1, world // sharing_ranks(self.trainer))
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps * data_parallel * steps
        samples_per_s = samples / window_s if window_s > 0 and steps else None
        tokens_per_s = None
        if self.seq_len is not None and samples_per_s is not None:
            tokens_per_s = samples_per_s * self.seq_len
        elif args.include_num_input_tokens_seen not in ("no", False) and window_s > 0 and steps:
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
            "eta_s": remaining * step_time if step_time is not None else None,
            "mem_peak_mb": max(mem),
            "mem_peak_mb_per_rank": mem,
            "flops_per_token": self._flops_per_token,
            "mfu": mfu,
            **_launch(),
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
    ``threshold`` x the median in two reports running, rank 0 warns with the rank and its host name
    (one slow window, a pause of the machine or the first window's warm-up, is in the record only).

    Forward passes that contain collectives themselves (ZeRO-3, FSDP) make the spread smaller than
    the real one.

    JSON-lines fields (``event`` ``"straggler"``, one object per report, same file as
    MetricsCallback): ``step``, ``time``, ``world_size``, ``window_steps`` (the optimizer steps the
    report covers), ``forward_s_per_rank`` (forward seconds per optimizer step),
    ``step_time_s_per_rank`` (wall seconds per optimizer step), ``hosts`` (each rank's node: its
    name in the launch, ``$HFSCALE_HOST``, else the host name), ``median_forward_s`` (of the ranks
    other than the slowest),
    ``slowest_rank``, ``slowest_host``, ``ratio`` (slowest / that median), ``threshold``,
    ``straggler`` (ratio > threshold). Logged values:
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
        self._flagged: int | None = None  # the rank over the threshold in the previous report

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        # once per train() call, not per step; the node's name as hfscale launched it (else the host name)
        self.hosts = [str(h) for h in collectives.gather_objects(collectives.host())]
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

    def _open_window(self, state) -> None:
        super()._open_window(state)
        self._forward_s, self._events = 0.0, []  # the first step's forward is the start-up's

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
        rows = collectives.all_gather([forward_s / steps, self._window_s / steps])
        fwd = [r[0] for r in rows]
        wall = [r[1] for r in rows]
        slowest = max(range(len(fwd)), key=fwd.__getitem__)
        # the others' median: with the slowest included, two ranks' "median" is their mean and the
        # ratio could never reach 2 (a rank 2.75x slower read 1.48x)
        others = fwd[:slowest] + fwd[slowest + 1:]
        median = statistics.median(others) if others else fwd[slowest]
        ratio = fwd[slowest] / median if median > 0 else 1.0
        host = self.hosts[slowest] if slowest < len(self.hosts) else "?"
        record = {
            "event": "straggler",
            "step": state.global_step,
            "time": time.time(),
            "world_size": len(rows),
            "window_steps": self._window_steps,
            "forward_s_per_rank": fwd,
            "step_time_s_per_rank": wall,
            "hosts": self.hosts,
            "median_forward_s": median,
            "slowest_rank": slowest,
            "slowest_host": host,
            "ratio": ratio,
            "threshold": self.threshold,
            "straggler": ratio > self.threshold,
            **_launch(),
        }
        self.last = record
        running = record["straggler"] and self._flagged == slowest
        self._flagged = slowest if record["straggler"] else None
        if running and state.is_world_process_zero:
            logger.warning(
                "straggler at step %d: rank %d on host %s takes %.3f s of forward per step, %.2fx the other "
                "ranks' median %.3f s (threshold %.2f, over it in two reports running)", state.global_step, slowest,
                host, fwd[slowest], ratio, median, self.threshold,
            )
        self._write(args, state, record)
        self._pending[LOG_PREFIX + "straggler_ratio"] = float(ratio)
        self._pending[LOG_PREFIX + "slowest_rank"] = float(slowest)
