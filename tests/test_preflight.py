"""Preflight: probes as data, verdicts from their outputs, and a real local run."""

from __future__ import annotations

import os
import sys

from hfscale.launch.preflight.probes import MARK, evaluate, gpu_memory_hint, probes, render_table

from conftest import job_of, run_cli

TWO = """
    name: pf
    cluster: {hosts: [{host: node0, slots: 4}, {host: node1, slots: 4}], master_port: 29555}
    runner: {type: pdsh, ssh_port: 2200, ssh_user: bob, connect_timeout: 3}
    network: {preset: infiniband}
    batch: {micro_batch_size: 1}
"""


def facts(**over):
    base = dict(python="3.11.7", torch="2.13.0", transformers="5.23.0", deepspeed="0.19.8", accelerate="1.15.0",
                gpus="4", gpu_mib="81559", ib="mlx5_0,mlx5_1,", port="free")
    base.update(over)
    return (0, f"{MARK}\n" + "".join(f"{k}={v}\n" for k, v in base.items()), "")


def test_probe_commands():
    cmds = probes(job_of(TWO), "/py")
    assert sorted(cmds) == ["node0", "node0/shell", "node1", "node1/shell"]
    ssh = ["ssh", "-p", "2200", "-o", "ConnectTimeout=3", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=10",
           "-o", "ServerAliveCountMax=3", "-l", "bob"]
    assert list(cmds["node1/shell"].argv) == ssh + ["node1", "true"]
    assert list(cmds["node0"].argv[:-1]) == ssh + ["node0"]
    assert "port=free" in cmds["node0"].argv[-1] and "29555" in cmds["node0"].argv[-1]
    assert "port=" not in cmds["node1"].argv[-1]  # the port is only probed on the master


def test_all_good():
    results = {"node0": facts(), "node1": facts(port=""), "node0/shell": (0, "", ""), "node1/shell": (0, "", "")}
    reports = evaluate(job_of(TWO), results)
    assert [r.problems for r in reports] == [(), ()]
    table = render_table(reports)
    assert table.splitlines()[0].split() == ["host", "python", "torch", "transformers", "deepspeed", "accelerate",
                                             "gpus", "gpu_mib", "ib", "port", "status"]
    assert table.splitlines()[1].split() == ["node0", "3.11.7", "2.13.0", "5.23.0", "0.19.8", "1.15.0", "4",
                                             "81559", "mlx5_0,mlx5_1", "free", "ok"]
    assert gpu_memory_hint(job_of(TWO), reports) == (
        "smallest GPU: 81559 MiB; set cluster.gpu_memory: 81559MiB for check's and plan's verdict on whether the job fits")


def test_gpus_smaller_than_cluster_gpu_memory_are_named():
    job = job_of(TWO.replace("master_port: 29555}", "master_port: 29555, gpu_memory: 80GB}"))
    results = {"node0": facts(), "node1": facts(gpu_mib="40960"), "node0/shell": (0, "", ""),
               "node1/shell": (0, "", "")}
    reports = evaluate(job, results)
    assert reports[0].problems == () and gpu_memory_hint(job, reports) is None
    assert reports[1].problems == ("its smallest GPU has 40960 MiB, less than cluster.gpu_memory 80GB (what check "
                                   "and plan judge the job against)",)


def test_every_failure_names_its_host():
    results = {
        "node0": facts(port="busy", gpus="2"),
        "node0/shell": (0, "Welcome to node0!\n", ""),
        "node1": facts(torch="2.12.0", ib="", deepspeed="missing"),
        "node1/shell": (0, "", ""),
    }
    reports = {r.host: r.problems for r in evaluate(job_of(TWO), results)}
    assert reports["node0"] == (
        "login shell prints output for non-interactive commands ('Welcome to node0!'); silence it in the remote shell's rc files",
        "4 slots but only 2 GPUs",
        "master port 29555 is already in use",
    )
    assert reports["node1"] == (
        "deepspeed is not installed",
        "torch 2.12.0 differs from node0's 2.13.0",
        "no InfiniBand devices in /sys/class/infiniband (network preset infiniband)",
    )


def test_unreachable_host():
    results = {
        "node0": facts(), "node0/shell": (0, "", ""),
        "node1": (255, "", "ssh: connect to host node1 port 2200: Connection refused\n"),
        "node1/shell": (255, "", "ssh: connect to host node1 port 2200: Connection refused\n"),
    }
    reports = evaluate(job_of(TWO), results)
    assert reports[1].problems == ("unreachable: ssh: connect to host node1 port 2200: Connection refused",)
    assert "node1: unreachable" in render_table(reports)


def test_real_local_preflight(tmp_path):
    cfg = tmp_path / "local.yaml"
    cfg.write_text("name: pf\ncluster: {nproc_per_node: 2, master_port: 29557}\nbatch: {micro_batch_size: 1}\n")
    r = run_cli("preflight", str(cfg))
    assert r.returncode == 0, r.stdout + r.stderr
    row = r.stdout.splitlines()[1].split()
    import torch  # the versions preflight reports are the installed ones

    assert row[0] == "local" and row[2] == torch.__version__ and row[-1] == "ok"
    assert r.stdout.strip().endswith("preflight ok: 1 host(s)")


def test_real_local_preflight_sees_a_busy_port(tmp_path):
    import socket

    s = socket.socket()
    s.bind(("", 0))
    s.listen()
    port = s.getsockname()[1]
    cfg = tmp_path / "local.yaml"
    cfg.write_text(f"name: pf\ncluster: {{master_port: {port}}}\nbatch: {{micro_batch_size: 1}}\n")
    try:
        r = run_cli("preflight", str(cfg))
    finally:
        s.close()
    assert r.returncode == 3
    assert f"local: master port {port} is already in use" in r.stdout
    assert "preflight failed on: local" in r.stderr


def test_preflight_refuses_scheduler_runners(repo_root):
    r = run_cli("preflight", str(repo_root / "examples" / "slurm" / "config.yaml"))
    assert r.returncode == 2 and "with runner slurm the scheduler picks the nodes" in r.stderr


def test_real_local_preflight_reads_gpu_memory_through_nvidia_smi(tmp_path):
    """No GPU here: a stand-in nvidia-smi on PATH answers exactly the queries the probe makes (the count, the
    memory, and the health gate's two; anything else exits 1), so the query's fields and the smallest-GPU
    pipeline really run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        '#!/bin/sh\n'
        'if [ "$*" = "-L" ]; then echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)"; '
        'echo "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-b)"; exit 0; fi\n'
        'if [ "$*" = "--query-gpu=memory.total --format=csv,noheader,nounits" ]; then printf "81559\\n40960\\n"; exit 0; fi\n'
        # the health gate's two queries (hfscale.launch.node.health_checks): both GPUs healthy
        'if [ "$*" = "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits" ]; '
        'then printf "0, 00000000:18:00.0, 0\\n1, 00000000:2A:00.0, 0\\n"; exit 0; fi\n'
        'if [ "$*" = "--query-remapped-rows=gpu_bus_id,remapped_rows.pending,remapped_rows.failure '
        '--format=csv,noheader,nounits" ]; then printf "00000000:18:00.0, 0, 0\\n00000000:2A:00.0, 0, 0\\n"; exit 0; fi\n'
        'exit 1\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    path = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    cfg = tmp_path / "local.yaml"
    cfg.write_text("name: pf\ncluster: {nproc_per_node: 2, master_port: 29558}\nbatch: {micro_batch_size: 1}\n")
    r = run_cli("preflight", str(cfg), env=path)
    assert r.returncode == 0, r.stdout + r.stderr
    header, row = (line.split() for line in r.stdout.splitlines()[:2])
    assert (row[header.index("gpus")], row[header.index("gpu_mib")]) == ("2", "40960")
    assert "set cluster.gpu_memory: 40960MiB" in r.stdout + r.stderr
    cfg.write_text(cfg.read_text().replace("master_port: 29558}", "master_port: 29558, gpu_memory: 80GB}"))
    r = run_cli("preflight", str(cfg), env=path)
    assert r.returncode != 0 and "its smallest GPU has 40960 MiB, less than cluster.gpu_memory 80GB" in r.stdout


LOCAL = TWO + """    distributed: {backend: deepspeed, deepspeed: {stage: 2}}
    training: {local_checkpoints: {every: 5, dir: "/nvme/it's {host}"}}
"""


def test_the_local_tiers_folder_is_probed_and_a_full_one_admitted_with_a_note():
    job = job_of(LOCAL)
    script = probes(job, "/py")["node1"].argv[-1]
    assert "'/nvme/it'\"'\"'s node1'" in script  # the folder, {host} replaced, quoted as one argument
    results = {"node0": facts(local="5000000"), "node1": facts(port="", local="163840"),
               "node0/shell": (0, "", ""), "node1/shell": (0, "", "")}
    reports = evaluate(job, results, local_need=1_000_000)
    assert [r.problems for r in reports] == [(), ()]  # admitted: a full local disk keeps no host out
    assert reports[0].notes == () and reports[1].notes == (
        "local checkpoint folder /nvme/it's node1 has 160.0 KiB free, a local step needs about 976.6 KiB there: "
        "admitted; local steps are skipped while it has no room, the durable tier carries the job",)
    assert "node1: note: local checkpoint folder /nvme/it's node1 has 160.0 KiB free" in render_table(reports)
    results["node0"] = facts(local="unwritable:Read-only file system")
    assert evaluate(job, results)[0].notes == (
        "local checkpoint folder /nvme/it's node0 cannot be written (Read-only file system): admitted; local steps "
        "are skipped while it has no room, the durable tier carries the job",)
    assert evaluate(job, results)[1].notes == ()  # without an estimate, room is not judged: only a failed write


def test_real_local_probe_of_the_local_folder(tmp_path):
    from hfscale.launch.attempt.execute import run_probes
    from hfscale.launch.preflight.probes import HostFacts

    folder = tmp_path / "nvme" / "{host}"
    cfg = tmp_path / "local.yaml"
    cfg.write_text("name: pf\ncluster: {nproc_per_node: 2, master_port: 29558}\nbatch: {micro_batch_size: 1}\n"
                   f"distributed: {{backend: deepspeed, deepspeed: {{stage: 2}}}}\n"
                   f"training: {{local_checkpoints: {{every: 5, dir: '{folder}'}}}}\n")
    job = job_of(cfg.read_text())
    (rc, out, err), = run_probes(probes(job, sys.executable), 60).values()
    facts_ = HostFacts.read(out)
    assert rc == 0 and facts_ is not None and facts_.local_free and facts_.local_free > 0, out + err
    made = [p for p in (tmp_path / "nvme").iterdir()]
    assert len(made) == 1 and not list(made[0].iterdir())  # the folder made, the probe's file removed
