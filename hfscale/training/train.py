"""The built-in training entry point: what ``hfscale launch`` runs when ``training.script`` is null.

    python -m hfscale.training.train --config CONFIG        # under accelerate launch / torchrun / hfscale launch

A Transformers Trainer with everything from the hfscale YAML: the model from ``training.model``
(a local pretrained directory, or a config mapping: random init, nothing downloaded), the data from
``training.data`` (local text/json/parquet files through ``datasets``; by default the Python
standard library's own source files, always present), packed into fixed-length blocks, the
TrainingArguments and DeepSpeed JSON from the same fields, hfscale's callbacks (metrics,
stragglers, preemption, checkpoint completeness), and automatic resume from the newest complete
checkpoint in ``training.output_dir``.

Without a tokenizer next to the model, text is tokenized byte-level (token id = byte value), so
the model's vocabulary must have at least 256 entries.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import sys
from pathlib import Path

from hfscale.config.errors import ConfigError
from hfscale.core import exitcodes
from hfscale.config.model import DEFAULT_MODEL_CONFIG, DataConfig, ModelConfig
from hfscale.rules.config_file import load_job
from hfscale.rules.resolved import Job
from hfscale.training.heartbeat import fit_flight_recorder, phase
from hfscale.training.inprocess.restart import ENV_WORLD
from hfscale.training.instrument import add_callbacks, choose, with_local_tier
from hfscale.training.loss_guard import LossAlarm
from hfscale.training.shutdown import exit_cleanly
from hfscale.training.slow_nodes import SlowNodeStop

BYTE_VOCAB = 256


def stdlib_sources() -> list[str]:
    """The standard library's top-level ``.py`` files, sorted (the same text on every machine)."""
    return [str(p) for p in sorted(Path(os.path.dirname(os.__file__)).glob("*.py"))]


def stdlib_bytes(n: int) -> bytes:
    """The first ``n`` bytes of ``stdlib_sources()`` concatenated (about 4.7 MB exist): byte-level
    training data that is the same on every machine with this Python."""
    data = bytearray()
    for path in stdlib_sources():
        data += Path(path).read_bytes()
        if len(data) >= n:
            return bytes(data[:n])
    raise ValueError(f"the standard library has only {len(data)} bytes of source, {n} needed")


def data_files(data: DataConfig) -> list[str]:
    """Files named by ``training.data.files`` (globs expanded, sorted), or the built-in corpus."""
    if not data.files:
        return stdlib_sources()
    out: list[str] = []
    for pattern in data.files:
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise SystemExit(f"hfscale.training.train: training.data.files: nothing matches {pattern!r}")
        out += matches
    return out


def load_blocks(data: DataConfig, tokenizer, eos_id: int):
    """A ``datasets.Dataset`` of ``input_ids``/``labels`` blocks of ``data.block_size`` tokens."""
    import datasets

    files = data_files(data)
    if data.format == "text":
        # one row per file: documents stay whole until packing
        ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train")
        column = "text"
    else:
        ds = datasets.load_dataset(data.format, data_files=files, split="train")
        column = data.text_field
        if column not in ds.column_names:
            raise SystemExit(f"hfscale.training.train: training.data.text_field {column!r} not in columns {ds.column_names}")

    def tokenize(batch):
        if tokenizer is None:
            ids = [list(t.encode("utf-8")) + [eos_id] for t in batch[column]]
        else:
            ids = [x + [eos_id] for x in tokenizer(batch[column])["input_ids"]]
        return {"ids": ids}

    size = data.block_size

    def pack(batch):
        flat = [t for ids in batch["ids"] for t in ids]
        blocks = [flat[i:i + size] for i in range(0, len(flat) - size + 1, size)]
        return {"input_ids": blocks, "labels": blocks}

    ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names, desc="tokenize")
    return ds.map(pack, batched=True, batch_size=1000, remove_columns=["ids"], desc="pack")


@contextlib.contextmanager
def _without_zero_init():
    """Build a model whole although a stage-3 DeepSpeed config is active: transformers uses
    deepspeed.zero.Init whenever its global DeepSpeed config (set by TrainingArguments) is stage 3."""
    from transformers.integrations import deepspeed as hf_ds

    active = hf_ds._hf_deepspeed_config_weak_ref  # noqa: SLF001 - the one switch transformers reads
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = active  # noqa: SLF001


def build_model(model: ModelConfig, seed: int, zero_init: bool = True):
    """(model, tokenizer or None): pretrained from a local path, or random init from a config.
    ``zero_init`` False: never partitioned while built (training.deepspeed zero3_init: false)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed

    set_seed(seed)
    with contextlib.nullcontext() if zero_init else _without_zero_init():
        if model.path is not None:
            m = AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True)
            has_tok = any((Path(model.path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
            tok = AutoTokenizer.from_pretrained(model.path, local_files_only=True) if has_tok else None
            return m, tok
        cfg = dict(model.config or DEFAULT_MODEL_CONFIG)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)), None


def _ds_config_path(job: Job) -> str | None:
    """The DeepSpeed JSON hfscale launch wrote, or one written next to the checkpoints."""
    if job.deepspeed is None:
        return None
    given = os.environ.get("HFSCALE_DS_CONFIG")
    if given:
        return given
    from hfscale.core.atomic_files import write_files
    from hfscale.render.deepspeed import render_deepspeed

    out = Path(job.config.training.output_dir) / ".hfscale"
    (path,) = write_files(out, {f"ds_config.rank{os.environ.get('RANK', '0')}.json": render_deepspeed(job)})
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hfscale.training.train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.environ.get("HFSCALE_CONFIG"),
                    help="hfscale YAML (default: $HFSCALE_CONFIG, set by hfscale launch)")
    a = ap.parse_args(argv)
    if not a.config:
        ap.error("--config is required outside hfscale launch")
    fit_flight_recorder()  # before torch starts
    try:
        job = load_job(a.config)
    except ConfigError as e:
        print(f"error: {e.render()}", file=sys.stderr)
        return 2
    if os.environ.get(ENV_WORLD):  # in-process restarts: attempts in this process (hfscale.training.inprocess)
        from hfscale.training.inprocess.restart import Session, run

        try:
            session = Session.from_env()
        except ValueError as e:
            print(f"error: in-process restart: {e}", file=sys.stderr)
            return 2
        warm_up(job)  # a standby joins with its imports done
        return run(lambda attempt: train_once(job), session=session)
    return train_once(job)


def warm_up(job: Job) -> None:
    """The imports every attempt needs, done once, before the first: a standby then waits with them
    done, and joins in the time the survivors take to set up again. The same modules a warm launcher
    imports before it forks this entry point's ranks (hfscale.training.warm_launcher.PRELOADS), the ones
    DeepSpeed's engine imports as it starts included: without them a standby's first engine took 0.9 s
    more than a survivor's next one, and the survivors waited for it in their first collective."""
    from hfscale.training.warm_launcher import preload_groups, preload_modules, preload_told

    preload_told(preload_modules(preload_groups(job)))


def train_once(job: Job) -> int:
    """One training run of ``job`` in this process: what ``main`` runs, once or in each attempt."""
    import torch
    from transformers import Trainer, TrainerCallback

    from hfscale.checkpoints.lineage import begin_lineage
    from hfscale.checkpoints.resume import decide, first_start, scan_output
    from hfscale.training.callbacks import PreemptionCallback
    from hfscale.rules.trainer_args import training_arguments

    phase("imports")  # the parts of this start (hfscale.training.heartbeat.PHASES)
    t = job.config.training
    args = training_arguments(job, _ds_config_path(job), use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    # Join the process group now, DeepSpeed's communication layer included: deepspeed.zero.Init
    # (ZeRO-3) reads the world size from it while the model is built, and would otherwise see 1
    # and reject the batch geometry (TrainingArguments with use_cpu sets up torch's group only).
    _ = args.device
    if job.deepspeed is not None and torch.distributed.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
    scan = scan_output(t.output_dir, args.world_size)
    decision = decide(scan, t.max_steps)
    resume = decision.checkpoint
    if decision.action == "done" and scan.state is not None:
        if args.process_index == 0:
            print(f"HFSCALE_TRAIN already done step={scan.state.global_step} resumed_from={resume}", flush=True)
        return 0
    if decision.action == "refuse" and first_start(os.environ):  # a restart of this job may start over
        if args.process_index == 0:
            print(f"error: {decision.reason} (start over with hfscale launch --restart)", file=sys.stderr)
        return 2
    if not scan.found and args.process_index == 0:  # the checkpoints saved from now on are this job's own
        begin_lineage(t.output_dir, keep=True)
    ds = job.deepspeed
    model, tokenizer = build_model(t.model, t.seed, zero_init=ds is None or ds.zero3_init)
    phase("model")
    if ds is not None and ds.stage == 3 and args.process_index == 0:
        # deepspeed.zero.Init gives every parameter a ds_id as it is created, partitioned
        partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
        print(f"HFSCALE_TRAIN model built {'partitioned (zero.Init)' if partitioned else 'whole'}", flush=True)
    if tokenizer is None and model.config.vocab_size < BYTE_VOCAB:
        print(f"error: byte-level tokens need vocab_size >= {BYTE_VOCAB}, the model has "
              f"{model.config.vocab_size}", file=sys.stderr)
        return 2
    eos = getattr(model.config, "eos_token_id", None)
    eos = eos if isinstance(eos, int) else 0
    with args.main_process_first(desc="dataset"):
        train = load_blocks(t.data, tokenizer, eos)

    class SaveAtEnd(TrainerCallback):
        """A checkpoint at the last step too, so a re-run resumes instead of repeating the tail."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                control.should_save = True

    trainer = Trainer(model=model, args=args, train_dataset=train)
    added = add_callbacks(trainer, choose(job))  # what hfscale.instrument adds for this YAML
    preemption = next(cb for cb in added if isinstance(cb, PreemptionCallback))
    trainer.add_callback(SaveAtEnd())

    if t.local_checkpoints is not None:  # every rank: the nodes' local steps, newer than the durable one
        resume = with_local_tier(trainer, t.local_checkpoints, resume)
    if resume and trainer.is_world_process_zero():
        print(f"hfscale: resuming from {resume}", flush=True)
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    except LossAlarm:  # rank 0 said why; the launch rolls back (hfscale.checkpoints.rollbacks)
        return exitcodes.LOSS_ALARM
    except SlowNodeStop:  # rank 0 said which node; the relaunch replaces it (hfscale.training.slow_nodes)
        return exitcodes.SLOW_NODE
    if trainer.is_world_process_zero():
        state = trainer.state
        how = "preempted, checkpoint saved" if preemption.preempted else "done"
        # for the node log and the tests (the terminal hides HFSCALE_ lines); train_loss: the
        # Trainer's mean over this run's steps, not the last logged loss the progress line shows
        print(f"HFSCALE_TRAIN {how} step={state.global_step} train_loss={result.training_loss:.6f} "
              f"resumed_from={resume or '-'}", flush=True)
    return 0


if __name__ == "__main__":
    exit_cleanly(main())
