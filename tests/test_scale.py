"""3,000 hosts: nothing per host rides on a command line, the launch and clean-up fan-out are bounded, and
`hfscale launch` drives a stand-in pdsh (on PATH, recording its argv) to the end. Timings of check,
plan and dry-run at this size are measured by bench/bench_scale.py, not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from hfscale.launch.build import build_plan
from hfscale.launch.node_command import LaunchContext
from hfscale.rules.config_file import load_job

HOSTS = 3000
ARG_MAX_ONE = 128 * 1024  # Linux: MAX_ARG_STRLEN

STAND_IN_PDSH = r"""#!/usr/bin/env python3
# Stands in for pdsh: records its argv and environment, then answers for every listed host as the
# remote line would (its exit line), so that hfscale launch runs to the end.
import json, os, sys
out = os.environ["SCALE_OUT"]
n = len([f for f in os.listdir(out) if f.startswith("pdsh-")])
with open(os.path.join(out, f"pdsh-{n}.json"), "w") as f:
    json.dump({"argv": sys.argv, "env": {k: v for k, v in os.environ.items() if k.startswith("PDSH")}}, f)
listing = sys.argv[sys.argv.index("-w") + 1][1:]
hosts = open(listing).read().split()
if "setsid" in sys.argv[-1]:  # a detached launch: each node writes its own log, ending in its exit line
    for h in hosts:
        with open(os.path.join(os.path.dirname(listing), "logs", h + ".log"), "w") as f:
            f.write(f"rank of {h} done\nHFSCALE_EXIT rc=0\n")
elif "HFSCALE_EXIT" in sys.argv[-1]:
    for h in hosts:
        print(f"{h}: HFSCALE_EXIT rc=0")
"""


def big_config(tmp: Path) -> Path:
    hosts = [{"host": f"gpu-node-{i:05d}.rack-{i // 32:03d}.cluster.example.com", "slots": 8} for i in range(HOSTS)]
    per_host = {h["host"]: {"NCCL_SOCKET_IFNAME": f"ens{i % 4}f0", "NCCL_IB_HCA": f"mlx5_{i % 8}"}
                for i, h in enumerate(hosts)}
    doc = {"name": "big", "cluster": {"hosts": hosts}, "runner": {"type": "pdsh", "run_dir": str(tmp / "runs")},
           "env": {"per_host": per_host, "forward": ["SCALE_TOKEN"]}, "batch": {"micro_batch_size": 1},
           "training": {"script": "train.py", "pass_args": "none"}}
    path = tmp / "big.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_per_host_data_never_rides_on_a_command_line(tmp_path):
    config = big_config(tmp_path)
    assert config.stat().st_size > 500_000  # the table itself is far beyond one argument's limit
    plan = build_plan(load_job(config), LaunchContext.of(str(tmp_path), sys.executable, "20261123-000000-abcdef",
                                                         {"SCALE_TOKEN": "tok-secret"}))
    for cmd in (plan.main, plan.cleanup):
        argv = cmd.real_argv()
        assert max(len(a) for a in argv) < 4096 and sum(len(a) for a in argv) < 8192
        assert argv[argv.index("-w") + 1] == f"^{plan.run_dir}/pdsh_hosts"
        assert "tok-secret" not in " ".join(argv)
    # beyond runner.fanout the launch starts the nodes detached: neither it nor the clean-up holds
    # more than 256 ssh sessions
    assert plan.main.real_argv()[plan.main.real_argv().index("-f") + 1] == "256"
    assert plan.cleanup.real_argv()[plan.cleanup.real_argv().index("-f") + 1] == "256"
    assert plan.follow is not None and len(plan.follow.hosts) == HOSTS and plan.logs == ()
    private = dict(plan.private)
    assert private["nodes.sh"].real.count(") export HFSCALE_NODE_RANK=") == HOSTS
    assert "tok-secret" in private["env.sh"].real and "tok-secret" not in private["env.sh"].shown
    assert dict(plan.files)["pdsh_hosts"].count("\n") == HOSTS


def test_launch_with_a_stand_in_pdsh_on_3000_hosts(tmp_path):
    config = big_config(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pdsh").write_text(STAND_IN_PDSH)
    (bin_dir / "pdsh").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SCALE_OUT": str(tmp_path),
           "SCALE_TOKEN": "tok-secret"}
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    calls = [json.loads((tmp_path / "pdsh-0.json").read_text())]
    argv = calls[0]["argv"]
    assert max(len(a) for a in argv) < 4096
    assert "tok-secret" not in json.dumps(calls)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "env.sh").stat().st_mode & 0o777 == 0o600
    assert (run_dir / "nodes.sh").stat().st_mode & 0o777 == 0o600
    assert "tok-secret" in (run_dir / "env.sh").read_text()
    assert "tok-secret" not in (run_dir / "plan.txt").read_text()
    assert len(list((run_dir / "logs").iterdir())) == HOSTS
    # every node's exit line was followed from its log (it stays off the terminal: hfscale's lines only)
    ended = [p for p in (run_dir / "logs").iterdir() if p.read_text().endswith("HFSCALE_EXIT rc=0\n")]
    assert len(ended) == HOSTS and "HFSCALE_EXIT" not in r.stdout
    assert " finished in " in r.stdout, r.stdout[-2000:]  # the summary
