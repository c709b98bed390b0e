"""PreemptionCallback: a signal on any rank saves a checkpoint on every rank and stops training."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hfscale.training import heartbeat as progress
from hfscale.training.callbacks import collectives
from hfscale.training.callbacks.collectives import logger


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
        _, world = collectives.rank_world()
        if world == 1:
            return self._flag
        t = torch.tensor([1 if self._flag else 0], dtype=torch.int32, device=collectives.comm_device())
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
            progress.report(preempted=True, step=state.global_step)  # hfscale runs shows the run as preempted
        return control

    def on_train_end(self, args, state, control, **kwargs):
        # A signal after the last step boundary: training is over (the final save is done), but the
        # job is still being stopped; agree once more so every rank reports it the same way.
        if not self.preempted and self._any_rank_signalled():
            self.preempted = True
            self.stop_step = state.global_step
            progress.report(preempted=True, step=state.global_step)
        if not self.preempted:
            self.restore()
        collectives.leave_process_group_at_exit()

    def exit_if_preempted(self, code: int = 0) -> None:
        """After ``train()``: end the process with ``code`` if training was stopped by a signal."""
        if not self.preempted:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(code)
