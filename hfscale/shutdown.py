"""Ending a training process after its work is saved, without interpreter teardown.

Once ``trainer.train()`` has returned, gloo/DeepSpeed background threads that are still alive
while the interpreter finalizes can abort a rank (SIGABRT, "terminate called without an active
exception"), so a run that finished and saved everything is reported as failed. Leaving the
process group first (pytorch/pytorch#190489) makes that rarer but, on CPU under load, not
impossible: it was still seen once in three full test runs. Skipping finalization is what removes
it. This module imports nothing heavy, so it can end a process that never imported torch.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

__all__ = ["exit_cleanly"]


def exit_cleanly(code: int = 0) -> NoReturn:
    """Flush stdout/stderr, leave the process group if one is up, and end the process with ``code``.

    Call it last, after everything is saved: ``atexit`` hooks and ``finally`` blocks that have not
    run yet are skipped (that is the point)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(code)
