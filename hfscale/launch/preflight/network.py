"""``hfscale preflight --network``: which hosts measure each other when, and what the numbers say
(pure). hfscale.launch.netcheck does the measuring on each host; hfscale.launch.attempt.execute runs it.

Up to ``ALL_PAIRS_MAX`` hosts every pair is measured, in rounds where each host meets one peer
(the circle method: n-1 rounds); beyond, a ring (each host with its successor: 2-3 rounds), which
measures every host's link in both directions. Each meeting gives the round-trip time and the rate
each way. A directed rate under ``SLOW`` (a quarter) of the median is slow; a host slow towards (or from)
most of its peers has a slow link itself and is named alone; other slow pairs are named as pairs.
The address measured is the one NCCL would use when ``NCCL_SOCKET_IFNAME`` names one interface
(read on each host by the preflight probe), else the host's name.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from hfscale.core.shell import Command, Ran, render, words
from hfscale.launch.netcheck import MARK
from hfscale.launch.node.reach import ssh_argv
from hfscale.rules.resolved import Job

ALL_PAIRS_MAX = 16
# a rate under a quarter of the median is slow: one Python TCP stream is CPU-bound (about 10-20
# Gbit/s), so a fast fabric measures flat and the spread between healthy pairs reaches 2x on a busy
# host; what this finds is a link far below the rest (a fallback path, a mis-set NIC), not 2x
SLOW = 0.25
SLOW_RTT = 3.0  # a round trip over three times the median, and SLOW_RTT_US more, is slow
# a busy host delays every one of 30 pings by tens of microseconds (61 us against a median of 9 us,
# seen on a loaded 2-core machine, on a healthy veth pair); a bad path costs hundreds of microseconds
SLOW_RTT_US = 200
SECONDS = 0.5  # of data each way per meeting


def schedule(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of (connecting host, serving host) index pairs; each host in at most one pair per round."""
    if n < 2:
        return []
    if n > ALL_PAIRS_MAX:  # a ring: i with i+1, evens first, then odds, then the wrap if n is odd
        rounds = [[(i, i + 1) for i in range(0, n - 1, 2)], [(i, (i + 1) % n) for i in range(1, n, 2)]]
        if n % 2:
            rounds.append([(n - 1, 0)])
        return [r for r in rounds if r]
    ids: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    out = []
    for _ in range(len(ids) - 1):
        half = len(ids) // 2
        pairs = [(a, b) for a, b in zip(ids[:half], reversed(ids[half:])) if a is not None and b is not None]
        out.append(sorted(pairs))
        ids = [ids[0], ids[-1], *ids[1:-1]]  # rotate all but the first
    return out


def slot_seconds(seconds: float) -> float:
    """One round: the pings, the data each way, and a margin for connecting."""
    return round(2 * seconds + 1.0, 3)


def commands(job: Job, python: str, addresses: dict[str, str], port: int, start: float,
             seconds: float = SECONDS) -> dict[str, Command]:
    """One ssh command per host, each carrying only its own rounds (no per-host table in any argv)."""
    hosts = [h.host for h in job.hosts]
    rounds = schedule(len(hosts))
    py = job.config.runner.python or python
    out = {}
    for i, host in enumerate(hosts):
        plan = ",".join(f"{r}:{addresses[hosts[b]]}" for r, pairs in enumerate(rounds) for a, b in pairs if a == i)
        argv = [py, "-m", "hfscale.launch.netcheck", "--me", host, "--port", str(port), "--start", f"{start:.3f}",
                "--slot", str(slot_seconds(seconds)), "--seconds", str(seconds), "--rounds", str(len(rounds)),
                "--plan", plan]
        out[host] = Command(tuple(ssh_argv(job, host) + [render(words(argv))]))
    return out


@dataclass(frozen=True)
class Meeting:
    """What one host measured with one peer: the round trip and the rate each way (Gbit/s)."""

    a: str
    b: str
    rtt_us: float
    a_to_b: float
    b_to_a: float


def parse(outputs: dict[str, str], addresses: dict[str, str]) -> tuple[list[Meeting], list[str]]:
    """(meetings, problems) from each host's output: a host that printed nothing, or an error."""
    by_address = {v: k for k, v in addresses.items()}
    meetings, problems = [], []
    for host, text in outputs.items():
        for line in text.splitlines():
            if not line.startswith(MARK + " "):
                continue
            try:
                m = json.loads(line[len(MARK) + 1:])
                peer = by_address.get(m["to"], m["to"])
                if "error" in m:
                    problems.append(f"{host} could not reach {peer}: {m['error']}")
                else:
                    meetings.append(Meeting(host, peer, float(m["rtt_us"]), float(m["send_gbps"]),
                                            float(m["recv_gbps"])))
            except (ValueError, KeyError, TypeError):
                problems.append(f"{host}: unreadable measurement {line[:80]!r}")
    return meetings, problems


def rates(meetings: list[Meeting]) -> dict[tuple[str, str], float]:
    """(sender, receiver) -> Gbit/s."""
    out = {}
    for m in meetings:
        out[(m.a, m.b)] = m.a_to_b
        out[(m.b, m.a)] = m.b_to_a
    return out


def slow_links(meetings: list[Meeting], hosts: list[str]) -> list[str]:
    """One line per slow link: a host's own link (slow towards or from most peers), else a pair."""
    r = rates(meetings)
    if not r:
        return []
    median = statistics.median(r.values())
    slow = {k for k, v in r.items() if v < SLOW * median}
    out, explained = [], set()
    for host in hosts:
        for side, index, word in (("sending", 0, "to"), ("receiving", 1, "from")):
            mine = [k for k in r if k[index] == host]
            bad = [k for k in mine if k in slow]
            if len(mine) >= 2 and len(bad) * 3 >= len(mine) * 2:
                worst = max(r[k] for k in bad)
                out.append(f"{host}'s link, {side}: {worst:.3g} Gbit/s or less {word} {len(bad)} of {len(mine)} peers "
                           f"(median {median:.3g} Gbit/s)")
                explained |= set(bad)
    for (a, b) in sorted(slow - explained):
        out.append(f"link {a} -> {b}: {r[(a, b)]:.3g} Gbit/s (median {median:.3g} Gbit/s)")
    rtt = statistics.median(m.rtt_us for m in meetings)
    for m in meetings:
        if m.rtt_us > SLOW_RTT * rtt and m.rtt_us > rtt + SLOW_RTT_US:
            out.append(f"link {m.a} <-> {m.b}: round trip {m.rtt_us:.0f} us (median {rtt:.0f} us)")
    return out


def render_matrix(meetings: list[Meeting], hosts: list[str]) -> str:
    """The rate matrix (row sends to column, Gbit/s) and the round-trip matrix (us)."""
    r = rates(meetings)
    rtt = {frozenset((m.a, m.b)): m.rtt_us for m in meetings}
    width = max(8, *(len(h) for h in hosts)) + 2
    lines = ["Gbit/s, row sends to column:", " " * width + "".join(h.rjust(width) for h in hosts)]
    for a in hosts:
        cells = ["-" if a == b else (f"{r[(a, b)]:.3g}" if (a, b) in r else "?") for b in hosts]
        lines.append(a.ljust(width) + "".join(c.rjust(width) for c in cells))
    lines += ["", "round trip, us:", " " * width + "".join(h.rjust(width) for h in hosts)]
    for a in hosts:
        cells = ["-" if a == b else (f"{rtt[frozenset((a, b))]:.0f}" if frozenset((a, b)) in rtt else "?")
                 for b in hosts]
        lines.append(a.ljust(width) + "".join(c.rjust(width) for c in cells))
    return "\n".join(lines) + "\n"


def addresses(job: Job, addrs: dict[str, str | None]) -> dict[str, str]:
    """host -> the address to measure: the NCCL interface's (from the preflight probe), else its name."""
    return {h.host: addrs.get(h.host) or h.host for h in job.hosts}


def summary(job: Job, results: dict[str, Ran], addrs: dict[str, str]) -> tuple[str, bool]:
    """(matrix, slow links and problems as text; whether the network passed) from the hosts' runs."""
    hosts = [h.host for h in job.hosts]
    meetings, problems = parse({h: results[h].stdout for h in hosts if h in results}, addrs)
    for h in hosts:
        rc, out, err = results.get(h, (1, "", "no result"))
        if rc != 0:
            problems.append(f"{h}: netcheck failed: {(err.strip().splitlines() or [f'exit code {rc}'])[-1]}")
    expected = sum(len(r) for r in schedule(len(hosts)))
    if len(meetings) < expected and not problems:
        problems.append(f"{expected - len(meetings)} of {expected} measurements missing (a host started late?)")
    slow = slow_links(meetings, hosts)
    lines = [render_matrix(meetings, hosts).rstrip()]
    lines += [f"slow: {s}" for s in slow] + [f"problem: {p}" for p in problems]
    ok = not slow and not problems
    lines.append(f"network ok: {len(meetings)} host pairs measured" if ok else "network check failed")
    return "\n".join(lines) + "\n", ok


def refusal(job: Job) -> str | None:
    """Why --network cannot measure this job's hosts, or None."""
    if len(job.hosts) < 2:
        return "--network needs at least 2 hosts"
    if len(job.hosts) > job.config.runner.fanout:
        # the rounds are timed: every host's session must be open at once, and ssh sessions are bounded
        return (f"--network measures at most runner.fanout ({job.config.runner.fanout}) hosts at once, all their "
                f"ssh sessions open together; this job has {len(job.hosts)}: check groups of hosts with their own "
                "host files")
    return None
