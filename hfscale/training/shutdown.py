"""Ending a training process after its work is saved, without interpreter teardown.

Once ``trainer.train()`` has returned, gloo/DeepSpeed background threads that are still alive
while the interpreter finalizes can abort a rank (SIGABRT, "terminate called without an active
exception"), so a run that finished and saved everything is reported as failed. Leaving the
process group first (pytorch/pytorch#190489) makes that rarer but, on CPU under load, not
impossible: it was still seen once in three full test runs. Skipping finalization avoids the code
where it happens (the built-in entry point has ended this way without a recurrence). This module
imports nothing heavy, so it can end a process that never imported torch.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

__all__ = ["exit_cleanly"]


def exit_cleanly(code: int = 0) -> NoReturn:
    """Run the ``atexit`` hooks, leave the process group, flush, and end the process with ``code``.

    Call it last, after everything is saved. The ``atexit`` hooks still run (W&B and MLflow finish
    their runs there, and hfscale's callbacks leave the process group there), while the interpreter
    is fully alive; what is skipped is the finalization after them, where the abort happens. Close
    your own files first: Python-level buffers of files left open are not flushed."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()  # noqa: SLF001 - CPython's own runner of the registered hooks
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
