"""Jobs that heal themselves (issue #23), the pure parts: the decisions after a failed attempt
(hfscale.launch.recovery.policy), the timeline file read back as untrusted (hfscale.launch.recovery.timeline), and
the goodput arithmetic over it (hfscale.runs.goodput). No process is started."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from hfscale.core.records import TimelineEvent
from hfscale.core.untrusted import Unreadable
from hfscale.launch.recovery.policy import (Fault, GiveUp, History, Policy, Relaunch, decide, last_error, normalise_error,
                                     probe_targets)
from hfscale.launch.recovery.timeline import TIMELINE_FILE, Timeline, append_event, read_timeline
from hfscale.runs.goodput import goodput, lines, timeline_lines

HOSTS = ("node0", "node1", "node2")
T0 = 1_700_000_000.0
BOOM = "RuntimeError: boom"


def policy(max_restarts=5, window=None, strikes=2, min_nodes=2, hosts=HOSTS) -> Policy:
    return Policy.of(SimpleNamespace(max_restarts=max_restarts, window=window, strikes=strikes, min_nodes=min_nodes,
                                     keep_global_batch=True, probe_excluded=True), hosts)


def fault(host="node1", error="", cause="rank_failed", at=T0, steps=True) -> Fault:
    return Fault(cause, host, 1, f"{host} failed (exit code 1)", error, at, steps)


def test_policy_of_reads_the_config_by_attribute():
    assert policy(3, 600, 2, None) == Policy(3, 600.0, 2, None, HOSTS)
    assert Policy.of(None, HOSTS).max_restarts == 0


def test_recovery_off_gives_up():
    h = History()
    off = GiveUp("recovery is off (recovery.max_restarts: 0)")
    assert decide(policy(max_restarts=0), h, fault(), frozenset(), T0) == off
    assert len(h.faults) == 1


def test_max_restarts_gives_up_naming_the_repeated_error():
    p, h = policy(max_restarts=3, min_nodes=None, strikes=10), History()
    for i in range(3):
        assert isinstance(decide(p, h, fault(f"node{i % 3}", "ZeroDivisionError: division by zero", at=T0 + i),
                                 frozenset(), T0 + i), Relaunch)
    out = decide(p, h, fault("node0", "ZeroDivisionError: division by zero", at=T0 + 9), frozenset(), T0 + 9)
    assert out == GiveUp("gave up after 3 restarts: the last 4 attempts ended with the same error: "
                         "ZeroDivisionError: division by zero")
    assert h.restarts_at == [T0, T0 + 1, T0 + 2]


def test_max_restarts_without_a_repeated_error_names_the_last_failure():
    p, h = policy(max_restarts=1, min_nodes=None), History()
    assert isinstance(decide(p, h, fault("node0"), frozenset(), T0), Relaunch)
    assert decide(p, h, fault("node2"), frozenset(), T0 + 5) == GiveUp(
        "gave up after 1 restart: the last attempt ended: node2 failed (exit code 1)")


def test_only_restarts_within_the_window_count():
    p, h = policy(max_restarts=2, window=100, min_nodes=None, strikes=10), History()
    for t in (0, 50, 200, 260):  # by 200 the first two are out of the window
        assert isinstance(decide(p, h, fault(at=T0 + t), frozenset(), T0 + t), Relaunch), t
    assert decide(p, h, fault(at=T0 + 280), frozenset(), T0 + 280) == GiveUp(
        "gave up after 2 restarts within 100 s: the last attempt ended: node1 failed (exit code 1)")


def test_the_same_error_three_times_before_any_step_is_a_bug():
    p, h = policy(max_restarts=10, min_nodes=None, strikes=10), History()
    for i in range(2):
        assert isinstance(decide(p, h, fault(HOSTS[i], BOOM, steps=False), frozenset(), T0 + i), Relaunch)
    assert decide(p, h, fault("node2", BOOM, steps=False), frozenset(), T0 + 2) == GiveUp(
        "the same error 3 times in a row before any training step: RuntimeError: boom; "
        "this looks like a bug in the job, not a failed host")


def test_the_bug_rule_needs_three_in_a_row_with_no_step():
    p, h = policy(max_restarts=10, min_nodes=None, strikes=10), History()
    outs = [decide(p, h, fault(HOSTS[i % 3], BOOM, steps=s), frozenset(), T0 + i)
            for i, s in enumerate((False, True, False, False))]  # one attempt trained: not a storm yet
    assert all(isinstance(o, Relaunch) for o in outs)
    assert isinstance(decide(p, h, fault("node2", BOOM, steps=False), frozenset(), T0 + 9), GiveUp)


def test_the_same_error_on_one_host_is_left_to_its_strikes():
    """A host that fails alike every time (an ECC error at start-up) is hardware: its strikes leave it
    out; the bug verdict is for an error seen on more than one host."""
    p, h = policy(max_restarts=10, min_nodes=2, strikes=3), History()
    outs = [decide(p, h, fault("node1", BOOM, steps=False), frozenset(), T0 + i) for i in range(3)]
    assert all(isinstance(o, Relaunch) for o in outs)
    assert outs[-1].hosts == ("node0", "node2") and outs[-1].newly_excluded == ("node1",)


def test_normalising_a_hostile_line_is_fast():
    import time

    t0 = time.perf_counter()
    normalise_error("ValueError: pid" + " " * 8000 + "x")
    assert time.perf_counter() - t0 < 0.5  # the number pattern once backtracked quadratically


def test_the_bug_rule_with_fewer_restarts_allowed():
    p, h = policy(max_restarts=1, min_nodes=None), History()
    assert isinstance(decide(p, h, fault("node0", BOOM, steps=False), frozenset(), T0), Relaunch)
    assert decide(p, h, fault("node1", BOOM, steps=False), frozenset(), T0 + 1).reason.startswith(
        "the same error twice in a row before any training step: RuntimeError: boom;")


def test_strikes_exclude_a_host_when_min_nodes_allows():
    p, h = policy(min_nodes=2), History()
    first = decide(p, h, fault("node1", "OSError: a"), frozenset(), T0)
    assert first == Relaunch(HOSTS, (), (), (), "node1 failed (exit code 1) (strike 1 of 2 against node1); "
                                                "relaunching on node0, node1, node2 (3 of 3 nodes)")
    second = decide(p, h, fault("node1", "OSError: b"), frozenset(), T0 + 1)
    assert second == Relaunch(("node0", "node2"), ("node1",), ("node1",), (),
                              "node1 failed twice (strikes 2): excluded; relaunching on node0, node2 (2 of 3 nodes)")
    assert probe_targets(p, h) == ("node1",)


def test_without_min_nodes_a_host_is_retried_in_place():
    p, h = policy(min_nodes=None), History()
    decide(p, h, fault("node1"), frozenset(), T0)
    out = decide(p, h, fault("node1"), frozenset(), T0 + 1)
    assert out.hosts == HOSTS and out.excluded == () and out.reason == (
        "node1 failed twice; recovery.min_nodes is not set, so it is retried; "
        "relaunching on node0, node1, node2 (3 of 3 nodes)")


def test_excluding_below_min_nodes_gives_up():
    p, h = policy(min_nodes=2, hosts=("node0", "node1")), History()
    decide(p, h, fault("node1"), frozenset(), T0)
    assert decide(p, h, fault("node1"), frozenset(), T0 + 1) == GiveUp(
        "node1 failed twice and excluding it would leave 1 node, below recovery.min_nodes 2")


def test_a_lost_host_is_excluded_at_once():
    p, h = policy(min_nodes=1), History()
    out = decide(p, h, fault("node2", cause="host_lost"), frozenset(), T0)
    assert out.hosts == ("node0", "node1") and out.newly_excluded == ("node2",)
    assert out.reason == ("node2 failed (exit code 1): node2 was lost (relaunching onto it does not bring it back): "
                          "excluded; relaunching on node0, node1 (2 of 3 nodes)")
    # with min_nodes unset it is retried: a strike, as for any failure
    h2 = History()
    assert decide(policy(min_nodes=None), h2, fault("node2", cause="host_lost"), frozenset(), T0).hosts == HOSTS
    assert h2.strikes == {"node2": 1}


def test_a_bug_moving_between_hosts_gets_no_strike():
    p, h = policy(min_nodes=1), History()
    decide(p, h, fault("node0", BOOM), frozenset(), T0)
    out = decide(p, h, fault("node1", BOOM), frozenset(), T0 + 1)
    assert h.strikes == {"node0": 1}
    assert out.reason.startswith("node1 failed (exit code 1); node0 ended with the same error before "
                                 "(a bug moves between hosts): no strike against node1;")
    decide(p, h, fault("node0", BOOM), frozenset(), T0 + 2)  # again from another host: still no strike
    assert h.strikes == {"node0": 1} and h.excluded == []


def test_a_flapping_host_is_readmitted_once_then_excluded_for_good():
    p, h = policy(max_restarts=20, min_nodes=2), History()
    decide(p, h, fault("node1", "OSError: 1"), frozenset(), T0)
    assert decide(p, h, fault("node1", "OSError: 2"), frozenset(), T0 + 1).excluded == ("node1",)
    back = decide(p, h, fault("node0", "OSError: 3"), frozenset({"node1"}), T0 + 2)
    assert back.readmitted == ("node1",) and back.hosts == HOSTS and back.excluded == ()
    assert "node1 passed its probe: readmitted" in back.reason
    assert h.strikes["node1"] == 0 and probe_targets(p, h) == ()
    decide(p, h, fault("node1", "OSError: 4"), frozenset(), T0 + 3)
    again = decide(p, h, fault("node1", "OSError: 5"), frozenset(), T0 + 4)
    assert again.reason == ("node1 failed twice (strikes 2): excluded for good (it failed again after it was "
                            "readmitted); relaunching on node0, node2 (2 of 3 nodes)")
    assert probe_targets(p, h) == ()  # never probed again
    still = decide(p, h, fault("node2", "OSError: 6"), frozenset({"node1"}), T0 + 5)
    assert still.readmitted == () and still.hosts == ("node0", "node2")


def test_a_fault_no_host_is_blamed_for_relaunches_on_the_same_hosts():
    p, h = policy(), History()
    out = decide(p, h, fault(None, cause="launch_failed"), frozenset(), T0)
    assert out.hosts == HOSTS and h.strikes == {}


def test_normalise_error_makes_the_same_bug_on_two_ranks_equal():
    a = normalise_error("[rank1]: RuntimeError: boom at 0x7f3a12ab90")
    assert a == normalise_error("[rank0]: RuntimeError: boom at 0x55d1c0")
    assert a == normalise_error("node2: [default3]:RuntimeError:   boom at 0x1") == "RuntimeError: boom at 0x?"
    assert normalise_error("pdsh@l: node1: [rank3]: DistBackendError: NCCL error rank 3 pid 1234 at "
                           "10.0.0.2:29500 2024-05-01 12:00:00,123") == (
        "DistBackendError: NCCL error rank N pid N at <ip>:<port> <time>")
    assert len(normalise_error("ValueError: " + "x" * 10_000)) == 300


TRACEBACK = """\
node1: [rank1]: Traceback (most recent call last):
node1: [rank1]:   File "/work/train.py", line 12, in <module>
node1: [rank1]:     raise ZeroDivisionError("division by zero")
node1: [rank1]: ZeroDivisionError: division by zero
node1: W0501 12:00:01.000000 1234 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 1235 SIGTERM
node1: Traceback (most recent call last):
node1:   File "/usr/bin/torchrun", line 8, in <module>
node1: torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
node1: ============================================================
node1: train.py FAILED
node1: Root Cause (first observed failure):
node1: [0]:
node1:   time      : 2024-05-01_12:00:01
node1:   host      : node1
node1:   rank      : 1 (local_rank: 1)
node1:   exitcode  : 1 (pid: 1234)
"""


def test_last_error_of_a_torch_traceback_is_the_rank_exception():
    assert last_error(TRACEBACK.splitlines()) == "ZeroDivisionError: division by zero"


def test_last_error_of_a_node_whose_ranks_could_not_restart_in_process_is_why():
    """Exit 75 (hfscale.training.inprocess.restart): the ranks said why on their node's log; that is
    the error, before a standby's traceback that may follow it."""
    log = ["node1: hfscale: attempt 2 ended (rank 1 (uid 1): RuntimeError: Connection closed by peer); rank 0 "
           "stays and rejoins",
           "node1: hfscale: no in-process restart: 1 rank(s) lost (rank 1) and 0 standby rank(s) to take their "
           "place; the job is relaunched",
           "node1: RuntimeError: the store went away"]
    assert last_error(log) == ("no in-process restart: 1 rank(s) lost (rank N) and 0 standby rank(s) to take "
                               "their place")
    from hfscale.launch.attempt.node_lines import Nodes

    failed = Nodes(("node1",))._failed("node1", 75)
    assert failed.what == "node1's ranks could not restart in process (exit code 75): the job is relaunched"
    assert Nodes(("node1",))._failed("node1", 1).what == "node1 failed (exit code 1)"


def test_last_error_falls_back_on_torchruns_root_cause():
    killed = [line for line in TRACEBACK.splitlines() if "Error" not in line and "raise" not in line]
    assert last_error(killed + ["  exitcode  : -9 (pid: 1234)"]) == "exitcode -9"
    assert last_error(["loading", "UserWarning: careful", ""]) == ""


def event(kind, attempt, at, **kw) -> TimelineEvent:
    return TimelineEvent(kind=kind, attempt=attempt, at=T0 + at, **kw)


TWO_FAILURES = (
    event("launch", 1, 0, hosts=list(HOSTS), world_size=3, accumulation=4),
    event("training", 1, 3, step=1),
    event("failure", 1, 20, cause="rank_failed", host="node1", what="node1 failed (exit code 1)", step=14,
          step_time=1.0, error=BOOM),
    event("stopped", 1, 21),
    event("relaunch", 2, 22, hosts=["node0", "node2"], excluded=["node1"], resume_step=10, world_size=2,
          accumulation=6),
    event("training", 2, 26, step=11),
    event("failure", 2, 40, cause="hang", host="node2", what="no progress for 300 s", step=20, step_time=1.5),
    event("stopped", 2, 40.5),
    event("relaunch", 3, 41, hosts=["node0", "node2"], excluded=["node1"], resume_step=20, world_size=2,
          accumulation=6),
    event("training", 3, 45, step=21),
    event("finished", 3, 60, step=30, step_time=1.0),
)


def test_timeline_round_trip(tmp_path):
    for e in TWO_FAILURES:
        assert append_event(tmp_path, e) is None
    assert read_timeline(tmp_path) == Timeline(TWO_FAILURES, 0)
    assert oct(os.stat(tmp_path / TIMELINE_FILE).st_mode & 0o777) == oct(0o644 & ~_umask())
    assert read_timeline(tmp_path / "missing") == Timeline((), 0)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_symlinked_timeline_is_neither_followed_nor_written(tmp_path):
    target = tmp_path / "elsewhere.jsonl"
    target.write_text(TWO_FAILURES[0].model_dump_json() + "\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / TIMELINE_FILE).symlink_to(target)
    with pytest.raises(Unreadable, match="symbolic link"):
        read_timeline(run)
    assert "cannot write" in append_event(run, TWO_FAILURES[1])
    assert target.read_text().count("\n") == 1
    (run / TIMELINE_FILE).unlink()
    os.mkfifo(run / TIMELINE_FILE)  # no reader: refused at once, never waits
    assert "cannot write" in append_event(run, TWO_FAILURES[1])


def test_bad_timeline_lines_are_skipped_and_counted(tmp_path):
    good = TWO_FAILURES[0].model_dump_json(exclude_none=True)
    bad = [
        '{"kind": "launch", "attempt": 1, "at": 1700000000, "pad": "' + "x" * (40 << 20) + '"}',  # over the line cap
        json.dumps({"kind": "failure", "attempt": "2", "at": T0}),  # a wrong type
        json.dumps({"kind": "launch", "attempt": 1, "at": 3600.0}),  # 1970
        json.dumps({"kind": "failure", "attempt": 1, "at": T0, "step_time": -1}),
        json.dumps({"kind": "failure", "attempt": 1, "at": T0, "host": "node1; rm -rf /"}),
        json.dumps({"kind": "reboot", "attempt": 1, "at": T0}),
        '{"kind": "stopped", "attempt": 1, "at": 17000',  # torn by a crash
    ]
    (tmp_path / TIMELINE_FILE).write_text("\n".join([good, *bad, good]) + "\n")
    t = read_timeline(tmp_path)
    assert t.events == (TWO_FAILURES[0], TWO_FAILURES[0]) and t.skipped == len(bad)
    assert timeline_lines(t) == ["(7 bad timeline lines skipped)"]


def test_goodput_of_two_failures():
    g = goodput(Timeline(TWO_FAILURES))
    assert (g.wall, g.productive, g.restarts, g.excluded) == (60.0, 30.0, 2, ("node1",))
    # start 0 -> 3; detection: last steps at 3 + 13 * 1.0 = 16 (failure 20) and 26 + 9 * 1.5 = 39.5 (failure 40);
    # stop 1 + 0.5; restart 21 -> 26 and 40.5 -> 45; recompute (14 - 10) * 1.0 + 0; other: the rest of 60
    assert g.lost == {"start": 3.0, "detection": 4.5, "stop": 1.5, "restart": 9.5, "recompute": 4.0, "rollback": 0.0,
                      "other": 7.5}
    assert list(g.lost) == ["start", "detection", "stop", "restart", "recompute", "rollback", "other"]
    assert g.ratio == 0.5
    assert lines(g) == ["goodput 50.0% (productive 30.0 s of 60.0 s); lost: start 3.0 s, detection 4.5 s, "
                        "stop 1.5 s, restart 9.5 s, recompute 4.0 s, other 7.5 s", "restarts 2, excluded: node1"]


IN_PROCESS = (event("launch", 0, 0), event("training", 0, 3, step=1),
              event("in_process", 0, 20, in_process=1, what="rank 1 (uid 1): RuntimeError: Connection closed",
                    failed_step=14, resume_step=10, step=11,
                    phases={"model": 0.5, "engine": 1.0, "checkpoint": 0.5, "data": 0.2, "first_step": 0.8}),
              event("in_process", 0, 40, in_process=2, failed_step=30, resume_step=30, step=31,
                    phases={"engine": 2.0, "first_step": 1.0}),
              event("finished", 0, 60, step=50, step_time=1.0))


def test_goodput_status_and_report_of_restarts_made_in_process(tmp_path):
    """hfscale.launch.recovery.in_process_events: each restart the ranks made in their processes is a
    restart in the goodput (its parts) and a recompute (from the failed step back to the one resumed from)."""
    from hfscale.runs.goodput import status_lines
    from hfscale.runs.report import _segments

    g = goodput(Timeline(IN_PROCESS))
    assert (g.restarts, g.in_process, g.productive) == (0, 2, 50.0)
    assert g.lost["restart"] == 6.0 and g.lost["recompute"] == 4.0 and g.lost["start"] == 3.0
    assert lines(g)[1] == "restarts 0 (and 2 in process), no host excluded"
    assert timeline_lines(Timeline(IN_PROCESS)) == [
        "+20.0 s  attempt 0  restart in process 1 (rank 1 (uid 1): RuntimeError: Connection closed), from step 14: "
        "resumed from step 10, step 11 after 3.0 s: model 0.5 s, engine and process group 1.0 s, checkpoint load "
        "0.5 s, data fast-forward 0.2 s, first step 0.8 s",
        "+40.0 s  attempt 0  restart in process 2, from step 30: resumed from step 30, step 31 after 3.0 s: engine "
        "and process group 2.0 s, first step 1.0 s"]
    for e in IN_PROCESS:
        append_event(tmp_path, e)
    shown = status_lines(tmp_path)
    assert shown[0] == "restarts     0 (and 2 in process)"
    assert shown[-1] == ("last start   attempt 0, restart in process 2, from step 30: resumed from step 30, step 31 "
                         "after 3.0 s: engine and process group 2.0 s, first step 1.0 s")
    segments = [(w, round(a - T0, 1), round(b - T0, 1)) for w, a, b in _segments(Timeline(IN_PROCESS), T0 + 60)]
    assert segments == [("start", 0, 3), ("training", 3, 20), ("restart", 20, 23), ("training", 23, 40),
                        ("restart", 40, 43), ("training", 43, 60)]


def test_in_process_restarts_reach_the_timeline_once_their_first_step_is_marked(tmp_path, monkeypatch):
    """Rank 0's side (heartbeat.begin_attempt) and the launch's (in_process_events.record_new), through
    the real progress/metrics.json: one event per in-process attempt, written when its first step is."""
    from hfscale.launch.recovery.in_process_events import record_new
    from hfscale.training import heartbeat

    monkeypatch.setattr(heartbeat, "_state", {})
    monkeypatch.setenv("HFSCALE_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    heartbeat.report(resumed=0)
    heartbeat.step(7)
    heartbeat.begin_attempt(T0 + 10, 1, "rank 1 (uid 1): RuntimeError: Connection closed")
    heartbeat.report(resumed=5)
    heartbeat.phase("engine", at=T0 + 11)
    assert record_new(tmp_path, 0, 0) == 0 and read_timeline(tmp_path).events == ()  # no first step yet
    heartbeat.phase("first_step", at=T0 + 12.5)
    assert record_new(tmp_path, 0, 0) == 1 and record_new(tmp_path, 0, 1) == 1  # once
    (e,) = read_timeline(tmp_path).events
    assert (e.kind, e.in_process, e.at, e.failed_step, e.resume_step, e.step) == ("in_process", 1, T0 + 10, 7, 5, 6)
    assert e.what == "rank 1 (uid 1): RuntimeError: Connection closed" and e.phases == {"engine": 1.0,
                                                                                            "first_step": 1.5}
    heartbeat.begin_attempt(T0 + 20, 2, "")  # a standby took rank 0: it had done no step
    (tmp_path / "progress" / "metrics.json").write_text("{half")
    assert record_new(tmp_path, 0, 1) == 1  # not a record: tried again later
    heartbeat.phase("first_step", at=T0 + 21)
    assert record_new(tmp_path, 0, 1) == 2
    assert read_timeline(tmp_path).events[-1].what is None


def test_goodput_counts_only_the_steps_this_run_made():
    """A run that resumed at step 9,000 from an earlier run's checkpoint made 500 steps, not 9,500."""
    events = (TimelineEvent(kind="launch", attempt=0, at=T0, resume_step=9000),
              TimelineEvent(kind="training", attempt=0, at=T0 + 100, step=9001),
              TimelineEvent(kind="finished", attempt=0, at=T0 + 600, step=9500, step_time=1.0))
    g = goodput(Timeline(events))
    assert (g.wall, g.productive) == (600.0, 500.0)


def test_goodput_of_a_running_job_and_of_no_launch():
    assert goodput(Timeline(())) is None and goodput(Timeline(TWO_FAILURES[1:])) is None
    running = goodput(Timeline(TWO_FAILURES[:5]), now=T0 + 30)
    assert running.wall == 30.0 and running.productive == 14.0 and running.lost["restart"] == 9.0
    never_trained = goodput(Timeline((TWO_FAILURES[0], event("failure", 1, 8, cause="launch_failed"),
                                      event("gave_up", 1, 9, what="recovery is off"))))
    assert never_trained.lost["start"] == 8.0 and never_trained.productive == 0.0 and never_trained.ratio == 0.0


def test_timeline_lines():
    gave_up = event("gave_up", 3, 70, what="gave up after 2 restarts: the last attempt ended: x")
    assert timeline_lines(Timeline(TWO_FAILURES + (gave_up,), skipped=1)) == [
        "+20.0 s  attempt 1  failure  node1  rank_failed: node1 failed (exit code 1)  at step 14",
        "+22.0 s  attempt 2  relaunch  on node0, node2 (excluded node1), resuming from step 10, world 2, "
        "accumulation 6",
        "+40.0 s  attempt 2  failure  node2  hang: no progress for 300 s  at step 20",
        "+41.0 s  attempt 3  relaunch  on node0, node2 (excluded node1), resuming from step 20, world 2, "
        "accumulation 6",
        "+70.0 s  attempt 3  gave_up  gave up after 2 restarts: the last attempt ended: x",
        "(1 bad timeline line skipped)",
    ]


def test_the_step_the_ranks_resumed_from_counts_over_the_planned_one():
    """A relaunch planned from the durable checkpoint of step 10; its ranks restored the local tier's
    step 25 (rank 0 said so, the training event's resume_step): the failure at step 27 recomputed 2
    steps, not 17, and the relaunch line says where the ranks resumed."""
    events = (TimelineEvent(kind="launch", attempt=0, at=T0, resume_step=None),
              TimelineEvent(kind="training", attempt=0, at=T0 + 5, step=1, resume_step=0),
              TimelineEvent(kind="failure", attempt=0, at=T0 + 40, step=27, step_time=1.0, host="node1",
                            cause="rank_failed"),
              TimelineEvent(kind="stopped", attempt=0, at=T0 + 41),
              TimelineEvent(kind="relaunch", attempt=1, at=T0 + 42, resume_step=10),
              TimelineEvent(kind="training", attempt=1, at=T0 + 50, step=26, resume_step=25),
              TimelineEvent(kind="finished", attempt=1, at=T0 + 80, step=60, step_time=1.0))
    g = goodput(Timeline(events))
    assert g.lost["recompute"] == 2.0
    planned = goodput(Timeline(tuple(e.model_copy(update={"resume_step": None}) if e.kind == "training" else e
                                     for e in events)))
    assert planned.lost["recompute"] == 17.0  # what the relaunch's plan alone says
    assert timeline_lines(Timeline(events))[1].endswith(
        "relaunch  on the same hosts, resuming from step 10 (the ranks resumed from step 25)")


# ---- a start's parts (issue 38, item 4): rank 0's marks -> the "training" event -> status ----------------

def test_a_starts_parts_come_from_rank_0s_marks_in_order(tmp_path):
    from hfscale.runs.goodput import start_parts_text, timeline_lines
    from hfscale.launch.recovery.timeline import start_parts
    from hfscale.training.heartbeat import PHASES, parts

    t0 = 1_795_000_000.0
    marks = {"process": t0 + 1.5, "imports": t0 + 8.0, "model": t0 + 8.5, "checkpoint": t0 + 10.0,
             "data": t0 + 10.25, "first_step": t0 + 11.0}
    got = parts(marks, t0)
    # engine not marked: its time is inside the checkpoint's part; the launch's part is the process start
    assert got == {"process": 1.5, "imports": 6.5, "model": 0.5, "checkpoint": 1.5, "data": 0.25, "first_step": 0.75}
    assert list(got) == [p for p in PHASES if p in got] and sum(got.values()) == 11.0
    assert "process" not in parts(marks, None) and parts({"data": t0}, t0 + 5) == {"data": 0.0}  # clocks apart: never < 0
    progress = tmp_path / "progress"
    progress.mkdir()
    (progress / "metrics.json").write_text(json.dumps({"phases": marks, "step": 3}))
    assert start_parts(tmp_path, t0) == got
    assert start_parts_text(got) == ("process start 1.5 s, imports 6.5 s, model 0.5 s, checkpoint load 1.5 s, "
                                     "data fast-forward 0.2 s, first step 0.8 s")
    for bad in ({"phases": {"bogus": t0}}, {"phases": {"data": "soon"}}, {"phases": [1, 2]}, {"phases": {"data": 1e300}}):
        (progress / "metrics.json").write_text(json.dumps(bad))  # hostile: no parts, no exception
        assert start_parts(tmp_path, t0) is None
    (progress / "metrics.json").write_text("{")
    assert start_parts(tmp_path, t0) is None
    events = (TimelineEvent(kind="launch", attempt=0, at=t0),
              TimelineEvent(kind="training", attempt=1, at=t0 + 20, step=7, phases=got))
    assert timeline_lines(Timeline(events))[-1] == (
        "+20.0 s  attempt 1  training  step 7 after 11.0 s: process start 1.5 s, imports 6.5 s, model 0.5 s, "
        "checkpoint load 1.5 s, data fast-forward 0.2 s, first step 0.8 s")


def test_rank_0_marks_each_part_once_and_other_ranks_nothing(tmp_path, monkeypatch):
    from hfscale.training import heartbeat

    monkeypatch.setattr(heartbeat, "_state", {})
    monkeypatch.setenv("HFSCALE_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    heartbeat.phase("model")
    assert not (tmp_path / "progress" / "metrics.json").exists()
    monkeypatch.setenv("RANK", "0")
    heartbeat.phase("model", at=100.0)
    heartbeat.phase("model", at=200.0)  # the first mark stays
    heartbeat.phase("nonsense")
    marks = json.loads((tmp_path / "progress" / "metrics.json").read_text())["phases"]
    assert marks["model"] == 100.0 and set(marks) == {"process", "model"}
    assert abs(marks["process"] - heartbeat.process_started()) < 0.05  # this process's own start, from /proc


def test_an_in_process_attempt_marks_its_parts_again_from_the_failure(tmp_path, monkeypatch):
    """hfscale.training.inprocess.restart: no process starts, so the new start's "process" mark is the
    moment the previous attempt ended, and every part is marked again."""
    from hfscale.training import heartbeat

    monkeypatch.setattr(heartbeat, "_state", {})
    monkeypatch.setenv("HFSCALE_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    heartbeat.phase("model", at=100.0)
    heartbeat.phase("first_step", at=110.0)
    heartbeat.begin_attempt(500.0)
    heartbeat.phase("model", at=502.0)
    marks = json.loads((tmp_path / "progress" / "metrics.json").read_text())["phases"]
    assert marks == {"process": 500.0, "model": 502.0}
    assert heartbeat.parts(marks, 499.5) == {"process": 0.5, "model": 2.0}
