"""The hang watchdog's judgement: is the job stuck, which rank holds it up, and the report.

The ranks report their steps (hfscale.training.heartbeat); :class:`Watchdog` reads those files, timed by
this host's clock (content compared, as hfscale.launch.attempt.follow does). When no rank has finished a step
for ``timeout`` seconds, hfscale.launch.attempt.execute has every rank's Python stack written (py-spy, or
faulthandler through SIGUSR2) and :func:`analyze` names the stuck rank(s):

- ranks that never reported a step;
- ranks that did not answer the stack dump while most did (hfscale.launch.attempt.dump_files): a
  stopped process (SIGSTOP, a frozen container), one stuck in the kernel or a driver, or one on a
  node out of reach cannot;
- ranks behind the others in steps that are not inside a collective (stuck before it);
- ranks ahead of the others while those wait in a collective: they passed a collective the
  others are still in, so they skipped it (or the others repeat one);
- at the same step, ranks outside any collective while the others wait in one (a sleep, I/O,
  a loop); or the ranks in a different collective than most;
- when every rank waits in the same collective, none: the cause is a lost peer or the network.

Reads files only; hfscale.launch.attempt.execute runs the stack dump and stops the job.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from hfscale.core.atomic_files import write_files
from hfscale.launch.attempt.dump_files import (DumpMarks, LastCollective, await_answers, flight_dir, read_flight,
                                               read_stacks)
from hfscale.launch.spec import HangWatch
from hfscale.training.heartbeat import Progress, read_progress

_PYSPY = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^():]+):(?P<line>\d+)\)$")
_FAULT = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py", "deepspeed/comm/")


class Watchdog:
    """Steps seen per rank, and when each last changed."""

    def __init__(self, watch: HangWatch, now: float):
        self.watch = watch
        self.started = now
        self.ranks: dict[int, Progress] = {}
        self.changed: dict[int, float] = {}
        self._top = (-1, now)  # (highest step seen, when it was first seen)

    def poll(self, now: float) -> str | None:
        """Read the progress files; a reason when the job counts as hung (no rank wrote a step or a
        beat for the timeout), else None."""
        folder = Path(self.watch.progress_dir)
        try:
            names = [e.name for e in folder.iterdir() if e.name.startswith("rank-")]
        except OSError:
            names = []
        active = False
        for name in names:
            p = read_progress(folder / name)
            if p is not None and (p.rank not in self.ranks or self.ranks[p.rank] != p):
                self.ranks[p.rank], self.changed[p.rank] = p, now
                active = True
        top = max((p.step for p in self.ranks.values()), default=-1)
        if top > self._top[0] or active:  # a new step, or work between steps (evaluation, saving)
            self._top = (top, now)
        if not self.ranks:
            limit = self.watch.first_step
            if limit is not None and now - self.started >= limit:
                return f"no rank finished a step in the first {limit} s"
            return None
        if now - self._top[1] >= self.watch.timeout:
            return f"no rank finished a step for {self.watch.timeout} s (the last was step {top})"
        return None


@dataclass(frozen=True)
class Frame:
    func: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.func} ({Path(self.file).name}:{self.line})"


MAIN_OUTERMOST = ("<module>", "_run_module_as_main", "_run_code")  # a script, or python -m's runpy


def main_stack(text: str) -> list[Frame]:
    """The innermost-first frames of the main thread in a py-spy or faulthandler dump: the thread
    py-spy names "MainThread"; else faulthandler's "Current thread" (the signal is sent to the
    process, which Linux hands to its main thread); else the one whose outermost frame runs a
    script or module; else the first."""
    threads: list[tuple[str, list[Frame]]] = []
    for line in text.splitlines():
        m = _PYSPY.match(line) or _FAULT.match(line)
        if m:
            if not threads:
                threads.append(("", []))
            threads[-1][1].append(Frame(m["func"].strip(), m["file"], int(m["line"])))
        elif line.strip() and (line.startswith(("Thread", "Current thread")) or "(most recent call first)" in line):
            threads.append((line, []))
    threads = [(head, t) for head, t in threads if t]
    for pick in (lambda head, t: '"MainThread"' in head, lambda head, t: head.startswith("Current thread"),
                 lambda head, t: t[-1].func in MAIN_OUTERMOST):
        for head, t in threads:
            if pick(head, t):
                return t
    return threads[0][1] if threads else []


def collective(stack: list[Frame]) -> str | None:
    """The torch.distributed (or DeepSpeed comm) call the stack waits in, or None."""
    for f in stack:
        if any(part in f.file.replace("\\", "/") for part in COLLECTIVE_FILES):
            return f.func
    return None


def where(stack: list[Frame]) -> str:
    """The innermost frame outside Python's and the libraries' own files (else the innermost)."""
    for f in stack:
        if "site-packages" not in f.file and "/lib/python" not in f.file:
            return str(f)
    return str(stack[0]) if stack else "no stack"


@dataclass(frozen=True)
class Verdict:
    stuck: tuple[int, ...]
    line: str  # one line for the terminal


def analyze(ranks: dict[int, Progress], stacks: dict[int, str], world: int,
            flight: dict[int, LastCollective] | None = None, answered: frozenset[int] = frozenset()) -> Verdict:
    """Which rank(s) hold the job up, from their last steps, which of them ``answered`` the dump
    (hfscale.launch.attempt.dump_files.await_answers), their stacks and, where the stacks show no
    cause, their flight recorders' collective counts."""
    missing = tuple(r for r in range(world) if r not in ranks)
    if missing:
        return Verdict(missing, f"{_names(missing, ranks)} never finished a step")
    frames = {r: main_stack(stacks.get(r, "")) for r in ranks}
    coll = {r: collective(frames[r]) for r in ranks}
    steps = {r: p.step for r, p in ranks.items()}
    low, high = min(steps.values()), max(steps.values())
    silent = tuple(r for r in sorted(ranks) if answered and r not in answered)
    if silent and 2 * len(silent) <= len(ranks):  # most answered: the dump worked, these could not run
        waiting = next((c for c in coll.values() if c is not None), None)
        return Verdict(silent, f"{_names(silent, ranks)} did not answer the stack dump while the others "
                               f"{'wait in ' + waiting if waiting else 'did'} (step {low}): "
                               "stopped, stuck in the kernel or a driver, or out of reach")
    if low != high:
        behind = tuple(r for r in ranks if steps[r] == low)
        ahead = tuple(r for r in ranks if steps[r] > low)
        outside = tuple(r for r in behind if frames[r] and coll[r] is None)
        if outside:
            return Verdict(outside, f"{_names(outside, ranks)} stuck at step {low} in {where(frames[outside[0]])} "
                                    f"while the others are at step {high}")
        waiting = coll[behind[0]] or "a collective"
        return Verdict(ahead, f"{_names(ahead, ranks)} at step {high} passed the {waiting} that "
                              f"{_names(behind, ranks)} {'waits' if len(behind) == 1 else 'wait'} in at step {low}: "
                              "a skipped collective")
    outside = tuple(r for r in ranks if frames[r] and coll[r] is None)
    inside = [r for r in ranks if coll[r] is not None]
    if outside and inside:
        return Verdict(outside, f"{_names(outside, ranks)} stuck at step {low} in {where(frames[outside[0]])} while "
                                f"the others wait in {coll[inside[0]]}")
    kinds = Counter(c for c in coll.values() if c is not None)
    if len(kinds) > 1:
        common = kinds.most_common(1)[0][0]
        odd = tuple(r for r in ranks if coll[r] != common)
        return Verdict(odd, f"{_names(odd, ranks)} in {coll[odd[0]]} while the others wait in {common} (step {low})")
    behind = _behind_in_collectives(flight or {})
    if behind is not None:
        late, count, others, name = behind
        return Verdict(late, f"{_names(late, ranks)} issued {count} collectives, the others {others} (the last: "
                             f"{name}): {'it has' if len(late) == 1 else 'they have'} not reached the collective "
                             f"the others wait in (step {low})")
    if inside:
        return Verdict((), f"every rank waits in {coll[inside[0]]} at step {low}: a lost peer or the network")
    return Verdict((), f"no rank finished a step since step {low}; no stack shows a cause")


class Behind(NamedTuple):
    """Ranks with fewer collectives issued, their count, the others' count, the others' last collective."""

    ranks: tuple[int, ...]
    count: int
    others: int
    others_last: str


def _behind_in_collectives(flight: dict[int, LastCollective]) -> Behind | None:
    """Who is behind when the flight recorders disagree on the count, else None."""
    if len(flight) < 2:
        return None
    counts = {r: n for r, (n, _, _) in flight.items()}
    low, high = min(counts.values()), max(counts.values())
    if low == high:
        return None
    late = tuple(sorted(r for r, n in counts.items() if n == low))
    ahead = next(r for r, n in counts.items() if n == high)
    return Behind(late, low, high, flight[ahead].name)


def _names(ranks_: tuple[int, ...], ranks: dict[int, Progress]) -> str:
    named = [f"rank {r}" + (f" on {ranks[r].host}" if r in ranks else "") for r in ranks_[:8]]
    more = f" and {len(ranks_) - 8} more" if len(ranks_) > 8 else ""
    return ", ".join(named) + more


def flight_line(flight: dict[int, LastCollective]) -> str | None:
    """One line when the ranks' flight recorders disagree: different counts, or other collectives."""
    if len(flight) < 2 or len({(n, name) for n, name, _ in flight.values()}) == 1:
        return None
    parts = [f"rank {r}: #{n} {name} ({state})" for r, (n, name, state) in sorted(flight.items())[:8]]
    return "flight recorder, each rank's last collective: " + ", ".join(parts)


def report(reason: str, verdict: Verdict, ranks: dict[int, Progress], changed: dict[int, float],
           stacks: dict[int, str], now: float, flight: dict[int, LastCollective] | None = None) -> str:
    """The full hang report: why, every rank's last step, place and last collective, every stack."""
    flight = flight or {}
    lines = [f"hfscale hang report: {reason}", f"verdict: {verdict.line}", "",
             "rank  host                 pid      step  since   where"]
    for r in sorted(ranks):
        p, stack = ranks[r], main_stack(stacks.get(r, ""))
        last = f"  [collective #{flight[r][0]} {flight[r][1]} {flight[r][2]}]" if r in flight else ""
        lines.append(f"{r:<5} {p.host[:20]:<20} {p.pid:<8} {p.step:<5} {now - changed.get(r, now):>5.0f}s  "
                     f"{collective(stack) or where(stack)}{last}")
    disagree = flight_line(flight)
    if disagree:
        lines += ["", disagree]
    for r in sorted(stacks):
        lines += ["", f"--- rank {r}", stacks[r].rstrip()]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Hang:
    """What the launch says and stops for: the host of the first stuck rank, and the message."""

    where: str
    what: str


def conclude(dog: Watchdog, reason: str, now: float, echo: Callable[[str], None],
             before: DumpMarks | None = None) -> Hang:
    """Judge the hang once the stacks are on disk (those written since ``before``, the marks taken
    before the dump; the ranks' answers awaited for up to ``ANSWER_WAIT_S``), write the report (a
    write that fails is said)."""
    answered = await_answers(dog.watch, dog.ranks, before) if before is not None else frozenset()
    verdict, text = judge(dog, reason, now, before, answered)
    report_path = Path(dog.watch.report)
    try:
        write_files(report_path.parent, {report_path.name: text})
    except OSError as e:
        echo(f"hfscale: cannot write {report_path}: {e.strerror or e}")
    stuck = verdict.stuck[0] if verdict.stuck else None
    where = dog.ranks[stuck].host if stuck in dog.ranks else "the job"
    return Hang(where, f"hang: {verdict.line} ({reason}); report in {report_path}")


def judge(dog: Watchdog, reason: str, now: float, before: DumpMarks | None = None,
          answered: frozenset[int] = frozenset()) -> tuple[Verdict, str]:
    """(the verdict, the report's text) once the stacks and flight recorders are on disk (with
    ``before``, only those written since), knowing which ranks ``answered`` the dump."""
    stacks = read_stacks(dog.watch.stacks_dir, before and before.stacks)
    flight = read_flight(flight_dir(dog.watch), before and before.flight)
    verdict = analyze(dog.ranks, stacks, dog.watch.world_size, flight, answered)
    return verdict, report(reason, verdict, dog.ranks, dog.changed, stacks, now, flight)
