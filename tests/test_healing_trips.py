"""The healer must not trip on itself (issue 35), the pure parts: a save of the job's own cut short
is set aside, not refused (hfscale.checkpoints.resume.decide, hfscale.launch.build); a master port
still held is no host's fault (hfscale.launch.recovery.policy, ``port_busy``); hosts that do not answer
after the stop are left out or replaced (``lost``); what the settle probes say
(hfscale.launch.recovery.settle). No process is started: the probes' scripts run in tests/test_settle.py and
on the clusters in tests/test_healing_trips_cluster.py and tests/test_recovery_slurm.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from hfscale.checkpoints.lineage import LINEAGE_FILE, begin_lineage, read_lineage
from hfscale.checkpoints.resume import decide as resume_decision, scan_output
from hfscale.config.errors import ConfigError
from hfscale.core.shell import Ran
from hfscale.launch.build import INCOMPLETE_DIR, build_plan
from hfscale.launch.context import LaunchContext
from hfscale.launch.recovery import settle
from hfscale.launch.recovery.policy import Fault, GiveUp, History, Policy, Relaunch, decide, last_error
from hfscale.launch.recovery.supervisor import port_held
from hfscale.rules.config_file import load_job

HOSTS = ("node0", "node1", "node2")
T0 = 1_700_000_000.0
# what torch 2.x's store says on node 0 when the previous attempt's torchrun still holds the port (as a rank's
# log shows it, through torchrun and the node's prefix)
EADDRINUSE = ("node0: torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
              "address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")


def policy(spares=(), min_nodes=2, strikes=2, max_restarts=10) -> Policy:
    return Policy.of(SimpleNamespace(max_restarts=max_restarts, window=None, strikes=strikes, min_nodes=min_nodes),
                     HOSTS, spares)


def fault(host="node1", cause="rank_failed", error="", at=T0, steps=True, what=None) -> Fault:
    return Fault(cause, host, 1, what or f"{host} failed (exit code 1)", error, at, steps)


# -- a save of the job's own, cut short --------------------------------------------------------------------

def incomplete(out: Path, step: int) -> Path:
    """``checkpoint-<step>`` as a save cut short leaves it: DeepSpeed's shards, no trainer_state.json."""
    ckpt = out / f"checkpoint-{step}"
    (ckpt / f"global_step{step}").mkdir(parents=True)
    (ckpt / f"global_step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    (ckpt / "config.json").write_text("{}")
    return ckpt


def complete(out: Path, step: int) -> Path:
    """``checkpoint-<step>`` with hfscale's marker over its files (complete)."""
    from hfscale.checkpoints.resume import write_marker

    ckpt = out / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    write_marker(ckpt, step, 2)
    return ckpt


def test_a_lineage_begun_at_a_fresh_start_makes_the_checkpoints_the_jobs_own(tmp_path: Path):
    out = tmp_path / "out"
    incomplete(out, 5)
    refused = resume_decision(scan_output(out, 2), 40)  # nobody here vouches for them: refused, as before
    assert refused.action == "refuse" and "training would start over and overwrite them" in refused.reason
    lineage = begin_lineage(out)
    assert read_lineage(out) == lineage and begin_lineage(out, keep=True) == lineage
    assert begin_lineage(out) != lineage  # a fresh start (--restart moved the old one) begins another
    own = resume_decision(scan_output(out, 2), 40)
    assert (own.action, own.checkpoint, own.set_aside) == ("fresh", None, ("checkpoint-5",))
    complete(out, 3)
    incomplete(out, 6)
    newer = resume_decision(scan_output(out, 2), 40)
    assert (newer.action, newer.checkpoint, newer.set_aside) == ("resume", str(out / "checkpoint-3"),
                                                                 ("checkpoint-6", "checkpoint-5"))


@pytest.mark.parametrize("bad", ["link", "folder", "not json", "not hex"])
def test_a_lineage_file_that_is_not_one_is_no_lineage(tmp_path: Path, bad: str):
    out = tmp_path / "out"
    out.mkdir()
    path = out / LINEAGE_FILE
    if bad == "link":
        (tmp_path / "elsewhere.json").write_text('{"lineage": "0123456789abcdef"}')
        path.symlink_to(tmp_path / "elsewhere.json")
    elif bad == "folder":
        path.mkdir()
    else:
        path.write_text("{" if bad == "not json" else '{"lineage": "../../etc"}')
    assert read_lineage(out) is None


def _job(tmp_path: Path):
    doc = {"name": "own", "cluster": {"hosts": [{"host": h, "slots": 1} for h in HOSTS]},
           "runner": {"type": "pdsh", "run_dir": str(tmp_path / "runs"), "python": "/usr/bin/python3"},
           "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}}, "precision": "no",
           "batch": {"micro_batch_size": 1}, "watchdog": {"timeout": 60},
           "training": {"output_dir": str(tmp_path / "out"), "max_steps": 40, "save_steps": 5},
           "recovery": {"max_restarts": 3}}
    (tmp_path / "own.yaml").write_text(json.dumps(doc))
    return load_job(tmp_path / "own.yaml")


def test_a_relaunch_moves_its_own_saves_cut_short_aside_and_starts_over(tmp_path: Path):
    """The issue's first fault: the link went down inside checkpoint-5's save, the first of the job."""
    job, out = _job(tmp_path), tmp_path / "out"
    incomplete(out, 5)

    def plan(attempt: int):
        ctx = LaunchContext.of(str(tmp_path), "/usr/bin/python3", "20261128-120000-abcdef", {},
                               output=scan_output(out, 3), attempt=attempt)
        return build_plan(job, ctx)

    with pytest.raises(ConfigError, match="none is complete"):  # not the job's own: refused, nothing moved
        plan(1)
    begin_lineage(out)
    relaunch = plan(1)
    aside = str(out / INCOMPLETE_DIR / "20261128-120000-abcdef-r1")
    assert relaunch.moves == ((str(out / "checkpoint-5"), os.path.join(aside, "checkpoint-5")),)
    (told,) = relaunch.told
    assert told.startswith("checkpoint-5 this job's own save, cut short: ") and "trainer_state.json" in told
    assert told.endswith(f"; set aside in {aside}; no complete checkpoint: starting at step 0")
    assert f"resume: {told}" in relaunch.render() and f"  {out / 'checkpoint-5'} -> " in relaunch.render()
    complete(out, 3)  # with a complete one before it: resumed from it, the save cut short still set aside
    again = plan(2)
    assert [os.path.basename(b) for _, b in again.moves] == ["checkpoint-5"]
    assert again.told[-1].endswith("; resuming from checkpoint-3")


# -- a busy master port: no host's fault --------------------------------------------------------------------

def test_the_error_of_a_store_that_cannot_bind_is_a_held_port():
    error = last_error([EADDRINUSE, "node0: [rank0]: exitcode  : 1"])
    assert port_held(error) and "EADDRINUSE" in error
    assert not port_held(last_error(["node0: RuntimeError: CUDA error: an illegal memory access"]))


def test_a_held_port_strikes_no_host_and_keeps_node0_where_a_spare_waits():
    """The issue's second fault: node2 replaced by the spare, then node0's new store cannot bind."""
    p, h = policy(spares=("node3",)), History()
    first = decide(p, h, fault("node2", error="exitcode -9"), frozenset({"node3"}), T0)
    assert isinstance(first, Relaunch) and first.hosts == ("node0", "node1", "node3")
    held = fault("node0", cause="port_busy", error=last_error([EADDRINUSE]), steps=False)
    out = decide(p, h, held, frozenset({"node2"}), T0 + 1)  # node2 probed healthy: readmitted as the spare
    assert isinstance(out, Relaunch) and out.hosts == ("node0", "node1", "node3"), out
    assert out.replaced == () and out.newly_excluded == () and h.strikes.get("node0", 0) == 0
    assert "the master port was still held on node0, not node0's fault: no strike" in out.reason


def test_a_port_held_at_three_starts_in_a_row_gives_up_naming_it():
    p, h = policy(), History()
    error = last_error([EADDRINUSE])
    for i in range(2):
        assert isinstance(decide(p, h, fault("node0", "port_busy", error, T0 + i, steps=False), frozenset(), T0 + i),
                          Relaunch)
    out = decide(p, h, fault("node0", "port_busy", error, T0 + 2, steps=False), frozenset(), T0 + 2)
    assert isinstance(out, GiveUp) and out.reason.startswith("the master port was held on node0 at 3 starts in a row")
    assert h.strikes.get("node0", 0) == 0


# -- hosts that do not answer after the stop ----------------------------------------------------------------

def test_a_hang_that_named_no_rank_leaves_out_the_host_that_did_not_answer():
    """The issue's third fault, as the supervisor hands it on: the hang's culprit is the silent host."""
    p, h = policy(spares=("node3",)), History()
    lost = fault("node1", cause="host_lost", what="hang: every rank waits in all_reduce; node1 did not answer")
    out = decide(p, h, lost, frozenset({"node3"}), T0)
    assert isinstance(out, Relaunch) and out.hosts == ("node0", "node3", "node2") and out.newly_excluded == ("node1",)
    no_spare = decide(policy(), History(), lost, frozenset(), T0)
    assert isinstance(no_spare, Relaunch) and no_spare.hosts == ("node0", "node2")


def test_other_hosts_silent_after_the_stop_are_replaced_then_left_out_then_the_job_gives_up():
    p, h = policy(spares=("node3",)), History()
    nobody = fault(None, cause="launch_failed", what="pdsh failed")  # a failure no host is blamed for
    out = decide(p, h, nobody, frozenset({"node3"}), T0, lost=("node1", "node2"))
    # node1 takes the healthy spare's place; node2 is left out (3 -> 2 nodes)
    assert isinstance(out, Relaunch) and out.hosts == ("node0", "node3"), out
    assert set(out.newly_excluded) == {"node1", "node2"} and [(r.host, r.spare) for r in out.replaced] == [
        ("node1", "node3")]
    assert "node1 did not answer after the stop: node3 (a spare that passed its probe) takes its place" in out.reason
    assert "node2 did not answer after the stop: excluded" in out.reason
    floor = decide(policy(min_nodes=3), History(), nobody, frozenset(), T0, lost=("node2",))
    assert isinstance(floor, GiveUp) and "node2 did not answer after the stop and excluding it would leave 2 nodes, " \
                                         "below recovery.min_nodes 3" in floor.reason
    never = decide(policy(min_nodes=None), History(), nobody, frozenset(), T0, lost=("node2",))
    assert isinstance(never, GiveUp) and "recovery.min_nodes is not set" in never.reason


# -- what the settle probes answer --------------------------------------------------------------------------

def test_a_settle_answer_is_read_and_a_silent_host_is_none():
    assert settle.Settled.read(Ran(0, "banner\nHFSCALE_SETTLE\nleft=0\nport=free\n", "")) == settle.Settled(0, "free")
    assert settle.Settled.read(Ran(0, "HFSCALE_SETTLE\nleft=2\n", "")) == settle.Settled(2, None)
    assert settle.Settled.read(Ran(124, "", "timed out after 12 s")) is None  # srun to a cut-off node
    assert settle.Settled.read(Ran(255, "", "ssh: connect to host node1 port 22: No route to host")) is None
    # srun to a node whose link is cut, after its MessageTimeout (seen on the test Slurm: exit code 233 after 12 s)
    assert settle.Settled.read(Ran(233, "", "srun: error: Task launch for StepId=1.16 failed on node node1: "
                                            "Communication connection failure")) is None
    assert settle.Settled.read(Ran(0, "HFSCALE_SETTLE\nleft=$(rm -rf /)\n", "")) == settle.Settled(None, None)


def test_settle_probes_reach_every_host_and_node0_alone_waits_for_the_port(tmp_path: Path):
    job = _job(tmp_path)
    cmds = settle.probes(job, HOSTS, "20261128-120000-abcdef-r1", 10, "/usr/bin/python3")
    assert list(cmds) == list(HOSTS)
    assert ["29500" in c.real_argv()[-1] for c in cmds.values()] == [True, False, False]
    for host, c in cmds.items():
        argv = c.real_argv()
        assert argv[0] == "ssh" and argv[-2] == host
        assert argv[-1].startswith("exec env -u HFSCALE_JOB_ID sh -c ")
        assert "HFSCALE_JOB_ID=20261128-120000-abcdef-r1" in argv[-1]
    assert settle.bound_s(10, True) == 10 + settle.LEFT_AFTER_S + settle.PORT_WAIT_S + settle.REACH_S
    assert settle.told({"node0": settle.Settled(0, "free"), "node1": None}, 10) == []
    (line,) = settle.told({"node1": settle.Settled(2, None)}, 0)
    assert line.startswith(f"processes of the stopped attempt still ran {settle.LEFT_AFTER_S} s after the stop on "
                           "node1 (2)")
