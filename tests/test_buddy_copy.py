"""The local tier's buddy copy behind training (hfscale.training.callbacks.buddy_stream), with real
processes: 3 ranks under torchrun (gloo on CPU), each sending its part to the next rank and
receiving the previous one's in a thread, over a gloo group of the copy's own, while the main
thread runs an all-reduce per "step" on the default group (tests/scripts/buddy_copy_worker.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

WORLD = 3


def _run(tmp: Path, missing: int) -> list[dict]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
            str(ROOT / "tests" / "scripts" / "buddy_copy_worker.py"), str(tmp), str(missing)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp / f"result-{r}.json").read_text()) for r in range(WORLD)]


def _digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_each_part_reaches_the_next_node_whole_while_training_goes_on(tmp_path: Path):
    results = _run(tmp_path, missing=-1)
    for r in results:
        assert r["read"] and r["received"] and r["errors"] == [], r
        assert r["steps_during_copy"] >= 1, r  # the main thread's collectives ran while the copy was in flight
        assert r["sum"] == WORLD * 1.0 * (r["steps_during_copy"] + 1)  # every all-reduce summed every rank
    for rank in range(WORLD):
        sent = _digest(tmp_path / f"node{rank}" / "own" / "checkpoint-5")
        got = _digest(tmp_path / f"node{(rank + 1) % WORLD}" / "buddy" / "checkpoint-5")
        assert got == sent and len(sent) == 4  # byte for byte, the empty file too


def test_a_part_that_cannot_be_read_is_not_kept_by_its_buddy_and_nothing_hangs(tmp_path: Path):
    results = _run(tmp_path, missing=1)
    assert not results[1]["read"] and "latest" in results[1]["errors"][0] and results[1]["received"]
    assert not results[2]["received"] and "could not read all of its part" in results[2]["errors"][-1]
    assert results[0]["read"] and results[0]["received"] and results[0]["errors"] == []
