#!/usr/bin/env python
"""Benchmark: the detached-job follower (hfscale.launch.attempt.follow.follow_detached) at 10,000 hosts.

A stand-in of a run directory on this machine: ``logs/<host>.log`` and ``alive/<host>`` for N
hosts. A writer process plays the nodes: each host rewrites its heartbeat every 10 s (staggered,
as pdsh's node lines do), a few hosts append lines every second, one host stops beating at
``--lose-at`` s, and one host writes its last lines (a rank's traceback) at ``--fail-at`` s. This
process runs the real follow loop with a recording relay and measures:

- the follower's CPU: its own user+system time over the wall time (issue 23: at most 25 % of one core);
- the lost host named: seconds from its last heartbeat to the relay's fail() (at most 60 s);
- the failed rank's last lines relayed: seconds from their write to route() (at most 5 s).

    python bench/bench_follow.py                 # 10,000 hosts, about 90 s
    python bench/bench_follow.py --hosts 1000 --seconds 60
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfscale.launch.attempt.follow import follow_detached  # noqa: E402
from hfscale.launch.spec import Follow  # noqa: E402
from hfscale.launch.node.keeper import NODE_BEAT_S as HEARTBEAT_S  # noqa: E402
from hfscale.launch.node.line import LOST_AFTER_S  # noqa: E402

MARK = "BENCH-LAST-LINE"


def nodes(root: str, hosts: list[str], seconds: float, lose: str, lose_at: float, fail: str, fail_at: float,
          chatty: int, start: float) -> None:
    """The nodes' side: heartbeats every HEARTBEAT_S s (staggered), chatty hosts' lines, a loss, a failure."""
    rnd = random.Random(0)
    beats = {h: 0 for h in hosts}
    offset = {h: rnd.uniform(0, HEARTBEAT_S) for h in hosts}
    due = sorted((start + offset[h], h) for h in hosts)
    talkers = rnd.sample(hosts, min(chatty, len(hosts)))
    failed = False
    next_talk = start
    while time.time() < start + seconds:
        now = time.time()
        i = 0
        while i < len(due) and due[i][0] <= now:
            t, h = due[i]
            i += 1
            if h == lose and now - start >= lose_at:
                continue  # this node died: no more heartbeats
            beats[h] += 1
            tmp = f"{root}/alive/.{h}"
            with open(tmp, "w") as f:
                f.write(f"{beats[h]}\n")
            os.replace(tmp, f"{root}/alive/{h}")
            due.append((t + HEARTBEAT_S, h))
        due = sorted(due[i:])
        if now >= next_talk:
            next_talk += 1.0
            for h in talkers:
                with open(f"{root}/logs/{h}.log", "a") as f:
                    f.write(f"[rank] step log line at {now:.3f}\n")
        if not failed and now - start >= fail_at:
            failed = True
            with open(f"{root}/logs/{fail}.log", "a") as f:
                f.write(f"Traceback (most recent call last):\nRuntimeError: boom\n{MARK} {time.time():.6f}\n")
        time.sleep(0.05)


class Recorder:
    """A Relay that records when lines and the failure arrive (hfscale.launch.attempt.execute's role)."""

    def __init__(self, run_dir: str):
        self.plan = SimpleNamespace(run_dir=run_dir)
        self.exited: set[str] = set()
        self.failure: tuple[str, int] | None = None
        self.fail_seen: float | None = None
        self.mark_latency: float | None = None
        self.lines = 0
        self.stop = False

    @property
    def signalled(self) -> int | None:
        return 0 if self.stop else None

    def route(self, line: str) -> None:
        self.lines += 1
        if MARK in line and self.mark_latency is None:
            self.mark_latency = time.time() - float(line.rsplit(" ", 1)[1])

    def fail(self, where: str, rc: int, what: str) -> None:
        self.failure, self.fail_seen = (where, rc), time.time()

    def finish(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--lose-at", type=float, default=20, help="one host stops beating after this many seconds")
    ap.add_argument("--fail-at", type=float, default=10, help="one host writes a traceback after this many seconds")
    ap.add_argument("--chatty", type=int, default=100, help="hosts that write a line every second")
    ap.add_argument("--dir", help="where to build the stand-in run directory (default: a temporary one)")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-follow-", dir=a.dir)
    hosts = [f"gpu-node-{i:05d}" for i in range(a.hosts)]
    os.makedirs(f"{root}/logs")
    os.makedirs(f"{root}/alive")
    for h in hosts:
        Path(f"{root}/logs/{h}.log").write_text("started\n")
        Path(f"{root}/alive/{h}").write_text("0\n")
    lose, fail = hosts[len(hosts) // 2], hosts[len(hosts) // 3]
    start = time.time() + 1
    writer = mp.get_context("fork").Process(target=nodes, args=(root, hosts, a.seconds, lose, a.lose_at, fail,
                                                                a.fail_at, a.chatty, start))
    writer.start()
    follow = Follow(tuple(hosts), f"{root}/logs", f"{root}/alive", HEARTBEAT_S, LOST_AFTER_S)
    relay = Recorder(root)
    threading.Timer(a.seconds, lambda: setattr(relay, "stop", True)).start()
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.time()
    follow_detached(relay, follow)
    cpu1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.time()
    relay.stop = True
    writer.join()
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    wall = wall1 - wall0
    # the lost host's last heartbeat: the last multiple of its schedule before lose_at (within one period)
    print(f"hosts {a.hosts}, heartbeat every {HEARTBEAT_S} s, lost after {LOST_AFTER_S} s, {a.chatty} chatty hosts")
    print(f"follower CPU: {cpu:.2f} s over {wall:.1f} s wall = {100 * cpu / wall:.1f} % of one core (target <= 25 %)")
    if relay.failure is not None:
        detect = relay.fail_seen - (start + a.lose_at)
        print(f"lost host: {relay.failure[0]} named {detect:.1f} s after it stopped beating "
              f"(at most {detect + HEARTBEAT_S:.1f} s after its last beat; target <= 60 s)")
    else:
        print("lost host: not named before the end")
    print(f"failed rank's last line relayed after "
          f"{relay.mark_latency:.2f} s (target <= 5 s)" if relay.mark_latency is not None else "last line: not relayed")
    print(f"lines relayed: {relay.lines}")


if __name__ == "__main__":
    main()
