"""The examples as users run them: every config checks and plans; the README's main job trains,
checkpoints and resumes; the existing-script example; a rank killed under the restart budget."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, UNIT_MODULES, run_cli
from doc_commands import NOT_HERE, Command, commands, run_as_written

EXAMPLES = sorted((ROOT / "examples").glob("*/config.yaml"))


def test_the_examples_the_issue_asks_for_exist():
    assert {p.parent.name for p in EXAMPLES} >= {"tiny_cpu", "multinode_infiniband", "docker", "existing_script",
                                                  "accelerate_loop"}


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda p: p.parent.name)
def test_every_example_checks_and_plans(config):
    r = run_cli("check", str(config))
    assert r.returncode == 0, r.stderr
    r = run_cli("launch", str(config), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# hfscale launch plan: job ")


def test_infiniband_example_plan():
    r = run_cli("launch", str(ROOT / "examples/multinode_infiniband/config.yaml"), "--dry-run",
                env={"WANDB_API_KEY": "wandb-secret-value", "HF_TOKEN": "hf-secret-value"})
    assert r.returncode == 0, r.stderr
    assert "secret-value" not in r.stdout
    assert "-w '^/shared/llama/runs/llama-pretrain-" in r.stdout and "gpu-node-04\n" not in r.stdout.split("run:")[1]
    assert "NCCL_IB_HCA=mlx5_0,mlx5_1" in r.stdout and "gpu-node-04) export HFSCALE_NODE_RANK=3 NCCL_SOCKET_IFNAME=ens2f0" in r.stdout
    assert "WANDB_API_KEY='***'" in r.stdout  # env.sh as the nodes read it, masked
    assert "{ source /shared/venv/bin/activate ; }" in r.stdout


def _launch(config: Path, cwd: Path, timeout: float = 400, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_readme_main_job_trains_checkpoints_and_resumes(tmp_path):
    """`hfscale launch examples/tiny_cpu/config.yaml`, exactly as in the README (run from a scratch dir)."""
    config = ROOT / "examples" / "tiny_cpu" / "config.yaml"
    r = _launch(config, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    out = tmp_path / "output" / "tiny_cpu"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-150", "checkpoint-200"]  # limit 2
    assert all((p / "hfscale_complete.json").is_file() for p in out.glob("checkpoint-*"))
    assert all((p / "hfscale_loss_guard.json").is_file() for p in out.glob("checkpoint-*"))  # its windows, saved
    assert not (out / "hfscale_rollbacks.json").exists()  # the loss guard, on by default, fired no alarm
    records = [json.loads(line) for line in (out / "hfscale_metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in records if m["event"] == "metrics"]
    assert [m["step"] for m in metrics] == [50, 100, 150, 200]
    assert all(m["world_size"] == 2 and m["tokens_per_s"] > 0 for m in metrics)
    (run_dir,) = (tmp_path / "runs").iterdir()
    log = (run_dir / "logs" / "local.log").read_text()
    train_loss = float(re.search(r"^HFSCALE_TRAIN done step=200 train_loss=([\d.]+) resumed_from=-$", log, re.M)[1])
    # the Trainer's log dicts go to the node log; the terminal gets the progress line
    losses = [float(x) for x in re.findall(r"'loss': '([\d.]+)'", log)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, losses  # it learns
    last = re.search(r"^hfscale: step 200/200 \(100%\) \| loss ([\d.]+) ", r.stdout, re.M)[1]
    # the terminal: hfscale's own lines only (no internal HFSCALE_ line, no library line), ending with the
    # summary (the loss the progress line showed, and the run's mean, named) and the next commands
    name = run_dir.name
    summary = (rf"hfscale: {name} finished in \dm\d\ds: step 200/200, loss {last} \(the last logged; mean over the "
               rf"run {train_loss:.4f}\), [\d.]+k tokens/s")
    shown = r.stdout.splitlines()
    assert re.fullmatch(summary, shown[-6]), shown[-6:]
    assert shown[-5:] == ["hfscale: newest checkpoint output/tiny_cpu/checkpoint-200", "next:",
                          f"  hfscale status {name}", f"  hfscale report {name}",
                          f"  hfscale export {name} --out tiny_cpu-model"]
    ours = ("hfscale: ", "next:", "  hfscale ")
    assert [line for line in (r.stdout + r.stderr).splitlines() if not line.startswith(ours)] == []
    print("the README's main job, its terminal:", r.stderr, r.stdout, sep="\n")
    # the next commands as printed, on the README's install: it has no matplotlib (hfscale[report] adds it)
    blocked = tmp_path / "no-matplotlib"
    (blocked / "matplotlib").mkdir(parents=True)
    (blocked / "matplotlib" / "__init__.py").write_text('raise ImportError("No module named \'matplotlib\'")\n')
    for command in shown[-3:]:
        done = run_as_written(Command("terminal", 0, command.strip(), 0), tmp_path, tmp_path / "doc-bin",
                              env={"PYTHONPATH": str(blocked)})
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        if " export " in command:  # the libraries' lines (DeepSpeed's 'Detected checkpoint ...') go to the run's log
            assert [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("hfscale: ")] == []
            (log,) = (tmp_path / "runs").glob("tiny_cpu-*/logs/export.log")
            assert "Detected checkpoint of type" in log.read_text()
    assert (tmp_path / "tiny_cpu-model" / "model.safetensors").is_file()
    assert "plot not drawn: matplotlib is not installed" in next((tmp_path / "runs").glob("tiny_cpu-*/report.html")).read_text()

    again = _launch(config, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to train: output/tiny_cpu/checkpoint-200 is at step 200, max_steps is 200" in again.stderr
    assert len(list((tmp_path / "runs").iterdir())) == 1  # nothing was started

    # then what README.md and docs/ show about this run (runs, status, logs, report, export), as written
    shown = {c.text: c for c in commands() if c.after_main_job and c.text not in NOT_HERE}
    assert {"hfscale status runs/tiny_cpu-*", "hfscale export runs/tiny_cpu-* --out tiny-model"} <= set(shown)
    for c in shown.values():
        r = run_as_written(c, tmp_path, tmp_path / "doc-bin")
        assert r.returncode == c.expect, f"{c}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    assert (tmp_path / "tiny-model" / "model.safetensors").is_file()
    assert any((tmp_path / "runs").glob("tiny_cpu-*/report.html"))

    # the README's two commands in one clone: the tests pass where the main job has run. A copy of this
    # checkout with the main job's output/ and runs/ in it (as they are after README command 1), and its
    # fast tier run there: a test that reads the working directory's ./output or ./runs fails here
    clone = tmp_path / "clone"
    top = {".git", ".cache", "runs", "output", "hfscale.egg-info", ".pytest_cache"}  # this checkout's own, at its root
    shutil.copytree(ROOT, clone, ignore=lambda d, names: [n for n in names if n == "__pycache__"
                                                          or (Path(d) == ROOT and n in top)])
    for made in ("output", "runs"):  # as they are: the run's stack FIFOs too
        subprocess.run(["cp", "-a", str(tmp_path / made), str(clone / made)], check=True)
    # (the unit modules named: the same tests as `-m unit`, without importing every other module to collect
    # it, which took 45 % of the CPU)
    unit = [f"tests/{name}.py" for name in sorted(UNIT_MODULES)]
    tier = subprocess.run([sys.executable, "-m", "pytest", "-m", "unit", "-q", "-n", "0", "-p", "no:cacheprovider", *unit],
                          cwd=clone, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(clone)})
    assert tier.returncode == 0, tier.stdout[-4000:] + tier.stderr[-2000:]
    print("the fast tier where the main job has run:", tier.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_existing_script_example(tmp_path):
    doc = yaml.safe_load((ROOT / "examples/existing_script/config.yaml").read_text())
    doc["training"]["script"] = str(ROOT / doc["training"]["script"])
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(doc))
    r = _launch(config, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    out = tmp_path / "output" / "existing_script"
    marker = json.loads((out / "checkpoint-40" / "hfscale_complete.json").read_text())
    assert marker["global_step"] == 40 and marker["world_size"] == 2
    assert any(name.startswith("global_step40/") for name in marker["files"])  # DeepSpeed shards listed
    assert (out / "hfscale_metrics.jsonl").read_text().count('"event": "metrics"') == 4


def _workers(job_id: str) -> list[int]:
    """PIDs of this job's training processes: the Python processes (carrying the job id in the environment
    they started with) that the node's launcher, torchrun, started, as new interpreters or forked from it
    (runner.warm_start), the keeper's shell it also holds excluded."""
    def read(pid: str, name: str) -> bytes:
        try:
            return (Path("/proc") / pid / name).read_bytes()
        except OSError:
            return b""

    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or f"HFSCALE_JOB_ID={job_id}".encode() not in read(p.name, "environ").split(b"\0"):
            continue
        stat = read(p.name, "stat")
        parent = stat[stat.rfind(b")") + 2:].split()[1].decode() if b")" in stat else ""
        argv0 = read(p.name, "cmdline").split(b"\0")[0]
        if b"python" in Path(argv0.decode(errors="replace")).name.encode() and b"torch.distributed.run" in read(parent, "cmdline"):
            pids.append(int(p.name))
    return pids


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_from_last_complete_checkpoint(tmp_path):
    doc = yaml.safe_load((ROOT / "examples/tiny_cpu/config.yaml").read_text())
    doc["runner"].update(max_restarts=1, launcher="torchrun")
    doc["cluster"]["master_port"] = 29531
    doc["training"].update(max_steps=60, save_steps=20, logging_steps=20, save_total_limit=None)
    doc["training"]["model"]["config"].update(n_layer=2, n_embd=64, n_head=2)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        job_id = None
        while job_id is None:
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline
            m = re.match(r"hfscale: job (\S+) on", line)
            job_id = m.group(1) if m else None
        marker = tmp_path / "output/tiny_cpu/checkpoint-20/hfscale_complete.json"
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the job ended before its first checkpoint"
            time.sleep(0.2)
        workers = _workers(job_id)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:] + err[-3000:]
    resumed = re.findall(r"hfscale: resuming from output/tiny_cpu/checkpoint-(\d+)", out)
    assert resumed and int(resumed[-1]) >= 20
    (log,) = (tmp_path / "runs").glob("tiny_cpu-*/logs/local.log")
    assert "HFSCALE_TRAIN done step=60" in log.read_text() and "HFSCALE_TRAIN" not in out
