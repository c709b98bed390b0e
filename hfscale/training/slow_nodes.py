"""The slow-node judgement (issue 40, its second part): is one node holding the job back?

Fed each straggler report (hfscale.training.callbacks.reporting.StragglerCallback: every rank's forward
seconds per step and wall seconds per step over the report's steps, and each rank's host), it adds
them up into windows of at least ``window_s`` seconds of training (the slowest rank's wall clock, so
every rank closes a window at the same report). At each window's end a node's forward time is its
slowest rank's; the slowest node's ratio is its time over the median of the other nodes'. A node over
``factor`` in ``windows`` windows running is slow: :class:`SlowNode`.

One report is too short to judge: on the 2-core test machine, reports of one step from even jobs put
a node at up to 6.3x the others (a rank preempted for a few milliseconds); summed over windows of 5 s the
largest was 1.75x, over 10 s 1.38x (tests/data/straggler/, replayed by tests/test_slow_nodes.py).

Pure and standard library only. Every rank runs the same judgement on the same gathered numbers, so
all reach the same verdict at the same report and stop at the same checkpoint.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence


# "1": this attempt can replace a slow node, so its ranks watch (hfscale.launch.node.command.rank_env sets it)
ENV_WATCH = "HFSCALE_SLOW_NODES"


class SlowNodeStop(RuntimeError):
    """A slow node's ranks and every other stopped after a complete checkpoint, to replace it (raised out of
    ``trainer.train()`` on every rank); rank 0's ``progress/metrics.json`` names the node."""


@dataclass(frozen=True)
class SlowSettings:
    """``recovery.slow_nodes`` (hfscale.config.slow_nodes)."""

    factor: float = 1.5
    window_s: float = 60.0
    windows: int = 3

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor > 1.0) or not self.window_s > 0 or self.windows < 1:
            raise ValueError(f"slow nodes: factor {self.factor} (> 1), window {self.window_s} s (> 0), windows "
                             f"{self.windows} (>= 1)")


@dataclass(frozen=True)
class SlowNode:
    """The verdict: ``host`` was over the factor in each of the last windows (their ratios, oldest first)."""

    host: str
    ratios: tuple[float, ...]
    step: int  # the step of the report that closed the last window
    forward_s: float  # its forward seconds per step in the last window
    others_s: float  # the other nodes' median

    def line(self, settings: SlowSettings) -> str:
        ratios = ", ".join(f"{r:.1f}x" for r in self.ratios)
        return (f"{self.host} is slow: its ranks' forward passes took {ratios} the other nodes' median in "
                f"{len(self.ratios)} window{'s' * (len(self.ratios) != 1)} of {settings.window_s:g} s running "
                f"(up to step {self.step}; {self.forward_s:.3f} s a step against {self.others_s:.3f} s; factor "
                f"{settings.factor:g})")


@dataclass(frozen=True)
class Window:
    """One closed window: the slowest node, its ratio, and the seconds per step behind it."""

    host: str
    ratio: float
    forward_s: float
    others_s: float


class SlowNodeWatch:
    """See the module. ``observe`` each report; it answers a :class:`SlowNode` once, when it is found."""

    def __init__(self, settings: SlowSettings) -> None:
        self.settings = settings
        self.verdict: SlowNode | None = None
        self.closed: list[Window] = []  # every window closed, for the record (at most a few per hour)
        self._forward: list[float] = []  # per rank, summed over the open window (seconds)
        self._steps = 0
        self._wall_s = 0.0
        self._streak: list[Window] = []

    def observe(self, step: int, forward_s_per_step: Sequence[float], wall_s_per_step: Sequence[float],
                steps: int, hosts: Sequence[str]) -> SlowNode | None:
        """One report of ``steps`` optimizer steps: each rank's forward and wall seconds per step and host."""
        n = len(forward_s_per_step)
        if self.verdict is not None or steps < 1 or n < 2 or len(hosts) != n or len(wall_s_per_step) != n:
            return None
        if not all(math.isfinite(v) and v >= 0 for v in (*forward_s_per_step, *wall_s_per_step)):
            return None  # a clock that went wrong is no evidence
        if len(self._forward) != n:  # the world changed (a new train() call): start again
            self._forward, self._steps, self._wall_s, self._streak = [0.0] * n, 0, 0.0, []
        self._forward = [a + f * steps for a, f in zip(self._forward, forward_s_per_step)]
        self._steps += steps
        self._wall_s += max(wall_s_per_step) * steps
        if self._wall_s < self.settings.window_s:
            return None
        window = _judge(self._forward, self._steps, hosts)
        self._forward, self._steps, self._wall_s = [0.0] * n, 0, 0.0
        if window is None:
            self._streak = []
            return None
        self.closed.append(window)
        if window.ratio <= self.settings.factor:
            self._streak = []
            return None
        self._streak = [*self._streak, window] if self._streak and self._streak[-1].host == window.host else [window]
        if len(self._streak) < self.settings.windows:
            return None
        self.verdict = SlowNode(window.host, tuple(w.ratio for w in self._streak), step, window.forward_s,
                                window.others_s)
        return self.verdict


def _judge(forward: Sequence[float], steps: int, hosts: Sequence[str]) -> Window | None:
    """The slowest node of a window and its ratio over the other nodes' median (None: one node only)."""
    by_host: dict[str, float] = {}
    for host, f in zip(hosts, forward):
        by_host[host] = max(by_host.get(host, 0.0), f / steps)
    if len(by_host) < 2:
        return None
    slowest = max(by_host, key=lambda h: by_host[h])
    others = statistics.median(v for h, v in by_host.items() if h != slowest)
    ratio = by_host[slowest] / others if others > 0 else 1.0
    return Window(slowest, ratio, by_host[slowest], others)
