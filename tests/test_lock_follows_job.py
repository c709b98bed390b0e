"""The output_dir lock follows the job, not only its launcher (issue 27; hfscale.launch.attempt.output_lock,
hfscale.launch.attempt.beats): a holder whose launcher is gone but whose nodes' heartbeats change is not
taken over, from the holder's host or from another; once the heartbeats stop, it is. Threads stand
in for the nodes' keepers (the real keepers run in tests/test_keeper.py and, on the namespace
cluster, tests/test_orphans_cluster.py). No process is started."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from hfscale.core.pid_identity import this_process
from hfscale.core.records import TimelineEvent
from hfscale.launch.attempt import beats, output_lock
from hfscale.launch.recovery.timeline import Timeline
from hfscale.runs.goodput import goodput

JOB, NEW = "20261126-000001-aaaaaa", "20261126-000002-bbbbbb"
WATCH = 1.5  # the tests' look at the heartbeats (the product's: beats.OBSERVE_S)


@pytest.fixture
def short_watch(monkeypatch):
    monkeypatch.setattr(output_lock, "observe", lambda run_dir, seconds, launcher=True: beats.observe(run_dir, WATCH, launcher))


class Node:
    """A node's keeper: rewrites ``alive/<host>`` every ``every`` seconds until stopped."""

    def __init__(self, run: Path, host: str, every: float = 0.5):
        self.path, self.every, self.done = run / "alive" / host, every, threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        n = 0
        while not self.done.wait(self.every):
            n += 1
            self.path.write_text(f"{n:012d}\n")

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)


def holder(tmp_path: Path, host: str, dead_launcher: bool = True) -> tuple[Path, Path]:
    """An output_dir locked by job JOB of a pdsh launch whose run directory is ``run``; its launcher is
    this process with a wrong start time (gone: provably not it) on this host, or runs on ``host``."""
    out, run = tmp_path / "out", tmp_path / "runs" / f"j-{JOB}"
    for d in (out, run / "alive", run / "orphaned", run / "logs"):
        d.mkdir(parents=True)
    (run / "launcher.beat").write_text("00000000000000000007\n")
    me = this_process()
    (out / "_hfscale-lock.json").write_text(json.dumps({
        "job_id": JOB, "host": host, "pid": me.pid, "proc_start": me.start + 1 if dead_launcher else me.start,
        "boot_id": me.boot_id, "pid_ns": me.pid_ns, "run_dir": str(run), "started": time.time(), "runner": "pdsh",
        "stops_within_s": 50}))
    return out, run


@pytest.mark.parametrize("host", ["here", "login2"])
def test_a_lock_whose_launcher_is_gone_is_not_taken_while_its_nodes_beat(tmp_path, short_watch, host):
    """From the holder's host (its launcher provably gone) and from another (its launcher's heartbeat
    still): refused while node0 and node1 beat, naming them; taken over once they stopped, saying so."""
    out, run = holder(tmp_path, socket.gethostname() if host == "here" else host)
    nodes = [Node(run, "node0"), Node(run, "node1")]
    try:
        with pytest.raises(output_lock.LockHeld) as e:
            output_lock.acquire(out, NEW, "/r2")
        said = str(e.value)
        assert "its job still runs on node0, node1 (their heartbeats)" in said, said
        assert f"stops itself within 50 s of losing its launcher; launch again then, or stop it now: hfscale stop {run}" \
            in said
        assert json.loads((out / "_hfscale-lock.json").read_text())["job_id"] == JOB  # not taken
    finally:
        for n in nodes:
            n.stop()
    (run / "orphaned" / "node0").write_text("1764180000\n")
    (run / "orphaned" / "node1").write_text("1764180000\n")
    taken = output_lock.acquire(out, NEW, "/r2")
    assert taken.took_over is not None and taken.took_over.job_id == JOB
    gone = "is gone" if host == "here" else "on login2 does not beat"
    assert taken.why.startswith(f"its launcher {gone}") and "none of its nodes' heartbeats changed for 2 s" in taken.why
    assert taken.why.endswith("node0, node1 stopped the job themselves"), taken.why
    assert json.loads((out / "_hfscale-lock.json").read_text())["job_id"] == NEW


def test_a_launcher_on_another_host_that_beats_holds_its_lock(tmp_path, short_watch):
    out, run = holder(tmp_path, "login2")
    beat = beats.LauncherBeat(run, print, every=0.5)
    try:
        with pytest.raises(output_lock.LockHeld, match=r"its launcher's heartbeat in .* changed"):
            output_lock.acquire(out, NEW, "/r2")
    finally:
        beat.stop()
    assert int((run / "launcher.beat").read_text()) >= 2  # rewritten in place, a counter


def test_settle_waits_for_a_job_that_stops_itself_then_acquire_takes_it_without_a_second_look(tmp_path, short_watch):
    out, run = holder(tmp_path, "login2")
    nodes = [Node(run, "node0"), Node(run, "node1")]
    threading.Timer(2.0, lambda: [n.stop() for n in nodes]).start()  # the keepers stop the job after 2 s
    said: list[str] = []
    t0 = time.monotonic()
    output_lock.settle(out, said.append, watch_s=WATCH)
    waited = time.monotonic() - t0
    assert said[0].startswith(f"hfscale: training.output_dir {out} is in use by job {JOB}, whose launcher (host login2")
    assert "its job still runs on node0, node1 and stops itself within 50 s" in said[0]
    assert said[-1].startswith(f"hfscale: job {JOB} stopped itself (")
    assert 2.0 + WATCH - 1 < waited < 2.0 + 3 * WATCH
    t1 = time.monotonic()
    taken = output_lock.acquire(out, NEW, "/r2")
    assert taken.took_over is not None and time.monotonic() - t1 < 1.0  # settle's verdict reused


def test_settle_gives_up_after_the_bound_and_acquire_refuses(tmp_path, short_watch):
    """Nodes that go on beating past stops_within_s (a keeper that does not work): settle returns,
    the launch is refused, naming them."""
    out, run = holder(tmp_path, "login2")
    doc = json.loads((out / "_hfscale-lock.json").read_text())
    (out / "_hfscale-lock.json").write_text(json.dumps({**doc, "stops_within_s": 1}))
    node = Node(run, "node7")
    try:
        said: list[str] = []
        t0 = time.monotonic()
        output_lock.settle(out, said.append, watch_s=WATCH)
        assert time.monotonic() - t0 < 1 + 3 * WATCH and len(said) == 1
        with pytest.raises(output_lock.LockHeld, match="its job still runs on node7"):
            output_lock.acquire(out, NEW, "/r2")
    finally:
        node.stop()


def test_an_older_lock_and_a_run_directory_not_visible_here_are_judged_as_before(tmp_path, short_watch):
    """No stops_within_s (an older hfscale's lock), or a run directory this host cannot read: its
    age on the file system's clock, as before (a launcher elsewhere touched 0 s ago holds it)."""
    out, run = holder(tmp_path, "login2")
    doc = json.loads((out / "_hfscale-lock.json").read_text())
    (out / "_hfscale-lock.json").write_text(json.dumps({**doc, "run_dir": str(tmp_path / "not-here")}))
    with pytest.raises(output_lock.LockHeld, match="touched 0 s ago"):
        output_lock.acquire(out, NEW, "/r2")
    old = time.time() - 120
    os.utime(out / "_hfscale-lock.json", (old, old))
    assert "not touched for 1" in output_lock.acquire(out, NEW, "/r2").why


def test_watch_reads_a_hostile_run_directory_without_hanging_or_following_links(tmp_path):
    run = tmp_path / "run"
    (run / "alive").mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_text("x" * 10)
    (run / "launcher.beat").symlink_to(secret)  # a link out: not read
    os.mkfifo(run / "alive" / "node0")  # a FIFO: not opened
    (run / "alive" / "node1").write_bytes(b"9" * 10_000_000)  # too big: skipped
    (run / "alive" / "..hidden").write_text("1")
    t0 = time.monotonic()
    seen = beats.observe(run, 1.0)
    assert seen is not None and not seen.launcher_beats and seen.running == () and time.monotonic() - t0 < 5
    assert beats.look(run).nodes == {} and beats.look(run).launcher is None
    assert beats.observe(tmp_path / "missing", 1.0) is None


def test_goodput_counts_the_steps_a_job_trained_after_its_launcher_died():
    """The timeline ends at the last step the launcher saw (step 10 at +20 s); the orphaned job went on
    to step 40 at +50 s: those steps count, and the wall ends there."""
    t0 = 1_764_000_000.0
    events = (TimelineEvent(kind="launch", at=t0, attempt=0, resume_step=0),
              TimelineEvent(kind="training", at=t0 + 10, attempt=0, step=1))
    without = goodput(Timeline(events))
    with_last = goodput(Timeline(events), last=(t0 + 50, 40))
    assert without is not None and with_last is not None
    assert without.wall == 10 and without.productive == 0  # no step time known: nothing counted
    assert with_last.wall == 50
    assert with_last.productive == pytest.approx(40 * 40 / 39)  # 40 steps at the pace from step 1 to step 40
