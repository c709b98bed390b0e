"""A user script's opt-in to in-process restarts, through the public face: ``hfscale.restart_in_process``.

    def main():
        ...                                             # model, data, Trainer: all built in here
        trainer.train(resume_from_checkpoint=hfscale.instrument(trainer))

    if __name__ == "__main__":
        sys.exit(hfscale.restart_in_process(main))

Launched with ``recovery.in_process: true``, ``main`` runs in attempts (hfscale.training.inprocess.restart):
when a node is lost, the ranks left call it again in the same process, a standby in the lost ranks'
place, each attempt in a process group of its own. So ``main`` builds what it trains with every time
it is called, and resumes from the newest complete checkpoint (``hfscale.instrument`` returns it, at
every call). Launched otherwise, it runs ``main`` once. Either way it returns the exit code for
``sys.exit``: ``main``'s own when it returns an int, else 0.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from hfscale.training.inprocess.restart import ENV_WORLD, Session, run


def _code(returned: object) -> int:
    return returned if isinstance(returned, int) and not isinstance(returned, bool) else 0


def restart_in_process(train: Callable[[], object]) -> int:
    """Run ``train`` in attempts when the launch restarts in process (``recovery.in_process``), else once."""
    if not os.environ.get(ENV_WORLD):
        return _code(train())

    try:
        session = Session.from_env()
    except ValueError as e:
        print(f"error: in-process restart: {e}", file=sys.stderr)
        return 2
    _warm_up()

    def attempt(_: object) -> int:
        _deepspeed_on_the_group()
        return _code(train())

    return run(attempt, session=session)


def _warm_up() -> None:
    """The imports every attempt needs, before the first: a standby waits with them done."""
    import torch  # noqa: F401

    if os.environ.get("HFSCALE_DS_CONFIG"):
        # with what DeepSpeed's engine imports as it starts (its muon optimizer's torch.compile): a standby's
        # first engine took 0.9 s more than a survivor's next one without it (hfscale.training.train.warm_up)
        from hfscale.training.warm_launcher import preload_modules, preload_told

        preload_told(preload_modules("deepspeed"))
    try:
        import transformers  # noqa: F401
    except ImportError:  # a plain loop without transformers
        pass


def _deepspeed_on_the_group() -> None:
    """DeepSpeed's communication layer on the attempt's process group (which ``run`` formed), as the
    built-in entry point has it before it builds a model: ZeRO-3's ``zero.Init`` reads the world size
    from it, and on the CPU TrainingArguments set up torch's group only."""
    if not os.environ.get("HFSCALE_DS_CONFIG"):
        return
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
