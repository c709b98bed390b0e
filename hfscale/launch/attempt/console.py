"""What ``hfscale launch`` shows on the terminal: one live progress line fed by rank 0's numbers,
the nodes' errors, hfscale's own lines. Library warnings and info logs (a warning printed behind a
progress bar too), the Trainer's log dicts (the progress line shows them) and hfscale's internal
markers (``HFSCALE_TRAIN``, ``HFSCALE_EXIT``) stay in the node logs (``<run dir>/logs``), which always
get every line. ``--verbose`` shows every line as well; ``--quiet`` only errors and failures.

No processes here: ``execute`` calls a Console for each line and runs ``show_progress`` in a
thread.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Literal, TextIO

from hfscale.core.records import Rank0Metrics
from hfscale.core.untrusted import Unreadable
from hfscale.launch.attempt.node_lines import HOST_PREFIX
from hfscale.launch.run_dir import read_metrics

PROGRESS_POLL_S = 1.0
PROGRESS_EVERY_S = 30.0  # without a terminal (a CI log, nohup) the line is printed this often

_RANK = re.compile(r"^\[(?:default)?rank\d+\]: ?")
_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")  # warnings.warn's first line; an indented source line follows
# the same behind a progress bar: tqdm ends its bar with no newline, so a warning printed while it
# runs continues the bar's line ("  0%|  | 0/4 [00:00<?, ?it/s]/x/c10d_logger.py:83: FutureWarning: ...")
_WARNING_BEHIND_BAR = re.compile(r"\]\S+:\d+: \w*Warning: ")
_CSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # terminal control sequences (tqdm moves the cursor: ESC[A)
# hfscale's own markers for the node logs and the tests (the built-in entry point's result, a node's exit)
_C10_PREFIX = re.compile(r"^[EWI]\d{4} [\d:.]+ +\d+ \S+:\d+\] ")  # torch's c10 logging: level, date, time, pid, file:line
_INTERNAL = re.compile(r"^HFSCALE_(?:TRAIN|EXIT) ")
# lines after a warning's first line in which its source line may still come: the ranks share one
# pipe and write the two lines separately, so another rank's warning can come in between
_SOURCE_WITHIN = 16
_NOISE = [
    re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,.]+\] \[(?:INFO|WARNING|DEBUG)\]"),  # DeepSpeed's logger
    re.compile(r"^\[(?:transformers|accelerate|datasets|torch)\] "),  # transformers 5's logging format
    re.compile(r"^\[?[WI]\d{4} [\d:.]+ +(?:\d+ )?"),  # torch's c10 logging (torchrun's OMP_NUM_THREADS notice ...)
    re.compile(r"^(?:WARNING|INFO|DEBUG):[\w.]+:"),  # the logging module's default format
    # the Trainer's log dicts, its final summary included (the progress line shows the numbers)
    re.compile(r"^\{'(?:loss|grad_norm|learning_rate|hfscale/|train_runtime)"),
    re.compile(r"\d+%\|.*\| *\d+/\d+ \["),  # tqdm bars
    # tqdm without a total ("Generating train split: 5 examples [00:00, 427.55 examples/s]", datasets)
    re.compile(r": *\d[\d.]*[kMGT]? ?[\w ]* \[(?:\d+:)?\d\d:\d\d, +(?:\?|[\d.]+[kMGT]?) ?\w*/\w+[^\]]*\]$"),
    re.compile(r"^DeepSpeed [\w.]+ built successfully$"),  # DeepSpeed's JIT op builds (deepspeed.comm)
    re.compile(r"^Time to load \w+ op: [\d.]+ seconds$"),
    re.compile(r"^\s*warnings\.warn\("),
]
_ERROR = re.compile(r"Traceback \(most recent call last\)|\b\w*(?:Error|Exception)\b|\bFAILED\b|\berror\b", re.I)
_TRACE_END = re.compile(r"^[\w.]+(?:Error|Exception|Interrupt|Exit)\b")
_HFSCALE_FAILURE = re.compile(r"fail|cannot|stopping|lost|hang|killed|error|not submitted", re.I)


ConsoleMode = Literal["quiet", "normal", "verbose"]


class Console:
    """The terminal side of a launch; ``mode``: quiet, normal or verbose."""

    def __init__(self, mode: ConsoleMode = "normal", stream: TextIO | None = None, tty: bool | None = None,
                 hosts: frozenset[str] | None = None):
        self.mode = mode
        self.hosts = hosts  # the names a "host: " prefix may carry (None: any name)
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._lock = threading.Lock()
        self._live = ""  # the progress line now on the terminal (tty only)
        # per source: [warnings whose source line has not come yet, lines left in which it may come]
        self._after_warning: dict[str, list[int]] = {}
        self._in_trace: set[str] = set()

    def shown(self, line: str) -> bool:
        """Whether ``line`` (as the launcher printed it) goes to the terminal in this mode."""
        if self.mode == "verbose":
            return True
        if line.startswith("hfscale: "):
            return self.mode == "normal" or bool(_HFSCALE_FAILURE.search(line))
        m = HOST_PREFIX.match(line)
        if m and self.hosts is not None and m["host"] not in self.hosts:
            m = None  # "ValueError: bad batch" from a local run is no host's line
        source, text = (m["host"], _RANK.sub("", line[m.end():])) if m else ("", _RANK.sub("", line))
        text = _CSI.sub("", text)
        if not text.strip():
            return False
        if "Traceback (most recent call last)" in text:
            self._in_trace.add(source)
            return True
        if source in self._in_trace:
            if _TRACE_END.match(_C10_PREFIX.sub("", text)):  # torch's agent logs a traceback with a prefix on each line
                self._in_trace.discard(source)
            return True
        pending = self._after_warning.get(source)
        if pending is not None:
            indented = text[:1].isspace()  # a warning's source line
            pending[0] -= indented
            pending[1] -= 1
            if pending[0] <= 0 or pending[1] <= 0:
                del self._after_warning[source]
            if indented:
                return False
        if _WARNING.match(text) or _WARNING_BEHIND_BAR.search(text):
            pending = self._after_warning.setdefault(source, [0, 0])
            pending[0], pending[1] = pending[0] + 1, _SOURCE_WITHIN
            return False
        if _INTERNAL.match(text) or any(p.search(text) for p in _NOISE):
            return False
        return self.mode == "normal" or bool(_ERROR.search(text))

    def __call__(self, line: str) -> None:
        with self._lock:
            if not self.shown(line):
                return
            if self._live:
                self.stream.write("\r\033[K")
            self.stream.write(line + "\n")
            if self._live:
                self.stream.write(self._live)
            self.stream.flush()

    def progress(self, text: str) -> None:
        """Show ``text`` as the live line (a terminal), else as a line of its own."""
        if self.mode == "quiet":
            return
        with self._lock:
            if self.tty:
                self._live = text
                self.stream.write("\r\033[K" + text)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End the live line so what follows starts on a line of its own."""
        with self._lock:
            if self._live:
                self.stream.write("\n")
                self.stream.flush()
                self._live = ""


def never_raises(echo: Callable[[str], None]) -> Callable[[str], None]:
    """``echo`` that never raises: after SIGHUP the terminal is gone, and the job must still stop."""
    def say(text: str) -> None:
        try:
            echo(text)
        except (OSError, ValueError):
            pass
    return say


def duration_text(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def count_text(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"


def progress_text(m: Rank0Metrics, rate: float | None = None) -> str | None:
    """``step 120/300 (40%) | loss 4.1230 | 18.2k tokens/s | ETA 1m05s`` from rank 0's numbers
    (``rate``: steps per second seen here, for an ETA the run did not report)."""
    step, total = m.step, m.max_steps
    if step is None:
        return None
    parts = [f"step {step}/{total} ({100 * step // total}%)" if total else f"step {step}"]
    if m.loss is not None:
        parts.append(f"loss {m.loss:.4f}")
    if m.tokens_per_s is not None:
        parts.append(f"{count_text(m.tokens_per_s)} tokens/s")
    eta = m.eta_s
    if eta is None and rate and total is not None and total > step:
        eta = (total - step) / rate
    if eta is not None and 0 <= eta < 1e9:
        parts.append(f"ETA {duration_text(eta)}")
    return "hfscale: " + " | ".join(parts)


class AttemptRate:
    """Steps per second seen here, within rank 0's current start only: the count starts again when
    rank 0 reports another restart (torchrun restarted the ranks) or a step below the last one seen
    (a relaunch resumed from an earlier checkpoint), so the stop and the restart never count as
    training."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None  # (time, step) where this start's count began
        self.last: tuple[int, int | None] | None = None  # (step, restart) last seen

    def __call__(self, now: float, step: int, restart: int | None) -> float | None:
        if self.first is None or self.last is None or restart != self.last[1] or step < self.last[0]:
            self.first = (now, step)
        self.last = (step, restart)
        t0, s0 = self.first
        return (step - s0) / (now - t0) if now > t0 and step > s0 else None


def show_progress(run_dir: str | Path, done: threading.Event, show: Callable[[str], None], tty: bool) -> None:
    """Until ``done`` (and once more then): read rank 0's numbers each second and ``show`` the line
    when it changes (without a terminal: the first, then at most every PROGRESS_EVERY_S, and the
    last). The ETA rank 0 did not report comes from the rate of its current start (``AttemptRate``)."""
    last_text, last_shown, rate_of = None, 0.0, AttemptRate()
    while True:
        ending = done.wait(PROGRESS_POLL_S)
        try:
            m = read_metrics(run_dir)
        except Unreadable:
            m = Rank0Metrics()  # damaged or replaced by something else: no line from it
        step = m.step
        if step is not None:
            now = time.monotonic()
            text = progress_text(m, rate_of(now, step, m.restart))
            final = ending or (m.max_steps is not None and step >= m.max_steps)
            if text is not None and text != last_text and (
                    tty or final or last_text is None or now - last_shown >= PROGRESS_EVERY_S):
                show(text)
                last_text, last_shown = text, now
        if ending:
            return
