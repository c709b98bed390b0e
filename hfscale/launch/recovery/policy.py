"""What to do after an attempt of a job failed (pure: no files, no processes, no clock; times are
passed in). hfscale.launch.recovery.supervisor stops the job, asks :func:`decide`, and relaunches or gives up.

- Off: ``recovery.max_restarts: 0``.
- At most ``max_restarts`` restarts within ``window`` seconds (the whole job when None).
- No restart storm for a bug: the same error ``BUG_REPEATS`` times in a row, each before any
  training step, gives up at once.
- Strikes: a fault attributed to a host counts against it, except when the previous fault ended
  with the same error on another host (a bug moves between hosts; a broken host does not); a rank
  killed by a signal is not such an error (two hosts' ranks SIGKILLed are two faults). A host
  at ``strikes`` is excluded when ``min_nodes`` is set and enough hosts remain; with ``min_nodes``
  unset it is retried in place; below ``min_nodes`` the job gives up. A lost host is excluded at
  once when ``min_nodes`` allows.
- Readmission: an excluded host that passed a probe since (``healthy_again``) comes back once, its
  strikes cleared; excluded again, it stays out for the rest of the job. It takes back a place the
  job lost (its own first), else it waits as a spare.
- A busy master port (``port_busy``: the attempt found node 0's master port still held, by its own
  previous attempt or by another process) is no host's fault: no strike, no replacement, the same
  hosts again (the supervisor waits for the port first); held at ``BUG_REPEATS`` starts in a row
  before any step, the job gives up naming the port.
- Hosts that did not answer after the stop (``lost``: hfscale.launch.recovery.settle; after a hang that named
  no rank, the cut-off node) are replaced by a spare or left out, as a lost host is.
- Hot spares (``recovery.spares``): a host the rules above would exclude, or one that failed with a
  strike when a spare that passed its probe is free, is replaced by that spare in its place (its node
  rank): the world size, the batch math and the checkpoint stay as they are. Only when no healthy
  spare is left does the job shrink (``min_nodes``). A bug that moved between hosts replaces nothing.

Errors compare after :func:`normalise_error`: without rank or host prefixes, addresses, pids,
ranks, ports, times, so the same bug on two hosts reads the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from hfscale.core.records import Cause

__all__ = ["Cause", "Fault", "Policy", "Relaunch", "Replacement", "GiveUp", "History", "normalise_error",
           "last_error", "decide", "probe_targets"]

BUG_REPEATS = 3  # the same error this many times in a row before any step: a bug, not a host
ERROR_CAP = 300  # characters of a normalised error
LINE_CAP = 8192  # characters of a line looked at


@dataclass(frozen=True)
class Fault:
    """One failure of one attempt, as the supervisor saw it."""

    cause: Cause
    host: str | None  # the host it is attributed to (None: not attributable, e.g. the launcher itself)
    rc: int  # the exit code hfscale reported for the attempt
    what: str  # hfscale's one-line message ("node1 failed (exit code 1)")
    error: str  # the failing rank's last error line (normalise_error), "" if none
    at: float  # when it was detected (time.time())
    steps_done: bool  # whether this attempt completed at least one training step


@dataclass(frozen=True)
class Policy:
    """``recovery`` of the config, with the job's hosts and its hot spares (config order)."""

    max_restarts: int
    window: float | None
    strikes: int
    min_nodes: int | None
    hosts: tuple[str, ...]
    spares: tuple[str, ...] = ()

    @staticmethod
    def of(recovery_config: Any, hosts: tuple[str, ...], spares: tuple[str, ...] = ()) -> "Policy":
        """The policy of a ``recovery`` config section (read by attribute; None: recovery off)."""
        window = getattr(recovery_config, "window", None)
        return Policy(max_restarts=int(getattr(recovery_config, "max_restarts", 0) or 0),
                      window=None if window is None else float(window),
                      strikes=max(1, int(getattr(recovery_config, "strikes", 2))),
                      min_nodes=getattr(recovery_config, "min_nodes", None), hosts=tuple(hosts), spares=tuple(spares))


@dataclass(frozen=True)
class Replacement:
    """``spare`` took ``host``'s place (its node rank)."""

    host: str
    spare: str


@dataclass(frozen=True)
class Relaunch:
    """Relaunch the job on ``hosts`` (in node-rank order), with ``spares`` waiting."""

    hosts: tuple[str, ...]
    excluded: tuple[str, ...]  # excluded from now on (cumulative)
    newly_excluded: tuple[str, ...]
    readmitted: tuple[str, ...]
    reason: str  # one line for the terminal
    spares: tuple[str, ...] = ()  # the free spares after this decision
    replaced: tuple[Replacement, ...] = ()


@dataclass(frozen=True)
class GiveUp:
    """Stop for good; ``reason`` is one line for the terminal."""

    reason: str


@dataclass
class History:
    """What the supervisor keeps across attempts (:func:`decide` updates it)."""

    faults: list[Fault] = field(default_factory=list)
    strikes: dict[str, int] = field(default_factory=dict)
    excluded: list[str] = field(default_factory=list)
    readmitted_once: set[str] = field(default_factory=set)
    restarts_at: list[float] = field(default_factory=list)
    places: list[str | None] = field(default_factory=list)  # by node rank: its host, None when the job shrank
    pool: list[str] = field(default_factory=list)  # the free spares
    origin: dict[str, int] = field(default_factory=dict)  # a host's first place, for its readmission

    def begin(self, policy: Policy) -> None:
        """The job's first attempt: every host in its place, every spare free (once)."""
        if not self.places and not self.origin:
            self.places = list(policy.hosts)
            self.pool = [s for s in policy.spares if s not in policy.hosts]
            self.origin = {h: i for i, h in enumerate(policy.hosts)}

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(h for h in self.places if h is not None)


# prefixes of a line as hfscale shows it: pdsh's, the host's ("node1: "), the rank's ("[rank1]: ", "[default0]:")
_PDSH = re.compile(r"^pdsh@[^:\s]+: ")
_RANK = re.compile(r"^\[(?:default|rank)?\d+\]: ?")
_HOST = re.compile(r"^(?P<name>[A-Za-z0-9][\w.-]*): ")
# a leading "Name: " that is a message's own, not a host: "ValueError: ...", "UserWarning: ..."
_NOT_HOST = re.compile(r"(?:\w+\.)*[A-Z]\w*(?:Error|Exception|Warning|Interrupt|Exit|Iteration)|Error|Exception")
# an exception's name: "ValueError", "torch.distributed.DistBackendError", "Exception"
_EXC_NAME = re.compile(r"(?:\w+\.)*(?:[A-Z]\w*)?(?:Error|Exception)")
_EXCEPTION = re.compile(rf"^(?P<name>{_EXC_NAME.pattern})(?::\s.*|:)?$")
_ROOT_CAUSE = re.compile(r"^exitcode\s*:\s*(?P<rc>-?\d+)")
_WRAPPER = "ChildFailedError"  # torchrun's summary of its ranks' failures: the root cause follows
# "hfscale: no in-process restart: <why>; the job is relaunched" (its "hfscale: " taken as a host's prefix)
# why a node ended that its ranks' errors do not say: no in-process restart, or its health gate (hfscale.launch.node.health_gate)
_NODE_ENDED = re.compile(r"^(?P<why>(?:no in-process restart|health gate failed): .+?)(?:; the job is relaunched)?$")
_VARIABLE = [  # what differs between the same failure on two hosts, ranks or runs
    (re.compile(r"\b\d{4}-\d\d-\d\d[ T_]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"), "<time>"),
    (re.compile(r"\b\d\d:\d\d:\d\d(?:[.,]\d+)?\b"), "<time>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "0x?"),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b"), "<ip>"),
    (re.compile(r"(?:(?<=<ip>)|(?<=\])|(?<=localhost)):\d{1,5}\b"), ":<port>"),
    (re.compile(r"\b(pid|PID|tid|rank|Rank|local_rank|global_rank|port|device|GPU|cuda|node|process)"
                r"(\s*(?:[:=]\s*)?)\d+\b"), r"\1\2N"),
    (re.compile(r"\[(?:rank|default)?\d+\]"), "[rank N]"),
]
_SPACES = re.compile(r"\s+")


def _strip_prefixes(line: str) -> str:
    text = line.strip()
    for _ in range(4):  # "pdsh@x: node1: [rank1]: ..."
        before = text
        text = _PDSH.sub("", text)
        m = _HOST.match(text)
        if m and not _NOT_HOST.fullmatch(m["name"]):
            text = text[m.end():]
        text = _RANK.sub("", text).lstrip()
        if text == before:
            break
    return text


def normalise_error(line: str) -> str:
    """``line`` without what differs between the same failure on two hosts or ranks: the pdsh, host
    and rank prefixes, hex addresses, IP addresses, ports, times, and the numbers of pids, ranks,
    devices; spaces collapsed, at most ERROR_CAP characters."""
    text = _strip_prefixes(line[:LINE_CAP])
    for pattern, repl in _VARIABLE:
        text = pattern.sub(repl, text)
    return _SPACES.sub(" ", text).strip()[:ERROR_CAP]


def last_error(lines: Iterable[str]) -> str:
    """The failing rank's error among ``lines``, normalised: the last line that is a Python exception
    ("ValueError: ...", "...Exception: ...", a bare "RuntimeError"), torchrun's ChildFailedError
    summary aside; without one, torchrun's root cause ("exitcode  : -9" -> "exitcode -9"); "" if neither.
    Why a rank's in-process restart could not go on ("no in-process restart: ...", its node's exit 75:
    hfscale.training.inprocess.restart) or why its node failed its health gate ("health gate failed: ...",
    exit 69) comes before either: it is why the node ended."""
    exception = root = node_said = ""
    for line in lines:
        text = _strip_prefixes(line[:LINE_CAP])
        if (n := _NODE_ENDED.match(text)) is not None:
            node_said = normalise_error(n["why"])
            continue
        m = _EXCEPTION.match(text)
        if m and not m["name"].endswith(_WRAPPER):
            exception = normalise_error(text)
            continue
        r = _ROOT_CAUSE.match(text)
        if r:
            root = f"exitcode {r['rc']}"
    return node_said or exception or root


def _names(hosts: Iterable[str]) -> str:
    return ", ".join(hosts) or "no host"


def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def _repeated(faults: list[Fault]) -> int:
    """How many of the last faults in a row ended with the last one's (non-empty) error."""
    error, n = faults[-1].error, 0
    if not error:
        return 0
    for f in reversed(faults):
        if f.error != error:
            break
        n += 1
    return n


def _signalled(error: str) -> bool:
    """Whether ``error`` is torchrun's root cause of a rank killed by a signal ("exitcode -9"): that
    comes from outside the job (the OOM killer, a driver's fault handler, a person), not a bug."""
    return error.startswith("exitcode -")


def probe_targets(policy: Policy, history: History, excluded: bool = True) -> tuple[str, ...]:
    """The hosts worth probing between attempts (config order): the free spares (only a healthy one
    replaces a host), and with ``excluded`` the excluded hosts not readmitted before."""
    history.begin(policy)
    return tuple(h for h in policy.hosts + policy.spares if h in history.pool or (
        excluded and h in history.excluded and h not in history.readmitted_once))


def _readmit(policy: Policy, history: History, healthy: frozenset[str]) -> tuple[str, ...]:
    """Excluded hosts that passed a probe come back once: into a place the job lost (their own
    first), else among the free spares."""
    back = tuple(h for h in policy.hosts + policy.spares if h in healthy and h in history.excluded
                 and h not in history.readmitted_once)
    for h in back:
        history.excluded.remove(h)
        history.readmitted_once.add(h)
        history.strikes[h] = 0
        own = history.origin.get(h)
        empty = [i for i, p in enumerate(history.places) if p is None]
        if empty:
            history.places[own if own in empty else empty[0]] = h
        else:
            history.pool.append(h)
    return back


def _replace(history: History, host: str, healthy: frozenset[str]) -> Replacement | None:
    """Put the first free spare that passed its probe in ``host``'s place; None when none did."""
    spare = next((s for s in history.pool if s in healthy), None)
    if spare is None:
        return None
    history.pool.remove(spare)
    history.places[history.places.index(host)] = spare
    return Replacement(host, spare)


def _leave_out(history: History, host: str, swaps: list[Replacement]) -> None:
    """``host`` is excluded from now on; its place is the spare's that took it, else lost (the job shrinks)."""
    history.excluded.append(host)
    if host not in {r.host for r in swaps}:
        history.places[history.places.index(host)] = None


# causes that exclude a host at once where the job may shrink (no strikes to wait for), and why
_AT_ONCE = {"host_lost": "was lost (relaunching onto it does not bring it back)",
            "loss_spike": "struck by the loss guard", "unhealthy": "failed its health gate", "slow": "was slow"}


def decide(policy: Policy, history: History, fault: Fault, healthy_again: frozenset[str], now: float,
           lost: tuple[str, ...] = ()) -> Relaunch | GiveUp:
    """Record ``fault`` in ``history`` and say what to do: relaunch (on which hosts, and why) or
    give up (why). ``healthy_again``: excluded hosts that passed a probe since the last attempt.
    ``lost``: other hosts of the attempt that did not answer after the stop (hfscale.launch.recovery.settle),
    each replaced by a spare or left out, as a lost host is (below ``min_nodes``: give up)."""
    history.faults.append(fault)
    if policy.max_restarts <= 0:
        return GiveUp("recovery is off (recovery.max_restarts: 0)")
    repeated = _repeated(history.faults)
    bug_at = min(BUG_REPEATS, policy.max_restarts + 1)
    last = history.faults[-bug_at:]
    # a host failing alike: its strikes decide (a busy master port is never a host's: no strikes)
    one_host = len({f.host for f in last}) == 1 and last[0].host is not None and fault.cause != "port_busy"
    if repeated >= bug_at and not any(f.steps_done for f in last) and not one_host:
        if all(f.cause == "port_busy" for f in last):
            return GiveUp(f"the master port was held on {fault.host} at {bug_at} starts in a row, each after "
                          f"waiting for it: {fault.error}; stop what holds it, or set cluster.master_port to a free one")
        return GiveUp(f"the same error {_times(bug_at)} in a row before any training step: {fault.error}; "
                      "this looks like a bug in the job, not a failed host")
    recent = [t for t in history.restarts_at if policy.window is None or now - t <= policy.window]
    if len(recent) >= policy.max_restarts:
        within = f" within {policy.window:g} s" if policy.window is not None else ""
        why = (f"the last {repeated} attempts ended with the same error: {fault.error}" if repeated >= 2
               else f"the last attempt ended: {fault.what}")
        return GiveUp(f"gave up after {len(recent)} restart{'s' * (len(recent) != 1)}{within}: {why}")

    history.begin(policy)
    readmitted = _readmit(policy, history, healthy_again)
    active = history.active
    host = fault.host if fault.host in active else None
    newly: list[str] = []
    swaps: list[Replacement] = []
    floor = max(1, policy.min_nodes) if policy.min_nodes is not None else None
    if host is None:
        head = fault.what
    elif fault.cause == "port_busy":
        head = (f"{fault.what}: the master port was still held on {host}, not {host}'s fault: no strike; "
                "relaunching once it is free")
    else:
        previous = history.faults[-2] if len(history.faults) > 1 else None
        moved = (previous is not None and fault.error != "" and previous.error == fault.error
                 and previous.host is not None and previous.host != host and not _signalled(fault.error))
        if moved and fault.cause != "host_lost":
            head = (f"{fault.what}; {previous.host} ended with the same error before "  # type: ignore[union-attr]
                    f"(a bug moves between hosts): no strike against {host}")
        else:
            n = history.strikes[host] = history.strikes.get(host, 0) + 1
            swap = _replace(history, host, healthy_again)
            if swap is not None:
                newly, swaps = [host], [swap]
                head = (f"{fault.what}: {swap.spare} (a spare that passed its probe) takes its place at the same world "
                        f"size; {host} is left out")
            elif fault.cause in _AT_ONCE and floor is not None and len(active) - 1 >= floor:
                newly = [host]
                head = f"{fault.what}: {host} {_AT_ONCE[fault.cause]}: excluded"
            elif n < policy.strikes:
                head = f"{fault.what} (strike {n} of {policy.strikes} against {host})"
            elif floor is None:
                head = f"{host} failed {_times(n)}; recovery.min_nodes is not set, so it is retried"
            elif len(active) - 1 < floor:
                left = len(active) - 1
                return GiveUp(f"{host} failed {_times(n)} and excluding it would leave {left} "
                              f"node{'s' * (left != 1)}, below recovery.min_nodes {policy.min_nodes}")
            else:
                newly = [host]
                head = f"{host} failed {_times(n)} (strikes {policy.strikes}): excluded"
            if not swaps and policy.spares and newly:
                head += " (no spare left that passed its probe)"
    parts = [head]
    for h in newly:
        _leave_out(history, h, swaps)
    if host is not None and host in history.readmitted_once and host in newly:
        parts[0] += " for good (it failed again after it was readmitted)"
    for h in (h for h in dict.fromkeys(lost) if h in active and h != host):
        # it did not answer after the stop: a relaunch onto it would wait on it, or fail on it again
        swap = _replace(history, h, healthy_again)
        if swap is not None:
            swaps.append(swap)
            part = f"{h} did not answer after the stop: {swap.spare} (a spare that passed its probe) takes its place"
        elif floor is not None and len(history.active) - 1 >= floor:
            part = f"{h} did not answer after the stop: excluded"
        elif floor is None:
            return GiveUp(f"{h} did not answer after the stop, no spare that passed its probe is left, and "
                          "recovery.min_nodes is not set (the job never shrinks)")
        else:
            left = len(history.active) - 1
            return GiveUp(f"{h} did not answer after the stop and excluding it would leave {left} "
                          f"node{'s' * (left != 1)}, below recovery.min_nodes {policy.min_nodes}")
        newly.append(h)
        _leave_out(history, h, swaps)
        parts.append(part + (" for good (it failed again after it was readmitted)" if h in history.readmitted_once
                             else ""))
    hosts = history.active
    if readmitted:
        probes = "its probe" if len(readmitted) == 1 else "their probes"
        parts.append(f"{_names(readmitted)} passed {probes}: readmitted")
    parts.append(f"relaunching on {_names(hosts)} ({len(hosts)} of {len(policy.hosts)} nodes)" if policy.hosts
                 else "relaunching on this machine")
    if policy.spares:
        parts.append(f"{len(history.pool)} spare{'s' * (len(history.pool) != 1)} left")
    history.restarts_at.append(now)
    return Relaunch(hosts=hosts, excluded=tuple(h for h in policy.hosts + policy.spares if h in history.excluded),
                    newly_excluded=tuple(newly), readmitted=readmitted, reason="; ".join(parts),
                    spares=tuple(history.pool), replaced=tuple(swaps))
