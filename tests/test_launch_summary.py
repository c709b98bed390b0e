"""What ``hfscale launch`` prints when its run finished (hfscale.cli.finish): the summary read from the
run directory and the next commands with the run's name, exactly; files only, no process (the
README's main job shows it for real: test_examples.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from test_checkpoint_files import trainer_checkpoint

from hfscale.cli.finish import finish_lines

RUN = "tiny_cpu-20261126-061500-3820dc"


def _run(root: Path, metrics: dict | None = None, where: str = "runs") -> Path:
    run = root / where / RUN
    (run / "progress").mkdir(parents=True)
    (run / "state.json").write_text(json.dumps({"job_id": "20261126-061500-3820dc", "runner": "local",
                                                "state": "finished", "exit_code": 0, "cwd": str(root),
                                                "started": 1795721705.5, "ended": 1795721813.9}))
    (run / "config.yaml").write_text(f"name: tiny_cpu\nrunner: {{run_dir: {where}}}\n"
                                     "training: {output_dir: output/tiny_cpu}\n")
    if metrics is not None:
        (run / "progress" / "metrics.json").write_text(json.dumps(metrics))
    return run


FINAL = {"step": 300, "max_steps": 300, "loss": 2.347255859375, "train_loss": 2.638249, "tokens_per_s": 8605.79,
         "time": 1795721812.9}


def test_the_summary_and_the_next_commands(tmp_path):
    out = tmp_path / "output" / "tiny_cpu"
    for step in (200, 300, 400):
        trainer_checkpoint(out, step)
    (out / "checkpoint-400" / "rng_state_1.pth").unlink()  # a save cut short: not the newest complete one
    assert finish_lines(_run(tmp_path, FINAL), "tiny_cpu", cwd=tmp_path) == [
        f"hfscale: {RUN} finished in 1m48s: step 300/300, loss 2.3473 (the last logged; mean over the run "
        "2.6382), 8.6k tokens/s",
        "hfscale: newest checkpoint output/tiny_cpu/checkpoint-300",
        "next:",
        f"  hfscale status {RUN}",
        f"  hfscale report {RUN}",
        f"  hfscale export {RUN} --out tiny_cpu-model",
    ]


def test_a_resumed_run_elsewhere_without_a_checkpoint_or_numbers(tmp_path):
    run = _run(tmp_path, {**FINAL, "tokens_per_s": None, "train_loss": None}, where="my runs")
    lines = finish_lines(run, "tiny_cpu", resumed_at=200, cwd=tmp_path)
    # outside ./runs the commands name the run by its directory (quoted for the shell); no checkpoint: no export
    assert lines == [f"hfscale: {RUN} finished in 1m48s: step 300/300 (resumed at 200), loss 2.3473 (the last logged)",
                     "next:", f"  hfscale status 'my runs/{RUN}'", f"  hfscale report 'my runs/{RUN}'"]
    shutil.rmtree(run / "progress")  # a plain loop that reports nothing
    assert finish_lines(run, "tiny_cpu", cwd=tmp_path)[0] == f"hfscale: {RUN} finished in 1m48s"
    (run / "progress").mkdir()
    (run / "progress" / "metrics.json").write_text(json.dumps({"step": 120, "max_steps": 300, "preempted": True}))
    assert finish_lines(run, "tiny_cpu", cwd=tmp_path)[0] == (
        f"hfscale: {RUN} was preempted (its checkpoint saved; a relaunch resumes) in 1m48s: step 120/300")
    (run / "state.json").write_text("{not json")  # what cannot be read is left out
    (run / "progress" / "metrics.json").write_text("[]")
    assert finish_lines(run, "tiny_cpu", cwd=tmp_path)[0] == f"hfscale: {RUN} finished"
