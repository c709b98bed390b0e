"""hfscale.launch.node_lines: the job's output lines as typed events, and the hosts' state machine."""

from __future__ import annotations

from hfscale.core import exitcodes
from hfscale.launch.node_lines import Failure, NodeExit, Nodes, Output, SshEnded, parse


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
    assert nodes.see(parse("pdsh@l: node3: ssh killed by signal 9")) == Failure(
        "node3", 137, "the ssh to node3 was killed (SIGKILL)")
    assert nodes.see(parse("node4: HFSCALE_EXIT rc=1")) == Failure("node4", 1, "node4 failed (exit code 1)")
