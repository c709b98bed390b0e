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
