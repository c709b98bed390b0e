#!/usr/bin/env python
"""GPU check (issue 38, item 5; not a test, CI has no GPU): a restart's parts for a 1B model on one
GPU, in process against a full relaunch, with NCCL.

    python bench/gpu_restart_parts.py                  # one CUDA device: about 5 min
    python bench/gpu_restart_parts.py --cpu --tiny     # the same flow on this CPU machine (gloo)

``hfscale launch`` (runner local, torchrun, hfscale's built-in entry point, one rank, bf16 on the GPU)
trains a GPT-2 of ``--layers`` x ``--width`` (24 x 2048: 1.2B parameters) on the standard library's
bytes, saving at step ``--save``. In the step after that save the rank fails (a RuntimeError raised by
a callback put in from outside, once, as a CUDA error or a lost peer would surface):

- ``in process`` (``recovery.in_process: true``): the process stays; it leaves its process group
  (NCCL), joins the next attempt's and builds its training again (the CUDA context and the imports
  kept) from the checkpoint;
- ``relaunch``: the rank exits, torchrun ends, and hfscale starts the job again: a new interpreter,
  its imports, CUDA, the model and the checkpoint.

R runs from the failure to the end of the first step trained after it; its parts come from the
run's timeline (in process: the ``in_process`` event; relaunch: failure, stop, relaunch and the new
start's parts). One GPU means one rank: a survivor here is the failed rank itself, so the in-process
row is what every survivor of a larger job pays, and the relaunch row what every rank pays.
Prints a line per run and a table; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_restart_parts import PARTS, restart_parts  # noqa: E402
from hfscale.launch.recovery.timeline import read_timeline  # noqa: E402
from hfscale.runs.goodput import PART_NAMES  # noqa: E402

# raises once, in the step after checkpoint FAIL_AFTER, while the file FAIL_ONCE exists (then removes it)
FAIL = textwrap.dedent('''\
    import os, time

    if os.environ.get("FAIL_ONCE") and os.environ.get("RANK") is not None:
        import transformers

        class FailOnce(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                marker = os.environ["FAIL_ONCE"]
                if state.global_step > int(os.environ["FAIL_AFTER"]) and os.path.exists(marker):
                    with open(marker + ".at", "w") as f:
                        f.write(repr(time.time()))
                    os.unlink(marker)
                    raise RuntimeError("injected by bench/gpu_restart_parts.py")

        _init = transformers.Trainer.__init__

        def _with_fault(self, *a, **k):
            _init(self, *a, **k)
            self.add_callback(FailOnce())

        transformers.Trainer.__init__ = _with_fault
''')


def params(layers: int, width: int, vocab: int = 256, positions: int = 1024) -> int:
    return layers * (12 * width * width + 13 * width) + (vocab + positions) * width + 2 * width


def config(tmp: Path, in_process: bool, a: argparse.Namespace) -> Path:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(FAIL)
    (tmp / "fail").touch()
    size = {"n_layer": 2, "n_head": 2, "n_embd": 32} if a.tiny else {"n_layer": a.layers, "n_head": a.width // 128,
                                                                      "n_embd": a.width}
    env = {"PYTHONPATH": f"{site}:{ROOT}", "FAIL_ONCE": str(tmp / "fail"), "FAIL_AFTER": str(a.save),
           "HF_HUB_OFFLINE": "1", **({"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"} if a.cpu else {})}
    doc = {"name": "inproc" if in_process else "relaunch", "cluster": {"nproc_per_node": 1, "master_port": 29991},
           "runner": {"type": "local", "launcher": "torchrun", "run_dir": str(tmp / "runs")},
           "distributed": {"backend": "ddp"}, "precision": "no" if a.cpu else "bf16",
           "batch": {"micro_batch_size": a.micro_batch, "global_batch_size": a.micro_batch},
           "env": {"vars": env}, "watchdog": {"timeout": 600, "first_step": 1800},
           "training": {"output_dir": str(tmp / "out"), "max_steps": a.save + 3, "save_steps": a.save,
                        "logging_steps": 1, "learning_rate": 1.0e-4, "lr_scheduler_type": "constant", "seed": 3,
                        "model": {"config": {"model_type": "gpt2", **size, "vocab_size": 256, "n_positions": 1024,
                                             "bos_token_id": 0, "eos_token_id": 0}},
                        "data": {"block_size": 64 if a.tiny else 1024}},
           "recovery": {"max_restarts": 2, "in_process": in_process}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def one(in_process: bool, a: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="gpu-parts-"))
    path = config(tmp, in_process, a)
    log = tmp / "launch.log"
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(path)], cwd=tmp, stdout=out,
                            stderr=subprocess.STDOUT, timeout=a.timeout).returncode
    if rc != 0:
        raise SystemExit(f"the launch failed (exit {rc}): {log}\n" + log.read_text()[-3000:])
    failed = float((tmp / "fail.at").read_text())
    (run,) = (tmp / "runs").iterdir()
    first = json.loads((run / "progress" / "metrics.json").read_text())["phases"]["first_step"]  # the newest start's
    row: dict = {"way": "in process" if in_process else "relaunch", "R": first - failed,
                 **restart_parts(read_timeline(run).events, failed)}
    row["other"] = row["R"] - sum(row.get(k, 0.0) for k in PARTS)
    print(f"{row['way']:10} R {row['R']:7.2f} s  " + "  ".join(f"{k} {row[k]:.2f}" for k in (*PARTS, "other")
                                                           if k in row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--save", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--cpu", action="store_true", help="no GPU: gloo on the CPU (checks the flow)")
    ap.add_argument("--tiny", action="store_true", help="the 2-layer GPT-2 (checks the flow)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not a.cpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu --tiny to check the flow here")
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}")
    size = params(2, 32) if a.tiny else params(a.layers, a.width)
    print(f"model: GPT-2, {size / 1e9:.2f}B parameters; {'gloo on the CPU' if a.cpu else 'NCCL on one GPU, bf16'}")
    rows = [one(True, a), one(False, a)]
    shown = (*PARTS, "other")
    print("\n| way | " + " | ".join(PART_NAMES.get(k, k) for k in shown) + " | **R** |")
    print("| --- | " + " | ".join("---" for _ in shown) + " | --- |")
    for r in rows:
        print(f"| {r['way']} | " + " | ".join(f"{r[k]:.2f} s" if k in r else "-" for k in shown)
              + f" | **{r['R']:.2f} s** |")
    if a.json:
        Path(a.json).write_text(json.dumps({"params": size, "cpu": a.cpu, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
