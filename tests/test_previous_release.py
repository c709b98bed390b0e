"""Scripts written against the previous release's module paths run unchanged, warning where each name
lives now; every public name by both paths; ``import hfscale`` without torch; ``hfscale.instrument``
on a real Trainer. The previous release's example scripts are in tests/scripts/previous_release/,
byte for byte as commit 7121bc2 (the parent of ddc25f8, "hfscale in ten layered subpackages") had them."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import yaml

import hfscale
from conftest import ROOT

PREVIOUS = ROOT / "tests" / "scripts" / "previous_release"
# each public name at the previous release's path (instrument is new)
OLD_PATH = {
    "CheckpointCompleteCallback": "hfscale.callbacks", "MetricsCallback": "hfscale.callbacks",
    "StragglerCallback": "hfscale.callbacks", "PreemptionCallback": "hfscale.callbacks",
    "ProgressCallback": "hfscale.callbacks.progress", "latest_checkpoint": "hfscale.resume",
    "IncompleteCheckpointWarning": "hfscale.resume", "exit_cleanly": "hfscale.shutdown", "step": "hfscale.progress",
    "alive": "hfscale.progress", "report": "hfscale.progress", "load_job": "hfscale.load",
}
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _python(code_or_path: str | Path, *args: str, cwd: Path = ROOT, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    argv = [str(code_or_path)] if isinstance(code_or_path, Path) else ["-c", code_or_path]
    return subprocess.run([sys.executable, *argv, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**ENV, **(env or {})})


def test_import_hfscale_imports_no_torch_until_a_callback_is_used():
    r = _python(textwrap.dedent("""
        import sys
        import hfscale
        seen = ["torch" in sys.modules]
        hfscale.step(1), hfscale.report(step=1), hfscale.latest_checkpoint("nowhere"), hfscale.load_job
        hfscale.instrument, hfscale.exit_cleanly
        seen.append("torch" in sys.modules)
        hfscale.MetricsCallback
        seen.append("torch" in sys.modules)
        print(seen, sorted(set(dir(hfscale)) & {"instrument", "step", "MetricsCallback"}))
    """))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[False, False, True] ['MetricsCallback', 'instrument', 'step']"


def test_every_public_name_by_both_paths():
    from hfscale import _PUBLIC  # noqa: PLC2701 - the map the face is built from

    assert set(OLD_PATH) == set(_PUBLIC) - {"instrument", "DataStateCallback", "restart_in_process"}  # new in this release
    for name, where in _PUBLIC.items():
        value = getattr(hfscale, name)
        assert value is getattr(importlib.import_module(where), name), name
        exec(f"from hfscale import {name} as same", (ns := {}))  # noqa: S102
        assert ns["same"] is value
        if name in OLD_PATH:
            old = OLD_PATH[name]
            sys.modules.pop(old, None)  # imported by an earlier name: the finder warns at each fresh import
            with pytest.warns(DeprecationWarning, match=rf"{old} moved to hfscale\.[\w.]+: import it from there"):
                module = importlib.import_module(old)
            assert getattr(module, name) is value, name


def test_the_old_packages_names_and_modules():
    with pytest.warns(DeprecationWarning, match=r"hfscale\.config\.HfscaleConfig moved to hfscale\.config\.model\."):
        from hfscale.config import HfscaleConfig
    from hfscale.config.model import HfscaleConfig as New

    assert HfscaleConfig is New
    with pytest.warns(DeprecationWarning, match=r"hfscale\.runs\.list_runs moved to hfscale\.runs\.registry\."):
        from hfscale.runs import list_runs  # noqa: F401
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a submodule of the new package is no old name
        from hfscale.config import model_config  # noqa: F401
        from hfscale.memory import plan_command  # noqa: F401
    with pytest.raises(ImportError):
        from hfscale.config import NoSuchName  # noqa: F401
    sys.modules.pop("hfscale.job", None)
    with pytest.warns(DeprecationWarning, match="hfscale.job moved to hfscale.rules.check"):
        import hfscale.job
    from hfscale.rules.resolved import Job

    assert hfscale.job.Job is Job and callable(hfscale.job.resolve)


def test_the_previous_releases_trainer_script_runs_unchanged(tmp_path):
    """examples/existing_script/train.py as it was (``from hfscale.callbacks import ...``), on one CPU process."""
    r = _python(PREVIOUS / "existing_script.py", "--output_dir", "out", "--max_steps", "2", "--save_steps", "2",
                "--logging_steps", "1", "--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true",
                "--per_device_train_batch_size", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "DeprecationWarning: hfscale.callbacks moved to hfscale.training.callbacks" in r.stderr
    assert (tmp_path / "out" / "checkpoint-2" / "hfscale_complete.json").is_file()  # CheckpointCompleteCallback
    assert '"event": "metrics"' in (tmp_path / "out" / "hfscale_metrics.jsonl").read_text()  # MetricsCallback


@pytest.mark.slow
def test_the_previous_releases_plain_loop_runs_unchanged(tmp_path):
    """examples/accelerate_loop/train.py as it was (``hfscale.progress``, ``hfscale.load``,
    ``hfscale.train``), launched by this hfscale as the example is (2 processes, DeepSpeed ZeRO-2);
    the run ends with the summary its ``hfscale.progress.report`` fed."""
    doc = yaml.safe_load((ROOT / "examples" / "accelerate_loop" / "config.yaml").read_text())
    doc["cluster"]["master_port"] = 29797
    doc["training"].update(script=str(PREVIOUS / "accelerate_loop.py"), max_steps=3, logging_steps=1)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(cfg)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**ENV, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = (tmp_path / "runs").glob("accelerate_loop-*")
    log = (run / "logs" / "local.log").read_text()
    for old, new in [("hfscale.progress", "hfscale.training.heartbeat"), ("hfscale.load", "hfscale.rules.config_file"),
                     ("hfscale.train", "hfscale.training.train")]:
        assert f"DeprecationWarning: {old} moved to {new}" in log
    assert "HFSCALE_RANK rank=1 world_size=2 steps=3 " in r.stdout  # the script's own line
    assert (run / "progress" / "rank-0").read_text().startswith("3 ")  # hfscale.progress.step
    assert r.stdout.splitlines()[-4:] == [  # hfscale.progress.report fed the summary
        next(line for line in r.stdout.splitlines() if line.startswith(f"hfscale: {run.name} finished in ")),
        "next:", f"  hfscale status {run.name}", f"  hfscale report {run.name}"]
    assert ": step 3/3, loss " in r.stdout


def test_python_m_at_an_old_path_runs_the_module():
    """``python -m hfscale.train`` (the previous release's launch plans, Slurm scripts) runs the entry point."""
    r = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "hfscale.train", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m hfscale.training.train")
    assert "DeprecationWarning: hfscale.train moved to hfscale.training.train" in r.stderr


# --- hfscale.instrument on a real Trainer


def _trainer(out: Path, max_steps: int = 2):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = torch.arange(i, i + 16) % 256
            return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=max_steps, logging_steps=1,
                             per_device_train_batch_size=2, use_cpu=True, report_to="none", disable_tqdm=True)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=256, n_positions=32))
    return Trainer(model=model, args=args, train_dataset=Blocks())


def _kinds(trainer) -> list[str]:
    return sorted(type(cb).__name__ for cb in trainer.callback_handler.callbacks if type(cb).__module__.startswith("hfscale"))


def test_instrument_outside_a_launch_adds_the_defaults_and_resumes(tmp_path, monkeypatch):
    monkeypatch.delenv("HFSCALE_CONFIG", raising=False)
    trainer = _trainer(tmp_path / "out")
    assert hfscale.instrument(trainer) is None  # nothing saved yet
    assert _kinds(trainer) == ["CheckpointCompleteCallback", "DataStateCallback", "LossGuardCallback",
                               "MetricsCallback", "PreemptionCallback", "ProgressCallback", "StragglerCallback"]
    hfscale.instrument(trainer)
    assert len(_kinds(trainer)) == 7  # a kind the Trainer has is not added twice
    trainer.train()
    assert (tmp_path / "out" / "checkpoint-2" / "hfscale_complete.json").is_file()
    assert hfscale.instrument(_trainer(tmp_path / "out", 4)) == str(tmp_path / "out" / "checkpoint-2")


def test_instrument_under_a_launch_reads_the_yaml(tmp_path, monkeypatch):
    cfg = tmp_path / "job.yaml"
    cfg.write_text('name: t\nbatch: {micro_batch_size: 2}\nprecision: "no"\n'
                   "training: {script: train.py, peak_tflops: 100}\n")
    monkeypatch.setenv("HFSCALE_CONFIG", str(cfg))  # as hfscale launch sets it, for a job of one process
    trainer = _trainer(tmp_path / "out")
    assert hfscale.instrument(trainer, seq_len=16) is None
    assert _kinds(trainer) == ["CheckpointCompleteCallback", "DataStateCallback", "LossGuardCallback",
                               "MetricsCallback", "PreemptionCallback", "ProgressCallback"]  # no stragglers among one rank
    off = tmp_path / "off.yaml"
    off.write_text(cfg.read_text().replace("peak_tflops: 100}", "peak_tflops: 100, loss_guard: {enabled: false}}"))
    monkeypatch.setenv("HFSCALE_CONFIG", str(off))
    unguarded = _trainer(tmp_path / "out2")
    hfscale.instrument(unguarded)
    assert "LossGuardCallback" not in _kinds(unguarded)
    metrics = next(cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "MetricsCallback")
    assert (metrics.seq_len, metrics.peak_flops_per_device) == (16, 100e12)


def test_the_builtin_entry_point_gets_the_block_size_and_the_stragglers(tmp_path):
    from hfscale.training.instrument import choose

    job = hfscale.load_job(str(ROOT / "examples" / "tiny_cpu" / "config.yaml"))
    chosen = choose(job, seq_len=7)
    assert chosen.kinds == ("metrics", "stragglers", "preemption", "checkpoints", "progress")  # 2 ranks
    assert chosen.seq_len == job.config.training.data.block_size and chosen.lookup_peak is False  # precision "no"


def test_the_previous_releases_launch_paths_still_import_with_a_warning():
    """Issue 37 put hfscale.launch in rooms: a script importing the old paths (hfscale.launch.execute,
    hfscale.launch.beats, ...) gets the module at its new place with a DeprecationWarning; the two
    old modules whose name is a package now (preflight, recovery) serve their names from it."""
    from hfscale.core.moved import MOVED

    old_launch = {old: new for old, new in MOVED.items() if old.startswith("hfscale.launch.")}
    assert {"hfscale.launch.beats", "hfscale.launch.execute", "hfscale.launch.node_command",
            "hfscale.launch.network", "hfscale.launch.runners.keeper"} <= set(old_launch)
    for old, new in old_launch.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} moved to {re.escape(new)}"):
            module = importlib.import_module(old)
        assert module.__dict__.keys() >= {k for k in vars(importlib.import_module(new)) if not k.startswith("_")}
    from hfscale.launch.preflight.probes import evaluate
    from hfscale.launch.recovery.policy import decide

    with pytest.warns(DeprecationWarning, match=r"hfscale\.launch\.preflight\.evaluate moved to"):
        from hfscale.launch.preflight import evaluate as old_evaluate
    with pytest.warns(DeprecationWarning, match=r"hfscale\.launch\.recovery\.decide moved to"):
        from hfscale.launch.recovery import decide as old_decide
    assert old_evaluate is evaluate and old_decide is decide
