"""Resuming a DeepSpeed ZeRO checkpoint with another number of processes (files only, no processes).

DeepSpeed loads ZeRO shards only into as many processes as wrote them. Its universal checkpoint
does not have that limit: ``deepspeed.checkpoint.ds_to_universal`` turns ``<ckpt>/global_stepN``
into ``<ckpt>/global_stepN_universal`` (each parameter's fp32 weights and optimizer moments whole)
and writes ``<ckpt>/latest_universal``; a job whose DeepSpeed JSON says
``checkpoint: {load_universal: true}`` loads it into any number of processes. ``hfscale launch``
runs the conversion before the job starts (``conversion``) and sets that key for the run.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from hfscale.checkpoints.files import deepspeed_tag, read_tag
from hfscale.core.shell import Command
from hfscale.core.untrusted import Unreadable, real_dir, tag_name

LATEST_UNIVERSAL = "latest_universal"
SUFFIX = "_universal"


def universal_ready(ckpt: str | Path) -> bool:
    """Whether ``ckpt`` holds a finished universal conversion of its DeepSpeed state (written last:
    ``latest_universal`` naming a folder with the per-parameter states)."""
    try:
        name = read_tag(Path(ckpt) / LATEST_UNIVERSAL)
    except Unreadable:
        return False
    folder = Path(ckpt) / name
    return tag_name(name) and real_dir(folder / "zero") and any(folder.glob("*model_states.pt"))


def conversion(ckpt: str, python: str) -> Command | None:
    """The command that converts ``ckpt``'s DeepSpeed state to a universal checkpoint beside it."""
    t = deepspeed_tag(ckpt)
    if t is None:
        return None
    return Command((python, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", posixpath.join(ckpt, t), "--output_folder", posixpath.join(ckpt, t + SUFFIX),
                    "--inject_missing_state"))
