"""hfscale.launch.attempt.node_lines: the job's output lines as typed events, and the hosts' state machine."""

from __future__ import annotations

import time

from hfscale.core import exitcodes
from hfscale.launch.attempt.first_failure import FirstFailure
from hfscale.launch.attempt.node_lines import Failure, NodeExit, Nodes, Output, SshEnded, parse


def test_lines_parse_into_events():
    assert parse("node1: HFSCALE_EXIT rc=3") == NodeExit("node1", 3)
    assert parse("pdsh@launcher: node1: ssh exited with exit code 255") == SshEnded("node1", 255, None)
    assert parse("pdsh@launcher: node1: ssh killed by signal 9") == SshEnded("node1", None, 9)
    assert parse("node1: loss 2.5") == Output("node1", "loss 2.5", False)
    assert parse("pdsh@launcher: node1: connect: refused") == Output("node1", "connect: refused", True)
    assert parse("no prefix here") == Output(None, "no prefix here", False)


def test_a_host_goes_silent_talking_exited_and_each_ending_has_its_failure():
    nodes = Nodes()
    assert nodes.see(parse("node0: starting")) is None and nodes.state == {"node0": "talking"}
    assert nodes.see(parse("node0: HFSCALE_EXIT rc=0")) is None and nodes.exited == {"node0"}
    # ssh's 255 after the node's own exit line is the node's code, not an unreachable host
    assert nodes.see(parse("pdsh@l: node0: ssh exited with exit code 255")) == Failure(
        "node0", 255, "node0 failed (exit code 255)")
    assert nodes.see(parse("node1: ssh: connect to host node1 port 22: Connection refused")) is None
    assert nodes.see(parse("pdsh@l: node1: ssh exited with exit code 255")) == Failure(
        "node1", exitcodes.UNREACHABLE,
        "cannot reach node1 over ssh (ssh: connect to host node1 port 22: Connection refused)")
    nodes.see(parse("node2: step 1"))
    nodes.see(parse("node2: Connection closed"))
    assert nodes.see(parse("pdsh@l: node2: ssh exited with exit code 255")).what == (
        "lost the connection to node2 over ssh (Connection closed)")
    nodes.see(parse("node5: step 1"))
    nodes.see(parse("node5: {'hfscale/straggler_ratio': 1.02}"))  # the node's own last line, then its processes killed
    assert nodes.see(parse("pdsh@l: node5: ssh exited with exit code 255")).what == (
        "the line on node5 ended with no exit code and its ssh session closed without ssh saying why: its processes "
        "were killed (kill -9, the OOM killer) or its connection dropped")
    nodes.see(parse("node6: step 1"))
    nodes.see(parse("node6: Timeout, server node6 not responding."))  # ServerAliveCountMax keep-alives missed
    assert nodes.see(parse("pdsh@l: node6: ssh exited with exit code 255")).what == (
        "lost the connection to node6 over ssh (Timeout, server node6 not responding.)")
    assert nodes.see(parse("pdsh@l: node3: ssh killed by signal 9")) == Failure(
        "node3", 137, "the ssh to node3 was killed (SIGKILL)")
    assert nodes.see(parse("node4: HFSCALE_EXIT rc=1")) == Failure("node4", 1, "node4 failed (exit code 1)")


GLOO_PEER_LOST = ("node0: [rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                  "by peer [10.78.1.2]:57018. This is typically caused by a remote worker crashing.")


def test_a_node_whose_ranks_lost_a_peer_is_marked_so():
    nodes = Nodes()
    nodes.see(parse(GLOO_PEER_LOST))
    assert nodes.see(parse("node0: HFSCALE_EXIT rc=1")) == Failure("node0", 1, "node0 failed (exit code 1)", lost_peer=True)
    assert nodes.see(parse("node1: HFSCALE_EXIT rc=1")).lost_peer is False
    nodes.see(parse("node2: torch.distributed.DistBackendError: NCCL error: remote process exited or there was a network error"))
    assert nodes.see(parse("pdsh@l: node2: ssh exited with exit code 1")).lost_peer is True


def _named(wait_s: float = 30.0):
    named: list[Failure] = []
    return named, FirstFailure(named.append, wait_s=wait_s)


def test_the_node_that_failed_first_is_named_though_its_victim_reported_first():
    """The order a loaded CI run saw: rank 1 crashed on node1, but node0 (its all_reduce broken
    by the crash) reported first. node1 is the failure, named as soon as it reports."""
    nodes, (named, first) = Nodes(), _named()
    for line in (GLOO_PEER_LOST, "node0: HFSCALE_EXIT rc=1", "pdsh@vm: node0: ssh exited with exit code 1",
                 "node1: PROBE_CRASH rank=1", "node1: HFSCALE_EXIT rc=1"):
        if (failure := nodes.see(parse(line))) is not None:
            first.offer(failure)
        assert named == [] or line == "node1: HFSCALE_EXIT rc=1", line
    assert named == [Failure("node1", 1, "node1 failed (exit code 1) (node0's ranks lost it as a peer)")]
    first.settle()
    first.offer(Failure("node2", 1, "node2 failed (exit code 1)"))
    assert len(named) == 1  # once


def test_a_node_that_only_lost_a_peer_is_named_when_no_other_fails():
    named, first = _named(wait_s=0.2)
    first.offer(Failure("node0", 1, "node0 failed (exit code 1)", lost_peer=True))
    first.offer(Failure("node1", 1, "node1 failed (exit code 1)", lost_peer=True))  # another victim: still waiting
    assert named == []
    deadline = time.monotonic() + 10
    while not named and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [f.where for f in named] == ["node0"]
    assert "its ranks lost a peer, and no other node reported a failure within 0.2 s" in named[0].what
    # every node reported before the wait ended: settle names the held one at once
    named2, first2 = _named()
    first2.offer(Failure("node3", 1, "node3 failed (exit code 1)", lost_peer=True))
    first2.settle(all_ended=True)
    assert [f.where for f in named2] == ["node3"]
    assert "its ranks lost a peer, and every node's line ended and none failed otherwise" in named2[0].what


def test_a_failure_that_is_not_a_lost_peer_is_named_at_once():
    named, first = _named()
    first.offer(Failure("node1", 3, "node1 failed (exit code 3)"))
    assert named == [Failure("node1", 3, "node1 failed (exit code 3)")]
