"""hfscale launch on a real multi-host cluster: network namespaces, one sshd each, real pdsh.

Uses the ``cluster2`` / ``make_cluster`` / ``podman2`` fixtures (tests/cluster): they skip with the
reason when this machine cannot make namespaces (not root) or run containers (podman missing), and
fail instead under CI=true.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cluster import cmdline, leftover_processes, pids_in_node
from conftest import ROOT, read_until
from hfscale.launch.node.stopping import STOP_GRACE_S

PROBE = str(ROOT / "tests" / "scripts" / "dist_probe.py")
pytestmark = pytest.mark.slow


def node_env() -> dict[str, str]:
    # what every rank needs on this CPU-only machine; TORCH_EXTENSIONS_DIR is on the shared filesystem
    return {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"],
            "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def write_config(tmp_path: Path, hosts: list[str], *, slots: int = 1, port: int, launcher: str = "torchrun",
                 script: str = PROBE, script_args: list[str] | None = None, env: dict | None = None,
                 extra: dict | None = None) -> Path:
    cfg = {
        "name": "cl",
        "cluster": {"hosts": [{"host": h, "slots": slots} for h in hosts], "master_port": port},
        "runner": {"type": "pdsh", "launcher": launcher, "run_dir": str(tmp_path / "runs"), "connect_timeout": 5},
        "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}},
        "precision": "no",
        "batch": {"micro_batch_size": 2},
        "env": {"vars": {**node_env(), **(env or {})}},
        # the probe and the accelerate loop are plain scripts, not HfArgumentParser ones
        "training": {"script": script, "script_args": script_args or [], "pass_args": "none"},
    }
    for key, value in (extra or {}).items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def launch(cluster, config: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config), *args], cwd=ROOT,
                          env=cluster.env(), capture_output=True, text=True, timeout=timeout)


def ready_lines(text: str) -> list[dict]:
    return [json.loads(line.split("PROBE_READY ", 1)[1]) for line in text.splitlines() if "PROBE_READY " in line]


def launch_until_ready(cluster, config: Path, ranks: int) -> tuple[subprocess.Popen, list[str]]:
    """Start ``hfscale launch`` and read its output until ``ranks`` PROBE_READY lines were seen."""
    proc = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=ROOT, env=cluster.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, read_until(proc, "PROBE_READY", ranks)


def _children(pid: int) -> list[int]:
    # pdsh starts each ssh from one of its threads: every thread's children
    return [int(p) for task in Path(f"/proc/{pid}/task").iterdir() for p in (task / "children").read_text().split()]


def run_dir_of(tmp_path: Path) -> Path:
    (d,) = list((tmp_path / "runs").iterdir())
    return d


def test_two_node_deepspeed_training_with_accelerate(cluster2, tmp_path):
    """A real 2-node ZeRO-2 training (tiny GPT-2, gloo on CPU) through pdsh and accelerate launch."""
    model = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "n_positions": 64,
             "bos_token_id": 0, "eos_token_id": 0}
    config = tmp_path / "job.yaml"
    cfg_path = write_config(tmp_path, cluster2.nodes, port=29611, launcher="accelerate",
                            script=str(ROOT / "examples" / "accelerate_loop" / "train.py"),
                            script_args=["--config", str(config), "--max-steps", "4"],
                            extra={"training": {"model": {"config": model}, "data": {"block_size": 32}}})
    assert cfg_path == config
    r = launch(cluster2, config)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    ranks = [line for line in r.stdout.splitlines() if "HFSCALE_RANK " in line]
    assert sorted(line.split(": ", 1)[0] for line in ranks) == ["node0", "node1"]
    for line in ranks:
        fields = dict(kv.split("=", 1) for kv in line.split("HFSCALE_RANK ", 1)[1].split())
        assert fields["world_size"] == "2" and fields["steps"] == "4" and fields["zero_stage"] == "2"
    run_dir = run_dir_of(tmp_path)
    for i, node in enumerate(cluster2.nodes):
        log = (run_dir / "logs" / f"{node}.log").read_text()
        assert f"HFSCALE_RANK rank={i} world_size=2" in log
        assert "HFSCALE_EXIT rc=0" in log
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".deepspeed_env", "accelerate_config.yaml", "alive", "cleanup.json", "config.yaml", "ds_config.json", "env.sh",
        "hostfile", "launcher.beat", "logs", "nodes.sh", "orphaned", "pdsh_hosts", "plan.txt", "progress", "stacks",
        "state.json"]
    assert sorted(p.name for p in (run_dir / "alive").iterdir()) == ["node0", "node1"]  # the keepers beat
    assert list((run_dir / "orphaned").iterdir()) == []  # and stopped nothing
    # the plain loop's one line for the hang watchdog: each rank's last step
    assert {p.name: p.read_text().split()[0] for p in (run_dir / "progress").glob("rank-*")} == {
        "rank-0": "4", "rank-1": "4"}
    # and rank 0's numbers for the progress line and hfscale runs (reported at step 1 of 4)
    metrics = json.loads((run_dir / "progress" / "metrics.json").read_text())
    assert metrics["step"] == 1 and metrics["max_steps"] == 4 and metrics["loss"] > 0
    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished"
    for secret_file in ("env.sh", "nodes.sh", "cleanup.json"):
        assert (run_dir / secret_file).stat().st_mode & 0o777 == 0o600
    assert leftover_processes(cluster2, timeout=5) == {}


def test_two_node_trainer_script_gets_the_yaml_through_pdsh(cluster2, tmp_path):
    """An unchanged HfArgumentParser script on 2 nodes (torchrun launcher): each remote rank gets the
    YAML's TrainingArguments flags, --deepspeed and --use_cpu, and trains ZeRO-2 across the nodes."""
    model = "n_layer=2,n_head=2,n_embd=32,vocab_size=256,n_positions=64,bos_token_id=0,eos_token_id=0"
    report = tmp_path / "report.json"
    config = write_config(tmp_path, cluster2.nodes, port=29618, launcher="torchrun",
                          script=str(ROOT / "tests" / "scripts" / "hf_clm.py"),
                          script_args=["--config_overrides", model, "--block_size", "32", "--report_file", str(report),
                                       "--disable_tqdm", "true"],
                          extra={"training": {"pass_args": "trainer", "output_dir": str(tmp_path / "out"),
                                              "max_steps": 6, "save_steps": 6, "logging_steps": 3}})
    r = launch(cluster2, config)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    seen = json.loads(report.read_text())
    run_dir = run_dir_of(tmp_path)
    assert (seen["world_size"], seen["deepspeed_enabled"], seen["zero_stage"], seen["global_step"]) == (2, True, 2, 6)
    assert seen["args"]["deepspeed"] == str(run_dir / "ds_config.json") and seen["args"]["use_cpu"] is True
    assert (seen["args"]["per_device_train_batch_size"], seen["args"]["max_steps"]) == (2, 6)
    shards = tmp_path / "out" / "checkpoint-6" / "global_step6"
    assert sorted(p.name for p in shards.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert leftover_processes(cluster2, timeout=5) == {}


def test_ranks_follow_the_host_list_and_values_arrive_verbatim(cluster2, tmp_path):
    """node1 listed first gets rank 0; shell metacharacters in values and args execute nothing."""
    marker = tmp_path / "PWNED"
    evil_value = f"$(touch {marker}) `touch {marker}` ; touch {marker} 100%h"
    evil_args = [f"; touch {marker}", f"$(touch {marker})", f"`touch {marker}`", "64(x2)", "{\"j\": 1}",
                 "$$ ${local_rank} $HOME"]
    config = write_config(tmp_path, ["node1", "node0"], port=29612, script_args=["--mode", "ok", *evil_args],
                          env={"PROBE_VALUE": evil_value})
    r = launch(cluster2, config)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    ready = sorted(ready_lines(r.stdout), key=lambda d: d["rank"])
    assert [(d["rank"], d["host"], d["node_rank"]) for d in ready] == [(0, "node1", "0"), (1, "node0", "1")]
    for d in ready:
        assert d["value"] == evil_value
        assert d["argv"] == evil_args
    assert not marker.exists()


def test_a_crashing_rank_stops_every_node(cluster2, tmp_path):
    config = write_config(tmp_path, cluster2.nodes, port=29613, script_args=["--mode", "crash", "--rank", "1"])
    t0 = time.monotonic()
    r = launch(cluster2, config, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode != 0
    assert "PROBE_CRASH rank=1" in r.stdout
    assert "hfscale: node1 failed" in r.stdout
    assert leftover_processes(cluster2, timeout=10) == {}, "a rank was left running"
    assert took < 60, f"the surviving rank blocked in all_reduce should be killed promptly, took {took:.0f}s"
    log0 = (run_dir_of(tmp_path) / "logs" / "node0.log").read_text()
    assert "PROBE_READY" in log0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_stops_every_node(cluster2, tmp_path, sig):
    """Ctrl-C, a scheduler's TERM, a closed terminal: every node's ranks end, the one on node1 that
    ignores those signals (SIGHUP case) by the stop's KILL pass after the grace period."""
    port = {signal.SIGINT: 29614, signal.SIGTERM: 29618, signal.SIGHUP: 29619}[sig]
    mode = ["--mode", "stubborn", "--rank", "1"] if sig == signal.SIGHUP else ["--mode", "hang"]
    config = write_config(tmp_path, cluster2.nodes, port=port, script_args=mode)
    proc, seen = launch_until_ready(cluster2, config, ranks=2)
    assert leftover_processes(cluster2, contains="dist_probe") != {}  # the job really runs on the nodes
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 128 + sig, "".join(seen) + out
    assert f"got {sig.name}; stopping the job on every node" in out
    # hfscale returns once main's processes ended; the KILL pass on the nodes may still be due
    assert leftover_processes(cluster2, timeout=STOP_GRACE_S + 3) == {}, out
    assert time.monotonic() - t0 < STOP_GRACE_S + 8, f"stop took {took:.1f}s"


def test_pdsh_killed_under_hfscale_stops_every_node(cluster2, tmp_path):
    """pdsh SIGKILLed by someone else: its ssh sessions die with it, the ranks would live on; hfscale
    notices and runs the stop on every node."""
    config = write_config(tmp_path, cluster2.nodes, port=29620, script_args=["--mode", "hang"])
    proc, seen = launch_until_ready(cluster2, config, ranks=2)
    (pdsh,) = [p for p in _children(proc.pid) if (cmdline(p) or "").startswith("pdsh")]
    os.kill(pdsh, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, "".join(seen) + out
    assert "hfscale: pdsh was killed (SIGKILL); stopping the job on every node" in out
    assert leftover_processes(cluster2, timeout=STOP_GRACE_S + 3) == {}, out


def test_a_killed_ssh_session_stops_every_node(cluster2, tmp_path):
    """One node's ssh killed (pdsh reports 'ssh killed by signal 9'): that node counts as failed."""
    config = write_config(tmp_path, cluster2.nodes, port=29621, script_args=["--mode", "hang"])
    proc, seen = launch_until_ready(cluster2, config, ranks=2)
    (pdsh,) = [p for p in _children(proc.pid) if (cmdline(p) or "").startswith("pdsh")]
    sessions = {p: (cmdline(p) or "").split() for p in _children(pdsh)}
    to_node1 = [p for p, argv in sessions.items() if os.path.basename(argv[0]) == "ssh" and "node1" in argv]
    assert len(to_node1) == 1, sessions
    os.kill(to_node1[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, "".join(seen) + out
    assert "hfscale: the ssh to node1 was killed (SIGKILL); stopping the job on every node" in out
    assert leftover_processes(cluster2, timeout=STOP_GRACE_S + 3) == {}, out


SETUP_LOOP = "echo SETUP_RUNNING; for i in 1 2 3 4 5 6 7 8 9 10 11 12; do sleep 5; done"


def test_a_signal_during_runner_setup_stops_it_on_every_node(cluster2, tmp_path):
    """runner.setup (a pip install, a data copy) runs before the launcher: a stop must end it too."""
    config = write_config(tmp_path, cluster2.nodes, port=29622, extra={"runner": {"setup": SETUP_LOOP}})
    proc = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=ROOT, env=cluster2.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = read_until(proc, "SETUP_RUNNING", 2)
    assert leftover_processes(cluster2, contains="sleep 5") != {}
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + out
    assert "PROBE_READY" not in out
    assert leftover_processes(cluster2, timeout=STOP_GRACE_S + 3) == {}, out


def test_a_node_failing_in_setup_stops_the_others_setup(cluster2, tmp_path):
    setup = f'if [ "$(hostname)" = node0 ]; then sleep 2; exit 7; fi; {SETUP_LOOP}'
    config = write_config(tmp_path, cluster2.nodes, port=29623, extra={"runner": {"setup": setup}})
    t0 = time.monotonic()
    r = launch(cluster2, config, timeout=120)
    assert r.returncode == 7, r.stdout + r.stderr
    assert "hfscale: node0 failed (exit code 7); stopping the job on every node" in r.stdout
    assert "node1: SETUP_RUNNING" in r.stdout and "PROBE_READY" not in r.stdout
    assert leftover_processes(cluster2, timeout=STOP_GRACE_S + 3) == {}, r.stdout
    assert time.monotonic() - t0 < 40, "node1's 60 s setup was not cut short"


def test_a_lost_node_is_noticed_within_a_minute(make_cluster, tmp_path):
    """node1's link goes down mid-run (a dead switch port, a kernel panic): no process says anything,
    node0's rank blocks in all_reduce. ssh's keep-alives end node1's session, hfscale names the host,
    exits 3 and stops node0."""
    cluster = make_cluster(2)
    config = write_config(tmp_path, cluster.nodes, port=29624, script_args=["--mode", "hang"])
    proc, seen = launch_until_ready(cluster, config, ranks=2)
    link = f"hfs{cluster.id}v1"  # node1's veth end on the bridge
    subprocess.run(["ip", "link", "set", link, "down"], check=True)
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    assert proc.returncode == 3, "".join(seen) + out
    # this test bed's ssh says nothing of the lost server (LogLevel ERROR, as many sites set), so the line
    # is told as it is seen: no exit line, no reason from ssh (with ssh's own words it is "lost the
    # connection to node1 over ssh (Timeout, server node1 not responding.)": tests/test_node_lines.py)
    assert ("hfscale: the line on node1 ended with no exit code and its ssh session closed without ssh saying why: "
            "its processes were killed (kill -9, the OOM killer) or its connection dropped") in out, out
    print(f"lost node noticed after {took:.1f}s")
    assert took < 60, f"the lost node was noticed after {took:.0f}s"
    assert leftover_processes(cluster, timeout=STOP_GRACE_S + 3, but=cluster.nodes[1:]) == {}, "node0's rank was left"


def test_unrelated_processes_survive_cleanup(cluster2, tmp_path):
    """Cleanup matches this job's id only: a python process of another job on the node lives on."""
    other = subprocess.Popen(["ip", "netns", "exec", cluster2.netns("node0"), sys.executable, "-c",
                              "import time; time.sleep(300)  # dist_probe.py bystander"],
                             env={**os.environ, "HFSCALE_JOB_ID": "some-other-job"})
    try:
        config = write_config(tmp_path, cluster2.nodes, port=29615, script_args=["--mode", "crash", "--rank", "0"])
        r = launch(cluster2, config, timeout=120)
        assert r.returncode != 0
        time.sleep(STOP_GRACE_S + 2)  # the stop's KILL pass comes up to STOP_GRACE_S after TERM
        assert other.poll() is None, "cleanup killed a process of another job"
    finally:
        other.kill()
        other.wait()


def test_unreachable_host_fails_fast_naming_it(cluster2, tmp_path):
    conf = cluster2.dir / "ssh_config.d" / "ghost.conf"
    conf.write_text(f"Host ghost\n  HostName {cluster2.bridge_address}\n  Port 1\n")
    try:
        config = write_config(tmp_path, ["node0", "ghost"], port=29616)
        t0 = time.monotonic()
        r = launch(cluster2, config, timeout=60)
        # no separate ssh round first: the fan-out itself finds ghost unreachable and stops node0's rank
        assert r.returncode == 3, r.stdout + r.stderr
        assert "hfscale: cannot reach ghost over ssh (ssh: connect to host" in r.stdout
        assert "node0" not in r.stdout.split("cannot reach", 1)[1].split("\n", 1)[0]
        assert time.monotonic() - t0 < 30
        assert leftover_processes(cluster2, timeout=5) == {}
        pf = subprocess.run([sys.executable, "-m", "hfscale", "preflight", str(config)], cwd=ROOT,
                            env=cluster2.env(), capture_output=True, text=True, timeout=60)
        assert pf.returncode == 3
        assert "ghost: unreachable: ssh: connect to host" in pf.stdout
        assert "preflight failed on: ghost" in pf.stderr
    finally:
        conf.unlink()


def test_preflight_on_the_cluster(cluster2, tmp_path):
    config = write_config(tmp_path, cluster2.nodes, port=29617)
    r = subprocess.run([sys.executable, "-m", "hfscale", "preflight", str(config)], cwd=ROOT, env=cluster2.env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[1:3]]
    import torch

    assert [row[0] for row in rows] == cluster2.nodes
    assert all(row[2] == torch.__version__ and row[-1] == "ok" for row in rows)


def test_a_stuck_rank_on_another_host_is_named(cluster2, tmp_path):
    """The hang watchdog across 2 hosts: rank 1 on node1 sleeps outside any collective, rank 0 on
    node0 waits in all_reduce; py-spy runs on each node over pdsh; exit 4, nothing left."""
    config = write_config(tmp_path, cluster2.nodes, port=29630, script_args=["--mode", "stall", "--step", "3"],
                          extra={"watchdog": {"timeout": 5}})
    t0 = time.monotonic()
    r = launch(cluster2, config, timeout=180)
    took = time.monotonic() - t0
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("hfscale: hang: "))
    assert "rank 1 on node1 stuck at step 2 in stuck_here (dist_probe.py:" in line, line
    report = (run_dir_of(tmp_path) / "hang-report.txt").read_text()
    rank1 = report.split("--- rank 1\n", 1)[1]
    assert "stuck_here" in rank1 and "node0" in report.splitlines()[4]
    print(f"2 hosts: hang found and the job stopped {took:.1f} s after the launch")
    assert leftover_processes(cluster2, timeout=STOP_GRACE_S + 3) == {}, r.stdout


# ---- more hosts than runner.fanout: the nodes run detached, hfscale follows the run directory ----


def detached_config(tmp_path: Path, hosts: list[str], fanout: int, **kw) -> Path:
    extra = kw.pop("extra", {})
    return write_config(tmp_path, hosts, **kw, extra={**extra, "runner": {**extra.get("runner", {}), "fanout": fanout}})


def test_detached_launch_trains_and_relays_every_node(cluster2, tmp_path):
    config = detached_config(tmp_path, cluster2.nodes, 1, port=29625, script_args=["--mode", "ok"])
    r = launch(cluster2, config, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = run_dir_of(tmp_path)
    assert " -f 1 " in (run_dir / "plan.txt").read_text()
    for i, node in enumerate(cluster2.nodes):
        assert f"{node}: PROBE_DONE rank={i}" in r.stdout  # relayed from the node's own log
        log = (run_dir / "logs" / f"{node}.log").read_text()
        assert f"PROBE_DONE rank={i}" in log and log.rstrip().endswith("HFSCALE_EXIT rc=0")
        assert (run_dir / "alive" / node).read_text().strip().isdigit()
    assert leftover_processes(cluster2, timeout=STOP_GRACE_S + 3) == {}


def test_detached_crash_stops_every_node(cluster2, tmp_path):
    config = detached_config(tmp_path, cluster2.nodes, 1, port=29626, script_args=["--mode", "crash", "--rank", "1"])
    r = launch(cluster2, config, timeout=120)
    assert r.returncode not in (0, 3), r.stdout + r.stderr
    assert "node1: PROBE_CRASH rank=1" in r.stdout and "hfscale: node1 failed" in r.stdout
    assert leftover_processes(cluster2, timeout=STOP_GRACE_S + 3) == {}, r.stdout


def test_detached_sigterm_stops_every_node(cluster2, tmp_path):
    config = detached_config(tmp_path, cluster2.nodes, 1, port=29627, script_args=["--mode", "stubborn", "--rank", "0"])
    proc, seen = launch_until_ready(cluster2, config, ranks=2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + out
    assert leftover_processes(cluster2, timeout=STOP_GRACE_S + 3) == {}, out


def test_detached_dead_node_is_noticed_by_its_heartbeat(make_cluster, tmp_path):
    """Every process of node1 frozen at once (a hung kernel: its connections stay open, nothing is
    reset, node0's rank waits in all_reduce): no exit line, no more heartbeats; within a minute
    hfscale names node1, exits 3 and stops node0."""
    cluster = make_cluster(2)
    config = detached_config(tmp_path, cluster.nodes, 1, port=29628, script_args=["--mode", "hang"])
    proc, seen = launch_until_ready(cluster, config, ranks=2)
    t0 = time.monotonic()
    for pid in pids_in_node(cluster, "node1", include_infra=True):
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    print(f"dead node noticed after {took:.1f}s")
    assert proc.returncode == 3, "".join(seen) + out
    assert "hfscale: lost node1: no heartbeat for 40 s; stopping the job on every node" in out
    assert took < 60
    assert leftover_processes(cluster, timeout=STOP_GRACE_S + 3, but=cluster.nodes[1:]) == {}, out


def test_stop_of_a_died_detached_launch_stops_every_node(make_cluster, tmp_path):
    """The launcher killed -9 (out of memory on the login node): the detached nodes train on, and
    the run shows as died; ``hfscale stop`` runs the cleanup the launch recorded, over pdsh, and
    nothing of the job is left on any node."""
    cluster = make_cluster(2)
    config = detached_config(tmp_path, cluster.nodes, 1, port=29627, script_args=["--mode", "hang"])
    proc, seen = launch_until_ready(cluster, config, ranks=2)
    proc.kill()
    proc.communicate(timeout=30)
    run_dir = run_dir_of(tmp_path)
    time.sleep(1)
    assert set(leftover_processes(cluster)) == set(cluster.nodes), "".join(seen)  # the ranks live on
    r = subprocess.run([sys.executable, "-m", "hfscale", "stop", str(run_dir)], cwd=ROOT, env=cluster.env(),
                       capture_output=True, text=True, timeout=STOP_GRACE_S + 60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "died; running the recorded cleanup (pdsh) on every host" in r.stdout
    assert leftover_processes(cluster, timeout=5) == {}
    assert json.loads((run_dir / "state.json").read_text())["state"] == "stopped"


def test_eight_hosts_attached_and_detached(make_cluster, tmp_path):
    """8 namespace hosts, the launcher replaced by a stand-in (8 torch imports would not fit 2
    cores): attached (fanout 256) and detached 3 at a time, every host gets its own rank."""
    cluster = make_cluster(8)
    standin = tmp_path / "python"
    standin.write_text('#!/bin/sh\ncase "$*" in *hfscale.launch.node.health_gate*) exit 0 ;; esac\n'  # passes the gate
                       'echo "STANDIN rank=$HFSCALE_NODE_RANK host=$(hostname)"\n')
    standin.chmod(0o755)
    for fanout in (256, 3):
        work = tmp_path / f"fanout{fanout}"
        work.mkdir()
        config = detached_config(work, cluster.nodes, fanout, port=29629,
                                 extra={"runner": {"python": str(standin)}})
        r = launch(cluster, config, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        said = sorted(line.split(": ", 1)[1] for line in r.stdout.splitlines() if "STANDIN" in line)
        assert said == sorted(f"STANDIN rank={i} host=node{i}" for i in range(8)), r.stdout
        plan = (run_dir_of(work) / "plan.txt").read_text()
        assert f" -f {min(fanout, 8)} " in plan and ("then follow" in plan) == (fanout < 8)
    assert leftover_processes(cluster, timeout=5) == {}


# ---- pdsh_docker: the same fan-out, each node's launcher inside a real container ----------------
# podman stands in for docker (no docker engine runs here): tests/cluster/containers.py


def docker_section(podman, tmp_path: Path) -> dict:
    return {"image": podman.image, "binary": str(podman.binary), "gpus": None,
            "python": sys.executable,
            "mounts": podman.host_mounts(writable=(ROOT, tmp_path, os.environ["TORCH_EXTENSIONS_DIR"])),
            # podman's default rlimits fail on this host (tests/cluster/containers.py)
            "extra_args": ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]}


def write_docker_config(podman, tmp_path: Path, hosts: list[str] | None, **kw) -> Path:
    runner = {"type": "pdsh_docker", "docker": docker_section(podman, tmp_path)}
    extra = {"runner": runner, **kw.pop("extra", {})}
    config = write_config(tmp_path, hosts or [], **kw, extra=extra)
    if hosts is None:  # one local node, no pdsh
        doc = yaml.safe_load(config.read_text())
        doc["cluster"] = {"nproc_per_node": 2, "master_port": kw["port"]}
        config.write_text(yaml.safe_dump(doc, sort_keys=False))
    return config


def containers_left(podman, cluster) -> dict[str, list[str]]:
    return {n: names for n in cluster.nodes if (names := podman.containers(cluster, n))}


def test_two_node_deepspeed_training_in_containers(podman2, cluster2, tmp_path):
    """pdsh_docker for real: a 2-node ZeRO-2 training, each node's launcher in its own container."""
    model = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "n_positions": 64,
             "bos_token_id": 0, "eos_token_id": 0}
    config = tmp_path / "job.yaml"
    # the interpreter's ninja first, as on the hosts: the image's PATH finds the system's, which hashes DeepSpeed's
    # JIT build otherwise and rebuilt the shared op twice per .ci/run (here, then the next ZeRO test; conftest.same_ninja)
    path = f"{os.path.dirname(sys.executable)}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    write_docker_config(podman2, tmp_path, cluster2.nodes, port=29631, launcher="accelerate",
                        script=str(ROOT / "examples" / "accelerate_loop" / "train.py"),
                        script_args=["--config", str(config), "--max-steps", "4"], env={"PATH": path},
                        extra={"training": {"model": {"config": model}, "data": {"block_size": 32}}})
    r = launch(cluster2, config)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    ranks = sorted(line for line in r.stdout.splitlines() if "HFSCALE_RANK " in line)
    assert [line.split(": ", 1)[0] for line in ranks] == ["node0", "node1"]
    for line in ranks:
        fields = dict(kv.split("=", 1) for kv in line.split("HFSCALE_RANK ", 1)[1].split())
        assert fields["world_size"] == "2" and fields["steps"] == "4" and fields["zero_stage"] == "2"
    plan = (run_dir_of(tmp_path) / "plan.txt").read_text()
    assert f"{podman2.binary} run --rm --name hfscale-" in plan
    assert containers_left(podman2, cluster2) == {}  # --rm
    assert leftover_processes(cluster2, timeout=5) == {}


def test_containers_get_env_args_and_mounts_verbatim(podman2, cluster2, tmp_path):
    """Inside the containers: ranks follow the host list, values with shell metacharacters arrive
    unchanged through ``-e NAME`` (never on docker's argv), read-only mounts are read-only."""
    marker = tmp_path / "PWNED"
    evil_value = f"$(touch {marker}) `touch {marker}` ; touch {marker} 100%h"
    evil_args = [f"; touch {marker}", f"$(touch {marker})", "64(x2)", "{\"j\": 1}", "$$ ${local_rank}"]
    config = write_docker_config(podman2, tmp_path, ["node1", "node0"], port=29632,
                                 script_args=["--mode", "ok", *evil_args], env={"PROBE_VALUE": evil_value})
    r = launch(cluster2, config)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    ready = sorted(ready_lines(r.stdout), key=lambda d: d["rank"])
    assert [(d["rank"], d["host"], d["container"]) for d in ready] == [(0, "node1", True), (1, "node0", True)]
    assert all(d["value"] == evil_value and d["argv"] == evil_args for d in ready)
    assert [d["prefix_writable"] for d in ready] == [False, False]  # mounted readonly: true
    assert not marker.exists()
    plan = (run_dir_of(tmp_path) / "plan.txt").read_text()
    docker_lines = [line for line in plan.splitlines() if line.startswith(("  [0] node1: ", "  [1] node0: "))]
    assert len(docker_lines) == 2
    assert all(" -e PROBE_VALUE " in line and "touch" not in line.split(podman2.image)[0] for line in docker_lines)


def test_a_crashing_rank_in_a_container_stops_every_container(podman2, cluster2, tmp_path):
    config = write_docker_config(podman2, tmp_path, cluster2.nodes, port=29633,
                                 script_args=["--mode", "crash", "--rank", "1"])
    r = launch(cluster2, config, timeout=120)
    assert r.returncode != 0
    assert "PROBE_CRASH rank=1" in r.stdout and "hfscale: node1 failed" in r.stdout
    assert containers_left(podman2, cluster2) == {}, "a container was left on a node"
    assert leftover_processes(cluster2, timeout=10) == {}, "a rank was left running"


def test_ctrl_c_removes_the_containers_on_every_node(podman2, cluster2, tmp_path):
    config = write_docker_config(podman2, tmp_path, cluster2.nodes, port=29634, script_args=["--mode", "hang"])
    proc, seen = launch_until_ready(cluster2, config, ranks=2)
    running = {n: podman2.containers(cluster2, n) for n in cluster2.nodes}
    assert all(len(names) == 1 and names[0].startswith("hfscale-") for names in running.values()), running
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, "".join(seen) + out
    assert containers_left(podman2, cluster2) == {}
    assert leftover_processes(cluster2, timeout=10) == {}


def test_one_local_node_runs_its_container_without_pdsh(podman2, cluster2, tmp_path):
    config = write_docker_config(podman2, tmp_path, None, port=29635, script_args=["--mode", "ok"])
    r = launch(cluster2, config, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    ready = sorted(ready_lines(r.stdout), key=lambda d: d["rank"])
    assert [(d["rank"], d["world"], d["container"]) for d in ready] == [(0, 2, True), (1, 2, True)]
    plan = (run_dir_of(tmp_path) / "plan.txt").read_text()
    assert f"\n  [0] local: {podman2.binary} run --rm --name hfscale-" in plan
    assert "pdsh -R ssh" not in plan


# ---- preflight --network: the bandwidth matrix names a throttled link -----------------------------


def _preflight_network(cluster, config: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "hfscale", "preflight", str(config), "--network"], cwd=ROOT,
                       env=cluster.env(), capture_output=True, text=True, timeout=120)
    return r, time.monotonic() - t0


def test_preflight_network_names_the_throttled_link(make_cluster, tmp_path):
    """4 namespace hosts, every pair measured over eth0 (NCCL_SOCKET_IFNAME); then node2's veth is
    throttled to 100 Mbit/s with tc tbf (its sending side): the check names node2's link, and only it."""
    from cluster import run_on

    cluster = make_cluster(4)
    config = write_config(tmp_path, cluster.nodes, port=29660, extra={"network": {"env": {"NCCL_SOCKET_IFNAME": "eth0"}}})
    r, took = _preflight_network(cluster, config)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "network ok: 6 host pairs measured" in r.stdout and "slow:" not in r.stdout
    assert "Gbit/s, row sends to column:" in r.stdout
    tbf = run_on(cluster, "node2", "tc qdisc add dev eth0 root tbf rate 100mbit burst 64kb latency 50ms", check=True)
    assert tbf.returncode == 0
    try:
        r, took = _preflight_network(cluster, config)
    finally:
        run_on(cluster, "node2", "tc qdisc del dev eth0 root")
    print(r.stdout)
    print(f"preflight --network on 4 hosts with the throttled link: {took:.1f} s")
    assert r.returncode == 3, r.stdout + r.stderr
    slow = [line for line in r.stdout.splitlines() if line.startswith("slow: ")]
    assert len(slow) == 1 and slow[0].startswith("slow: node2's link, sending: "), r.stdout
    assert "network check failed" in r.stdout
    assert took < 60
