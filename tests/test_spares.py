"""Hot spares (issue 29): the config (a host file's 'spare', cluster.hosts[].spare, recovery.spares),
what check says of them, the decision that puts a spare in a failed host's place
(hfscale.launch.recovery.policy.decide) and the job a relaunch then runs (hfscale.rules.relaunch.job_on).
Pure: no process, no file but tmp ones."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import yaml

from hfscale.cli.check_summary import summary
from hfscale.config.hostfile import parse_hostfile, render_hostfile
from hfscale.core.records import TimelineEvent
from hfscale.launch.recovery.policy import Fault, History, Policy, Replacement, decide, probe_targets
from hfscale.launch.recovery.supervisor import _specs
from hfscale.launch.recovery.timeline import Timeline
from hfscale.rules.config_file import load_job
from hfscale.rules.relaunch import job_on
from hfscale.runs.goodput import replacement_lines, timeline_lines

HOSTS = ("node0", "node1", "node2")
SPARES = ("node3",)
T0 = 1_700_000_000.0


def policy(spares=SPARES, min_nodes=2, strikes=2, max_restarts=10) -> Policy:
    return Policy.of(SimpleNamespace(max_restarts=max_restarts, window=None, strikes=strikes, min_nodes=min_nodes),
                     HOSTS, spares)


def fault(host="node1", cause="rank_failed", error="", at=T0) -> Fault:
    return Fault(cause, host, 1, f"{host} failed (exit code 1)", error, at, True)


def test_a_failed_host_is_replaced_at_once_by_a_healthy_spare_at_the_same_size():
    p, h = policy(), History()
    assert probe_targets(p, h) == ("node3",)  # a free spare is probed before it is used
    out = decide(p, h, fault("node1"), frozenset({"node3"}), T0)
    assert out.hosts == ("node0", "node3", "node2")  # node1's place: node rank 1
    assert out.replaced == (Replacement("node1", "node3"),) and out.spares == ()
    assert out.newly_excluded == ("node1",) and out.excluded == ("node1",)
    assert out.reason == ("node1 failed (exit code 1): node3 (a spare that passed its probe) takes its place at the "
                          "same world size; node1 is left out; relaunching on node0, node3, node2 (3 of 3 nodes); "
                          "0 spares left")


def test_a_spare_that_fails_its_probe_is_not_used():
    p, h = policy(), History()
    out = decide(p, h, fault("node1"), frozenset(), T0)  # node3 did not answer
    assert out.hosts == HOSTS and out.replaced == () and out.spares == ("node3",)
    assert "strike 1 of 2 against node1" in out.reason and "1 spare left" in out.reason


def test_a_lost_host_is_replaced_even_when_the_job_may_not_shrink():
    p, h = policy(min_nodes=None), History()
    out = decide(p, h, fault("node0", cause="host_lost"), frozenset({"node3"}), T0)
    assert out.hosts == ("node3", "node1", "node2") and out.replaced == (Replacement("node0", "node3"),)


def test_with_no_spare_left_the_job_shrinks_as_before():
    p, h = policy(min_nodes=1), History()
    decide(p, h, fault("node1"), frozenset({"node3"}), T0)
    out = decide(p, h, fault("node2", cause="host_lost"), frozenset(), T0 + 1)
    assert out.hosts == ("node0", "node3") and out.replaced == ()
    assert "excluded (no spare left that passed its probe)" in out.reason
    assert out.excluded == ("node1", "node2")


def test_a_bug_that_moves_between_hosts_replaces_nobody():
    p, h = policy(), History()
    decide(p, h, fault("node0", error="RuntimeError: boom"), frozenset(), T0)  # spare not healthy: retried
    out = decide(p, h, fault("node1", error="RuntimeError: boom"), frozenset({"node3"}), T0 + 1)
    assert out.replaced == () and out.hosts == HOSTS and out.spares == ("node3",)


def test_a_replaced_host_probed_healthy_waits_as_a_spare_and_a_lost_place_is_taken_back():
    p, h = policy(min_nodes=1), History()
    decide(p, h, fault("node1"), frozenset({"node3"}), T0)
    assert probe_targets(p, h) == ("node1",)  # excluded, not yet readmitted; no free spare
    back = decide(p, h, fault(None, cause="launch_failed"), frozenset({"node1"}), T0 + 1)
    assert back.readmitted == ("node1",) and back.hosts == ("node0", "node3", "node2")  # full: it waits
    assert back.spares == ("node1",)
    shrunk = decide(p, h, fault("node0", cause="host_lost"), frozenset(), T0 + 2)  # node1 not healthy now
    assert shrunk.hosts == ("node3", "node2") and shrunk.spares == ("node1",)
    # node0 comes back: it takes its own place again
    again = decide(p, h, fault(None, cause="launch_failed"), frozenset({"node0"}), T0 + 3)
    assert again.hosts == ("node0", "node3", "node2") and again.readmitted == ("node0",)


def test_without_spares_the_decision_is_unchanged():
    p, h = policy(spares=()), History()
    out = decide(p, h, fault("node1"), frozenset(), T0)
    assert out.hosts == HOSTS and out.spares == () and "spare" not in out.reason


def test_a_host_file_marks_spares(tmp_path: Path):
    hosts, problems = parse_hostfile("node0 slots=2\nnode1 slots=2 spare\n", "hf")
    assert problems == [] and [(h.host, h.spare) for h in hosts] == [("node0", False), ("node1", True)]
    assert render_hostfile(hosts) == "node0 slots=2\nnode1 slots=2 spare\n"
    _, bad = parse_hostfile("node0 slots=2 sparse\n", "hf")
    assert [str(b).startswith("hf:1: expected 'host slots=N' (or 'host slots=N spare'), got 'node0 slots") for b in bad] == [True]


def config(tmp: Path, runner="pdsh", spares=1, marked=("node3",), recovery=None) -> Path:
    hosts = [{"host": h, "slots": 1} for h in HOSTS] + [{"host": h, "slots": 1, "spare": True} for h in marked]
    rec = {"max_restarts": 3, "min_nodes": 2, **({"spares": spares} if spares is not None else {})}
    doc = {"name": "sp", "cluster": {"hosts": hosts} if runner != "slurm" else {"num_nodes": 3},
           "runner": {"type": runner}, "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}},
           "batch": {"micro_batch_size": 2, "global_batch_size": 12},
           "training": {"output_dir": str(tmp / "out"), "max_steps": 10, "save_steps": 5},
           "recovery": recovery if recovery is not None else rec}
    path = tmp / "sp.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_spares_are_left_out_of_the_world_size_and_check_says_what_a_failure_costs(tmp_path: Path):
    job = load_job(str(config(tmp_path)))
    assert [h.host for h in job.hosts] == list(HOSTS) and [h.host for h in job.spares] == ["node3"]
    assert job.world_size == 3 and job.gradient_accumulation_steps == 2
    text = summary(job)
    assert "nodes        3 (node0, node1, node2) x 1 processes + 1 spare (node3)" in text
    assert ("spare node3: a failed host is replaced at once by a spare that passes its probe, so the first 1 "
            "failure(s) cost a restart at 3 node(s), world size 3, nothing converted; then shrinking, down to 2 "
            "node(s); global batch 12 kept: accumulation 2 at 3, 3 at 2 node(s)") in text


def test_check_refuses_spares_it_cannot_use(tmp_path: Path):
    def problems(**kw) -> list[str]:
        try:
            load_job(str(config(tmp_path, **kw)))
        except Exception as e:  # ConfigError
            return [str(p) for p in e.problems]  # type: ignore[attr-defined]
        return []

    assert any("recovery.spares" in p and "2, but 1 host(s)" in p for p in problems(spares=2))
    assert any("spares with runner local" in p for p in problems(runner="local"))
    assert problems(spares=None) == []  # null: as many as are marked


def test_a_relaunch_with_a_spare_in_place_keeps_the_batch_and_marks_the_spares_left(tmp_path: Path):
    job = load_job(str(config(tmp_path, marked=("node3", "node4"), spares=2)))
    p, h = Policy.of(job.config.recovery, HOSTS, ("node3", "node4")), History()
    out = decide(p, h, fault("node2", cause="host_lost"), frozenset({"node3", "node4"}), T0)
    after = job_on(job, *_specs(job, out))
    assert [x.host for x in after.hosts] == ["node0", "node1", "node3"] and not any(x.spare for x in after.hosts)
    assert [x.host for x in after.spares] == ["node4"] and after.config.recovery.spares == 1
    assert (after.world_size, after.gradient_accumulation_steps, after.global_batch_size) == (3, 2, 12)
    assert after.master_addr == "node0"


def test_status_and_report_say_which_spare_replaced_which_host():
    events = (TimelineEvent(kind="launch", attempt=0, at=T0),
              TimelineEvent(kind="failure", attempt=0, at=T0 + 30, cause="rank_failed", host="node1", what="x"),
              TimelineEvent(kind="relaunch", attempt=1, at=T0 + 40.5, hosts=["node0", "node3", "node2"],
                            excluded=["node1"], replaced=[{"host": "node1", "spare": "node3"}], spares=[],
                            resume_step=12, world_size=3, accumulation=2))
    t = Timeline(events, 0, False)
    assert replacement_lines(t) == ["replaced     node3 replaced node1 at +40.5 s (attempt 1; spares left: none)"]
    assert timeline_lines(t)[-1] == ("+40.5 s  attempt 1  relaunch  on node0, node3, node2 (node3 replaced node1; "
                                     "excluded node1; spares left: none), resuming from step 12, world 3, "
                                     "accumulation 2")


def test_the_resolved_config_the_ranks_read_keeps_the_spares(tmp_path: Path):
    """Each rank reads the run's resolved config.yaml again: without its spares, recovery.spares: 1
    counted none and every rank that read it failed at start (found by test_spares_cluster)."""
    from hfscale.launch.build import resolved_config_yaml
    from hfscale.rules.config_file import load_text

    job = load_job(str(config(tmp_path)))
    again = load_text(resolved_config_yaml(job), str(tmp_path / "resolved.yaml"), tmp_path)
    assert again.hosts == job.hosts and again.spares == job.spares and again.world_size == 3


def test_ranks_killed_by_a_signal_on_two_hosts_are_two_faults_not_a_moving_bug():
    p, h = policy(), History()
    decide(p, h, fault("node1", error="exitcode -9"), frozenset({"node3"}), T0)
    out = decide(p, h, fault("node2", error="exitcode -9"), frozenset({"node1"}), T0 + 1)
    assert out.replaced == (Replacement("node2", "node1"),) and h.strikes == {"node1": 0, "node2": 1}  # node1 readmitted: cleared
