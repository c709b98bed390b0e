"""A node's keeper (hfscale.launch.node.keeper), its real shell text run by bash on this machine,
with short timings: it beats while its launcher beats, and stops the node's job (and only that job)
when the launcher's heartbeat stops; a line that ends normally takes its keeper with it. On the
namespace cluster with the product's timings: tests/test_orphans_cluster.py."""

from __future__ import annotations

import dataclasses
import os
import posixpath
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import job_pids
from hfscale.core.shell import Line, Sh, render
from hfscale.launch.run_dir import BEAT_ADDR
from hfscale.launch.attempt.beats import LauncherBeat, LaunchBeats
from hfscale.launch.node.keeper import keeper_line, keeper_of
from hfscale.launch.node.line import node_script
from hfscale.launch.node.stopping import stop_script
from hfscale.launch.spec import Keeper

JOB = "20261126-000001-keeper"


def short(run: Path, lost_after: int = 3) -> Keeper:
    k = keeper_of(str(run))
    return Keeper(k.launcher_beat, k.beats_dir, k.orphaned_dir, k.logs_dir, 1, 1, 1, lost_after, lost_after + 12)


def node_line(run: Path, k: Keeper, launcher: list[str], job: str = JOB) -> str:
    first = Line.of(Sh("export HFSCALE_HOST=node0;"), keeper_line(k, Line((Sh(stop_script(job)),))))
    line = node_script(Line(()), launcher, posixpath.join(str(run), "stopping"), first=first,
                       on_exit="kill $hb 2>/dev/null; ")
    return render(line, shown=False)


def start(run: Path, k: Keeper, launcher: list[str], job: str = JOB) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", node_line(run, k, launcher, job)], env={**os.environ, "HFSCALE_JOB_ID": job},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def made(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    for d in ("alive", "orphaned", "logs"):
        (run / d).mkdir(parents=True)
    return run


def wait(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_a_node_stops_its_job_when_its_launcher_stops_beating(tmp_path):
    run = made(tmp_path)
    k = short(run)
    beat = LauncherBeat(run, print, every=0.5)
    other = subprocess.Popen(["sleep", "300"], env={**os.environ, "HFSCALE_JOB_ID": "20261126-000002-other"})
    node = start(run, k, ["sleep", "300"])  # the launcher: a process of this job
    try:
        wait(lambda: len(job_pids(JOB)) >= 3 and (run / "alive" / "node0").exists(), 10,
             "the node's line, its keeper (its first beat) and its launcher")
        first = (run / "alive" / "node0").read_text()
        time.sleep(k.lost_after_s + 2)  # longer than lost_after: the launcher beats, nothing stops
        assert node.poll() is None and len(job_pids(JOB)) >= 3
        assert (run / "alive" / "node0").read_text() != first and first.strip().isdigit()
        beat.stop()  # the launcher is killed -9: its heartbeat stops
        t0 = time.monotonic()
        took = wait(lambda: not job_pids(JOB), k.lost_after_s + k.check_s + 5, "the job to stop itself")
        print(f"the job stopped itself {took:.1f} s after its launcher's last beat")
        assert took >= k.lost_after_s - k.check_s
        assert (run / "orphaned" / "node0").read_text().strip().isdigit()
        log = (run / "logs" / "node0.log").read_text()
        assert "node0: the launcher's heartbeat (launcher.beat) has not changed for 3 s: stopping this node's job " \
               "(TERM: the ranks save a checkpoint; KILL after 10 s)" in log
        node.communicate(timeout=10)
        assert node.returncode != 0  # its launcher was stopped (TERM), no exit line
        assert other.poll() is None  # another job's process is left alone
        assert time.monotonic() - t0 < k.lost_after_s + k.check_s + 5
    finally:
        beat.stop()
        other.kill()
        for pid in job_pids(JOB):
            os.kill(pid, 9)


def test_a_line_that_ends_takes_its_keeper_with_it_and_nothing_is_stopped(tmp_path):
    run = made(tmp_path)
    beat = LauncherBeat(run, print, every=0.5)
    try:
        node = start(run, short(run), ["sh", "-c", "sleep 2; echo trained"])
        out, _ = node.communicate(timeout=30)
        assert node.returncode == 0 and "trained" in out and "HFSCALE_EXIT rc=0" in out
        wait(lambda: not job_pids(JOB), 5, "the keeper to end with its line")
        assert not list((run / "orphaned").iterdir()) and (run / "alive" / "node0").exists()
    finally:
        beat.stop()


# ---- the heartbeat line (hfscale.launch.attempt.beat_server): the keeper hears its launcher over TCP ----------

SERVER = ("import sys, time\nfrom hfscale.launch.attempt.beat_server import BeatServer\n"
          "s = BeatServer.start(sys.argv[1], 1, print)\nprint('listening', s.port, flush=True)\ntime.sleep(600)\n")


def lined(run: Path, lost_after: int = 3) -> Keeper:
    k = short(run, lost_after)
    return dataclasses.replace(k, beat_addr=str(run / BEAT_ADDR))


def launcher_process(run: Path) -> subprocess.Popen:
    """A launcher's heartbeat line in a process of its own (a launcher to kill -9 or freeze)."""
    p = subprocess.Popen([sys.executable, "-c", SERVER, str(run)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().startswith("listening")
    return p


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_node_on_the_line_stops_its_job_when_its_launcher_is_killed_or_frozen(tmp_path, how):
    """Killed -9: its kernel closes the line, the node stops at once. Frozen (SIGSTOP: a host that
    stops answering, no close): after lost_after_s. While the launcher answers, the node writes
    nothing in the run directory after its first beat."""
    run = made(tmp_path)
    k = lined(run)
    server = launcher_process(run)
    node = start(run, k, ["sleep", "300"])
    try:
        wait(lambda: len(job_pids(JOB)) >= 3 and (run / "alive" / "node0").exists(), 10, "the node's line")
        first = (run / "alive" / "node0").stat().st_mtime_ns
        time.sleep(k.lost_after_s + 2)  # the launcher answers: nothing stops, no file is rewritten
        assert node.poll() is None and len(job_pids(JOB)) >= 3
        assert (run / "alive" / "node0").stat().st_mtime_ns == first
        assert not (run / "logs" / "node0.log").exists()  # no "no heartbeat line" note: it is on the line
        os.kill(server.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        took = wait(lambda: not job_pids(JOB), k.lost_after_s + 3 * k.check_s + 5, "the job to stop itself")
        print(f"{how}: the job stopped itself {took:.1f} s after its launcher")
        log = (run / "logs" / "node0.log").read_text()
        if how == "killed":
            assert took < 2 * k.check_s + k.launcher_beat_s + 2.5, took  # heard at once, not after lost_after_s
            assert "node0: the launcher closed its heartbeat line, and launcher.beat has not changed for 2 s: " \
                   "stopping this node's job" in log
        else:
            assert took >= k.lost_after_s - k.check_s, took
            assert "node0: the launcher has not answered on its heartbeat line for 3 s, and launcher.beat has not changed " \
                   "for 2 s: stopping this node's job" in log
            assert (run / "alive" / "node0").stat().st_mtime_ns != first  # silent launcher: the file beats again
        assert (run / "orphaned" / "node0").read_text().strip().isdigit()
    finally:
        os.kill(server.pid, signal.SIGKILL)
        os.kill(server.pid, signal.SIGCONT)
        server.wait()
        for pid in job_pids(JOB):
            os.kill(pid, 9)


def test_a_node_that_cannot_reach_the_line_says_so_and_reads_the_file(tmp_path):
    run = made(tmp_path)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (run / BEAT_ADDR).write_text(f"{port} {'0' * 32} 127.0.0.1\n")
    beat = LauncherBeat(run, print, every=0.5)
    node = start(run, lined(run), ["sleep", "300"])
    try:
        wait(lambda: (run / "logs" / "node0.log").exists(), 10, "the note")
        assert f"no heartbeat line to the launcher at 127.0.0.1 port {port}; reading launcher.beat instead" in \
            (run / "logs" / "node0.log").read_text()
        first = (run / "alive" / "node0").read_text()
        time.sleep(5)  # longer than lost_after: the file beats, the launcher's file beats, nothing stops
        assert node.poll() is None and (run / "alive" / "node0").read_text() != first
        beat.stop()
        wait(lambda: not job_pids(JOB), 3 + 3 + 5, "the job to stop itself")
    finally:
        beat.stop()
        for pid in job_pids(JOB):
            os.kill(pid, 9)


def test_an_attempt_that_ends_sends_its_nodes_back_to_the_file_not_to_a_stop(tmp_path):
    """The line closed by an attempt's end (the launch says so first) is not the launcher's death: a
    node the stop did not reach (a slurmd-less node under Slurm, whose keeper's stop requeues the job)
    watches launcher.beat again, which the next attempt rewrites, and stops only when that stops."""
    run = made(tmp_path)
    k = lined(run)
    beats = LaunchBeats(run, 1, True, print)
    beats.file.stop()
    beats.file = LauncherBeat(run, print, every=0.5)  # beats faster than the short keeper's lost_after
    node = start(run, k, ["sleep", "300"])
    try:
        wait(lambda: len(job_pids(JOB)) >= 3 and beats.line is not None and beats.line.last_seen(), 10, "the line")
        assert beats.line is not None
        beats.line.stop()  # the attempt ends; the launcher lives on: its file beats
        time.sleep(k.lost_after_s + 2)
        assert node.poll() is None and len(job_pids(JOB)) >= 3
        assert not (run / "orphaned" / "node0").exists()
        beats.file.stop()  # now the launcher is gone
        took = wait(lambda: not job_pids(JOB), k.lost_after_s + 3 * k.check_s + 5, "the job to stop itself")
        assert took >= k.lost_after_s - k.check_s
        assert "launcher's heartbeat (launcher.beat) has not changed for 3 s" in \
            (run / "logs" / "node0.log").read_text()
    finally:
        beats.stop()
        for pid in job_pids(JOB):
            os.kill(pid, 9)


def test_a_lost_line_with_a_live_launchers_file_goes_back_to_the_file(tmp_path):
    """The line closed without its "x" (here: the line's process killed) while launcher.beat still
    changes (a node cut off from the launch for a while, its stop never reached it): the keeper
    watches the file, it does not stop, or under Slurm requeue, a job its launch carries on."""
    run = made(tmp_path)
    k = lined(run)
    server = launcher_process(run)
    beat = LauncherBeat(run, print, every=0.5)
    node = start(run, k, ["sleep", "300"])
    try:
        wait(lambda: len(job_pids(JOB)) >= 3, 10, "the node's line")
        time.sleep(1)
        os.kill(server.pid, signal.SIGKILL)
        time.sleep(k.lost_after_s + k.launcher_beat_s + 4)
        assert node.poll() is None and len(job_pids(JOB)) >= 3 and not (run / "orphaned" / "node0").exists()
        assert "the heartbeat line to the launcher is lost, but launcher.beat still changes: watching it instead" in \
            (run / "logs" / "node0.log").read_text()
        beat.stop()
        wait(lambda: not job_pids(JOB), k.lost_after_s + 3 * k.check_s + 5, "the job to stop itself")
    finally:
        beat.stop()
        server.wait()
        for pid in job_pids(JOB):
            os.kill(pid, 9)
