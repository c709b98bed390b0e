"""Following a detached job's files (hfscale.launch.attempt.follow): lines as the nodes complete them, and hosts
whose heartbeat stopped changing, timed by the caller's clock."""

from __future__ import annotations

import os

from hfscale.launch.attempt.follow import Follower
from hfscale.launch.spec import Follow


def _follow(tmp_path, hosts=("a", "b")) -> Follow:
    (tmp_path / "logs").mkdir()
    (tmp_path / "alive").mkdir()
    return Follow(tuple(hosts), str(tmp_path / "logs"), str(tmp_path / "alive"), 10, 40)


def test_lines_are_relayed_whole_and_once(tmp_path):
    f = Follower(_follow(tmp_path), now=0)
    assert f.lines() == []  # no log yet: the node has not started
    log = tmp_path / "logs" / "a.log"
    log.write_bytes(b"first\nsec")
    assert f.lines() == [("a", "first")]  # the half-written line waits
    with open(log, "ab") as out:
        out.write(b"ond \xff\nHFSCALE_EXIT rc=0\n")
    (tmp_path / "logs" / "b.log").write_text("b1\n")
    assert f.lines() == [("a", "second \ufffd"), ("a", "HFSCALE_EXIT rc=0"), ("b", "b1")]
    assert f.lines() == []


def test_a_host_is_silent_once_its_counter_stops_changing(tmp_path):
    follow = _follow(tmp_path)
    f = Follower(follow, now=100)
    beat_a, beat_b = tmp_path / "alive" / "a", tmp_path / "alive" / "b"
    beat_a.write_text("1\n")
    assert f.silent(105, set()) == [] and f.ever_beat("a") and not f.ever_beat("b")
    assert f.silent(140, set()) == ["b"]  # b never beat: 40 s after following began
    beat_a.write_text("2\n")
    beat_b.write_text("1\n")
    assert f.silent(141, set()) == []  # both changed: timed again from now
    assert f.silent(180, set()) == []
    assert f.silent(181, set()) == ["a", "b"]
    assert f.silent(181, {"a", "b"}) == []  # hosts that printed their exit line are not watched


def test_hosts_come_in_the_order_their_logs_changed(tmp_path):
    """Two nodes failing within one poll: the one whose log changed first is relayed first, so
    it is the one named as failed (host order in the list says nothing)."""
    f = Follower(_follow(tmp_path), now=0)
    a, b = tmp_path / "logs" / "a.log", tmp_path / "logs" / "b.log"
    a.write_text("HFSCALE_EXIT rc=1\n")
    b.write_text("HFSCALE_EXIT rc=3\n")
    os.utime(b, ns=(1_000_000_000, 1_000_000_000))
    os.utime(a, ns=(2_000_000_000, 2_000_000_000))
    assert f.lines() == [("b", "HFSCALE_EXIT rc=3"), ("a", "HFSCALE_EXIT rc=1")]


class _Line:
    """The heartbeat line's answers (hfscale.launch.attempt.beat_server.BeatServer), as a follower asks them."""

    def __init__(self, seen: dict[str, float], closed: dict[str, float]):
        self.seen, self.shut = seen, closed

    def last_seen(self) -> dict[str, float]:
        return dict(self.seen)

    def closed(self) -> dict[str, float]:
        return dict(self.shut)


def test_on_the_line_logs_are_read_in_turn_and_an_ended_node_each_poll_until_its_exit_line(tmp_path):
    from hfscale.launch.attempt.follow import LOGS_PER_POLL

    hosts = tuple(f"n{i:04d}" for i in range(3 * LOGS_PER_POLL))
    (tmp_path / "logs").mkdir()
    for h in hosts:
        (tmp_path / "logs" / f"{h}.log").write_text(f"{h} started\n")
    line = _Line(dict.fromkeys(hosts, 0.0), {})
    f = Follower(Follow(hosts, str(tmp_path / "logs"), str(tmp_path / "alive"), 10, 30), 0.0, line)  # type: ignore[arg-type]
    first = f.lines()
    assert {h for h, _ in first} == set(hosts[:LOGS_PER_POLL])  # one turn's worth, not every log
    last = hosts[-1]
    line.shut[last] = 1.0  # its line closed: its keeper ended, its exit line follows
    assert {h for h, _ in f.lines()} == {last, *hosts[LOGS_PER_POLL:2 * LOGS_PER_POLL]}
    with open(tmp_path / "logs" / f"{last}.log", "a") as log:
        log.write("HFSCALE_EXIT rc=0\n")
    assert (last, "HFSCALE_EXIT rc=0") in f.lines()  # read again at once, not at its turn
    assert f.silent(31.0, {last}) == list(hosts[:-1]) and f.silent(31.0, set(hosts) - {last}) == [last]
