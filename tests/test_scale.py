"""3,000 hosts: nothing per host rides on a command line, the launch and clean-up fan-out are bounded, and
`hfscale launch` drives a stand-in pdsh (on PATH, recording its argv) to the end. Timings of check,
plan and dry-run at this size are measured by bench/bench_scale.py, not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from hfscale.launch.build import build_plan
from hfscale.launch.context import LaunchContext
from hfscale.launch.recovery.requeue import in_allocation_of
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
        # of fixed size, whatever the host count (Linux takes 128 KiB per argument): the node line, its keeper
        # and stop, about 4.5 KB with this test's run directory
        assert max(len(a) for a in argv) < 6144 and sum(len(a) for a in argv) < 10240
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
    assert max(len(a) for a in argv) < 6144
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


SLURM_NODES = 10_000
STAND_IN = r"""#!/bin/bash
# Stands in for {name}: records its argv, a line each call ({name}.calls); {body}
printf '%s\n' "$*" >> "$SCALE_OUT/{name}.calls"
{body}
"""


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    (bin_dir / name).write_text(STAND_IN.format(name=name, body=body))
    (bin_dir / name).chmod(0o755)


def recorded(calls: Path) -> list[str]:
    """The complete lines a stand-in has recorded so far."""
    text = calls.read_text() if calls.exists() else ""
    return text[:text.rfind("\n") + 1].splitlines()


def test_a_supervised_slurm_job_on_10000_nodes_keeps_its_host_lists_in_files(tmp_path):
    """The batch script of a supervised Slurm job on 10,000 nodes, run by bash with stand-ins for
    scontrol, srun and the supervisor's python: the allocation's hosts go to a file (one variable
    would pass Linux's 128 KiB for one string), 3 nodes watch the batch host (not 9,999 sruns on it),
    spread over the list; the attempt's plan then keeps every host list in files, and its stop runs
    at most runner.fanout steps at once."""
    names = [f"gpu-node-{i:05d}.rack-{i // 32:03d}" for i in range(SLURM_NODES)]
    assert len(",".join(names)) > ARG_MAX_ONE
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(), out.mkdir()
    (out / "names").write_text("\n".join(names) + "\n")
    stand_in(bin_dir, "scontrol", 'cat "$SCALE_OUT/names"')
    stand_in(bin_dir, "srun", "exit 0")
    stand_in(bin_dir, "python", 'cp "$HFSCALE_SLURM_HOSTS_FILE" "$SCALE_OUT/seen"')
    doc = {"name": "big", "cluster": {"num_nodes": SLURM_NODES - 8, "nproc_per_node": 8},
           "runner": {"type": "slurm", "run_dir": str(tmp_path / "runs"), "fanout": 64}, "batch": {"micro_batch_size": 1},
           "training": {"script": "train.py", "pass_args": "none"}, "recovery": {"max_restarts": 3, "spares": 8},
           "watchdog": {"timeout": 300}}
    config = tmp_path / "big.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    job = load_job(config)
    submit = build_plan(job, LaunchContext.of(str(tmp_path), str(bin_dir / "python"), "20261127-000000-abcdef", {}))
    run_dir = Path(submit.run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "job.sbatch").write_text(dict(submit.files)["job.sbatch"])
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SCALE_OUT": str(out), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "gpu-node-[00000-09999].rack-[000-312]", "SLURMD_NODENAME": names[0]}
    r = subprocess.run(["bash", str(run_dir / "job.sbatch")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.startswith("hfscale: job 7 on gpu-node-[00000-09999].rack-[000-312] (10000 nodes), restart 0;")
    assert (out / "seen").read_text().split() == names  # the supervisor found them all in the file
    # the watchers' sruns run in the background: the script may end before each stand-in has recorded itself
    deadline = time.monotonic() + 60
    while len(watches := recorded(out / "srun.calls")) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    others = names[1:]  # not the batch host
    assert sorted(w.split()[2] for w in watches) == [f"--nodelist={others[0]}",  # started at once: in any order
                                                     f"--nodelist={others[len(others) // 2]}", f"--nodelist={others[-1]}"]
    # the supervisor's plan of its first attempt, on the allocation: no host list on any command line
    inside = {"SLURM_JOB_ID": "7", "HFSCALE_SLURM_HOSTS_FILE": str(out / "seen")}
    job = in_allocation_of(job, inside)
    assert len(job.hosts) == SLURM_NODES - 8 and [s.host for s in job.spares] == names[-8:]
    plan = build_plan(job, LaunchContext.of(str(tmp_path), sys.executable, "20261127-000000-abcdef", inside))
    for cmd in (plan.main, plan.cleanup, plan.dump, plan.kill):
        argv = cmd.real_argv()
        assert max(len(a) for a in argv) < 16_384 and sum(len(a) for a in argv) < 32_768, cmd.shown_argv()[:3]
    assert dict(plan.files)["step_hosts"].split() == names[:SLURM_NODES - 8]
    # the stop: one step per node, at most runner.fanout (64) at once; every node once. 300 of the hosts,
    # each stand-in step taking 0.5 s: the fan-out fills several times over
    (out / "srun.calls").unlink()
    stand_in(bin_dir, "srun", 'mkdir "$SCALE_OUT/running.$$"; ls -d "$SCALE_OUT"/running.* | wc -l >> "$SCALE_OUT/most"; '
                              'sleep 0.5; rmdir "$SCALE_OUT/running.$$"')
    stop = plan.cleanup.real_argv()[2]
    assert '[ "$n" -lt 64 ]' in stop
    (Path(plan.run_dir) / "step_hosts").write_text("\n".join(names[:300]) + "\n")
    r = subprocess.run(["bash", "-c", stop], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    called = [line.split("--nodelist=")[1].split()[0] for line in (out / "srun.calls").read_text().splitlines()]
    assert sorted(called) == sorted(names[:300])
    most = max(int(n) for n in (out / "most").read_text().split())
    print(f"stop of 300 nodes: at most {most} steps at once (fan-out 64)")
    assert 32 <= most <= 64


def test_the_host_slurm_took_out_of_a_10000_node_allocation_is_named(tmp_path):
    """Before each attempt's step, the hosts of step_hosts that Slurm no longer lists in the allocation
    (set DOWN under --no-kill) are found by one grep over both lists (stand-ins for squeue and scontrol):
    the first is named and the step is not started (exit 3); with none missing, srun starts."""
    names = [f"gpu-node-{i:05d}" for i in range(SLURM_NODES)]
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(), out.mkdir()
    stand_in(bin_dir, "squeue", 'case "$*" in *" -s "*) ;; *) echo "gpu-node-[00000-09999]" ;; esac')
    stand_in(bin_dir, "scontrol", 'cat "$SCALE_OUT/allocated"')
    stand_in(bin_dir, "srun", "exit 0")
    doc = {"name": "big", "cluster": {"num_nodes": SLURM_NODES, "nproc_per_node": 8},
           "runner": {"type": "slurm", "run_dir": str(tmp_path / "runs")}, "batch": {"micro_batch_size": 1},
           "training": {"script": "train.py", "pass_args": "none"}, "recovery": {"max_restarts": 3}}
    config = tmp_path / "big.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    (out / "seen").write_text("\n".join(names) + "\n")
    inside = {"SLURM_JOB_ID": "7", "HFSCALE_SLURM_HOSTS_FILE": str(out / "seen")}
    plan = build_plan(in_allocation_of(load_job(config), inside),
                      LaunchContext.of(str(tmp_path), sys.executable, "20261127-000000-abcdef", inside))
    Path(plan.run_dir).mkdir(parents=True)
    (Path(plan.run_dir) / "step_hosts").write_text(dict(plan.files)["step_hosts"])
    line = plan.main.real_argv()[2]
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SCALE_OUT": str(out), "SLURM_JOB_ID": "7"}
    for gone, rc in (([4321, 9000], 3), ([], 0)):
        (out / "allocated").write_text("".join(n + "\n" for i, n in enumerate(names) if i not in gone))
        (out / "srun.calls").unlink(missing_ok=True)
        r = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == rc, r.stdout[-2000:] + r.stderr[-2000:]
        if gone:
            assert r.stdout == ("hfscale: Slurm took gpu-node-04321 out of the allocation (set DOWN: its slurmd "
                                "stopped answering)\n")
            assert not (out / "srun.calls").exists()
        else:
            assert r.stdout == "" and (out / "srun.calls").read_text().startswith(
                f"--overlap --nodelist={plan.run_dir}/step_hosts --nodes=10000 --ntasks=10000 ")


def test_a_node_srun_cannot_reach_is_written_down_once_and_skipped_by_the_next_pass(tmp_path):
    """Issue 35: srun to a node whose link is cut fails only after Slurm's MessageTimeout (12 s on the test
    Slurm), once per pass: the stack dump after a hang names it in the attempt's ``unreached`` file, and the
    kill that follows (and the supervisor's settle) skip it. A step that only timed out is not written down."""
    names = [f"gpu-node-{i:05d}" for i in range(50)]
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(), out.mkdir()
    # node 7: srun's launch failure (the test Slurm's exit code 233); node 9: killed by the pass's timeout (124)
    stand_in(bin_dir, "srun", 'case "$*" in *=gpu-node-00007\\ *) exit 233 ;; esac; exit 0')
    stand_in(bin_dir, "timeout", 'case "$*" in *=gpu-node-00009\\ *) exit 124 ;; esac; shift; exec "$@"')
    doc = {"name": "cut", "cluster": {"num_nodes": len(names), "nproc_per_node": 8},
           "runner": {"type": "slurm", "run_dir": str(tmp_path / "runs")}, "batch": {"micro_batch_size": 1},
           "watchdog": {"timeout": 60},
           "training": {"script": "train.py", "pass_args": "none"}, "recovery": {"max_restarts": 3}}
    config = tmp_path / "cut.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    (out / "seen").write_text("\n".join(names) + "\n")
    inside = {"SLURM_JOB_ID": "7", "HFSCALE_SLURM_HOSTS_FILE": str(out / "seen")}
    plan = build_plan(in_allocation_of(load_job(config), inside),
                      LaunchContext.of(str(tmp_path), sys.executable, "20261128-000000-abcdef", inside))
    run = Path(plan.run_dir)
    run.mkdir(parents=True)
    (run / "step_hosts").write_text(dict(plan.files)["step_hosts"])
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SCALE_OUT": str(out)}
    assert plan.dump is not None and plan.kill is not None
    for n, c in enumerate((plan.dump, plan.kill)):
        r = subprocess.run(c.real_argv(), env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert (run / "unreached").read_text() == "gpu-node-00007\n"
        called = [line.split("--nodelist=")[1].split()[0] for line in (out / "srun.calls").read_text().splitlines()]
        assert called.count("gpu-node-00007") == 1 and called.count("gpu-node-00008") == n + 1  # once: then skipped
    from hfscale.launch.run_dir import read_unreached

    assert read_unreached(run, tuple(names)) == ("gpu-node-00007",)
    assert read_unreached(run, ("node0",)) == ()  # only the attempt's own hosts
