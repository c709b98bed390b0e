"""Real 2-process training: `hfscale config`, then `accelerate launch` of examples/accelerate_loop/train.py.

DeepSpeed runs on the CPU (DS_ACCELERATOR=cpu) with gloo; each run takes about 15 s on 2 cores, plus
about 30 s once per checkout while DeepSpeed builds its C++ op into TORCH_EXTENSIONS_DIR.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "accelerate_loop"
STEPS = 5
RANK_LINE = re.compile(
    r"HFSCALE_RANK rank=(\d+) world_size=(\d+) steps=(\d+) loss=(\S+) distributed_type=(\w+) zero_stage=(\d+|-)"
)


def _launch(config: Path, out: Path, max_steps: int = STEPS) -> subprocess.CompletedProcess:
    r = run_cli("config", str(config), "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(out / "accelerate_config.yaml"),
           str(EXAMPLE / "train.py"), "--config", str(config), "--max-steps", str(max_steps)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]}
    return subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)


def _variant(tmp_path: Path, **changes) -> Path:
    """A copy of the example config with top-level sections replaced."""
    doc = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    doc.update(changes)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_loop_trains_on_two_ranks(stage, tmp_path):
    if stage == 2:
        config = EXAMPLE / "config.yaml"  # the example exactly as users run it
    else:
        doc = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
        config = _variant(tmp_path, distributed={"backend": "deepspeed", "deepspeed": {**doc["distributed"]["deepspeed"],
                                                                                      "stage": 3}})
    r = _launch(config, tmp_path / "generated")
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-8000:]

    ranks = RANK_LINE.findall(log)
    assert len(ranks) == 2, log[-8000:]
    assert {int(rank) for rank, *_ in ranks} == {0, 1}
    losses = []
    for rank, world, steps, loss, distributed_type, zero_stage in ranks:
        assert (int(world), int(steps)) == (2, STEPS)
        assert (distributed_type, zero_stage) == ("DEEPSPEED", str(stage))  # the live engine's stage
        assert math.isfinite(float(loss))
        losses.append(float(loss))
    assert losses[0] != losses[1], "both ranks saw the same batch: the data loader was not sharded"

    first = re.search(r"step 1/\d+ loss (\d+\.\d+)", log)
    last = re.search(rf"step {STEPS}/{STEPS} loss (\d+\.\d+)", log)
    assert first and last, log[-8000:]
    assert float(last.group(1)) < float(first.group(1)), "rank 0's loss did not go down"


def test_accelerate_loop_refuses_fsdp_on_cpu(tmp_path):
    """accelerate runs an FSDP config on CPU-only ranks with no engine at all (distributed_type NO):
    each rank would train its own model. The example must stop instead of pretending."""
    config = _variant(tmp_path, distributed={"backend": "fsdp", "fsdp": {"cpu_ram_efficient_loading": False}})
    r = _launch(config, tmp_path / "generated", max_steps=1)
    log = r.stdout + r.stderr
    assert r.returncode != 0
    assert "no distributed engine" in log, log[-8000:]
    assert not RANK_LINE.search(log)
