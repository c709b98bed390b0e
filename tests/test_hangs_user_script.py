"""The hang watchdog on an unchanged Trainer script (tests/scripts/hf_clm.py) run through
hfscale.run_script (python -m), with and without py-spy (issue 23).

The bug is put in from outside, as a user's own would be: a sitecustomize.py on the ranks'
PYTHONPATH adds a Trainer callback that never returns on rank 1 at step 3, while rank 0 goes on
into DeepSpeed's next collective. The verdict must name rank 1 and the callback, not hfscale's own
flight-recorder thread (which faulthandler lists first under python -m)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, same_ninja

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "scripts" / "hf_clm.py"
MODEL = "n_layer=2,n_head=2,n_embd=32,vocab_size=256,n_positions=64,bos_token_id=0,eos_token_id=0"
HANG = textwrap.dedent('''\
    import os
    import sys

    if "hf_clm.py" in " ".join(sys.argv) and os.environ.get("HANG_RANK"):
        import transformers

        class NeverReturns(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if os.environ.get("RANK") == os.environ["HANG_RANK"] and state.global_step == 3:
                    import time
                    while True:
                        time.sleep(0.5)

        _init = transformers.Trainer.__init__

        def _with_the_bug(self, *a, **k):
            _init(self, *a, **k)
            self.add_callback(NeverReturns())

        transformers.Trainer.__init__ = _with_the_bug
''')


def config(tmp_path: Path, port: int, **runner) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HANG)
    doc = {
        "name": "hang-trainer", "cluster": {"nproc_per_node": 2, "master_port": port},
        "runner": {"run_dir": str(tmp_path / "runs"), **runner},
        "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2, "steps_per_print": 100000}},
        "precision": "no", "batch": {"micro_batch_size": 2},
        "env": {"vars": {"PYTHONPATH": str(site), "HANG_RANK": "1", "OMP_NUM_THREADS": "1"}},
        "watchdog": {"timeout": 5},
        "training": {"script": str(SCRIPT), "output_dir": "out", "max_steps": 50, "logging_steps": 1,
                     "script_args": ["--model_type", "gpt2", "--config_overrides", MODEL, "--block_size", "32",
                                     "--disable_tqdm", "true"]},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def hang_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-3000:]
    return next(x for x in r.stdout.splitlines() if x.startswith("hfscale: hang: "))


def test_the_stuck_callback_is_named_with_py_spy(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config(tmp_path, 29671))], cwd=tmp_path,
                       capture_output=True, text=True, timeout=400)
    line = hang_line(r)
    assert "rank 1 on " in line and "on_step_end (sitecustomize.py:" in line, line
    assert "_flight_loop" not in line
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "stacks" / "rank-1.txt").exists()  # py-spy's dump


def test_the_stuck_callback_is_named_without_py_spy(tmp_path):
    """No py-spy beside the interpreter or on PATH: faulthandler's dump, whose first thread is
    hfscale's flight recorder and whose main thread's outermost frame is runpy's."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # a script, not a symlink: Python finds its venv (pyvenv.cfg) beside the path it was started by, so a
    # symlinked venv interpreter in another folder is the base interpreter, without this checkout's packages
    (bindir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bindir / "python").chmod(0o755)
    same_ninja(bindir)
    env = {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch",
                        str(config(tmp_path, 29673, python=str(bindir / "python")))], cwd=tmp_path,
                       capture_output=True, text=True, timeout=400, env=env)
    line = hang_line(r)
    assert "rank 1 on " in line and "on_step_end (sitecustomize.py:" in line, line
    (run_dir,) = (tmp_path / "runs").iterdir()
    stacks = sorted(p.name for p in (run_dir / "stacks").iterdir())
    assert "rank-1.fh" in stacks and "rank-1.txt" not in stacks
