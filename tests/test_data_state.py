"""A streaming dataset resumes from its saved position, for real: an unchanged Trainer script
(tests/scripts/hf_clm_stream.py: ``datasets.load_dataset("json", streaming=True)`` and a ``.map()``
that logs every record it maps) under ``hfscale launch``, 2 ranks, DeepSpeed ZeRO-2 on the CPU.
A relaunch from a checkpoint maps only the records after it, and every step's loss equals the
uninterrupted run's; a checkpoint whose position cannot be read is replayed as the Trainer always
did, with the reason said, and trains the same. The pure parts: tests/test_data_state_unit.py; the
time a resume takes at step 20 and at step 2000: bench/bench_stream_resume.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "scripts" / "hf_clm_stream.py"
MODEL = "n_layer=2,n_head=2,n_embd=64,vocab_size=256,n_positions=64,bos_token_id=0,eos_token_id=0"
PER_STEP = 4 * 2  # micro batch 4, 2 ranks, no accumulation: records a step


def make_data(folder: Path, files: int = 4, records: int = 500) -> None:
    """``files`` JSON-lines files of 64-byte pieces of the standard library's source, ids in order."""
    text = b"".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("*.py"))[:20])
    folder.mkdir()
    n = 0
    for f in range(files):
        with open(folder / f"part-{f}.jsonl", "w") as out:
            for _ in range(records):
                piece = text[(n * 64) % (len(text) - 64):][:64].decode("latin-1")
                out.write(json.dumps({"id": n, "text": piece}) + "\n")
                n += 1


def write_config(tmp_path: Path, max_steps: int, save_steps: int) -> Path:
    doc = {
        "name": "stream",
        "cluster": {"nproc_per_node": 2, "master_port": 29651},
        "runner": {"launcher": "accelerate"},
        "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2, "steps_per_print": 100000}},
        "precision": "no",
        "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
        "training": {"script": str(SCRIPT),
                     "script_args": ["--model_type", "gpt2", "--config_overrides", MODEL, "--data_dir", "data",
                                     "--mapped_log", "mapped", "--report_file", "report.json",
                                     "--disable_tqdm", "true"],
                     "output_dir": "out", "max_steps": max_steps, "save_steps": save_steps, "logging_steps": 1,
                     "learning_rate": 1.0e-3, "seed": 7},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def launch(config: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=config.parent,
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def losses(tmp_path: Path) -> dict[int, float]:
    history = json.loads((tmp_path / "report.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def mapped(tmp_path: Path) -> dict[int, list[int]]:
    """The record ids each rank mapped, in order; the logs are emptied for the next launch."""
    found = {}
    for rank in (0, 1):
        path = tmp_path / f"mapped.{rank}"
        found[rank] = [int(x) for x in path.read_text().split()] if path.exists() else []
        path.unlink(missing_ok=True)
    return found


def test_a_relaunch_reads_on_from_the_saved_position_and_trains_as_the_uninterrupted_run(tmp_path):
    make_data(tmp_path / "data")
    config = write_config(tmp_path, max_steps=16, save_steps=8)
    launch(config)
    full = losses(tmp_path)
    assert sorted(full) == list(range(1, 17))
    # accelerate's dispatcher: rank 0 reads every rank's batch, one step ahead (the last step's too)
    assert mapped(tmp_path) == {0: list(range(16 * PER_STEP + PER_STEP)), 1: []}
    saved = json.loads((tmp_path / "out" / "checkpoint-8" / "hfscale_data_state.json").read_text())
    assert saved["step"] == 8 and saved["batches"] == 8 * 2 and saved["states"][1] is None  # rank 1 read nothing
    assert saved["states"][0]["examples_iterable"]["type"] == "MappedExamplesIterable"

    # the relaunch resumes from checkpoint-8: records 64.. only, and the same losses, bit for bit
    shutil.rmtree(tmp_path / "out" / "checkpoint-16")
    r = launch(config)
    assert "hfscale: data: the stream resumes where checkpoint-8 left it (no replay)" in r.stdout + r.stderr
    assert mapped(tmp_path) == {0: list(range(8 * PER_STEP, 16 * PER_STEP + PER_STEP)), 1: []}
    again = losses(tmp_path)
    assert {s: again[s] for s in range(9, 17)} == {s: full[s] for s in range(9, 17)}

    # a position that cannot be read: the Trainer replays records 0..63, says why, and trains the same
    shutil.rmtree(tmp_path / "out" / "checkpoint-16")
    (tmp_path / "out" / "checkpoint-8" / "hfscale_data_state.json").write_text("{")
    r = launch(config)
    assert "hfscale: data: the Trainer replays the stream up to step 8: " in r.stdout + r.stderr
    assert "hfscale_data_state.json: not valid JSON" in r.stdout + r.stderr
    assert mapped(tmp_path) == {0: list(range(16 * PER_STEP + PER_STEP)), 1: []}
    replayed = losses(tmp_path)
    assert {s: replayed[s] for s in range(9, 17)} == {s: full[s] for s in range(9, 17)}
    # the checkpoint the replayed run saved has its position again
    assert json.loads((tmp_path / "out" / "checkpoint-16" / "hfscale_data_state.json").read_text())["step"] == 16
