"""In-process restart's pure parts (hfscale.training.inprocess): who is which rank in the next attempt,
and the members record read back from the store as hostile input. The runs: tests/test_inprocess.py."""

from __future__ import annotations

import pytest

from hfscale.training.inprocess.assignment import (Assigned, Members, Relaunch, Replaced, assign, changes, decode,
                                                   encode, first)
from hfscale.training.inprocess.restart import Session


def test_the_first_attempt_is_the_launch_order_with_the_standbys_waiting():
    m = first(4, 2)
    assert m == Members(0, (0, 1, 2, 3), (4, 5))
    assert [m.rank_of(u) for u in range(6)] == [0, 1, 2, 3, None, None] and m.world_size == 4


def test_survivors_keep_their_ranks_and_a_spare_nodes_ranks_take_a_lost_nodes_in_order():
    # 3 nodes of 2 ranks (uids 0-5) and one spare node (uids 6, 7): node 1 (uids 2, 3) is lost
    got = assign(first(6, 2), frozenset({0, 1, 4, 5, 6, 7}), 8)
    assert got == Assigned(Members(1, (0, 1, 6, 7, 4, 5), ()), (Replaced(2, 2, 6), Replaced(3, 3, 7)))


def test_nothing_lost_is_the_same_ranks_and_the_standbys_wait_on():
    got = assign(first(2, 2), frozenset({0, 1, 2, 3}), 4)
    assert got == Assigned(Members(1, (0, 1), (2, 3)), ())


def test_a_second_failure_uses_the_standbys_left_and_the_replaced_uid_keeps_its_new_rank():
    one = assign(first(4, 4), frozenset({0, 1, 3, 4, 5, 6, 7}), 8)  # uid 2 lost: 4 takes rank 2
    assert isinstance(one, Assigned) and one.members.uids == (0, 1, 4, 3) and one.members.waiting == (5, 6, 7)
    two = assign(one.members, frozenset({0, 4, 3, 5, 6, 7}), 8)  # uid 1 lost: 5 takes rank 1
    assert isinstance(two, Assigned) and two.members == Members(2, (0, 5, 4, 3), (6, 7))
    assert two.replaced == (Replaced(1, 1, 5),) == changes(one.members, two.members)
    assert changes(first(4, 4), two.members) == (Replaced(1, 1, 5), Replaced(2, 2, 4))


def test_too_few_standbys_is_a_full_relaunch_that_names_the_lost_ranks():
    got = assign(first(4, 1), frozenset({0, 3, 4}), 5)
    assert got == Relaunch("2 rank(s) lost (rank 1, rank 2) and 1 standby rank(s) to take their place")
    many = assign(first(20, 0), frozenset({0}), 20)
    assert isinstance(many, Relaunch) and many.reason.startswith("19 rank(s) lost (rank 1, rank 2, rank 3, rank 4, "
                                                                  "rank 5, rank 6, rank 7, rank 8 and 11 more)")


def test_a_process_of_no_attempt_is_not_taken_as_a_standby():
    got = assign(first(2, 0), frozenset({0, 9}), 2)
    assert got == Relaunch("1 rank(s) lost (rank 1) and 0 standby rank(s) to take their place; 1 unknown process(es) "
                           "ignored")
    assert assign(first(2, 0), frozenset({0, 1, 9}), 2) == Assigned(Members(1, (0, 1), ()), ())


def test_a_survivor_late_for_an_attempt_is_a_standby_of_the_next():
    # uid 1 arrived after attempt 1's members were written: uid 2 took its rank, and it waits
    one = assign(first(2, 1), frozenset({0, 2}), 3)
    assert isinstance(one, Assigned) and one.members == Members(1, (0, 2), ())
    two = assign(one.members, frozenset({0, 1}), launched=3)  # uid 2 lost: the late uid 1 takes its rank
    assert two == Assigned(Members(2, (0, 1), ()), (Replaced(1, 2, 1),))
    assert assign(one.members, frozenset({0, 5}), launched=3) == Relaunch(
        "1 rank(s) lost (rank 1) and 0 standby rank(s) to take their place; 1 unknown process(es) ignored")


def test_members_go_through_the_store_and_back():
    for m in (first(3, 2), Members(7, (4, 0, 2), ()), Members(1, (0,), (1,))):
        assert decode(encode(m)) == m


@pytest.mark.parametrize("text", ["", "1;0,1", "1;0,1;2;3", "x;0;", "-1;0;", "1;;2", "1;0,0;", "1;0,1;1",
                                  "1;0,-2;", "1;0,a;", f"1;0,{1 << 20};", "1;0;" + "1" * (8 << 20)],
                         ids=lambda t: t if len(t) < 20 else f"{len(t)} characters")
def test_a_members_record_that_is_not_one_is_refused(text):
    with pytest.raises(ValueError):
        decode(text)


def test_the_first_attempt_needs_a_rank():
    with pytest.raises(ValueError):
        first(0, 1)


ENV = {"WORLD_SIZE": "6", "RANK": "5", "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "HFSCALE_INPROCESS_WORLD": "4"}


def test_the_session_is_read_from_the_launchs_environment():
    assert Session.from_env(ENV) == Session(uid=5, world_size=4, standbys=2, master_addr="node0", master_port=29500,
                                            join_s=3.0, max_restarts=10)
    s = Session.from_env({**ENV, "HFSCALE_INPROCESS_JOIN_S": "2.5", "HFSCALE_INPROCESS_RESTARTS": "3",
                          "HFSCALE_INPROCESS_TIMEOUT_S": "20"})
    assert (s.join_s, s.max_restarts, s.timeout_s) == (2.5, 3, 20.0)


@pytest.mark.parametrize("change, said", [
    ({"WORLD_SIZE": None}, "WORLD_SIZE=None: not an integer"),
    ({"WORLD_SIZE": "x"}, "WORLD_SIZE='x': not an integer"),
    ({"HFSCALE_INPROCESS_WORLD": "7"}, "HFSCALE_INPROCESS_WORLD=7: needs 1 .. 6"),
    ({"HFSCALE_INPROCESS_WORLD": "0"}, "HFSCALE_INPROCESS_WORLD=0: needs 1 .. 6"),
    ({"RANK": "6"}, "RANK=6: needs 0 .. 5"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000: needs 1 .. 65535"),
    ({"HFSCALE_INPROCESS_JOIN_S": "nan"}, "HFSCALE_INPROCESS_JOIN_S=nan: needs 0 .. 3600"),
    ({"HFSCALE_INPROCESS_RESTARTS": "-1"}, "HFSCALE_INPROCESS_RESTARTS=-1: needs 0 .. 10000"),
    ({"HFSCALE_INPROCESS_TIMEOUT_S": "0.5"}, "HFSCALE_INPROCESS_TIMEOUT_S=0.5: needs 1 .. 86400"),
])
def test_a_session_variable_out_of_its_range_is_named(change, said):
    env = {k: v for k, v in {**ENV, **change}.items() if v is not None}
    with pytest.raises(ValueError) as e:
        Session.from_env(env)
    assert str(e.value) == said


def test_a_process_its_node_started_again_says_so_in_its_session():
    assert Session.from_env(ENV).restarted == 0
    assert Session.from_env({**ENV, "HFSCALE_INPROCESS_RESTARTED": "2"}).restarted == 2
    with pytest.raises(ValueError, match="HFSCALE_INPROCESS_RESTARTED='x': not an integer"):
        Session.from_env({**ENV, "HFSCALE_INPROCESS_RESTARTED": "x"})


def test_the_node_agent_gives_each_rank_torchruns_variables_and_its_uid():
    from hfscale.training.inprocess.node_agent import _parser, rank_env

    a = _parser().parse_args(["--nproc", "4", "--node-rank", "2", "--world", "8", "--launched", "12", "--store-file",
                              "/r/inprocess.store", "--reach", "ssh", "--", "-m", "hfscale.training.train"])
    env = rank_env({"PATH": "/bin"}, a, 3, "10.0.0.1", 4567, 1)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                "MASTER_PORT", "HFSCALE_INPROCESS_WORLD", "HFSCALE_INPROCESS_RESTARTED",
                                "OMP_NUM_THREADS")} == {
        "RANK": "11", "WORLD_SIZE": "12", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "2",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4567", "HFSCALE_INPROCESS_WORLD": "8",
        "HFSCALE_INPROCESS_RESTARTED": "1", "OMP_NUM_THREADS": "1"}
    s = Session.from_env(env)  # what the rank makes of it: uid 11 of 12, a standby (8 active)
    assert (s.uid, s.world_size, s.standbys, s.restarted) == (11, 8, 4, 1)


def test_the_node_agent_finds_the_launcher_as_the_node_sees_it():
    from hfscale.training.inprocess.node_agent import store_host

    assert store_host("ssh", {"SSH_CONNECTION": "10.1.2.3 50022 10.1.2.9 22"}) == "10.1.2.3"
    assert store_host("srun", {"SLURM_LAUNCH_NODE_IPADDR": "10.1.2.4"}) == "10.1.2.4"
    assert store_host("local", {}) == "127.0.0.1"
    with pytest.raises(ValueError, match=r"--reach ssh: \$SSH_CONNECTION is not set here"):
        store_host("ssh", {})


@pytest.mark.parametrize("content, said", [
    (b"40123\n", None),
    (b"0\n", "is not a port"),
    (b"70000", "is not a port"),
    (b"12 34", "is not a port"),
    (b"x" * 100, "over the 64-byte limit"),
])
def test_the_store_port_file_is_read_as_hostile(tmp_path, content, said):
    from hfscale.training.inprocess.node_agent import store_port

    path = tmp_path / "inprocess.store"
    path.write_bytes(content)
    if said is None:
        assert store_port(str(path), 0) == 40123
        return
    with pytest.raises(ValueError, match=said):
        store_port(str(path), 0)


def test_the_store_port_file_not_written_in_time_is_named(tmp_path):
    from hfscale.training.inprocess.node_agent import store_port

    with pytest.raises(ValueError, match=r"inprocess.store: not written within 0 s \(the launch starts the store first\)"):
        store_port(str(tmp_path / "inprocess.store"), 0)
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="not a regular file|is a directory"):
        store_port(str(tmp_path / "dir"), 0)


def test_the_launch_heals_around_failed_nodes_unless_one_asks_for_a_relaunch():
    from hfscale.launch.attempt.in_process import HealedEnds
    from hfscale.launch.attempt.node_lines import Failure

    ends = HealedEnds()
    lost = Failure("node1", 3, "lost the connection to node1 over ssh")
    assert ends.heals(lost) and ends.heals(Failure("node2", 137, "node2 failed (exit code 137)"))
    assert not ends.heals(Failure("node0", 75, "node0 failed (exit code 75)"))  # its ranks asked for a relaunch
    assert [f.where for f in ends.healed] == ["node1", "node2"]
    assert ends.finished({"node0", "node3"}) and not ends.finished(set())


def test_a_standby_imports_what_a_warm_launcher_imports_before_it_forks(monkeypatch):
    """A standby started as a new interpreter waits with DeepSpeed's engine imports done too (its muon
    optimizer's torch.compile: 0.9 s of a first engine, which the survivors waited for in "data")."""
    from conftest import ROOT
    from hfscale.rules.config_file import load_job
    from hfscale.training import train, warm_launcher

    seen: list[list[str]] = []
    monkeypatch.setattr(warm_launcher, "preload", lambda modules: seen.append(modules) or [])
    train.warm_up(load_job(ROOT / "examples" / "tiny_cpu" / "config.yaml"))  # the built-in entry point, DeepSpeed ZeRO-2
    assert seen == [warm_launcher.preload_modules("trainer,deepspeed,builtin")]
    assert "deepspeed.runtime.zero.muon.muon_optimizer" in seen[0]


def test_a_user_scripts_standby_imports_what_deepspeeds_engine_imports_as_it_starts(monkeypatch):
    """hfscale.restart_in_process's standby, in a DeepSpeed job: the muon optimizer module too (its engine's start)."""
    from hfscale.training import warm_launcher
    from hfscale.training.inprocess import opt_in

    seen: list[list[str]] = []
    monkeypatch.setattr(warm_launcher, "preload", lambda modules: seen.append(modules) or [])
    monkeypatch.setenv("HFSCALE_DS_CONFIG", "ds_config.json")
    opt_in._warm_up()
    assert seen == [warm_launcher.preload_modules("deepspeed")]
    assert "deepspeed.runtime.zero.muon.muon_optimizer" in seen[0]
