"""A real HF Trainer run on a tiny GPT-2, for the callback and resume tests (CPU, 1 or N ranks).

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 tests/scripts/trainer_run.py \
        --output-dir /tmp/run --max-steps 16 --save-steps 4 --deepspeed 2

The TrainingArguments and the DeepSpeed JSON come from one hfscale YAML (``load_text`` ->
``render_deepspeed`` + ``training_arguments``), as in the product. The model is a GPT-2 built from a
config with a fixed seed; the data are the bytes of the standard library's ``.py`` files (sorted;
byte = token id) packed into 64-token blocks. The run resumes from ``latest_checkpoint(output_dir)``.

At the end rank 0 prints one line ``HFSCALE_RESULT {json}`` with ``global_step``, ``final_loss``
(``repr`` of the loss of the final weights on a fixed held-out batch: bitwise comparable),
``train_loss`` (the Trainer's last logged loss), ``preempted``, ``resumed_from``, ``world_size``,
``restart`` (torchrun restart count), ``marked`` (checkpoints this process marked complete) and
``gathers`` (how many times the reporting callbacks gathered across ranks) and ``losses`` (every
logged training loss, ``repr``). ``--async-save`` sets ``training.async_save``. With ``--pid-dir`` each
rank writes ``rank<R>.pid`` at start and ``rank<R>.exit`` (its exit status) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, set_seed

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hfscale.training.callbacks import (
    CheckpointCompleteCallback,
    MetricsCallback,
    PreemptionCallback,
    StragglerCallback,
    exit_cleanly,
)
from hfscale.checkpoints.resume import latest_checkpoint
from hfscale.render.deepspeed import render_deepspeed
from hfscale.rules.config_file import load_text
from hfscale.rules.trainer_args import training_arguments
from hfscale.training.train import stdlib_bytes

BLOCK = 64
N_BLOCKS = 1024
MICRO_BATCH = 4
EXIT_FILE: str | None = None
GATHERS = [0]


def _count_gathers() -> None:
    """Count the callbacks' all_gathers (they must happen only every N steps)."""
    import hfscale.training.callbacks.collectives as hc

    original = hc.all_gather

    def counting(values):
        GATHERS[0] += 1
        return original(values)

    hc.all_gather = counting


def stdlib_blocks(n_blocks: int = N_BLOCKS, block: int = BLOCK) -> torch.Tensor:
    return torch.tensor(list(stdlib_bytes(n_blocks * block)), dtype=torch.long).view(n_blocks, block)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def job_yaml(a: argparse.Namespace, world: int) -> str:
    backend = "deepspeed" if a.deepspeed else "ddp"
    ds = f"  deepspeed: {{stage: {a.deepspeed}, steps_per_print: 100000}}\n" if a.deepspeed else ""
    limit = a.save_total_limit if a.save_total_limit else "null"
    return f"""\
name: trainer-run
cluster: {{nproc_per_node: {world}}}
distributed:
  backend: {backend}
{ds}precision: "no"
batch: {{micro_batch_size: {MICRO_BATCH}, gradient_accumulation_steps: 1}}
training:
  output_dir: {json.dumps(a.output_dir)}
  max_steps: {a.max_steps}
  learning_rate: 1.0e-3
  seed: {a.seed}
  logging_steps: {a.logging_steps}
  save_steps: {a.save_steps}
  save_total_limit: {limit}
  async_save: {json.dumps(a.async_save)}
"""


class Slow(TrainerCallback):
    """Make one rank's forward pass slower (a straggler on purpose)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_begin(self, args, state, control, model=None, **kw):
        # inside the model's forward (first block), like slow compute on this rank
        model.transformer.h[0].register_forward_pre_hook(lambda m, i: time.sleep(self.seconds) if m.training else None)


class CrashOnSave(TrainerCallback):
    """Kill this process in on_save at one step: after the Trainer's save (and its own rotation)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kw):
        if state.global_step == self.step:
            sys.stdout.flush()
            os._exit(17)


class SleepAfterStep(TrainerCallback):
    """Slow every step down a little, so a test has time to send its signal mid-run."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kw):
        time.sleep(self.seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--max-steps", type=int, default=16)
    ap.add_argument("--save-steps", type=int, default=4)
    ap.add_argument("--logging-steps", type=int, default=2)
    ap.add_argument("--save-total-limit", type=int, default=0, help="0: keep all")
    ap.add_argument("--deepspeed", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage; 0: no DeepSpeed")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--callbacks", default="metrics,straggler,preempt,complete")
    ap.add_argument("--metrics-every", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=BLOCK)
    ap.add_argument("--peak-flops", type=float, default=1e12)
    ap.add_argument("--straggler-threshold", type=float, default=1.5)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-seconds", type=float, default=0.0)
    ap.add_argument("--crash-on-save-step", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--pid-dir", default=None, help="write rank<R>.pid files here")
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--async-save", action="store_true", help="training.async_save: DeepSpeed's decoupled writer")
    ap.add_argument("--slow-writes", type=float, default=0.0,
                    help="with --async-save: the writer processes sleep this long per write (tests/scripts/slow_writer.py)")
    a = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _count_gathers()
    if a.pid_dir:
        global EXIT_FILE
        EXIT_FILE = os.path.join(a.pid_dir, f"rank{rank}.exit")
        os.makedirs(a.pid_dir, exist_ok=True)
        tmp = os.path.join(a.pid_dir, f".rank{rank}.pid.tmp")
        Path(tmp).write_text(str(os.getpid()))
        os.replace(tmp, os.path.join(a.pid_dir, f"rank{rank}.pid"))

    job = load_text(job_yaml(a, world), "trainer_run.yaml", ROOT)
    ds_path = None
    if job.deepspeed is not None:
        ds_path = os.path.join(a.output_dir, f".ds_config.rank{rank}.json")
        os.makedirs(a.output_dir, exist_ok=True)
        Path(ds_path).write_text(render_deepspeed(job))
    args = training_arguments(
        job, ds_path, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0
    )

    set_seed(a.seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=BLOCK))
    blocks = stdlib_blocks()
    train, held_out = Blocks(blocks[:-8]), blocks[-8:]
    trainer = Trainer(model=model, args=args, train_dataset=train)

    names = set(filter(None, a.callbacks.split(",")))
    if rank == a.slow_rank and a.slow_seconds:
        trainer.add_callback(Slow(a.slow_seconds))
    if a.step_sleep:
        trainer.add_callback(SleepAfterStep(a.step_sleep))
    if a.crash_on_save_step:
        trainer.add_callback(CrashOnSave(a.crash_on_save_step))  # before the marker is written
    metrics = preempt = complete = None
    if "metrics" in names:
        metrics = MetricsCallback(every=a.metrics_every, seq_len=a.seq_len, peak_flops_per_device=a.peak_flops,
                                  trainer=trainer)
        trainer.add_callback(metrics)
    if "straggler" in names:
        trainer.add_callback(StragglerCallback(threshold=a.straggler_threshold, trainer=trainer))
    if "preempt" in names:
        preempt = PreemptionCallback()
        trainer.add_callback(preempt)
    if "complete" in names:
        complete = CheckpointCompleteCallback(async_save=a.async_save)
        trainer.add_callback(complete)
    if a.slow_writes:
        import slow_writer

        slow_writer.install(a.slow_writes)

    resume = None if a.no_resume else latest_checkpoint(a.output_dir)
    trainer.train(resume_from_checkpoint=resume)

    model = trainer.model
    model.eval()
    with torch.no_grad():
        final = model(input_ids=held_out, labels=held_out).loss.item()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if rank == 0:
        result = {
            "global_step": trainer.state.global_step,
            "final_loss": repr(final),
            "train_loss": repr(losses[-1]) if losses else None,
            "preempted": bool(preempt and preempt.preempted),
            "resumed_from": resume,
            "world_size": world,
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "marked": complete.marked if complete else [],
            "gathers": GATHERS[0],
            "losses": [(h["step"], repr(h["loss"])) for h in trainer.state.log_history if "loss" in h],
        }
        print("HFSCALE_RESULT " + json.dumps(result), flush=True)
    if preempt is not None:
        preempt.exit_if_preempted(0)


if __name__ == "__main__":
    exit_code: object = "exception"
    try:
        main()
        exit_code = 0
    except SystemExit as e:
        exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    finally:
        if EXIT_FILE:  # how this rank ended, for tests that cannot see a worker's status through torchrun
            Path(EXIT_FILE).write_text(str(exit_code))
    exit_cleanly(0)  # main() returned: everything is saved (see hfscale.training.shutdown)
