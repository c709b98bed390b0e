"""hfscale launch with runner type slurm on a real Slurm: 2 namespace nodes, the built-in entry point.

Uses the ``slurm2`` fixture (tests/cluster: slurmctld + munged on node0, one slurmd per node); it
skips with the reason when this machine cannot host it (not root, slurm-wlm/munge missing) and
fails instead under CI=true. ``hfscale launch`` runs in the root namespace with ``slurm2.env()``
(SLURM_CONF, this Python first in PATH); sbatch hands the job that environment.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from hfscale.launch.attempt.first_failure import FirstFailure
from hfscale.launch.attempt.node_lines import Failure, Nodes, parse
from hfscale.launch.node.stopping import STOP_GRACE_S
from hfscale.launch.runners.slurm_step import srun_argv

pytestmark = pytest.mark.slow

MAX_STEPS, SAVE_STEPS = 40, 10
# ~0.2 s per step on this 2-core machine: a signal sent once checkpoint-10 is complete lands
# seconds before the last step.
MODEL = {"model_type": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 256, "n_positions": 128,
         "bos_token_id": 0, "eos_token_id": 0}


def write_config(tmp_path: Path, *, port: int, requeue: bool = False) -> Path:
    cfg = {
        "name": "sl",
        "cluster": {"num_nodes": 2, "nproc_per_node": 1, "master_port": port},
        "runner": {"type": "slurm", "launcher": "torchrun", "run_dir": str(tmp_path / "runs"),
                   "slurm": {"job_name": "hfs-test", "requeue": requeue}},
        "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2, "steps_per_print": 100000}},
        "precision": "no",
        "batch": {"micro_batch_size": 8, "gradient_accumulation_steps": 1},
        "env": {"vars": {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions"),
                         "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                         "HF_DATASETS_OFFLINE": "1"}},
        "training": {"script": None, "output_dir": str(tmp_path / "out"), "max_steps": MAX_STEPS,
                     "save_steps": SAVE_STEPS, "logging_steps": 10, "learning_rate": 1e-3,
                     "model": {"config": MODEL}, "data": {"block_size": 128}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@dataclass
class Submitted:
    job: str
    run_dir: Path
    out_dir: Path
    launch_output: str
    t0: float

    @property
    def log(self) -> Path:
        return self.run_dir / f"slurm-{self.job}.out"

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no output file)"


def submit(slurm, tmp_path: Path, **kw) -> Submitted:
    config = write_config(tmp_path, **kw)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=tmp_path, env=slurm.env(),
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    m = re.search(r"hfscale: submitted Slurm job (\d+); output in (\S+)/slurm-\1\.out", out)
    assert m, out
    run_dir = Path(m.group(2))
    assert (run_dir / "slurm_job_id").read_text().strip() == m.group(1)
    return Submitted(m.group(1), run_dir, tmp_path / "out", out, t0)


def finish(slurm, sub: Submitted, timeout: float = 400) -> dict[str, str]:
    try:
        info = slurm.wait(sub.job, timeout=timeout)
    except TimeoutError:
        slurm.run("scancel", sub.job, check=False)
        raise
    print(f"SLURM_TIMING job {sub.job}: submit to {info['JobState']} {time.monotonic() - sub.t0:.1f}s", flush=True)
    return info


EXIT_LINE = re.compile(r"HFSCALE_EXIT rc=(\d+) time=(\d+)$")  # the batch script's last line


def ended_with(text: str, rc: int) -> bool:
    """Whether the output ends with the batch script's exit line, exit code ``rc``, a time in it."""
    m = EXIT_LINE.search(text.rstrip())
    return m is not None and int(m.group(1)) == rc and abs(int(m.group(2)) - time.time()) < 3600


def status(slurm, sub_run_dir: Path) -> str:
    """``hfscale status`` of a submitted run, as the user runs it (Slurm's environment)."""
    r = subprocess.run([sys.executable, "-m", "hfscale", "status", sub_run_dir.name, "--runs-dir",
                        str(sub_run_dir.parent)], env=slurm.env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def slurm_times(text: str) -> tuple[float, float]:
    """(submitted, ended) from ``hfscale status``'s started line (Slurm's times, to the second)."""
    m = re.search(r"^started      \S+ \S+ \(Slurm\); submitted (\S+ \S+); ended (\S+ \S+)$", text, re.M)
    assert m, text
    return tuple(time.mktime(time.strptime(w, "%Y-%m-%d %H:%M:%S")) for w in m.groups())  # type: ignore[return-value]


def trainer_losses(checkpoint: Path) -> dict[int, float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}


@pytest.fixture(scope="module")
def uninterrupted(slurm2, tmp_path_factory):
    """One uninterrupted run, shared: test 1 checks it, the preemption tests compare against it."""
    tmp = tmp_path_factory.mktemp("slurm-plain-")
    sub = submit(slurm2, tmp, port=29721)
    return sub, finish(slurm2, sub)


def test_two_node_training_runs_to_completion(slurm2, uninterrupted):
    sub, info = uninterrupted
    text = sub.text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-4000:]
    assert info["NodeList"] == "node[0-1]" and info["Restarts"] == "0" and info["JobName"] == "hfs-test"
    assert f"hfscale: job {sub.job} on node[0-1], master node0, restart 0" in text
    assert f"HFSCALE_TRAIN done step={MAX_STEPS} " in text and "resumed_from=-" in text
    assert ended_with(text, 0), text[-3000:]
    said = status(slurm2, sub.run_dir)  # the real outcome, not sbatch's exit code
    assert f"state        finished (exit code 0); Slurm job {sub.job}: COMPLETED, from scontrol\n" in said, said
    submitted, ended = slurm_times(said)
    assert ended > submitted, said
    # both ranks took part: per-rank RNG states and ZeRO optimizer shards, world size 2 in the metrics
    last = sub.out_dir / f"checkpoint-{MAX_STEPS}"
    assert (last / "hfscale_complete.json").exists()
    assert {p.name for p in last.glob("rng_state_*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}
    shards = {p.name for p in (last / f"global_step{MAX_STEPS}").glob("zero_pp_rank_*_optim_states.pt")}
    assert shards == {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    metrics = [json.loads(line) for line in (sub.out_dir / "hfscale_metrics.jsonl").read_text().splitlines()]
    assert {m["world_size"] for m in metrics} == {2}
    assert sorted(p.name for p in sub.out_dir.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (10, 20, 30, 40)]
    assert slurm2.job_processes(timeout=10) == {}


@pytest.mark.parametrize("how", ["usr1-notice", "scontrol-requeue"])
def test_preempted_job_saves_requeues_and_resumes_to_the_same_result(slurm2, uninterrupted, tmp_path, how):
    """usr1-notice: the preemption notice (``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@N``
    sends before the time limit) reaches the batch script, which forwards it to the ranks and requeues
    the job itself. scontrol-requeue: an outside requeue, Slurm sends SIGTERM to every process."""
    port = 29722 if how == "usr1-notice" else 29723
    sub = submit(slurm2, tmp_path, port=port, requeue=True)
    first = sub.out_dir / f"checkpoint-{SAVE_STEPS}"
    deadline = time.monotonic() + 300
    while not (first / "hfscale_complete.json").exists():
        state = slurm2.state(sub.job)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"{state} before checkpoint-10:\n{sub.text()[-4000:]}"
        assert time.monotonic() < deadline, sub.text()[-4000:]
        time.sleep(0.1)
    print(f"SLURM_TIMING job {sub.job}: submit to checkpoint-{SAVE_STEPS} {time.monotonic() - sub.t0:.1f}s")
    t_signal = time.monotonic()
    if how == "usr1-notice":
        slurm2.run("scancel", "--signal=USR1", "--batch", sub.job)
    else:
        slurm2.run("scontrol", "requeue", sub.job)
    info = finish(slurm2, sub)
    print(f"SLURM_TIMING job {sub.job}: signal to {info['JobState']} {time.monotonic() - t_signal:.1f}s")
    text = sub.text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-5000:]
    assert info["Restarts"] == "1", text[-5000:]

    # the first run saved a checkpoint at the next step boundary and stopped
    saved = re.search(r"HFSCALE_TRAIN preempted, checkpoint saved step=(\d+) ", text)
    assert saved, text[-5000:]
    step = int(saved.group(1))
    assert SAVE_STEPS < step < MAX_STEPS
    signame = "SIGUSR1" if how == "usr1-notice" else "SIGTERM"
    assert f"preemption: saving checkpoint-{step} and stopping ({signame})" in text
    assert (sub.out_dir / f"checkpoint-{step}" / "hfscale_complete.json").exists()
    if how == "usr1-notice":
        assert "hfscale: preemption notice, the ranks save and stop" in text
        assert "hfscale: requeueing" in text  # the script's own requeue may end it before it exits
    else:
        assert f"JOB {sub.job} ON node0 CANCELLED AT" in text and "DUE TO JOB REQUEUE" in text

    # the requeued run (appended to the same output file) resumed from it and finished
    first_run, _, second_run = text.partition(f"hfscale: job {sub.job} on node[0-1], master node0, restart 1")
    assert second_run, text[-5000:]
    assert "HFSCALE_TRAIN done" not in first_run
    resumed_from = sub.out_dir / f"checkpoint-{step}"
    assert f"hfscale: resuming from {resumed_from}" in second_run
    assert f"HFSCALE_TRAIN done step={MAX_STEPS} " in second_run and f"resumed_from={resumed_from}" in second_run
    assert ended_with(second_run, 0), second_run[-3000:]

    # same final step, and the same losses after the interruption as the uninterrupted run
    ref, _ = uninterrupted
    last = sub.out_dir / f"checkpoint-{MAX_STEPS}"
    assert json.loads((last / "trainer_state.json").read_text())["global_step"] == MAX_STEPS
    got, want = trainer_losses(last), trainer_losses(ref.out_dir / f"checkpoint-{MAX_STEPS}")
    for s in (30, 40):  # the step-20 entry averages fewer steps after a resume (logging, not training)
        assert got[s] == pytest.approx(want[s], rel=1e-5), (s, got, want)
    assert slurm2.job_processes(timeout=10) == {}


# ---- the death of srun: nothing of the job may outlive it --------------------------------------

PROBE = str(ROOT / "tests" / "scripts" / "dist_probe.py")


def probe_config(tmp_path: Path, port: int, stubborn: bool = False) -> Path:
    """Two nodes of the dist_probe: ranks block in all_reduce until killed (stubborn: rank 1
    ignores TERM, INT and HUP)."""
    cfg = yaml.safe_load(write_config(tmp_path, port=port).read_text())
    mode = ["--mode", "stubborn", "--rank", "1"] if stubborn else ["--mode", "hang"]
    cfg["training"] = {"script": PROBE, "script_args": mode, "pass_args": "none"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _srun_pids() -> list[int]:
    """srun processes on this machine (the launch step's srun and the helper it forks)."""
    from cluster import cmdline

    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and (cmdline(int(p.name)) or "").startswith("srun --nodes=")]


def _kill(pids: list[int]) -> None:
    import os
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for_lines(read, marker: str, count: int, timeout: float) -> str:
    seen, deadline = "", time.monotonic() + timeout
    while seen.count(marker) < count:
        assert time.monotonic() < deadline, seen[-3000:]
        seen += read()
        time.sleep(0.2)
    return seen


def test_killed_srun_of_a_submitted_job_leaves_nothing(slurm2, tmp_path):
    """The batch script sees its step end (137), exits, and the job's end ends every step."""
    config = probe_config(tmp_path, 29724)
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=tmp_path, env=slurm2.env(),
                       capture_output=True, text=True, timeout=120)
    m = re.search(r"hfscale: submitted Slurm job (\d+); output in (\S+)/slurm-\1\.out", r.stdout + r.stderr)
    assert r.returncode == 0 and m, r.stdout + r.stderr
    log = Path(m.group(2)) / f"slurm-{m.group(1)}.out"
    _wait_for_lines(lambda: log.read_text() if log.exists() else "", "PROBE_READY", 2, 120)
    assert slurm2.job_processes() != {}
    t0 = time.monotonic()
    _kill(_srun_pids())
    left = slurm2.job_processes(timeout=15)
    print(f"submitted job: srun killed, nothing left after {time.monotonic() - t0:.1f}s")
    assert left == {}, left
    info = slurm2.wait(m.group(1), timeout=30)
    assert info["ExitCode"] == "137:0", info
    assert ended_with(log.read_text(), 137), log.read_text()[-3000:]
    # hfscale status: the job FAILED with 137 (not "submitted (exit code 0)", sbatch's), ended after its submission
    said = status(slurm2, log.parent)
    assert f"state        failed (exit code 137); Slurm job {m.group(1)}: FAILED (NonZeroExitCode), from scontrol\n" \
        in said, said
    submitted, ended = slurm_times(said)
    assert ended > submitted, said
    print(f"hfscale status of the killed job:\n{said}")


def test_a_failed_task_leaves_the_node_that_failed_first_its_exit_line(slurm2, tmp_path):
    """The order a loaded CI run saw (test_recovery_slurm): node1's rank SIGKILLed, but node2, whose
    rank lost it as a peer, exited first; srun's ``--kill-on-bad-exit=1`` then killed node1's task
    before its exit line and node2 was named. An attempt's step (slurm_step.srun_argv) leaves each
    task its own end: here node1's task only lost a peer and exits at once, node0's failed first and
    says so 3 s later; hfscale's reading of the lines (node_lines, first_failure) names node0."""
    hosts, out = tmp_path / "step_hosts", tmp_path / "step.out"
    hosts.write_text("node0\nnode1\n")
    task = ('h=$SLURMD_NODENAME; if [ "$h" = node1 ]; then echo "$h: RuntimeError: Connection reset by peer"; '
            'echo "$h: HFSCALE_EXIT rc=1"; exit 1; fi; sleep 3; echo "$h: HFSCALE_EXIT rc=1"; exit 1')
    step = shlex.join([*srun_argv(str(hosts), 2), "bash", "-c", task])
    info = slurm2.wait(slurm2.sbatch("-N2", f"--output={out}", "--wrap", step, cwd=tmp_path), timeout=60)
    lines = out.read_text().splitlines()
    assert info["JobState"] == "FAILED" and "node0: HFSCALE_EXIT rc=1" in lines, lines
    named: list[Failure] = []
    nodes, first = Nodes(), FirstFailure(named.append)
    for line in lines:
        if (failure := nodes.see(parse(line))) is not None:
            first.offer(failure)
    first.settle(all_ended=True)
    assert [(f.where, f.lost_peer) for f in named] == [("node0", False)], (named, lines)


@pytest.mark.parametrize("how", ["srun-killed", "sigterm-stubborn"])
def test_inside_an_allocation_nothing_outlives_the_launch(slurm2, tmp_path, how):
    """Inside an allocation that outlives the launch (salloc, then hfscale launch in it).
    srun-killed: a killed srun can leave its step's processes running until the allocation ends
    (measured without hfscale's stop: 2 of 4 runs left torchrun and the ranks for 15 s and more);
    hfscale sees the script fail and stops the job on every node with a step beside it.
    sigterm-stubborn: SIGTERM to hfscale while rank 1 ignores TERM: the stop's KILL pass ends it."""
    stubborn = how == "sigterm-stubborn"
    config = probe_config(tmp_path, 29725 if stubborn else 29726, stubborn=stubborn)
    shell = f"{sys.executable} -m hfscale launch {config} & h=$!; echo LAUNCHED=$h; wait $h; echo LAUNCH_RC=$?; sleep 120"
    proc = subprocess.Popen(["salloc", "--nodes=2", "bash", "-c", shell], cwd=tmp_path, env=slurm2.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        while sum("PROBE_READY" in line for line in seen) < 2:
            line = proc.stdout.readline()
            assert line, "".join(seen)
            seen.append(line)
        out = "".join(seen)
        allocation = re.search(r"Granted job allocation (\d+)", out).group(1)
        t0 = time.monotonic()
        if stubborn:
            import os
            import signal

            os.kill(int(re.search(r"LAUNCHED=(\d+)", out).group(1)), signal.SIGTERM)
        else:
            _kill(_srun_pids())
        while not any(line.startswith("LAUNCH_RC=") for line in seen):
            line = proc.stdout.readline()
            assert line, "".join(seen)
            seen.append(line)
        left = slurm2.job_processes(timeout=15)
        took = time.monotonic() - t0
        print(f"allocation, {how}: launch ended and nothing left after {took:.1f}s")
        out = "".join(seen)
        assert left == {}, (left, out[-3000:])
        # the stop's grace period (10 s) and Slurm's step cleanup; 15.1 s was seen with the other CI lane training
        assert took < STOP_GRACE_S + 8, out[-3000:]
        assert slurm2.state(allocation) == "RUNNING"  # the allocation's end did not do it
        if stubborn:
            assert "hfscale: got SIGTERM; stopping the job on every node" in out and "LAUNCH_RC=143" in out, out
        else:
            assert "hfscale: the slurm launch ended with exit code 137; stopping the job on every node" in out
            assert "LAUNCH_RC=137" in out
    finally:
        proc.kill()
        proc.wait()
        granted = re.search(r"Granted job allocation (\d+)", "".join(seen))
        if granted:
            slurm2.run("scancel", granted.group(1), check=False)


def test_status_asks_slurm_and_stop_cancels_the_submitted_job(slurm2, tmp_path):
    """hfscale status/stop of a submitted Slurm job hand the scheduler the recorded id only as an id
    (scontrol show job --oneliner N, scancel -- N), read from a file only this user could have written;
    once cancelled, status says so, with the end."""
    sub = submit(slurm2, tmp_path, port=29729)
    env = slurm2.env()
    try:
        s = subprocess.run([sys.executable, "-m", "hfscale", "status", sub.run_dir.name, "--runs-dir",
                            str(sub.run_dir.parent)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert s.returncode == 0, s.stderr
        assert re.search(rf"state        (pending|running); Slurm job {sub.job}: (PENDING|CONFIGURING|RUNNING)",
                         s.stdout), s.stdout
        r = subprocess.run([sys.executable, "-m", "hfscale", "stop", sub.run_dir.name,
                            "--runs-dir", str(sub.run_dir.parent)], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"hfscale: scancel -- {sub.job}: done;" in r.stdout
        info = slurm2.wait(sub.job, timeout=120)
        assert info["JobState"] == "CANCELLED", info
        said = status(slurm2, sub.run_dir)
        assert re.search(rf"^state        cancelled( \(signal 15\))?; Slurm job {sub.job}: CANCELLED, from scontrol$", said,
                         re.M), said
        assert "; submitted " in said and "; ended " in said, said
        assert slurm2.job_processes(timeout=30) == {}
    finally:
        slurm2.run("scancel", sub.job, check=False)
