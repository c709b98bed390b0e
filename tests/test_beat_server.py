"""The heartbeat line (hfscale.launch.attempt.beat_server): hostile input closed, beats answered, and what a
job's heartbeats cost the shared file system at 10,000 nodes, before the line and with it.

The figures are measured, not modelled: a real bash keeper per mode under strace (every file it
opens in the run directory), and the launcher's side (hfscale.launch.attempt.follow's follower of a
detached job, as at 10,000 nodes, with the launcher's own beat file) in this process with every file
operation under the run directory counted, against 10,000 real TCP connections from a child process
playing the nodes' keepers. Nothing here is simulated but the nodes' machines."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hfscale.launch.attempt.beat_server as beat_server
from conftest import job_pids
from hfscale.launch.attempt.beat_server import BeatServer
from hfscale.launch.attempt.beats import LaunchBeats
from hfscale.launch.attempt.follow import LOGS_PER_POLL, follow_detached
from hfscale.launch.node.keeper import KEEPER_CHECK_S, NODE_BEAT_S
from hfscale.launch.run_dir import BEAT_ADDR
from hfscale.launch.spec import Follow
from test_keeper import JOB, made, short, start, wait

NODES = 10_000


def _hello(port: int, text: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(text)
    return s


def _answer(s: socket.socket) -> bytes:
    try:
        return s.recv(16)
    except ConnectionResetError:  # closed with our hello unread: a reset, not a FIN
        return b""
    except TimeoutError:
        return b"<none>"


def test_hostile_hellos_are_closed_and_a_keeper_is_answered(tmp_path, monkeypatch):
    monkeypatch.setattr(beat_server, "HELLO_S", 1.0)
    server = BeatServer.start(tmp_path, 2, print)
    assert server is not None
    try:
        port, token, _ = (tmp_path / BEAT_ADDR).read_text().split()
        assert oct((tmp_path / BEAT_ADDR).stat().st_mode & 0o777) == "0o600" and port == str(server.port)
        bad = [f"HFSBEAT1 {'0' * 32} node0\n".encode(),  # the wrong token
               f"HFSBEAT1 {token} no/de\n".encode(),  # a name no beat file may have
               f"HFSBEAT1 {token} node0 extra\n".encode(),
               f"HFSBEAT2 {token} node0\n".encode(),
               b"x" * 1000,  # no end of line within the cap
               f"HFSBEAT1 {token} node0\nbb".encode()]  # bytes after the hello in its packet
        for text in bad:
            with _hello(server.port, text) as s:
                assert _answer(s) == b"", text  # closed, not answered
        with _hello(server.port, b"HFSBEAT1 ") as slow:  # a hello that never ends: closed after HELLO_S
            assert _answer(slow) == b""
        assert server.refused == len(bad) + 1 and server.last_seen() == {}
        with _hello(server.port, f"HFSBEAT1 {token} node0\n".encode()) as s:
            assert _answer(s) == b"ok\n"
            first = server.last_seen()["node0"]
            time.sleep(0.05)
            s.sendall(b"b")
            assert _answer(s) == b"b" and server.last_seen()["node0"] > first
        wait(lambda: "node0" in server.closed(), 5, "the close to be seen")
    finally:
        server.stop()


def test_no_more_connections_than_room_for(tmp_path):
    server = BeatServer.start(tmp_path, 1, print)
    assert server is not None
    server.max_conns = 2
    token = server.token
    try:
        a = _hello(server.port, f"HFSBEAT1 {token} node0\n".encode())
        b = _hello(server.port, f"HFSBEAT1 {token} node1\n".encode())
        assert _answer(a) == _answer(b) == b"ok\n"
        with _hello(server.port, f"HFSBEAT1 {token} node2\n".encode()) as c:
            assert _answer(c) == b""  # not answered ok: that keeper watches the file instead
        a.close()
        b.close()
    finally:
        server.stop()


# ---- 10,000 nodes: the shared file system's operations per second ----------------------------------

KEEPERS = r'''
import random, selectors, socket, sys, time
port, token, n, silent, seconds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
sel, socks = selectors.DefaultSelector(), {}
for i in range(0, n, 500):  # connect in batches, as detached nodes start at most runner.fanout at a time
    batch = []
    for j in range(i, min(n, i + 500)):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"HFSBEAT1 %s n%05d\n" % (token.encode(), j))
        batch.append((j, s))
    for j, s in batch:
        assert s.recv(3) == b"ok\n"
        s.setblocking(False)
        socks[j] = s
        sel.register(s, selectors.EVENT_READ, j)
print("connected", len(socks), flush=True)
slots = 50  # each keeper beats every CHECK s, in turn: a slot of them every CHECK/50 s
answers, t0, done = 0, time.monotonic(), -1
silent_j = int(silent[1:]) if silent else -1
while time.monotonic() - t0 < seconds:
    slot = int((time.monotonic() - t0) / (CHECK / slots))
    if slot != done:
        done = slot
        for j in range(slot % slots, n, slots):
            if j != silent_j:
                socks[j].send(b"b")
    for key, _ in sel.select(timeout=0.02):
        try:
            answers += len(key.fileobj.recv(64))
        except OSError:  # the launcher's side ended
            sys.exit(0)
print("answers", answers, flush=True)
'''.replace("CHECK", str(KEEPER_CHECK_S))


class Counted:
    """Every file operation this process makes under ``root`` (open, stat, lstat, scandir) and every
    positioned write (the launcher's beat), counted while in use."""

    NAMES = ("open", "stat", "lstat", "scandir")

    def __init__(self, root: Path, monkeypatch):
        self.root, self.n, self._lock = str(root), 0, threading.Lock()
        for name in self.NAMES:
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._counting(real))
        real_pwrite = os.pwrite
        monkeypatch.setattr(os, "pwrite", self._counting(real_pwrite, always=True))

    def _counting(self, real, always: bool = False):
        def counted(*a, **k):
            if always or (a and str(a[0]).startswith(self.root)):
                with self._lock:
                    self.n += 1
            return real(*a, **k)
        return counted


class _Relay:
    """follow_detached's view of a running launch, for ``seconds`` (then a signal ends it)."""

    def __init__(self, plan, seconds: float, counted: "Counted | None" = None):
        self.plan, self.exited, self.failure, self.lines = plan, set(), None, 0
        self.counted, self.ops, self.at_finish = counted, 0, 0.0
        self._until = time.monotonic() + seconds

    @property
    def signalled(self):
        return 15 if time.monotonic() > self._until else None

    def route(self, line):
        self.lines += 1

    def fail(self, where, rc, what):
        self.failure = (where, rc, what)

    def finish(self):  # before the last read of every log: the figures are those of the job's run
        self.at_finish = time.monotonic()
        self.ops = self.counted.n if self.counted is not None else 0


def _launcher_side(run: Path, hosts: tuple[str, ...], lost_after: int, seconds: float, line: bool, monkeypatch,
                   silent: str = "") -> tuple[float, float, _Relay, float]:
    """The launcher of a detached job at len(hosts) nodes for ``seconds``: (its file operations per
    second, its CPU seconds per second, the relay, when it ended)."""
    beats = LaunchBeats(run, len(hosts), line, print)
    keepers = None
    try:
        if line:
            assert beats.line is not None
            keepers = subprocess.Popen([sys.executable, "-c", KEEPERS, str(beats.line.port), beats.line.token,
                                        str(len(hosts)), silent, str(seconds + 30)], stdout=subprocess.PIPE, text=True)
            assert keepers.stdout is not None
            assert keepers.stdout.readline().split() == ["connected", str(len(hosts))]
        follow = Follow(hosts, str(run / "logs"), str(run / "alive"), NODE_BEAT_S, lost_after)
        counted = Counted(run, monkeypatch)
        relay = _Relay(type("Plan", (), {"run_dir": str(run)})(), seconds, counted)
        t0, cpu0 = time.monotonic(), time.process_time()
        follow_detached(relay, follow, beats.line)
        took, cpu = relay.at_finish - t0, time.process_time() - cpu0
        monkeypatch.undo()
        return relay.ops / took, cpu / took, relay, took
    finally:
        beats.stop()
        if keepers is not None:
            keepers.kill()
            keepers.wait()


def _parent_and_name(pid: int) -> tuple[int, str]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    return int(stat[stat.rindex(")") + 2:].split()[1]), name


def _keeper_opens(tmp_path: Path, line: bool, seconds: float) -> float:
    """A real keeper (bash, the product's timings) for ``seconds`` under strace: the files it opens in
    the run directory per second, after its start."""
    run = made(tmp_path / ("line" if line else "file"))
    beats = LaunchBeats(run, 1, line, print)
    k = dataclasses.replace(short(run), launcher_beat_s=5, beat_s=NODE_BEAT_S,
                            check_s=KEEPER_CHECK_S, lost_after_s=30, beat_addr=str(run / BEAT_ADDR) if line else "")
    trace = tmp_path / f"strace-{line}"
    job = f"{JOB}-{'line' if line else 'file'}"
    node = start(run, k, ["sleep", "600"], job)
    try:
        wait(lambda: (run / "alive" / "node0").exists(), 10, "the keeper's first beat")
        time.sleep(1)  # past its start (the address file, the connect)
        keeper = next(p for p in job_pids(job) if _parent_and_name(p) == (node.pid, "bash"))  # the ( ... ) subshell
        tracer = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=open,openat", "-o", str(trace), "-p", str(keeper)])
        time.sleep(seconds)
        tracer.terminate()
        tracer.wait(10)
    finally:
        for pid in job_pids(job):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        beats.stop()
    opened = [ln for ln in trace.read_text().splitlines() if str(run) in ln and "ENOENT" not in ln]
    return len(opened) / seconds


@pytest.mark.slow
def test_heartbeats_at_10000_nodes_cost_the_shared_file_system_next_to_nothing(tmp_path, monkeypatch):
    per_keeper: dict[bool, float] = {}
    measuring = [threading.Thread(target=lambda line=line: per_keeper.__setitem__(line, _keeper_opens(tmp_path, line, 10.0)))
                 for line in (False, True)]
    for t in measuring:
        t.start()
    for t in measuring:
        t.join()
    run = made(tmp_path / "launch")
    hosts = tuple(f"n{j:05d}" for j in range(NODES))
    for h in hosts:
        (run / "logs" / f"{h}.log").write_text("")
        (run / "alive" / h).write_text("000000000001\n")
    before, cpu_before, r_before, _ = _launcher_side(run, hosts, 60, 6.0, False, monkeypatch)
    after, cpu_after, r_after, took = _launcher_side(run, hosts, 10, 60.0, True, monkeypatch, silent="n07777")
    total_before, total_after = NODES * per_keeper[False] + before, NODES * per_keeper[True] + after
    print(f"\n{NODES} nodes, file operations per second on the shared file system:\n"
          f"  before (each keeper reads launcher.beat, rewrites alive/<host>; the follower reads every log and beat):\n"
          f"    keepers {NODES * per_keeper[False]:.0f} ({per_keeper[False]:.2f} per keeper), launcher {before:.0f}, "
          f"total {total_before:.0f}\n"
          f"  with the heartbeat line: keepers {NODES * per_keeper[True]:.0f} ({per_keeper[True]:.2f} per keeper), "
          f"launcher {after:.0f}, total {total_after:.0f}\n"
          f"  launcher CPU: {cpu_before:.2f} s/s before, {cpu_after:.2f} s/s on the line with {NODES} connections\n"
          f"  the silent node noticed after {took:.1f} s (lost_after 10 s): {r_after.failure}")
    assert per_keeper[False] > 0.15  # the file keeper: a read every 5 s, a write every 10 s
    assert per_keeper[True] == 0  # on the line: nothing in the run directory while the launcher answers
    assert before > 10 * after  # every log looked at every poll (a second when it keeps up), every beat file every 5 s
    assert after < 2 * LOGS_PER_POLL  # the logs in turn, LOGS_PER_POLL a second; no beat file read
    assert r_after.failure is not None and r_after.failure[0] == "n07777" and "no heartbeat for 10 s" in r_after.failure[2]
    assert took < 10 + NODE_BEAT_S / 2 + 3  # a lost node noticed within lost_after and one check
    assert "more host" not in r_after.failure[2]  # the 9,999 others beat on
    assert r_before.failure is None
    # measured 46-51x (the follower's part before is CPU-bound: a loaded machine polls less): at least 25x
    assert re.search(r"\d", str(total_after)) and total_after < total_before / 25
