"""The fake multi-host cluster works, and the pdsh behaviour the launcher relies on stays true.

pdsh facts pinned here (pdsh 2.34, Debian 12, `-R ssh`):
* `%h` -> the host name as written in -w; `%n` -> the host's 0-based position in the -w list, in the
  order given (never sorted: `-w node1,node0` gives node1=0 node0=1, also for `node[1,0]` and for
  repeated -w options). Substitution happens with a single host too (`-w node0` -> `node0 0`).
  Duplicates are NOT removed (`-w node0,node0,node1` runs twice on node0, ranks 0,1,2). `%%` -> `%`.
* Exit status: without -S pdsh returns 0 even when remote commands fail or a host is unreachable;
  with -S it returns the largest remote exit status (ssh's 255 for an unreachable host or a
  remote command killed by a signal), and prints `pdsh@<local>: <host>: ssh exited with exit code N`
  on stderr for each non-zero host.
* pdsh runs `ssh -oConnectTimeout=<-t, default 10> <PDSH_SSH_ARGS_APPEND...> -2 -a -x <host> <cmd>`:
  the appended args are passed, but because ssh keeps the first value of an option, a ConnectTimeout
  in PDSH_SSH_ARGS_APPEND or in ssh_config is ignored; use `pdsh -t N`.
* An unreachable host does not stop the others: their output is printed; ssh's own error comes out
  prefixed with the host (`refused: ssh: connect to host ... port 1: Connection refused`).
* Killing pdsh (SIGTERM) does not stop the remote commands: they keep running on the hosts.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from cluster import DOWN, UP, Cluster, _try_lock, kill_node_at_once, leftover_processes, pids_in_node, run_on, start_cluster, stop_cluster

pytest_plugins = ["cluster.fixtures"]


def pdsh(cluster: Cluster, *args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        ["pdsh", *args],
        env=cluster.env() | (env or {}),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.strip())


def ranks(out: str) -> dict[str, str]:
    """'node1: node1 0' lines -> {'node1': '0'} (asserting %h was substituted by the host itself)."""
    result = {}
    for line in lines(out):
        host, h, n = line.replace(":", "").split()
        assert host == h
        result[host] = n
    return result


# ---------------------------------------------------------------- the cluster itself


def test_each_node_has_its_own_hostname(cluster2):
    for node in cluster2.nodes:
        r = run_on(cluster2, node, "hostname")
        assert (r.returncode, r.stdout.strip()) == (0, node), r.stderr


def test_nodes_resolve_and_reach_each_other(cluster2):
    probe = (
        "import socket; print(socket.gethostbyname('node0')); "
        "s = socket.create_connection(('node0', 22), timeout=5); print(s.recv(7).decode())"
    )
    r = run_on(cluster2, "node1", f"python3 -c \"{probe}\"")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [cluster2.addresses["node0"], "SSH-2.0"]


def test_nodes_have_no_route_out(cluster2):
    r = run_on(cluster2, "node0", "ip route")
    assert r.returncode == 0, r.stderr
    assert "default" not in r.stdout
    assert r.stdout.split()[0] == f"10.78.{cluster2.id}.0/24"


def test_remote_shell_is_clean(cluster2):
    r = run_on(cluster2, "node0", "true")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    r = run_on(cluster2, "node0", 'echo "$HOME"; echo "$PATH"')
    home, path = r.stdout.splitlines()
    assert home == str(cluster2.home)
    assert path.split(":")[0] == os.path.dirname(sys.executable)


def test_remote_path_finds_this_python(cluster2):
    code = "import os, sys; print(sys.prefix); print(os.path.realpath(sys.executable))"
    expected = [sys.prefix, os.path.realpath(sys.executable)]
    r = run_on(cluster2, "node1", f'python3 -c "{code}"')
    assert (r.returncode, r.stdout.splitlines()) == (0, expected), r.stderr
    r = run_on(cluster2, "node1", f'{sys.executable} -c "{code}"')  # the filesystem is shared
    assert (r.returncode, r.stdout.splitlines()) == (0, expected), r.stderr


def test_pdsh_from_the_root_namespace(cluster2):
    r = pdsh(cluster2, "-R", "ssh", "-w", "node0,node1", "hostname")
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout) == ["node0: node0", "node1: node1"]
    assert r.stderr == ""
    r = pdsh(cluster2, "-w", "node[0-1]", "hostname")  # PDSH_RCMD_TYPE=ssh from cluster.env()
    assert lines(r.stdout) == ["node0: node0", "node1: node1"], r.stderr


def test_pids_in_node_sees_what_commands_leave_behind(cluster2):
    r = run_on(cluster2, "node1", "nohup sleep 123 >/dev/null 2>&1 &")
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 5
    while True:  # the backgrounding shell and nohup go away by themselves; wait for just the sleep
        found = leftover_processes(cluster2, contains="sleep 123")
        if list(found) == ["node1"] and list(found["node1"].values()) == ["sleep 123"]:
            break
        assert time.monotonic() < deadline, found
        time.sleep(0.05)
    assert pids_in_node(cluster2, "node0") == {}
    infra = pids_in_node(cluster2, "node0", include_infra=True)
    assert any("sshd" in c for c in infra.values())
    for pid in found["node1"]:
        os.kill(pid, signal.SIGKILL)
    assert leftover_processes(cluster2, timeout=5) == {}


def test_kill_node_at_once_leaves_no_process_a_moment_to_react(cluster2, tmp_path):
    """A host that dies takes every process at once: none may run a handler as another one dies (SIGSTOP
    then SIGKILL one by one would wake a stopped process group orphaned by its parent's death with
    SIGHUP and SIGCONT). Here a job-control child traps HUP, TERM and CONT and would write a file."""
    said = tmp_path / "reacted"
    child = f"trap 'echo $$ >> {said}' HUP TERM CONT; while sleep 0.1; do :; done"
    parent = f"set -m; bash -c {shlex.quote(child)} & bash -c {shlex.quote(child)} & wait"
    r = run_on(cluster2, "node1", f"nohup bash -c {shlex.quote(parent)} >/dev/null 2>&1 &")
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 5
    while len(leftover_processes(cluster2, contains="while sleep").get("node1", {})) < 3:  # parent, 2 children
        assert time.monotonic() < deadline, leftover_processes(cluster2)
        time.sleep(0.05)
    assert kill_node_at_once(cluster2, "node1") >= 3
    assert leftover_processes(cluster2) == {}
    time.sleep(0.5)
    assert not said.exists(), said.read_text()
    assert run_on(cluster2, "node1", "hostname").stdout.strip() == "node1"  # its ssh machinery is untouched


# ---------------------------------------------------------------- pdsh facts the launcher relies on


def test_pdsh_rank_follows_w_order(cluster2):
    r = pdsh(cluster2, "-w", "node1,node0", "echo %h %n")
    assert ranks(r.stdout) == {"node1": "0", "node0": "1"}, r.stderr
    r = pdsh(cluster2, "-w", "node0,node1", "echo %h %n")
    assert ranks(r.stdout) == {"node0": "0", "node1": "1"}, r.stderr
    r = pdsh(cluster2, "-w", "node[1,0]", "echo %h %n")
    assert ranks(r.stdout) == {"node1": "0", "node0": "1"}, r.stderr
    r = pdsh(cluster2, "-w", "node1", "-w", "node0", "echo %h %n")
    assert ranks(r.stdout) == {"node1": "0", "node0": "1"}, r.stderr


def test_pdsh_substitutes_with_a_single_host(cluster2):
    r = pdsh(cluster2, "-w", "node0", "echo %h %n")
    assert (r.returncode, r.stdout) == (0, "node0: node0 0\n"), r.stderr
    r = pdsh(cluster2, "-w", "node1", "echo %n%n %%n")
    assert r.stdout == "node1: 00 %n\n", r.stderr


def test_pdsh_keeps_duplicate_hosts(cluster2):
    r = pdsh(cluster2, "-w", "node0,node0,node1", "echo %h %n")
    assert lines(r.stdout) == ["node0: node0 0", "node0: node0 1", "node1: node1 2"], r.stderr


def test_pdsh_exit_status(cluster2):
    r = pdsh(cluster2, "-S", "-w", "node0,node1", "exit 3")
    assert r.returncode == 3
    assert sorted(re.findall(r"pdsh@\S+: (node\d): ssh exited with exit code (\d+)", r.stderr)) == [
        ("node0", "3"),
        ("node1", "3"),
    ]
    # -S gives the largest status, whichever host it came from
    assert pdsh(cluster2, "-S", "-w", "node0,node1", "exit $((4-%n))").returncode == 4
    assert pdsh(cluster2, "-S", "-w", "node0,node1", "exit $((7*%n))").returncode == 7
    assert pdsh(cluster2, "-S", "-w", "node0,node1", "exit 0").returncode == 0
    # a remote command killed by a signal: ssh reports 255
    assert pdsh(cluster2, "-S", "-w", "node0,node1", "kill -9 $$").returncode == 255
    # without -S: 0 whatever happened remotely
    assert pdsh(cluster2, "-w", "node0,node1", "exit 3").returncode == 0


def test_pdsh_passes_ssh_args_append(cluster2, tmp_path):
    log = tmp_path / "argv.log"
    env = {"HFS_SSH_ARGV_LOG": str(log), "PDSH_SSH_ARGS_APPEND": "-p 22 -o ConnectTimeout=2"}
    r = pdsh(cluster2, "-S", "-w", "node0", "true", env=env)
    assert r.returncode == 0, r.stderr
    assert log.read_text() == "ssh -oConnectTimeout=10 -p 22 -o ConnectTimeout=2 -2 -a -x node0 true\n"
    # the appended args really reach ssh: a wrong port breaks the connection
    r = pdsh(cluster2, "-S", "-w", "node0", "true", env={"PDSH_SSH_ARGS_APPEND": "-p 23"})
    assert r.returncode == 255
    assert "node0: ssh: connect to host" in r.stderr and "port 23: Connection refused" in r.stderr
    # ssh keeps the first value: pdsh's own -oConnectTimeout (from -t, default 10) wins
    g = subprocess.run(
        ["ssh", "-G", "-oConnectTimeout=10", "-o", "ConnectTimeout=2", "node0", "true"],
        env=cluster2.env(), capture_output=True, text=True,
    )
    assert "connecttimeout 10" in g.stdout.splitlines()
    log.write_text("")
    pdsh(cluster2, "-t", "3", "-w", "node0", "true", env={"HFS_SSH_ARGV_LOG": str(log)})
    assert log.read_text() == "ssh -oConnectTimeout=3 -2 -a -x node0 true\n"


@pytest.fixture
def extra_hosts(cluster2):
    """Host names in the cluster's ssh config that lead nowhere."""
    net = f"10.78.{cluster2.id}"
    conf = cluster2.dir / "ssh_config.d" / "unreachable.conf"
    # refused: the bridge address in the root namespace, a port where nothing listens.
    # hole: an address with a static neighbour entry to a MAC nobody has: SYNs vanish, connect times out.
    conf.write_text(f"Host refused\n  HostName {net}.254\n  Port 1\nHost hole\n  HostName {net}.201\n  ConnectTimeout 2\n")
    br = f"hfsbr{cluster2.id}"
    subprocess.run(["ip", "neigh", "replace", f"{net}.201", "lladdr", "02:00:00:00:00:01", "dev", br, "nud", "permanent"], check=True)
    yield
    conf.unlink()
    subprocess.run(["ip", "neigh", "del", f"{net}.201", "dev", br])


def test_pdsh_with_an_unreachable_host(cluster2, extra_hosts):
    r = pdsh(cluster2, "-S", "-w", "node0,refused", "echo hi")
    assert r.returncode == 255
    assert r.stdout == "node0: hi\n"
    assert re.search(r"^refused: ssh: connect to host 10\.78\.\d+\.254 port 1: Connection refused$", r.stderr, re.M)
    assert re.search(r"^pdsh@\S+: refused: ssh exited with exit code 255$", r.stderr, re.M)
    assert pdsh(cluster2, "-w", "node0,refused", "echo hi").returncode == 0  # without -S

    t0 = time.monotonic()
    r = pdsh(cluster2, "-S", "-t", "2", "-w", "node0,hole", "echo hi")
    took = time.monotonic() - t0
    assert r.returncode == 255 and r.stdout == "node0: hi\n"
    assert re.search(r"^hole: ssh: connect to host \S+ port 22: Connection timed out$", r.stderr, re.M), r.stderr
    assert 1.5 < took < 6


def test_killing_pdsh_leaves_remote_commands_running(cluster2):
    p = subprocess.Popen(
        ["pdsh", "-w", cluster2.hostlist, "sleep 97"], env=cluster2.env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while len(leftover_processes(cluster2, contains="sleep 97")) < 2:
            assert time.monotonic() < deadline, "remote sleeps never started"
            time.sleep(0.1)
        p.terminate()
        p.wait(timeout=10)
        time.sleep(0.5)
        found = leftover_processes(cluster2, contains="sleep 97")
        assert sorted(found) == ["node0", "node1"]
    finally:
        p.kill()
        for procs in leftover_processes(cluster2, contains="sleep 97").values():
            for pid in procs:
                os.kill(pid, signal.SIGKILL)
    assert leftover_processes(cluster2, timeout=5, contains="sleep 97") == {}


# ---------------------------------------------------------------- more clusters, teardown, crash recovery


def _alive(pid: int) -> bool:
    """Running (zombies count as dead: this machine's init reaps orphans only every few seconds)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _netns_and_links(cid: int) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    pat = re.compile(rf"\b(hfs{cid}-node\d+|hfs{cid}v\d+|hfsbr{cid})\b")
    return sorted(set(pat.findall(ns + links)))


def test_clusters_of_other_sizes_coexist_and_tear_down(cluster2, make_cluster):
    c3 = make_cluster(3)
    assert c3.id != cluster2.id
    r = pdsh(c3, "-S", "-w", c3.hostlist, "echo %n $(hostname)")
    assert lines(r.stdout) == ["node0: 0 node0", "node1: 1 node1", "node2: 2 node2"], r.stderr
    assert run_on(cluster2, "node1", "hostname").stdout.strip() == "node1"  # the other one is untouched
    assert len(_netns_and_links(c3.id)) == 3 + 3 + 1
    stop_cluster(c3)
    assert _netns_and_links(c3.id) == []
    stop_cluster(c3)  # idempotent; the fixture will call it once more


def test_leftovers_of_a_crashed_run_are_cleared(tmp_path, cluster2):
    fd = _try_lock(199)
    if fd is None:
        pytest.skip("cluster ID 199 is in use by another live test run")
    os.close(fd)  # free, as after a crash
    # a "crashed" cluster: up, never torn down, its dir gone
    crashed = tmp_path / "crashed"
    up = subprocess.run([str(UP), "-d", str(crashed), "-i", "199", "-n", "2"], capture_output=True, text=True)
    assert up.returncode == 0, up.stderr
    try:
        old_pids = [int(p) for p in (crashed / "pids").read_text().split()]
        # cluster_up.sh refuses an ID in use unless told it is a leftover (-f)
        again = subprocess.run([str(UP), "-d", str(tmp_path / "other"), "-i", "199"], capture_output=True, text=True)
        assert again.returncode == 1 and "ID 199 is in use" in again.stderr
        c = start_cluster(1, tmp_path / "new", cluster_id=199)
        try:
            assert run_on(c, "node0", "hostname").stdout.strip() == "node0"
            assert not any(_alive(p) for p in old_pids)
            assert len(_netns_and_links(199)) == 1 + 1 + 1
        finally:
            stop_cluster(c)
    finally:
        subprocess.run([str(DOWN), "-i", "199"], capture_output=True)
    assert _netns_and_links(199) == []
    down = subprocess.run([str(DOWN), "-d", str(crashed)], capture_output=True, text=True)
    assert down.returncode == 0  # idempotent
