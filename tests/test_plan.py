"""Launch plans as data: exact commands for every runner, quoting, secrets masked."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfscale.core.shell import Command, Line, Sh, render
from hfscale.launch.build import build_plan
from hfscale.launch.context import LaunchContext
from hfscale.launch.node.command import Rendezvous, launcher_argv
from hfscale.launch.node.keeper import LOCAL_REACH, keeper_line, keeper_of
from hfscale.launch.node.stopping import dump_script, stop_script
from hfscale.launch.spec import Follow, Keeper, HangWatch

from conftest import job_of, job_pids

CTX = LaunchContext.of("/work", "/opt/py/bin/python", "20261122-120000-abcdef", {
    "WANDB_API_KEY": "wk-secret", "WANDB_PROJECT": "proj", "HOME": "/root", "HF_TOKEN": "hf_secret"})
RUN = "/work/runs/demo-20261122-120000-abcdef"


LOCAL = """
    name: demo
    cluster: {nproc_per_node: 2}
    batch: {micro_batch_size: 1}
    training: {pass_args: none, script: train.py, script_args: [--epochs, "2"]}
"""


def test_local_accelerate_plan_exact():
    plan = build_plan(job_of(LOCAL), CTX)
    launcher = (f"/opt/py/bin/python -m hfscale.training.warm_launcher --preload accelerate,deepspeed accelerate.commands.launch --config_file {RUN}/accelerate_config.yaml "
                "--module hfscale.training.run_script --plain train.py --epochs 2")
    # a shell starts the node's keeper (it stops the job when the launcher's heartbeat stops), then
    # becomes the launcher: its pid and exit status are main's
    keeper = render(keeper_line(keeper_of(RUN, LOCAL_REACH), Line((Sh(stop_script("20261122-120000-abcdef")),))), False)
    assert plan.main.real_argv() == ["bash", "-c", f"export HFSCALE_HOST=local; {keeper} exec {launcher}"]
    assert render(plan.nodes[0].command) == launcher and plan.keeper == keeper_of(RUN, LOCAL_REACH)
    assert plan.main.cwd == "/work"
    assert dict(plan.main.env) == {
        "HFSCALE_JOB_ID": "20261122-120000-abcdef",
        "HFSCALE_RUN_DIR": RUN,
        "HFSCALE_CONFIG": f"{RUN}/config.yaml",
        "PYTHONUNBUFFERED": "1",
        "HFSCALE_DS_CONFIG": f"{RUN}/ds_config.json",
        # the hang watchdog's flight recorder (gloo and NCCL keep each rank's last collectives)
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": f"{RUN}/flight/nccl_rank_",
    }
    assert plan.cleanup.real_argv() == ["bash", "-c", stop_script("20261122-120000-abcdef")]
    # after a hang, the same stop with no grace: ranks stuck in a collective cannot save
    assert plan.kill.real_argv() == ["bash", "-c", stop_script("20261122-120000-abcdef", grace_s=0)]
    assert "while [ $n -lt 0 ]" in stop_script("x", grace_s=0) and "while [ $n -lt 10 ]" in stop_script("x")
    assert plan.dump.real_argv() == ["bash", "-c", dump_script("20261122-120000-abcdef", f"{RUN}/stacks",
                                                               "/opt/py/bin/python")]
    assert plan.watch == HangWatch(f"{RUN}/progress", f"{RUN}/stacks", f"{RUN}/hang-report.txt", 600, None, 2)
    assert plan.logs == ("local",)
    assert [name for name, _ in plan.files] == [
        "accelerate_config.yaml", "ds_config.json", "config.yaml", ".deepspeed_env"]


def test_local_torchrun_and_builtin_entry():
    job = job_of("name: demo\ncluster: {nproc_per_node: 4}\nrunner: {launcher: torchrun}\nbatch: {micro_batch_size: 1}\n")
    assert launcher_argv(job, "py", RUN, CTX, Rendezvous(rank="0")) == [
        "py", "-m", "hfscale.training.warm_launcher", "--preload", "trainer,deepspeed,builtin",
        "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "4", "--node_rank", "0",
        "--master_addr", "127.0.0.1", "--master_port", "29500", "-m", "hfscale.training.train", "--config", f"{RUN}/config.yaml",
    ]
    acc = job_of("name: demo\nbatch: {micro_batch_size: 1}\n")
    assert launcher_argv(acc, "py", RUN, CTX, Rendezvous(rank="0"))[-4:] == ["--module", "hfscale.training.train", "--config", f"{RUN}/config.yaml"]


PDSH = """
    name: demo
    cluster:
      hosts: [{host: node0, slots: 2}, {host: node1, slots: 2}]
      master_port: 29600
    runner: {type: pdsh, ssh_port: 2222, ssh_user: alice, workdir: /shared/code, connect_timeout: 7}
    network: {preset: roce, env: {NCCL_IB_HCA: mlx5_0, UCX_NET_DEVICES: null}}
    env:
      vars:
        SPACES: "a b  c"
        QUOTES: "it's \\"q\\""
        DOLLAR: "$(touch /tmp/pwned) $HOME `id`"
        JSON: '{"a": [1, 2]}'
        PAREN: 64(x2)
        PCT: "100%h %n"
      forward: [WANDB_*]
      per_host: {node1: {NCCL_SOCKET_IFNAME: eth1}}
    batch: {micro_batch_size: 1}
    training: {pass_args: none, script: train.py, script_args: ["--name", "x; rm -rf /"]}
"""

EXPORTS = (
    "export NCCL_IB_DISABLE=0 NCCL_IB_HCA=mlx5_0 NCCL_IB_GID_INDEX=3 NCCL_SOCKET_IFNAME='^lo,docker0' "
    "WANDB_API_KEY={key} WANDB_PROJECT={project} SPACES='a b  c' QUOTES='it'\"'\"'s \"q\"' "
    "DOLLAR='$(touch /tmp/pwned) $HOME `id`' JSON='{{\"a\": [1, 2]}}' PAREN='64(x2)' PCT='100%h %n' "
    "HFSCALE_JOB_ID=20261122-120000-abcdef HFSCALE_RUN_DIR={run} HFSCALE_CONFIG={run}/config.yaml "
    "PYTHONUNBUFFERED=1 HFSCALE_DS_CONFIG={run}/ds_config.json TORCH_FR_BUFFER_SIZE=2000 "
    "TORCH_FR_DUMP_TEMP_FILE={run}/flight/nccl_rank_"
)
ENV_HEAD = "# The ranks' environment, sourced on every node by hfscale's launch line (mode 0600: secrets).\n"
NODES = """\
# Each node's rank and own variables, by host name; sourced after env.sh.
case "$HFSCALE_HOST" in
  node0) export HFSCALE_NODE_RANK=0 ;;
  node1) export HFSCALE_NODE_RANK=1 NCCL_SOCKET_IFNAME={eth} ;;
  *) echo "hfscale: host $HFSCALE_HOST is not in the plan" >&2; exit 97 ;;
esac
"""


def test_pdsh_plan_exact():
    """No value of the job on any command line: pdsh reads the hosts from a file, every node sources
    the environment and its own rank from files only you can read."""
    plan = build_plan(job_of(PDSH), CTX)
    launcher = (f"/opt/py/bin/python -m hfscale.training.warm_launcher --preload accelerate,deepspeed accelerate.commands.launch --config_file {RUN}/accelerate_config.yaml "
                "--machine_rank \"$HFSCALE_NODE_RANK\" --module hfscale.training.run_script --plain train.py "
                "--name 'x; rm -rf /'")
    # the node's keeper: stops the node's job (as the cleanup does) when the launcher's heartbeat stops
    keeper = render(keeper_line(keeper_of(RUN), Line((Sh(stop_script("20261122-120000-abcdef")),))), False, pdsh=True)
    assert keeper.startswith("( trap ") and keeper.endswith(" & hb=$!;")
    assert f"head -c 64 {RUN}/launcher.beat" in keeper and f"b={RUN}/alive/\"$HFSCALE_HOST\";" in keeper
    assert "env -u HFSCALE_JOB_ID bash -c " + shlex.quote(stop_script("20261122-120000-abcdef")) in keeper
    # a line that starts after a stop (a slow ssh) finds the stop marker and starts nothing
    node = (f"[ ! -e {RUN}/stopping ] || {{ echo 'hfscale: the job was stopped before this node started'; exit 143; }}; "
            f"export HFSCALE_HOST=%h; {keeper} "
            f"cd /shared/code && . {RUN}/env.sh && export HFSCALE_HOST=%h && . {RUN}/nodes.sh && "
            "/opt/py/bin/python -m hfscale.launch.node.health_gate --slots 2 && " + launcher +  # the node's health gate
            '; rc=$?; kill $hb 2>/dev/null; echo "HFSCALE_EXIT rc=$rc"; exit $rc')
    # the node's shell starts with the job id in its environment: the stop finds it (and runner.setup)
    script = "exec env HFSCALE_JOB_ID=20261122-120000-abcdef bash -c " + shlex.quote(node)
    assert tuple(plan.main.real_argv()) == ("pdsh", "-R", "ssh", "-S", "-t", "7", "-f", "2", "-w",
                                            f"^{RUN}/pdsh_hosts", "-l", "alice", script)
    assert plan.main.env == (("PDSH_SSH_ARGS_APPEND", "-p 2222 -o BatchMode=yes -o ServerAliveInterval=10 "
                                                      "-o ServerAliveCountMax=3"),)
    assert dict(plan.files)["pdsh_hosts"] == "node0\nnode1\n"
    private = dict(plan.private)
    assert private["env.sh"].real == ENV_HEAD + EXPORTS.format(key="wk-secret", project="proj", run=RUN) + "\n"
    assert private["env.sh"].shown == ENV_HEAD + EXPORTS.format(key="'***'", project="'***'", run=RUN) + "\n"
    assert private["nodes.sh"].real == NODES.format(eth="eth1") and private["nodes.sh"].shown == NODES.format(eth="'***'")
    assert [(n.host, n.rank) for n in plan.nodes] == [("node0", 0), ("node1", 1)]
    assert render(plan.nodes[1].command) == launcher.replace('"$HFSCALE_NODE_RANK"', "1")
    assert plan.cleanup.argv[:-1] == plan.main.argv[:-1]
    assert plan.cleanup.real_argv()[-1] == stop_script("20261122-120000-abcdef")
    assert plan.kill.argv[:-1] == plan.cleanup.argv[:-1]  # the same fan-out
    assert plan.kill.real_argv()[-1] == stop_script("20261122-120000-abcdef", grace_s=0)
    assert plan.keeper == Keeper(f"{RUN}/launcher.beat", f"{RUN}/alive", f"{RUN}/orphaned", f"{RUN}/logs", 5, 10, 5, 30,
                                 56, f"{RUN}/beat.addr", '"${SSH_CONNECTION%% *}"')
    assert (f"each node: a beat every 5 s on the launcher's heartbeat line (a TCP connection to this host, its port in "
            f"{RUN}/beat.addr); when it closes, or the launcher has not answered for 30 s, the node stops its job") \
        in plan.render()
    assert f"launcher heartbeat: {RUN}/launcher.beat, every 5 s\n  each node: a beat every 5 s" in plan.render()
    assert (f"A node that cannot reach it:\n  each node: heartbeat every 10 s into {RUN}/alive/"
            "<host>; when the launcher's has not changed for 30 s, the node stops its job") in plan.render()


def test_more_hosts_than_fanout_launch_detached_exact():
    """Beyond runner.fanout hosts the launch holds no ssh per host: pdsh starts each node's line
    (the attached one, its keeper included, which also beats for the follower) in a new session,
    fanout hosts at a time, with its output going to logs/<host>.log; hfscale follows the files."""
    attached = build_plan(job_of(PDSH), CTX)
    plan = build_plan(job_of(PDSH.replace("connect_timeout: 7}", "connect_timeout: 7, fanout: 1}")), CTX)
    node = shlex.split(attached.main.real_argv()[-1])[-1]  # bash -c's script in the attached line
    node = node.replace("export HFSCALE_HOST=%h; ( trap", "( trap", 1)  # the detached line sets it before
    script = ("export HFSCALE_HOST=%h; env HFSCALE_JOB_ID=20261122-120000-abcdef setsid bash -c "
              + shlex.quote(node) + f' </dev/null >> {RUN}/logs/"$HFSCALE_HOST".log 2>&1 &')
    assert tuple(plan.main.real_argv()) == ("pdsh", "-R", "ssh", "-S", "-t", "7", "-f", "1", "-w",
                                            f"^{RUN}/pdsh_hosts", "-l", "alice", script)
    assert plan.logs == () and attached.logs == ("node0", "node1") and attached.follow is None
    assert plan.follow == Follow(("node0", "node1"), f"{RUN}/logs", f"{RUN}/alive", 10, 40)
    assert plan.line_hosts == attached.line_hosts == frozenset({"node0", "node1"})  # what the terminal reads as hosts
    assert plan.cleanup == Command((*plan.main.argv[:-1], attached.cleanup.argv[-1]), attached.cleanup.env)
    assert "a host silent for 40 s is lost" in plan.render()


def run_detached_locally(tmp_path: Path, launcher_body: str, edit=lambda line: line) -> Path:
    """Build the detached plan with a stand-in launcher (``launcher_body``, sh), run its line
    (after ``edit``) through pdsh's exec backend as host node1; returns the run directory."""
    job = job_of(PDSH.replace("connect_timeout: 7}", "connect_timeout: 7, fanout: 1}"))
    python = tmp_path / "python"
    # the node's health gate runs with the same interpreter first: the stand-in passes it
    python.write_text('#!/bin/sh\ncase "$*" in *hfscale.launch.node.health_gate*) exit 0 ;; esac\n' + launcher_body + "\n")
    python.chmod(0o755)
    plan = build_plan(job, LaunchContext.of(str(tmp_path), str(python), "20261122-120000-abcdef", dict(CTX.shell_env)))
    run = Path(plan.run_dir)
    (run / "logs").mkdir(parents=True)
    (run / "alive").mkdir()
    for name, text in plan.private:
        (run / name).write_text(text.real)
    line = edit(plan.main.real_argv()[-1].replace("cd /shared/code", f"cd {tmp_path}"))
    r = subprocess.run(["pdsh", "-R", "exec", "-w", "node1", "sh", "-c", line], capture_output=True, text=True,
                       timeout=10)
    assert r.returncode == 0 and r.stdout == "", r.stderr
    return run


def wait_for_exit_line(log: Path, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while "HFSCALE_EXIT" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.1)
    return log.read_text()


def job_left(job_id: str, timeout: float = 3) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := job_pids(job_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_detached_line_runs_the_node_and_returns(tmp_path):
    """The detached line, run locally through pdsh's exec backend: it returns at once, the node's
    line runs on in its own session, writes its log with the exit line and beats while it runs."""
    t0 = time.monotonic()  # the stand-in launcher runs 2 s, says its rank
    run = run_detached_locally(tmp_path, 'sleep 2; echo "rank=$HFSCALE_NODE_RANK sid=$(ps -o sid= $$)"')
    assert time.monotonic() - t0 < 1.5  # pdsh did not wait for the launcher
    rank, exit_line = wait_for_exit_line(run / "logs" / "node1.log").splitlines()
    assert (run / "alive" / "node1").read_text() == "000000000001\n"  # its first beat (the next one 10 s later)
    assert rank.startswith("rank=1 sid=") and int(rank.split("sid=")[1]) != os.getsid(0)
    assert exit_line == "HFSCALE_EXIT rc=0"
    # nothing of the node's line is left: the heartbeat loop and its sleep ended with it
    assert job_left("20261122-120000-abcdef") == []


def test_heartbeat_stopped_between_its_sleep_and_s_leaves_nothing(tmp_path):
    """The node's line ends while the keeper's loop has started its sleep but not yet waits for it
    (CI once left a 'sleep 10' behind that way). The window, microseconds in real runs, is widened
    here to 0.6 s by a sleep put into the real line; the launcher ends inside it."""
    def widen(line: str) -> str:
        assert "sleep 5 & wait $!;" in line
        return line.replace("sleep 5 & wait $!;", "sleep 5 & sleep 0.6; wait $!;", 1)

    run = run_detached_locally(tmp_path, "sleep 0.2; echo done", widen)
    assert wait_for_exit_line(run / "logs" / "node1.log").splitlines() == ["done", "HFSCALE_EXIT rc=0"]
    assert job_left("20261122-120000-abcdef") == []


def test_pdsh_line_survives_pdsh_and_the_remote_shell(tmp_path):
    """pdsh's own exec module substitutes %h like ssh does; the shell must then see every value intact."""
    job = job_of(PDSH)
    # a stand-in interpreter prints the environment the launcher would get
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import json, os; print(json.dumps(dict(os.environ)))'\n")
    python.chmod(0o755)
    plan = build_plan(job, LaunchContext.of(str(tmp_path), str(python), "20261122-120000-abcdef", dict(CTX.shell_env)))
    run = Path(plan.run_dir)
    run.mkdir(parents=True)
    for name, text in plan.private:
        (run / name).write_text(text.real)
    line = plan.main.real_argv()[-1].replace("cd /shared/code", f"cd {tmp_path}")
    # the whole line, run locally with pdsh's exec backend (which substitutes %h as for ssh)
    r = subprocess.run(["pdsh", "-R", "exec", "-w", "node1", "sh", "-c", line], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "node1: HFSCALE_EXIT rc=0"
    env = json.loads(r.stdout.split("node1: ", 1)[1].split("\n", 1)[0])
    assert env["HFSCALE_JOB_ID"] == "20261122-120000-abcdef" and env["HFSCALE_HOST"] == "node1"
    assert env["SPACES"] == "a b  c"
    assert env["QUOTES"] == "it's \"q\""
    assert env["DOLLAR"] == "$(touch /tmp/pwned) $HOME `id`"
    assert env["JSON"] == '{"a": [1, 2]}'
    assert env["PAREN"] == "64(x2)"
    assert env["PCT"] == "100%h %n"
    assert env["WANDB_API_KEY"] == "wk-secret"
    assert env["HFSCALE_NODE_RANK"] == "1" and env["NCCL_SOCKET_IFNAME"] == "eth1"
    assert not Path("/tmp/pwned").exists()


def test_one_plan_shows_secrets_masked_and_runs_them_real():
    plan = build_plan(job_of(PDSH), CTX)
    text = plan.render()
    assert "wk-secret" not in text and "mode 0600" in text
    for _, content in plan.files:
        assert "wk-secret" not in content and "hf_secret" not in content and "proj" not in content
    assert "wk-secret" not in " ".join(plan.main.real_argv())  # never on a command line
    assert "wk-secret" in dict(plan.private)["env.sh"].real  # the nodes read it from a file only you can read
    assert "HF_TOKEN" not in dict(plan.private)["env.sh"].real  # never forwarded unless asked for
    assert "wk-secret" not in repr(plan)


def test_public_names_are_shown():
    job = job_of(PDSH.replace("forward: [WANDB_*]", "forward: [WANDB_*]\n      public: [WANDB_PROJECT, NCCL_*]"))
    private = dict(build_plan(job, CTX).private)
    assert "WANDB_PROJECT=proj" in private["env.sh"].shown and "WANDB_API_KEY='***'" in private["env.sh"].shown
    assert "NCCL_SOCKET_IFNAME=eth1" in private["nodes.sh"].shown


def test_secret_in_yaml_is_masked_in_resolved_config():
    job = job_of(LOCAL + "    env: {vars: {HF_TOKEN: hf_yaml_secret, OK: visible}}\n")
    files = dict(build_plan(job, CTX).files)
    assert "hf_yaml_secret" not in files["config.yaml"] and "HF_TOKEN: '***'" in files["config.yaml"]
    assert "OK: visible" in files["config.yaml"]
    assert "HF_TOKEN" not in files[".deepspeed_env"] and "OK=visible\n" in files[".deepspeed_env"]


def test_deepspeed_env_leaves_out_values_deepspeed_would_expand():
    plan = build_plan(job_of(PDSH), CTX)
    files = dict(plan.files)
    assert "DOLLAR" not in files[".deepspeed_env"] and "QUOTES" not in files[".deepspeed_env"]
    assert "SPACES=a b  c\n" in files[".deepspeed_env"] and "PAREN=64(x2)\n" in files[".deepspeed_env"]
    assert "QUOTES" in plan.notes[0] and "DOLLAR" in plan.notes[0] and "WANDB_API_KEY" in plan.notes[0]


def test_single_host_pdsh():
    job = job_of("name: one\ncluster: {hosts: [{host: gpu7, slots: 8}]}\nrunner: {type: pdsh}\nbatch: {micro_batch_size: 1}\n"
                 "training: {script: t.py}\n")
    plan = build_plan(job, CTX)
    assert "--machine_rank" not in plan.main.real_argv()[-1]  # one node: the accelerate config says it all
    assert "  gpu7) export HFSCALE_NODE_RANK=0 ;;" in dict(plan.private)["nodes.sh"].real


DOCKER = """
    name: demo
    cluster: {hosts: [{host: node0, slots: 8}, {host: node1, slots: 8}]}
    runner:
      type: pdsh_docker
      docker:
        image: registry.local/train:1.0
        mounts:
          - {host: /data, container: /data, readonly: true}
          - {host: /ckpt, container: /ckpt}
        ipc: private
        shm_size: 32g
        workdir: /code
        extra_args: [--ulimit, "nofile=4096:4096"]
    network: {preset: infiniband}
    env: {vars: {A: "x y"}}
    batch: {micro_batch_size: 1}
    training: {script: train.py, pass_args: none}
"""


def test_pdsh_docker_plan_exact():
    plan = build_plan(job_of(DOCKER), CTX)
    script = plan.main.real_argv()[-1]
    docker = shlex.split(script)[-1].split("/nodes.sh && ", 1)[1].split("; rc=$?", 1)[0]
    names = ["NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES", "A", "HFSCALE_JOB_ID",
             "HFSCALE_RUN_DIR", "HFSCALE_CONFIG", "PYTHONUNBUFFERED", "HFSCALE_DS_CONFIG", "TORCH_FR_BUFFER_SIZE",
             "TORCH_FR_DUMP_TEMP_FILE", "HFSCALE_NODE_RANK"]
    assert docker == (
        'docker run --rm --name hfscale-20261122-120000-abcdef-"$HFSCALE_NODE_RANK" '
        "--label hfscale.job=20261122-120000-abcdef --network host --ipc private --shm-size 32g --gpus all "
        "--device /dev/infiniband --cap-add IPC_LOCK --ulimit memlock=-1:-1 "
        "-v /data:/data:ro -v /ckpt:/ckpt " + " ".join(f"-e {n}" for n in names) +
        " -w /code --ulimit nofile=4096:4096 registry.local/train:1.0 "
        f"python -m hfscale.training.warm_launcher --preload accelerate,deepspeed accelerate.commands.launch "
        f"--config_file {RUN}/accelerate_config.yaml "
        '--machine_rank "$HFSCALE_NODE_RANK" --module hfscale.training.run_script --plain train.py'
    )
    assert "x y" not in script and "A='x y'" in dict(plan.private)["env.sh"].real  # values never on an argv
    assert plan.cleanup.real_argv()[-1] == (
        "docker ps -q --filter label=hfscale.job=20261122-120000-abcdef | xargs -r docker rm -f; "
        + stop_script("20261122-120000-abcdef"))
    assert plan.kill.real_argv()[-1] == (  # after a hang: the same, with no grace
        "docker ps -q --filter label=hfscale.job=20261122-120000-abcdef | xargs -r docker rm -f; "
        + stop_script("20261122-120000-abcdef", grace_s=0))


def test_local_docker_runs_without_pdsh():
    text = DOCKER.replace("cluster: {hosts: [{host: node0, slots: 8}, {host: node1, slots: 8}]}",
                          "cluster: {nproc_per_node: 8}").replace("network: {preset: infiniband}", "")
    plan = build_plan(job_of(text), CTX)
    assert plan.main.argv[:4] == ("docker", "run", "--rm", "--name")
    assert plan.main.argv[4] == "hfscale-20261122-120000-abcdef-0"
    assert "--device" not in plan.main.argv
    assert dict(plan.main.env)["A"] == "x y" and dict(plan.main.env)["HFSCALE_NODE_RANK"] == "0"
    assert plan.cleanup.argv == ("docker", "rm", "-f", "hfscale-20261122-120000-abcdef-0")


def test_dry_run_text_is_shell_quoted_and_parseable():
    text = build_plan(job_of(PDSH), CTX).render()
    run_line = text.split("\nrun:\n  ", 1)[1].split("\n", 1)[0]
    words = shlex.split(run_line)
    assert words[0] == "PDSH_SSH_ARGS_APPEND=-p 2222 -o BatchMode=yes -o ServerAliveInterval=10 -o ServerAliveCountMax=3"
    assert words[-1] == build_plan(job_of(PDSH), CTX).main.real_argv()[-1]  # the node's line, no secret in it
    assert words[1:11] == ["pdsh", "-R", "ssh", "-S", "-t", "7", "-f", "2", "-w", f"^{RUN}/pdsh_hosts"]


@pytest.mark.parametrize("bad", ["", "UPPER", "a b", "a;b", "x" * 65])
def test_job_ids_are_validated(bad):
    with pytest.raises(ValueError):
        LaunchContext.of("/w", "py", bad, {})


def test_restarts_use_a_c10d_rendezvous_with_the_job_id():
    job = job_of("name: r\ncluster: {nproc_per_node: 2}\nrunner: {launcher: torchrun, max_restarts: 2}\n"
                 "batch: {micro_batch_size: 1}\ntraining: {script: t.py, pass_args: none}\n")
    plan = build_plan(job, CTX)
    assert tuple(plan.nodes[0].command.items) == ("/opt/py/bin/python", "-m", "hfscale.training.warm_launcher",
                              "--preload", "accelerate,deepspeed", "torch.distributed.run", "--nnodes", "1",
                              "--nproc_per_node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29500",
                              "--rdzv-id", "20261122-120000-abcdef", "--max-restarts", "2", "-m",
                              "hfscale.training.run_script", "--plain", "t.py")
    assert dict(plan.main.env)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_restarts_with_accelerate_are_refused():
    from hfscale.config.errors import ConfigError

    with pytest.raises(ConfigError, match="restarts need launcher: torchrun"):
        job_of("name: r\nrunner: {max_restarts: 1}\nbatch: {micro_batch_size: 1}\n")


def test_docker_env_names_keep_their_declared_order():
    """-e names from per-host values follow the YAML's order (no set order that changes per run)."""
    text = DOCKER.replace("env: {vars: {A: \"x y\"}}",
                          "env: {vars: {A: \"x y\"}, per_host: {node1: {ZZ: '1', MM: '2', AA: '3'}, node0: {QQ: '4'}}}")
    argv = build_plan(job_of(text), CTX).main.real_argv()[-1]
    e_names = re.findall(r" -e (\w+)", argv)
    assert e_names[-5:] == ["ZZ", "MM", "AA", "QQ", "HFSCALE_NODE_RANK"]
