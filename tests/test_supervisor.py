"""The supervisor's pieces that need no process (issue 23): an attempt's job id and run directory,
what a relaunch moves aside, and a report counting a relaunch's metrics as the run's own. The
supervisor itself runs in tests/test_recovery_cluster.py; here only with its attempts replaced."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from hfscale.core.shell import Ran
from hfscale.launch.build import build_plan
from hfscale.launch.context import LaunchContext, attempt_id, run_of
from hfscale.launch.run_dir import write_run_dir
from hfscale.launch.spec import Outcome
from hfscale.rules.config_file import load_job
from hfscale.runs.report import _other_launch

JOB_ID = "20261126-000000-abcdef"
PYTHON = "/usr/bin/python3"  # written into the plans, never run


def _job(tmp: Path):
    doc = {"name": "heal", "cluster": {"nproc_per_node": 1}, "runner": {"run_dir": str(tmp / "runs")},
           "distributed": {"backend": "ddp"}, "precision": "no", "batch": {"micro_batch_size": 1},
           "training": {"output_dir": str(tmp / "out"), "max_steps": 4}, "recovery": {"max_restarts": 2}}
    path = tmp / "heal.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_job(path)


def test_each_attempt_has_its_own_job_id_and_the_runs_directory():
    assert attempt_id(JOB_ID, 0) == JOB_ID and attempt_id(JOB_ID, 3) == f"{JOB_ID}-r3"
    assert run_of(f"{JOB_ID}-r3") == JOB_ID and run_of(JOB_ID) == JOB_ID
    ctx = LaunchContext.of("/w", PYTHON, JOB_ID, {}, attempt=2)
    assert ctx.job_id == f"{JOB_ID}-r2" and ctx.run_id == JOB_ID
    assert LaunchContext.of("/w", PYTHON, JOB_ID, {}).run_id is None


def test_a_relaunch_moves_the_previous_attempts_files_aside(tmp_path):
    job = _job(tmp_path)
    first = build_plan(job, LaunchContext.of(str(tmp_path), PYTHON, JOB_ID, {}))
    run = write_run_dir(first, "plan of attempt 0\n")
    (run / "logs" / "local.log").write_text("attempt 0's lines\n")
    (run / "progress" / "metrics.json").write_text('{"step": 3}')
    (run / "stopping").touch()  # the stop marker of attempt 0's stop: attempt 1's node lines must start
    (run / "timeline.jsonl").write_text("")
    again = build_plan(job, LaunchContext.of(str(tmp_path), PYTHON, JOB_ID, {}, attempt=1))
    assert again.run_dir == first.run_dir and again.job_id == f"{JOB_ID}-r1"
    assert f"HFSCALE_JOB_ID={JOB_ID}-r1" in again.render()  # what attempt 0's stop kills by is not this
    assert write_run_dir(again, "plan of attempt 1\n", attempt=1) == run
    kept = run / "attempts" / "0"
    assert (kept / "logs" / "local.log").read_text() == "attempt 0's lines\n"
    assert (kept / "progress" / "metrics.json").exists() and (kept / "stopping").exists()
    assert (kept / "plan.txt").read_text() == "plan of attempt 0\n"
    assert not (run / "stopping").exists() and list((run / "logs").iterdir()) == []
    assert (run / "plan.txt").read_text() == "plan of attempt 1\n" and (run / "timeline.jsonl").exists()


def test_a_relaunchs_metrics_are_the_runs_own_in_the_report():
    assert not _other_launch({"job": f"{JOB_ID}-r2"}, JOB_ID, None, None)
    assert not _other_launch({"job": JOB_ID}, f"{JOB_ID}-r1", None, None)
    assert _other_launch({"job": "20261126-000000-fedcba"}, JOB_ID, None, None)


def test_the_step_watch_counts_from_the_step_rank_0_resumed_from(tmp_path: Path):
    """The attempt was launched to resume from step 10; its ranks restored a local checkpoint of step
    25 and rank 0 wrote 25 at train begin (``resumed`` in metrics.json first): the first step done is
    26, not the 25 written at train begin, and it is told with the step resumed from."""
    import json
    import threading

    from hfscale.launch.recovery import supervisor

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "progress").mkdir()
    started: list[tuple[int, int | None]] = []
    steps, done = supervisor.Steps(), threading.Event()
    (run / "progress" / "metrics.json").write_text(json.dumps({"step": 25, "resumed": 25, "time": time.time()}))
    (run / "progress" / "rank-0").write_text("25 4242 node0 1\n")
    watch = threading.Thread(target=supervisor._time_steps,
                             args=(str(run), 0, 10, steps, done, lambda: None, lambda s, t, r: started.append((s, r))))
    watch.start()
    try:
        time.sleep(3 * supervisor.WATCH_STEPS_S)
        assert started == []  # step 25 is where it resumed, not a step done
        (run / "progress" / "rank-0").write_text("26 4242 node0 2\n")
        deadline = time.monotonic() + 10
        while not started and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        done.set()
        watch.join(5)
    assert started == [(26, 25)]


def test_the_supervisor_beats_while_it_probes_and_decides_between_attempts(tmp_path: Path, monkeypatch):
    """Between two attempts the supervisor rewrites the launcher beat the nodes watch (a supervised
    Slurm job's nodes requeue it when the beat has not changed for 50 s): here node1 is lost, and
    the supervisor's probe of it (ssh and preflight, seconds to minutes) sees the beat move. The
    attempts themselves are replaced (no node runs here), the beat's interval shortened to 0.1 s."""
    import functools

    from hfscale.core import exitcodes
    from hfscale.launch.attempt import beats
    from hfscale.launch.recovery import supervisor
    from hfscale.launch.run_dir import LAUNCHER_BEAT
    from hfscale.launch.spec import Outcome

    doc = {"name": "gap", "cluster": {"hosts": [{"host": "node0", "slots": 1}, {"host": "node1", "slots": 1}]},
           "runner": {"type": "pdsh", "run_dir": str(tmp_path / "runs"), "python": PYTHON},
           "distributed": {"backend": "ddp"}, "precision": "no", "batch": {"micro_batch_size": 1},
           "training": {"output_dir": str(tmp_path / "out"), "max_steps": 4},
           "recovery": {"max_restarts": 1, "strikes": 2}}
    (tmp_path / "gap.yaml").write_text(yaml.safe_dump(doc))
    job = load_job(tmp_path / "gap.yaml")
    monkeypatch.setattr(supervisor, "LauncherBeat", functools.partial(beats.LauncherBeat, every=0.1))
    beat: list[str] = []

    def execute(plan, text, echo, attempt):
        write_run_dir(plan, text, attempt)
        if attempt == 0:
            return Outcome(exitcodes.UNREACHABLE, "node1", "node1 cannot be reached", failed_at=time.time())
        return Outcome(0)

    def probe(job, hosts, python, notes):  # the probe of the lost host, while the beat thread runs
        path = Path(runs[0]) / LAUNCHER_BEAT
        beat.append(path.read_text())
        time.sleep(1.0)
        beat.append(path.read_text())
        return frozenset(hosts)

    runs: list[str] = []

    def context(j, n):
        ctx = LaunchContext.of(str(tmp_path), PYTHON, JOB_ID, {}, attempt=n)
        runs[:] = [build_plan(j, ctx).run_dir]
        return ctx

    monkeypatch.setattr(supervisor, "execute_attempt", execute)
    monkeypatch.setattr(supervisor, "healthy_again", probe)
    settled = Ran(0, "HFSCALE_SETTLE\nleft=0\nport=free\n", "")  # every node stopped, the port free
    monkeypatch.setattr(supervisor, "run_probes", lambda cmds, *a, **k: dict.fromkeys(cmds, settled))
    said: list[str] = []
    assert supervisor.supervise(job, context, lambda plan: said.append, said.append) == 0, said
    assert len(beat) == 2 and int(beat[1]) >= int(beat[0]) + 5, beat  # ~10 writes in the second it probed
    assert any("restart 1" in line for line in said), said


def _three_nodes(tmp_path: Path, spare: bool = False):
    hosts = [{"host": f"node{i}", "slots": 1} for i in range(3)] + ([{"host": "node3", "slots": 1, "spare": True}]
                                                                   if spare else [])
    doc = {"name": "trip", "cluster": {"hosts": hosts}, "runner": {"type": "pdsh", "run_dir": str(tmp_path / "runs"),
                                                                   "python": PYTHON},
           "distributed": {"backend": "ddp"}, "precision": "no", "batch": {"micro_batch_size": 1, "global_batch_size": 6},
           "watchdog": {"timeout": 30}, "training": {"output_dir": str(tmp_path / "out"), "max_steps": 4},
           "recovery": {"max_restarts": 3, "strikes": 1, "min_nodes": 2, **({"spares": 1} if spare else {})}}
    (tmp_path / "trip.yaml").write_text(yaml.safe_dump(doc))
    return load_job(tmp_path / "trip.yaml")


def _supervised(tmp_path: Path, monkeypatch, job, first, answer):
    """``supervise(job)`` with its attempts replaced (attempt 0 ends as ``first(plan)`` says, attempt 1
    finishes) and every settle probe answered by ``answer(host)``; the relaunch's plan, what was said."""
    from hfscale.launch.recovery import supervisor

    plans = []

    def execute(plan, text, echo, attempt):
        write_run_dir(plan, text, attempt)
        plans.append(plan)
        return first(plan) if attempt == 0 else Outcome(0)

    def context(j, n):
        return LaunchContext.of(str(tmp_path), PYTHON, JOB_ID, {}, attempt=n)

    monkeypatch.setattr(supervisor, "execute_attempt", execute)
    monkeypatch.setattr(supervisor, "healthy_again", lambda job, hosts, python, notes: frozenset(hosts))
    monkeypatch.setattr(supervisor, "run_probes", lambda cmds, *a, **k: {h: answer(h) for h in cmds})
    monkeypatch.setattr(supervisor, "run_probe", lambda cmd, timeout: answer("new master"))
    said: list[str] = []
    assert supervisor.supervise(job, context, lambda plan: said.append, said.append) == 0, said
    return plans, said


FREE = Ran(0, "HFSCALE_SETTLE\nleft=0\nport=free\n", "")


def test_a_store_that_could_not_bind_the_port_on_node0_strikes_no_host(tmp_path: Path, monkeypatch):
    """Issue 35: node 0's new store found the master port still held (EADDRINUSE): not node 0's fault."""
    from hfscale.launch.recovery.timeline import read_timeline

    job = _three_nodes(tmp_path, spare=True)

    def first(plan):
        (Path(plan.run_dir) / "logs" / "node0.log").write_text(
            "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
            "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n")
        return Outcome(1, "node0", "node0 failed (exit code 1)", failed_at=time.time())

    plans, said = _supervised(tmp_path, monkeypatch, job, first, lambda h: FREE)
    assert [n.host for n in plans[1].nodes] == ["node0", "node1", "node2"]  # strikes 1, a spare free: not used
    (failure,) = [e for e in read_timeline(plans[0].run_dir).events if e.kind == "failure"]
    assert (failure.cause, failure.host) == ("port_busy", "node0")
    assert any("the master port was still held on node0, not node0's fault: no strike" in line for line in said)


def test_a_hang_that_named_no_rank_leaves_out_the_node_that_does_not_answer(tmp_path: Path, monkeypatch):
    """Issue 35: a cut link leaves every rank waiting in a collective; the settle finds node1 silent
    (its probe timed out), and the relaunch puts the spare in its place instead of waiting on node1."""
    from hfscale.launch.recovery.timeline import read_timeline

    job = _three_nodes(tmp_path, spare=True)
    hang = "hang: every rank waits in all_reduce at step 6: a lost peer or the network"
    plans, said = _supervised(tmp_path, monkeypatch, job, lambda plan: Outcome(4, "the job", hang, hung=True),
                              lambda h: Ran(124, "", "timed out after 12 s") if h == "node1" else FREE)
    assert [n.host for n in plans[1].nodes] == ["node0", "node3", "node2"]
    (failure,) = [e for e in read_timeline(plans[0].run_dir).events if e.kind == "failure"]
    assert (failure.cause, failure.host) == ("host_lost", "node1") and failure.what.endswith(
        "; node1 did not answer after the stop")


def test_a_node_the_stack_dump_could_not_reach_is_not_probed_again(tmp_path: Path, monkeypatch):
    """Under Slurm, srun to a cut-off node fails after MessageTimeout; the stack dump wrote it down
    (unreached): the settle does not spend that time on it again, and the relaunch leaves it out."""
    job = _three_nodes(tmp_path)
    probed: list[str] = []

    def first(plan):
        (Path(plan.run_dir) / "unreached").write_text("node2\n")
        return Outcome(4, "the job", "hang: every rank waits in all_gather", hung=True)

    def answer(h):
        probed.append(h)
        return FREE

    plans, said = _supervised(tmp_path, monkeypatch, job, first, answer)
    assert "node2" not in probed and {"node0", "node1"} <= set(probed)
    assert [n.host for n in plans[1].nodes] == ["node0", "node1"]  # no spare: left out, 3 -> 2 nodes
