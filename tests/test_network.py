"""preflight --network's plan and judgement, on given numbers: the rounds, each host's own command,
parsing the hosts' lines, naming a slow host link or a slow pair, the matrix. The measuring itself
runs on 4 namespace hosts with a throttled veth in test_launch_cluster.py."""

from __future__ import annotations

import itertools
import json
import socket
import time

import pytest

from hfscale.launch import netcheck
from hfscale.launch.netcheck import MARK
from hfscale.launch.preflight.network import Meeting, commands, parse, render_matrix, schedule, slow_links

from conftest import job_of


@pytest.mark.parametrize("n", range(2, 17))
def test_every_pair_once_and_every_host_once_per_round(n):
    rounds = schedule(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    pairs = [frozenset(p) for r in rounds for p in r]
    assert sorted(map(sorted, pairs)) == sorted(map(sorted, map(frozenset, itertools.combinations(range(n), 2))))
    for r in rounds:
        hosts = [h for p in r for h in p]
        assert len(hosts) == len(set(hosts))


@pytest.mark.parametrize("n", [17, 18, 10_000])
def test_many_hosts_measure_a_ring(n):
    rounds = schedule(n)
    assert len(rounds) == (2 if n % 2 == 0 else 3)
    links = {frozenset(p) for r in rounds for p in r}
    assert links == {frozenset((i, (i + 1) % n)) for i in range(n)}
    for r in rounds:
        hosts = [h for p in r for h in p]
        assert len(hosts) == len(set(hosts))


def test_each_host_gets_only_its_own_rounds():
    hosts = "".join(f"\n        - {{host: n{i}, slots: 1}}" for i in range(4))
    job = job_of(f"name: n\ncluster:\n  hosts:{hosts}\nrunner: {{type: pdsh}}\nbatch: {{micro_batch_size: 1}}\n")
    cmds = commands(job, "/py", {f"n{i}": f"10.0.0.{i}" for i in range(4)}, 29601, 1000.0)
    script = cmds["n0"].real_argv()[-1]
    assert script == ("/py -m hfscale.launch.netcheck --me n0 --port 29601 --start 1000.000 --slot 2.0 --seconds 0.5 "
                      "--rounds 3 --plan 0:10.0.0.3,1:10.0.0.2,2:10.0.0.1")
    planned = sum(len(c.real_argv()[-1].split("--plan ")[1].split(",")) for c in cmds.values()
                  if not c.real_argv()[-1].endswith("--plan "))
    assert planned == 6  # each pair once, on the host that connects


def _lines(host: str, *meas: dict) -> str:
    return "noise\n" + "".join(f"{MARK} {json.dumps({'from': host, **m})}\n" for m in meas)


def test_parse_and_a_slow_host_link():
    addrs = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}
    outputs = {
        "a": _lines("a", {"to": "10.0.0.2", "rtt_us": 20, "send_gbps": 10.0, "recv_gbps": 9.0},
                    {"to": "10.0.0.3", "rtt_us": 25, "send_gbps": 11.0, "recv_gbps": 0.1}),
        "b": _lines("b", {"to": "10.0.0.3", "rtt_us": 22, "send_gbps": 12.0, "recv_gbps": 0.09}),
        "c": "",
    }
    meetings, problems = parse(outputs, addrs)
    assert problems == [] and meetings[0] == Meeting("a", "b", 20.0, 10.0, 9.0)
    assert slow_links(meetings, ["a", "b", "c"]) == [
        "c's link, sending: 0.1 Gbit/s or less to 2 of 2 peers (median 9.5 Gbit/s)"]
    text = render_matrix(meetings, ["a", "b", "c"])
    assert text.splitlines()[2].split() == ["a", "-", "10", "11"]
    assert text.splitlines()[4].split() == ["c", "0.1", "0.09", "-"]


def test_one_slow_pair_is_named_as_a_pair_and_errors_are_problems():
    hosts = ["a", "b", "c", "d"]
    fast = {"rtt_us": 20, "send_gbps": 10.0, "recv_gbps": 10.0}
    meetings = [Meeting(x, y, 20, 10.0, 10.0) for x, y in itertools.combinations(hosts, 2)]
    meetings[0] = Meeting("a", "b", 20, 1.0, 10.0)
    assert slow_links(meetings, hosts) == ["link a -> b: 1 Gbit/s (median 10 Gbit/s)"]
    meetings[1] = Meeting("a", "c", 900, 10.0, 10.0)
    assert "link a <-> c: round trip 900 us (median 20 us)" in slow_links(meetings, hosts)
    busy = [Meeting(x, y, 9, 10.0, 10.0) for x, y in itertools.combinations(hosts, 2)]
    busy[0] = Meeting("a", "b", 61, 10.0, 10.0)  # a busy host's pings (seen in CI, a healthy veth pair): not slow
    assert slow_links(busy, hosts) == []
    busy[0] = Meeting("a", "b", 260, 10.0, 10.0)
    assert slow_links(busy, hosts) == ["link a <-> b: round trip 260 us (median 9 us)"]
    _, problems = parse({"a": _lines("a", {"to": "b", "error": "connection refused"}, {"to": "c", **fast})}, {})
    assert problems == ["a could not reach b: connection refused"]


def test_the_measurement_itself_on_loopback():
    """hfscale.launch.netcheck's two sides in one process: a round trip and both rates come back."""
    with socket.socket() as probe:  # a free port: a fixed one collides with a second test session
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    netcheck.serve(port, time.time() + 10, 0.2)
    got = netcheck.measure("127.0.0.1", port, 0.2, time.time() + 3)
    assert got["rtt_us"] > 0 and got["send_gbps"] > 0 and got["recv_gbps"] > 0


def test_more_hosts_than_the_fanout_are_refused():
    from hfscale.launch.preflight.network import refusal

    hosts = "".join(f"\n        - {{host: n{i}, slots: 1}}" for i in range(5))
    job = job_of(f"name: n\ncluster:\n  hosts:{hosts}\nrunner: {{type: pdsh, fanout: 4}}\nbatch: {{micro_batch_size: 1}}\n")
    assert refusal(job).startswith("--network measures at most runner.fanout (4) hosts at once")
    assert refusal(job_of("name: n\nbatch: {micro_batch_size: 1}\n")) == "--network needs at least 2 hosts"
