"""Stopping a job: the stop script on real processes, and ``hfscale launch`` (local runner, real
torchrun) stopped by SIGTERM, SIGHUP, or by its launcher being killed under it.

The multi-host versions (pdsh over sshd in namespaces, a lost node) are in test_launch_cluster.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, job_pids, read_until
from hfscale.launch.node.stopping import JOB_ID_VAR, STOP_GRACE_S, stop_script

PROBE = str(ROOT / "tests" / "scripts" / "dist_probe.py")
SLEEPER = "import signal, sys, time\nif sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(120)"


def _start(job: str, behaviour: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SLEEPER, behaviour], env={**os.environ, JOB_ID_VAR: job},
                            start_new_session=True)


def _ended_within(proc: subprocess.Popen, seconds: float) -> float | None:
    t0 = time.monotonic()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - t0


def test_stop_script_terms_then_kills_only_this_job():
    polite, stubborn = _start("job-1", "obey"), _start("job-1", "ignore")
    # same id as a prefix, and a variable whose value merely contains the id: neither is this job
    other, prefixed = _start("job-12", "obey"), _start("job-1x", "obey")
    bystanders = (other, prefixed)
    try:
        time.sleep(0.5)  # the interpreters have installed their handlers
        t0 = time.monotonic()
        r = subprocess.run(["bash", "-c", stop_script("job-1")], capture_output=True, text=True, timeout=5)
        returned = time.monotonic() - t0
        assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
        assert returned < 1.5, f"the stop script must return at once (the KILL pass is detached), took {returned:.1f}s"
        assert _ended_within(polite, 3) is not None, "TERM did not reach the job's process"
        assert polite.returncode == -signal.SIGTERM
        assert stubborn.poll() is None  # ignores TERM: still there until the grace period ends
        took = _ended_within(stubborn, STOP_GRACE_S + 5)
        assert took is not None, "the KILL pass did not run"
        assert stubborn.returncode == -signal.SIGKILL
        assert STOP_GRACE_S - 3 < took + returned < STOP_GRACE_S + 4
        assert all(p.poll() is None for p in bystanders), "the stop reached another job's process"
    finally:
        for p in (polite, stubborn, *bystanders):
            p.kill()
            p.wait()


def test_the_stop_after_a_hang_kills_at_once():
    """``grace_s=0`` (LaunchPlan.kill, run after a hang): a process that cannot act on TERM (a rank
    whose handler waits for a collective that never returns) is killed at once, not 10 s later."""
    stubborn, other = _start("job-4", "ignore"), _start("job-45", "ignore")
    try:
        time.sleep(0.5)
        subprocess.run(["bash", "-c", stop_script("job-4", grace_s=0)], timeout=5, check=True)
        took = _ended_within(stubborn, STOP_GRACE_S)
        assert took is not None and stubborn.returncode == -signal.SIGKILL
        assert took < 2, f"killed {took:.1f} s after the stop"
        assert other.poll() is None
    finally:
        for p in (stubborn, other):
            p.kill()
            p.wait()


def test_stop_script_kill_pass_ends_early_when_everything_obeyed():
    polite = _start("job-2", "obey")
    try:
        time.sleep(0.5)
        subprocess.run(["bash", "-c", stop_script("job-2")], timeout=5, check=True)
        assert _ended_within(polite, 3) is not None
        # the detached waiter polls once a second and leaves as soon as nothing of the job is left
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            # this stop's waiter (its command line is the stop's text: the job id is in it), not another test's
            r = subprocess.run(["pgrep", "-f", "HFSCALE_JOB_ID=job-2'"], capture_output=True, text=True)
            if r.returncode == 1:
                break
            time.sleep(0.2)
        assert r.returncode == 1, f"the KILL pass lingers: {r.stdout}"
    finally:
        polite.kill()
        polite.wait()


def test_the_kill_pass_takes_only_what_the_stop_termed():
    """A process of the same job id started after the TERM (a Slurm requeue of the job, a relaunch
    within the grace period) is not this stop's: the KILL pass 10 s later leaves it alone, and still
    kills the old process that ignored the TERM."""
    stubborn = _start("job-3", "ignore")
    later = None
    try:
        time.sleep(0.5)
        subprocess.run(["bash", "-c", stop_script("job-3")], timeout=5, check=True)
        later = _start("job-3", "ignore")  # the requeued job's first process
        assert _ended_within(stubborn, STOP_GRACE_S + 5) is not None and stubborn.returncode == -signal.SIGKILL
        time.sleep(1.5)
        assert later.poll() is None, "the KILL pass reached a process started after the stop"
    finally:
        for p in (stubborn, later):
            if p is not None:
                p.kill()
                p.wait()


# ---- hfscale launch, local runner: real torchrun, two ranks of dist_probe -------------------------


def _config(tmp_path: Path, mode: str, port: int) -> Path:
    cfg = {"name": "stop", "cluster": {"nproc_per_node": 2, "master_port": port},
           "runner": {"type": "local", "launcher": "torchrun", "run_dir": str(tmp_path / "runs")},
           "distributed": {"backend": "ddp"}, "precision": "no", "batch": {"micro_batch_size": 1},
           "env": {"vars": {"OMP_NUM_THREADS": "1"}},
           "training": {"script": PROBE, "script_args": ["--mode", mode, "--rank", "1"], "pass_args": "none"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _launch_until_ready(config: Path) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, read_until(proc, "PROBE_READY", 2)


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _job_id(seen: list[str]) -> str:
    line = next(line for line in seen if line.startswith("hfscale: job "))
    return line.split()[2]


def _kill_all(job: str) -> None:
    """A failed test must not leave ranks holding the port for the next one."""
    for pid in job_pids(job):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _left(job: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (pids := job_pids(job)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_stops_a_rank_that_ignores_it(tmp_path, request, sig):
    """Rank 1 ignores TERM/INT/HUP and sleeps outside any collective: the stop's KILL pass ends it,
    hfscale exits 128+N once nothing of the job is left, within the grace period plus a little."""
    proc, seen = _launch_until_ready(_config(tmp_path, "stubborn", 29631 if sig == signal.SIGTERM else 29632))
    job = _job_id(seen)
    request.addfinalizer(lambda: _kill_all(job))
    assert len(job_pids(job)) >= 3  # torchrun and two ranks carry the job id
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 128 + sig, "".join(seen) + out
    assert f"hfscale: got {sig.name}; stopping the job on every node" in out
    assert _left(job, timeout=2) == []
    assert took < STOP_GRACE_S + 5, f"stop took {took:.1f}s"


@pytest.mark.slow
def test_launcher_killed_under_hfscale_stops_the_ranks(tmp_path, request):
    """torchrun SIGKILLed by someone else (the OOM killer, an operator) cannot stop its ranks, which
    are in their own sessions: hfscale notices its main process died of a signal and stops them."""
    proc, seen = _launch_until_ready(_config(tmp_path, "hang", 29633))
    job = _job_id(seen)
    request.addfinalizer(lambda: _kill_all(job))
    # hfscale's own child is the launcher; the ranks are its children
    (torchrun,) = [p for p in job_pids(job) if _parent(p) == proc.pid]
    os.kill(torchrun, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, "".join(seen) + out
    assert "was killed (SIGKILL); stopping the job on every node" in out
    assert _left(job, timeout=5) == []
