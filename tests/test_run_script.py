"""hfscale.training.run_script, what each rank of a Trainer script runs: the flags only the rank can decide,
the refusal to start over over incomplete checkpoints, and the script run as `python SCRIPT ARGS`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hfscale.training.run_script import plan_start, sees_gpu

from test_checkpoint_files import trainer_checkpoint

NO_GPU = {"CUDA_VISIBLE_DEVICES": "", "WORLD_SIZE": "2"}


def test_gpu_visibility(monkeypatch):
    assert not sees_gpu({"CUDA_VISIBLE_DEVICES": ""}) and not sees_gpu({"CUDA_VISIBLE_DEVICES": "-1"})
    monkeypatch.setattr("glob.glob", lambda pattern: ["/dev/nvidia0"] if pattern == "/dev/nvidia[0-9]*" else [])
    assert sees_gpu({}) and sees_gpu({"CUDA_VISIBLE_DEVICES": "0,1"})
    assert not sees_gpu({"CUDA_VISIBLE_DEVICES": ""})


def test_fresh_output_dir_adds_use_cpu_only(tmp_path):
    args = ["--output_dir", str(tmp_path / "out"), "--max_steps", "40"]
    assert plan_start(args, NO_GPU) == ([*args, "--use_cpu", "true"], "", 0)
    assert plan_start([*args, "--use_cpu", "false"], NO_GPU) == ([*args, "--use_cpu", "false"], "", 0)


def test_resumes_from_the_newest_complete_checkpoint(tmp_path):
    trainer_checkpoint(tmp_path, 10)
    newest = trainer_checkpoint(tmp_path, 20)
    args = ["--output_dir", str(tmp_path), "--max_steps", "40", "--use_cpu"]
    assert plan_start(args, NO_GPU) == ([*args, "--resume_from_checkpoint", str(newest)],
                                        f"hfscale: resuming from {newest}", 0)
    given = [*args, "--resume_from_checkpoint", "elsewhere"]
    assert plan_start(given, NO_GPU) == (given, "", 0)  # the user's choice stands


def test_a_finished_run_is_not_started_again(tmp_path):
    d = trainer_checkpoint(tmp_path, 40)
    assert plan_start(["--output_dir", str(tmp_path), "--max_steps", "40"], NO_GPU) == (
        None, f"hfscale: nothing to train: {d} is at step 40, max_steps is 40", 0)


def test_incomplete_checkpoints_refuse_the_first_start_only(tmp_path):
    (trainer_checkpoint(tmp_path, 10) / "rng_state_1.pth").unlink()
    args = ["--output_dir", str(tmp_path), "--max_steps", "40"]
    run, say, code = plan_start(args, NO_GPU)
    assert (run, code) == (None, 2)
    assert say.startswith(f"hfscale: {tmp_path} holds 1 checkpoint(s) but none is complete (checkpoint-10: ")
    assert say.endswith("or start over with hfscale launch --restart (it moves them aside).")
    # a torchrun restart of this job (or a Slurm requeue) may start over: nothing of it was saved
    assert plan_start(args, {**NO_GPU, "TORCHELASTIC_RESTART_COUNT": "1"})[0] == [*args, "--use_cpu", "true"]


SCRIPT = """
    import os, sys
    print("ARGV", sys.argv)
    print("NAME", __name__, "PATH0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
    if "--fail" in sys.argv:
        raise RuntimeError("boom")
    if "--exit" in sys.argv:
        sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
"""


@pytest.fixture
def script(tmp_path) -> Path:
    p = tmp_path / "sub" / "train.py"
    p.parent.mkdir()
    p.write_text(textwrap.dedent(SCRIPT))
    return p


def _run(script: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfscale.training.run_script", str(script), *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})})


def test_the_script_runs_as_main_with_its_own_argv(script, tmp_path):
    r = _run(script, "--output_dir", str(tmp_path / "out"), "--x", "$(touch pwned)")
    assert r.returncode == 0, r.stderr
    assert f"ARGV {[str(script), '--output_dir', str(tmp_path / 'out'), '--x', '$(touch pwned)', '--use_cpu', 'true']}" \
        in r.stdout
    assert "NAME __main__ PATH0 True" in r.stdout
    assert not (tmp_path / "pwned").exists()


def test_the_scripts_failures_keep_their_exit_codes(script):
    r = _run(script, "--fail")
    assert r.returncode == 1 and "RuntimeError: boom" in r.stderr
    assert _run(script, "--exit", "3").returncode == 3
    assert _run(script, "--exit", "0").returncode == 0


def test_refusal_exits_2_before_the_script_runs(script, tmp_path):
    (trainer_checkpoint(tmp_path / "out", 10) / "trainer_state.json").unlink()
    r = _run(script, "--output_dir", str(tmp_path / "out"), env={"RANK": "0"})
    assert r.returncode == 2 and "ARGV" not in r.stdout
    assert "none is complete (checkpoint-10: no hfscale_complete.json, and by its own files: trainer_state.json " \
           "is missing" in r.stderr
    quiet = _run(script, "--output_dir", str(tmp_path / "out"), env={"RANK": "1"})
    assert quiet.returncode == 2 and quiet.stderr == ""  # only rank 0 says why
