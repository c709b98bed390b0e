"""Living with runs: what the terminal shows (hfscale.launch.attempt.console), and hfscale runs / status / logs /
stop on real runs of the built-in entry point (2 CPU processes)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, job_pids
from hfscale.launch.attempt.console import Console, progress_text
from hfscale.launch.run_dir import read_cleanup
from hfscale.runs.registry import RunInfo, run_info

WARN = ("/usr/lib/python3/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: `all_gather_into_tensor` "
        "is deprecated.")
LINES = [
    "hfscale: resuming from out/checkpoint-10",
    WARN,
    "  return func(*args, **kwargs)",
    "[2026-11-24 20:28:23,166] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
    "[W1124 20:53:40.275528081 Utils.hpp:137] Warning: Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated",
    "W1124 20:53:40.275000 123 torch/distributed/run.py:766] Setting OMP_NUM_THREADS environment variable",
    "{'loss': '5.291', 'grad_norm': '2.181', 'learning_rate': '0.00095', 'epoch': '0.000109'}",
    "{'hfscale/step_time_s': '0.08425', 'epoch': '0.000109'}",
    "",
    "{'train_runtime': '1.365', 'train_loss': '5.001', 'epoch': '0.00109'}",
    "node1: " + WARN,
    "node1:   warnings.warn(",
    "node1: Traceback (most recent call last):",
    'node1:   File "train.py", line 3, in <module>',
    "node1: RuntimeError: CUDA out of memory",
    "node0: [rank0]: ValueError: bad batch",
    "hfscale: node1 failed (exit code 1); stopping the job on every node",
]


def _shown(mode: str) -> list[str]:
    c = Console(mode, io.StringIO(), tty=False)
    return [line for line in LINES if c.shown(line)]


def test_the_terminal_keeps_errors_and_hfscale_lines_and_drops_library_noise():
    assert _shown("normal") == [
        "hfscale: resuming from out/checkpoint-10",
        "node1: Traceback (most recent call last):",
        'node1:   File "train.py", line 3, in <module>',
        "node1: RuntimeError: CUDA out of memory",
        "node0: [rank0]: ValueError: bad batch",
        "hfscale: node1 failed (exit code 1); stopping the job on every node",
    ]
    assert _shown("quiet") == [
        "node1: Traceback (most recent call last):",
        'node1:   File "train.py", line 3, in <module>',
        "node1: RuntimeError: CUDA out of memory",
        "node0: [rank0]: ValueError: bad batch",
        "hfscale: node1 failed (exit code 1); stopping the job on every node",
    ]
    assert _shown("verbose") == LINES


def test_a_traceback_ends_at_its_exception_line_with_or_without_prefixes():
    """A local run's lines carry no host: "ValueError: ..." is the exception, not a host named
    ValueError; a "[rank0]: " traceback ends at its exception too. Lines after it are filtered again."""
    local = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
             "ValueError: bad batch", "W1124 20:53:40.275000 123 torch/distributed/run.py:766] noise",
             "plain info line"]
    rank = ["node0: [rank0]: Traceback (most recent call last):", 'node0: [rank0]:   File "t.py", line 1, in <module>',
            "node0: [rank0]: RuntimeError: boom", "node0: [rank0]: W1124 20:53:40.275000 1 x.py:1] noise",
            "node0: [rank0]: plain info line"]
    for hosts, lines in ((frozenset({"local"}), local), (frozenset({"node0", "node1"}), rank)):
        quiet = Console("quiet", io.StringIO(), tty=False, hosts=hosts)
        assert [line for line in lines if quiet.shown(line)] == lines[:3]
        normal = Console("normal", io.StringIO(), tty=False, hosts=hosts)
        assert [line for line in lines if normal.shown(line)] == lines[:3] + lines[4:]


def test_the_progress_line():
    from hfscale.core.records import Rank0Metrics as M

    m = M(step=120, max_steps=300, loss=4.12301, tokens_per_s=18234.0, eta_s=65.2)
    assert progress_text(m) == "hfscale: step 120/300 (40%) | loss 4.1230 | 18.2k tokens/s | ETA 1m05s"
    assert progress_text(M(step=5, max_steps=10), rate=0.5) == "hfscale: step 5/10 (50%) | ETA 0m10s"
    assert progress_text(M(loss=1.0)) is None
    out = io.StringIO()
    c = Console("normal", out, tty=True)
    c.progress("hfscale: step 1/2 (50%)")
    c("node0: RuntimeError: boom")
    c.close()
    # a line printed while the live line is up clears it and draws it again below
    assert out.getvalue() == ("\r\033[Khfscale: step 1/2 (50%)\r\033[Knode0: RuntimeError: boom\n"
                              "hfscale: step 1/2 (50%)\n")


def test_scheduler_commands_for_stop_and_status(tmp_path):
    """What reaches scancel/scontrol/sacct/kubectl comes from files only this user could write, checked by
    shape; the Kubernetes stop gets the objects' kinds, names and namespaces on stdin."""
    from hfscale.runs.stop import scheduler_command
    from hfscale.runs.registry import RunError

    run = tmp_path / "runs" / "x-1"
    run.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "runs", 0o700)

    def info(runner: str, slurm: str | None) -> RunInfo:
        return RunInfo(run, "20261125-000636-3820dc", runner, "submitted", None, None, None, None, None, None, None,
                       None, slurm)

    (run / "slurm_job_id").write_text("4242\n")
    assert scheduler_command(info("slurm", "4242"), "stop").real_argv() == ["scancel", "--", "4242"]
    assert scheduler_command(info("slurm", "4242"), "state").real_argv() == ["scontrol", "show", "job", "--oneliner",
                                                                             "4242"]
    assert scheduler_command(info("slurm", "4242"), "accounting").real_argv() == [
        "sacct", "--noheader", "--parsable2", "--allocations", "--jobs=4242",
        "--format=JobID,State,ExitCode,Submit,Start,End"]
    (run / "slurm_job_id").write_text("--me\n")
    with pytest.raises(RunError, match="'--me' is not a Slurm job id"):
        scheduler_command(info("slurm", "4242"), "stop")
    manifest = ("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: hfscale-3820dc\n  namespace: ml\n  labels:\n"
                "    hfscale.job: 20261125-000636-3820dc\ndata:\n  a: '***'\n")
    (run / "pytorchjob.yaml").write_text(manifest)
    cmd = scheduler_command(info("kubernetes", None), "stop")
    assert cmd.real_argv() == ["kubectl", "delete", "--ignore-not-found", "-f", "-"]
    assert yaml.safe_load(cmd.stdin.real) == {"apiVersion": "v1", "kind": "ConfigMap",
                                              "metadata": {"name": "hfscale-3820dc", "namespace": "ml"}}
    (run / "pytorchjob.yaml").chmod(0o666)
    with pytest.raises(RunError, match="pytorchjob.yaml: the file is writable by group and others"):
        scheduler_command(info("kubernetes", None), "stop")


def _job(tmp: Path, name: str, steps: int, port: int, extra_env: dict | None = None, python: str | None = None) -> Path:
    doc = {"name": name, "cluster": {"nproc_per_node": 2, "master_port": port},
           "runner": {"launcher": "torchrun", "run_dir": str(tmp / "runs"), **({"python": python} if python else {})},
           "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}}, "precision": "no",
           "batch": {"micro_batch_size": 2, "global_batch_size": 8},
           "env": {"vars": {"OMP_NUM_THREADS": "1", **(extra_env or {})}},
           "training": {"output_dir": str(tmp / f"out-{name}"), "max_steps": steps, "save_steps": 10,
                        "logging_steps": 2, "learning_rate": 1.0e-3,
                        "model": {"config": {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32,
                                             "vocab_size": 256, "n_positions": 64, "bos_token_id": 0,
                                             "eos_token_id": 0}},
                        "data": {"block_size": 32}}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def hfscale(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfscale", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 20-step run, launched with the default output."""
    tmp = tmp_path_factory.mktemp("runs")
    r = hfscale("launch", str(_job(tmp, "tiny", 20, 29881)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return tmp, r


@pytest.mark.slow
def test_a_launch_shows_progress_and_keeps_warnings_in_the_logs(finished):
    tmp, r = finished
    assert "hfscale: step 20/20 (100%) | loss " in r.stdout
    assert "Warning" not in r.stdout and "{'loss'" not in r.stdout
    (run,) = (tmp / "runs").iterdir()
    log = (run / "logs" / "local.log").read_text()
    assert "FutureWarning" in log and "{'loss'" in log  # every line is in the node log


@pytest.mark.slow
def test_runs_status_and_logs_of_a_finished_run(finished):
    tmp, _ = finished
    (run,) = (tmp / "runs").iterdir()
    r = hfscale("runs", str(tmp / "runs"))
    assert r.returncode == 0, r.stderr
    header, line = r.stdout.splitlines()
    assert header.split() == ["run", "runner", "state", "steps", "loss", "started"]
    cells = line.split()
    assert cells[:4] == [run.name, "local", "finished", "20/20"] and float(cells[4]) > 0
    s = hfscale("status", run.name[-6:], "--runs-dir", str(tmp / "runs"))  # the job id's tail is enough
    assert s.returncode == 0, s.stderr
    assert "state        finished (exit code 0)" in s.stdout
    assert "ranks        2 reporting; steps 20..20" in s.stdout
    g = hfscale("logs", str(run), "--node", "0")
    assert g.returncode == 0 and "FutureWarning" in g.stdout and "HFSCALE_TRAIN done step=20" in g.stdout
    bad = hfscale("logs", str(run), "--node", "node9")
    assert bad.returncode == 2 and bad.stderr.startswith("error: no log of node 'node9'")
    missing = hfscale("status", "nope", "--runs-dir", str(tmp / "runs"))
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr


@pytest.mark.slow
def test_quiet_and_verbose(tmp_path):
    q = hfscale("launch", str(_job(tmp_path, "q", 4, 29882)), "--quiet")
    assert q.returncode == 0, q.stdout[-2000:] + q.stderr[-2000:]
    assert q.stdout == ""  # no errors: nothing but the start and end lines (on stderr)
    job = _job(tmp_path, "v", 4, 29883)
    doc = yaml.safe_load(job.read_text())
    job.write_text(yaml.safe_dump({**doc, "watchdog": {"timeout": None}}))
    v = hfscale("launch", str(job), "--verbose")
    assert v.returncode == 0 and "FutureWarning" in v.stdout and "{'loss'" in v.stdout
    assert "hfscale: step 4/4 (100%) | loss " in v.stdout  # the progress line, with the hang watchdog off


def _processes_of(marker: str) -> list[str]:
    """Processes whose command line or environment holds ``marker`` (the ranks get HFSCALE_RUN_DIR)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or proc.name == str(os.getpid()):
            continue
        try:
            if marker.encode() in (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes():
                found.append(proc.name)
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_stop_ends_a_running_run_on_every_rank(tmp_path):
    job = _job(tmp_path, "long", 100000, 29884)
    launcher = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(job)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        run = None
        while time.monotonic() < deadline:
            runs = list((tmp_path / "runs").glob("long-*"))
            if runs and run_info(runs[0]).step and run_info(runs[0]).step >= 2:
                run = runs[0]
                break
            time.sleep(0.5)
        assert run is not None, "the run did not reach step 2"
        assert run_info(run).state == "running"
        listed = hfscale("runs", str(tmp_path / "runs"))
        assert " running " in listed.stdout
        t0 = time.monotonic()
        r = hfscale("stop", run.name, "--runs-dir", str(tmp_path / "runs"), timeout=200)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stdout + r.stderr
        assert launcher.wait(timeout=30) == 143
        info = run_info(run)
        assert info.state == "stopped" and info.exit_code == 143
        time.sleep(1)
        assert _processes_of(str(run)) == []
        print(f"stopped in {took:.1f} s at step {info.step}")
        again = hfscale("stop", run.name, "--runs-dir", str(tmp_path / "runs"))
        assert again.returncode == 2 and "is not running (state stopped)" in again.stderr
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_launcher_gone_without_a_word_is_died(tmp_path):
    run = tmp_path / "runs" / "x-1"
    (run / "logs").mkdir(parents=True)
    (run / "plan.txt").write_text("plan\n")
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run / "state.json").write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "state": "running",
                                                "started": time.time()}))
    assert run_info(run).state == "died"
    from hfscale.core.untrusted import Unreadable

    for bad in ('{"argv": ["pdsh"]', '{"argv": "pdsh -w h kill", "env": {}, "cwd": null}',
                '{"argv": ["pdsh"], "env": {"A": 1}, "cwd": null}'):  # cut short; argv a string; a number in env
        (run / "cleanup.json").write_text(bad)
        with pytest.raises(Unreadable):
            read_cleanup(run)
    r = hfscale("stop", str(run))
    assert r.returncode == 2 and "its recorded cleanup cannot be used" in r.stderr and "env.A" in r.stderr, r.stderr
    (run / "state.json").write_text(json.dumps({"pid": os.getpid(), "host": "elsewhere", "state": "running"}))
    assert run_info(run).state == "running"  # another host's process cannot be checked from here
    r = hfscale("stop", str(run))
    assert r.returncode == 2 and f"was launched on elsewhere (pid {os.getpid()}): run hfscale stop there" in r.stderr


def test_stop_of_a_died_run_runs_its_recorded_cleanup(tmp_path):
    """The launcher killed -9 leaves its node's processes running; ``hfscale stop`` then runs the
    cleanup the launch recorded (0600) and nothing of the job is left. The launcher is a stand-in
    that starts a long sleep (no torch: what is stopped is the job's processes, whatever they are)."""
    standin = tmp_path / "python"
    standin.write_text("#!/bin/sh\nsleep 300 &\nwait\n")
    standin.chmod(0o755)
    launcher = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(_job(tmp_path, "orphans", 4, 29885,
                                python=str(standin)))], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        run = job = None
        while time.monotonic() < deadline and not (job and len(job_pids(job)) >= 2):
            runs = list((tmp_path / "runs").glob("orphans-*"))
            run = runs[0] if runs else None
            job = run_info(run).job_id if run else None
            time.sleep(0.2)
        assert run is not None and job and len(job_pids(job)) >= 2, "the stand-in and its sleep did not start"
        assert oct((run / "cleanup.json").stat().st_mode & 0o777) == "0o600"
        assert read_cleanup(run) is not None
        (run / "cleanup.json").chmod(0o622)  # a file others could have written is not run
        with pytest.raises(Exception, match="writable by group and others"):
            read_cleanup(run)
        (run / "cleanup.json").chmod(0o600)
        launcher.kill()
        launcher.wait(timeout=10)
        left = job_pids(job)
        assert left and run_info(run).state == "died"  # the sleep outlives its launcher
        r = hfscale("stop", str(run))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "died; running the recorded cleanup (bash) on every host" in r.stdout
        deadline = time.monotonic() + 5
        while job_pids(job) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job_pids(job) == [] and run_info(run).state == "stopped"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in job_pids(job) if job else []:
            os.kill(pid, 9)


@pytest.mark.slow
def test_report_and_export_of_a_run_by_name(finished, tmp_path):
    tmp, _ = finished
    (run,) = (tmp / "runs").iterdir()
    r = hfscale("report", run.name, "--runs-dir", str(tmp / "runs"), "--out", str(tmp_path / "r.html"))
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "r.html").read_text()
    assert page.count("<svg") >= 5 and "Loss" in page
    e = hfscale("export", run.name, "--runs-dir", str(tmp / "runs"), "--out", str(tmp_path / "model"))
    assert e.returncode == 0, e.stderr
    assert "(zero2; weights: fp32 master weights" in e.stdout and "checkpoint-20" in e.stdout
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert model.config.n_embd == 32 and model.num_parameters() > 0
    again = hfscale("export", run.name, "--runs-dir", str(tmp / "runs"), "--out", str(tmp_path / "model"))
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "Traceback" not in again.stderr


def test_a_runs_end_state_comes_from_what_ended_it_not_from_its_exit_code():
    from hfscale.core.exitcodes import HUNG, state_of

    assert state_of(0) == "finished" and state_of(0, submitted=True) == "submitted"
    assert state_of(143, signalled=True) == state_of(130, signalled=True) == "stopped"
    assert state_of(143) == state_of(130) == "failed"  # a node killed by someone else's TERM, a script's exit(130)
    assert state_of(HUNG, hung=True) == "hung" and state_of(HUNG) == "failed"  # a script may exit 4 itself


def test_logs_follow_prints_every_line_then_ends_with_the_run(tmp_path):
    """hfscale logs --follow on a run that ends: every line (a last one without its newline too),
    each prefixed with its node when there are several logs, and it returns once the run ended."""
    from hfscale.launch.attempt.follow import READ_LIMIT
    from hfscale.runs.registry import follow_logs

    run = tmp_path / "runs" / "x-1"
    (run / "logs").mkdir(parents=True)
    (run / "state.json").write_text(json.dumps({"state": "finished", "exit_code": 0}))
    long = "y" * 1000
    (run / "logs" / "node0.log").write_text("a\n" + (long + "\n") * (2 * READ_LIMIT // 1000) + "last without newline")
    (run / "logs" / "node1.log").write_text("b\n")
    seen: list[str] = []
    follow_logs(run, sorted((run / "logs").glob("*.log")), seen.append, poll_s=0.01)
    assert seen[0] == "[node0] a" and seen.count(f"[node0] {long}") == 2 * READ_LIMIT // 1000
    assert "[node1] b" in seen and seen[-1] == "[node0] last without newline"
    one: list[str] = []
    follow_logs(run, [run / "logs" / "node1.log"], one.append)
    assert one == ["b"]


def test_state_json_holds_a_launcher_only_when_a_launch_records_one(tmp_path):
    """A stop on a run directory without state.json must not record the stopping process as its
    launcher (which a later stop would then signal)."""
    from hfscale.launch.run_dir import read_state, record_state, this_launcher

    record_state(tmp_path, stop_requested=1.7e9)
    assert read_state(tmp_path).model_dump(exclude_none=True) == {"stop_requested": 1.7e9}
    record_state(tmp_path, **this_launcher(), state="running")
    doc = read_state(tmp_path)
    assert doc.pid == os.getpid() and doc.state == "running" and doc.stop_requested == 1.7e9
    assert doc.proc_start and doc.boot_id  # the launcher's identity: a pid alone proves nothing


def test_a_run_is_found_by_its_job_name(tmp_path):
    """`hfscale status tiny_cpu`: the job name finds its run; with two runs of it, exit 2 names both
    and the newest."""
    from hfscale.runs.registry import PLAN_FILE, RunError, find_run

    def make(name: str) -> Path:
        d = tmp_path / name
        (d / "logs").mkdir(parents=True)
        (d / PLAN_FILE).write_text("{}")
        return d

    first = make("tiny_cpu-20261126-052511-3820dc")
    make("tiny_cpu_big-20261126-052600-aaaaaa")  # another job whose name starts the same
    assert find_run("tiny_cpu", tmp_path) == first
    make("tiny_cpu-20261126-062511-4920ef")
    with pytest.raises(RunError) as e:
        find_run("tiny_cpu", tmp_path)
    assert "matches 2 runs" in str(e.value) and "the newest: tiny_cpu-20261126-062511-4920ef" in str(e.value)
