"""Which job the checkpoints in an output_dir belong to: ``<output_dir>/_hfscale-lineage.json``.

A job hfscale starts fresh (no checkpoint in its output_dir, or ``--restart`` moved them aside)
begins a lineage there before it trains: rank 0 writes a new random id, by rename, before any
checkpoint can exist. So every checkpoint found later in an output_dir that holds the file was
saved by this job (its attempts, its relaunches by hand): a save of its own cut short by a failure
is set aside at the next start (hfscale.checkpoints.resume.decide), never a reason to stop. An
output_dir without the file (an earlier run of another tool, an older hfscale) keeps the refusal:
training from step 0 there would overwrite checkpoints nobody here can vouch for.

The local tier (hfscale.checkpoints.local_tier) tags its steps with the same id, so that an earlier
run's local steps are never restored. ``--restart`` moves the file aside with the checkpoints.

Plain Python (no torch): the launch reads it when it plans.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from hfscale.core.untrusted import Unreadable, read_json

LINEAGE_FILE = "_hfscale-lineage.json"  # "_": the Trainer's push_to_hub leaves it out
LINEAGE_CAP = 4096
_ID = re.compile(r"^[0-9a-f]{8,64}$")

__all__ = ["LINEAGE_FILE", "read_lineage", "begin_lineage"]


def read_lineage(output_dir: str | os.PathLike[str]) -> str | None:
    """The output_dir's lineage id; None when there is none, or the file is not one (a link, too big,
    not JSON, not an id of hex digits)."""
    try:
        doc = read_json(Path(output_dir) / LINEAGE_FILE, LINEAGE_CAP, output_dir)
    except Unreadable:
        return None
    value = doc.get("lineage") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and _ID.match(value) else None


def begin_lineage(output_dir: str | os.PathLike[str], keep: bool = False) -> str:
    """A new lineage in ``output_dir`` (made if missing), written by rename so that it is never seen
    half written; ``keep``: the one already there, when there is one. Call it on one rank."""
    value = read_lineage(output_dir) if keep else None
    if value is not None:
        return value
    value = secrets.token_hex(8)
    os.makedirs(output_dir, exist_ok=True)
    tmp = Path(output_dir) / f".{LINEAGE_FILE}.tmp{os.getpid()}"
    tmp.write_text(f'{{"lineage": "{value}"}}\n')
    os.replace(tmp, Path(output_dir) / LINEAGE_FILE)
    return value
