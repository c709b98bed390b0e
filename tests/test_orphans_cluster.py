"""A job outlives its launcher (issue 27), on the namespace cluster: real pdsh over real sshd, real
torchrun and DeepSpeed ZeRO-2 on CPU.

``hfscale launch`` is SIGKILLed mid-training (an OOM killer, a closed login session): pdsh and its
ssh sessions live on in their own session, and so would the ranks. Each node's keeper
(hfscale.launch.node.keeper) hears its heartbeat line to the launcher close (the launcher's
kernel closes its sockets) and stops its node's job at once (TERM: a preemption checkpoint at the
next step). The same launch run again from the same host takes over the lock and resumes. Then
that launch is frozen (SIGSTOP: a launcher whose host stopped answering, its line silent, not
closed): the keepers stop their job after 30 s, and the launch from a second host (node3, a
"login node" that shares the run and output directories) waits for that, takes over and resumes.
Measured: how long the orphans trained unwatched, that two jobs never ran at once, that no host
was struck out, and every step's loss against an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

import pytest

from cluster import leftover_processes
from conftest import ROOT
from site_hooks import site_hook
from hfscale.launch.recovery.timeline import read_timeline
from hfscale.training.heartbeat import read_progress
from test_recovery_cluster import fault_rng, REFERENCE_STEPS, largest_loss_difference, train_config

pytestmark = pytest.mark.slow
UNWATCHED_BOUND_S = 60
MAX_STEPS = 240
assert MAX_STEPS <= REFERENCE_STEPS
# Steps on this machine take 0.06-0.15 s: an orphaned job could finish all its steps in the 30-45 s before
# it stops itself. While the test's marker file exists (from just before a launcher is killed to the
# next launch's takeover), each rank sleeps SLOW_STEP_S (here 1 s; 0.25 s unless set) after every step,
# put in from outside as a user's callback would be: at most 1 step/s in the orphans' windows (A's, 15 s at most, B's, 60 s at most),
# so that with each launch's 10-40 steps the orphans stay below MAX_STEPS. Sleeping changes no loss and
# costs no CPU (the windows last as long whatever the steps do).
SLOW = site_hook('''\
    import time


    def _slow(module):
        class SlowWhileMarked(module.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if os.path.exists(os.environ["SLOW_WHILE"]):
                    time.sleep(float(os.environ.get("SLOW_STEP_S", "0.25")))

        _init = module.Trainer.__init__

        def _slowed(self, *a, **k):
            _init(self, *a, **k)
            self.add_callback(SlowWhileMarked())

        module.Trainer.__init__ = _slowed


    if os.environ.get("SLOW_WHILE"):
        _after_import("transformers.trainer", _slow)
''')


class Launch:
    """An ``hfscale launch`` started by the test, its output drained into ``lines`` by a thread."""

    def __init__(self, argv: list[str], env: dict[str, str] | None, runs: Path):
        before = set(runs.iterdir()) if runs.is_dir() else set()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.runs, self.before = runs, before
        self.run: Path | None = None

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def run_dir(self) -> Path | None:
        if self.run is None and self.runs.is_dir():
            new = [p for p in self.runs.iterdir() if p not in self.before and (p / "state.json").exists()]
            self.run = new[0] if new else None
        return self.run

    def step(self) -> int:
        run = self.run_dir()
        p = read_progress(run / "progress" / "rank-0") if run else None
        return p.step if p else 0

    def job_id(self) -> str | None:
        run = self.run_dir()
        try:
            return json.loads((run / "state.json").read_text()).get("job_id") if run else None
        except (OSError, ValueError):
            return None


def wait_until(what: str, cond, launch: Launch, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert launch.proc.poll() is None, f"the launch ended (exit {launch.proc.returncode}) before {what}:\n" \
                                           f"{launch.text[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{launch.text[-4000:]}"
        time.sleep(0.2)


class Jobs:
    """Which jobs have processes on the machine (the root pid namespace sees every node's), polled by a
    thread; ``overlaps`` records every moment two jobs ran at once."""

    def __init__(self):
        self.ids: list[str] = []
        self.overlaps: list[tuple[float, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def running(self) -> dict[str, int]:
        count: dict[str, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for var in environ:
                if var.startswith(b"HFSCALE_JOB_ID="):
                    value = var.split(b"=", 1)[1].decode()
                    job = next((j for j in self.ids if value == j or value.startswith(j + "-r")), None)
                    if job:
                        count[job] = count.get(job, 0) + 1
        return count

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            now = self.running()
            if len(now) > 1:
                self.overlaps.append((time.time(), sorted(now)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def last_progress_after(run: Path, killed_at: float, quiet_s: float = 8.0, timeout: float = 150) -> float:
    """Seconds from ``killed_at`` to rank 0's last step in ``run`` (its progress file stops changing)."""
    path = run / "progress" / "rank-0"
    deadline = time.time() + timeout
    while time.time() < deadline:
        last = path.stat().st_mtime
        if time.time() - last > quiet_s:
            return last - killed_at
        time.sleep(1)
    raise AssertionError(f"{path} still changes {timeout} s after its launcher was killed")


def complete_steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "hfscale_complete.json").exists())


def test_a_killed_launcher_s_job_stops_itself_and_the_next_launch_resumes_from_either_host(
        make_cluster, tmp_path, uninterrupted_losses):
    rng = fault_rng()
    cluster = make_cluster(4)  # node0-2 train; node3 is a second login host
    out = tmp_path / "out"
    config = train_config(tmp_path, "orph", out, 29961, cluster.nodes[:3],
                          {"max_restarts": 3, "strikes": 2, "min_nodes": 2, "keep_global_batch": True}, MAX_STEPS)
    site, slow = tmp_path / "site", tmp_path / "slow"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW)
    doc = yaml.safe_load(config.read_text())
    doc["env"]["vars"].update(PYTHONPATH=str(site), SLOW_WHILE=str(slow), SLOW_STEP_S="1.0")
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    runs = tmp_path / "runs"
    jobs = Jobs()
    launches: list[Launch] = []
    here = [sys.executable, "-m", "hfscale", "launch", str(config)]
    try:
        # A: launched, SIGKILLed at a random step
        a = Launch(here, cluster.env(), runs)
        launches.append(a)
        at = rng.randint(10, 40)
        wait_until(f"A at step {at}", lambda: a.step() >= at, a)
        jobs.ids.append(a.job_id())
        slow.touch()
        a.proc.kill()
        killed_a, step_a = time.time(), a.step()
        # B: the same launch again from the same host, at once
        b = Launch(here, cluster.env(), runs)
        launches.append(b)
        unwatched_a = last_progress_after(a.run_dir(), killed_a)
        wait_until("B's run directory", lambda: b.job_id() is not None, b)
        left_by_a = complete_steps(out)  # B's lock is taken, A's job is gone, B's ranks have not started
        slow.unlink()
        jobs.ids.append(b.job_id())
        wait_until("B training", lambda: b.step() > 0, b)
        resumed_b = b.step()
        at = b.step() + rng.randint(10, 40)
        wait_until(f"B at step {at}", lambda: b.step() >= at, b)
        slow.touch()
        b.proc.send_signal(signal.SIGSTOP)  # frozen: its line silent, not closed
        killed_b, step_b = time.time(), b.step()
        # C: the same launch from node3, which shares the run and output directories
        remote = (f"cd {shlex.quote(str(ROOT))} && PATH={shlex.quote(cluster.env()['PATH'])} PDSH_RCMD_TYPE=ssh "
                  f"{shlex.quote(sys.executable)} -m hfscale launch {shlex.quote(str(config))}")
        c = Launch([str(cluster.bin / "ssh"), "node3", remote], None, runs)
        launches.append(c)
        unwatched_b = last_progress_after(b.run_dir(), killed_b)
        wait_until("C's run directory", lambda: c.job_id() is not None, c)
        left_by_b = complete_steps(out)
        slow.unlink()
        jobs.ids.append(c.job_id())
        rc = c.proc.wait(timeout=900)
        time.sleep(1)
    finally:
        jobs.close()
        for launch in launches:
            if launch.proc.poll() is None:
                os.killpg(launch.proc.pid, signal.SIGKILL)
    print(f"A killed at step {step_a}: its job trained {unwatched_a:.1f} s after; B resumed at step {resumed_b}, "
          f"killed at step {step_b}: its job trained {unwatched_b:.1f} s after")
    for name, launch in zip("ABC", launches):
        print(f"--- {name} ({launch.run_dir()})\n" + "".join(line for line in launch.lines if "hfscale:" in line))
    assert rc == 0, c.text[-6000:]
    # killed: its line closed, the orphans stopped within a step or two; frozen: within a minute
    assert unwatched_a <= 15 and unwatched_b <= UNWATCHED_BOUND_S
    # two jobs never ran at once: C waited for the frozen launcher's orphans to stop themselves
    assert jobs.overlaps == [], jobs.overlaps[:5]
    assert "waiting for it, Ctrl-C to give up" in c.text, c.text[-3000:]
    for launch, orphan in ((b, a), (c, b)):
        assert f"took over the lock of {out}/_hfscale-lock.json from job {orphan.job_id()}" in launch.text
        stopped = sorted(p.name for p in (orphan.run_dir() / "orphaned").iterdir())
        assert stopped == ["node0", "node1", "node2"], stopped
    # no healthy node struck out: no failure in B's or C's attempts
    for launch in (b, c):
        events = read_timeline(launch.run_dir()).events
        assert [e.kind for e in events if e.kind in ("failure", "relaunch", "gave_up")] == [], events
    # no step lost beyond the newest complete checkpoint the orphans left (their preemption save when it
    # completed in the grace period): each relaunch resumed from it
    resumes = [next(e.resume_step for e in read_timeline(x.run_dir()).events if e.kind == "launch") for x in (b, c)]
    trained = [read_progress(x.run_dir() / "progress" / "rank-0").step for x in (a, b)]
    print(f"the orphans' last steps {trained}, resumed from {resumes}; complete checkpoints they left: "
          f"{left_by_a[-3:]}, {left_by_b[-3:]}")
    assert resumes == [left_by_a[-1], left_by_b[-1]]
    assert max(trained) < MAX_STEPS  # the orphans were stopped, they did not finish
    assert resumes[0] >= step_a and resumes[1] >= step_b
    worst = largest_loss_difference(out, MAX_STEPS, uninterrupted_losses)  # every step logged, against the reference
    print(f"largest loss difference over {MAX_STEPS} steps: {worst:.2e}")
    assert worst < 1e-3
    status = subprocess.run([sys.executable, "-m", "hfscale", "status", str(a.run_dir())], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    print(status.stdout.split("\n---")[0])
    assert "state        died: stopped after its launcher died" in status.stdout, status.stdout
    assert "3 node(s) stopped the job themselves" in status.stdout
    logs = "".join((a.run_dir() / "logs" / f"node{i}.log").read_text() for i in range(3))
    assert logs.count("the launcher closed its heartbeat line, and launcher.beat has not changed for 6 s: stopping") == 3, logs[-3000:]
    logs = "".join((b.run_dir() / "logs" / f"node{i}.log").read_text() for i in range(3))
    assert logs.count("the launcher has not answered on its heartbeat line for 30 s") == 3, logs[-3000:]
    assert leftover_processes(cluster, timeout=20, contains=str(tmp_path)) == {}
