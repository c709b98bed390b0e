"""Start a user's Trainer script as one rank, adding the two flags only the rank can decide.

    python -m hfscale.run_script SCRIPT [ARGS...]     # as each rank (accelerate launch --module, torchrun -m)

``hfscale launch`` runs a ``training.script`` with ``training.pass_args: trainer`` through this
module, after the flags the YAML determines (hfscale.script_rules). When the rank starts, it adds

- ``--resume_from_checkpoint <newest complete checkpoint in --output_dir>``: decided at every
  start, so a relaunch, a torchrun restart or a Slurm requeue continues from the newest checkpoint
  (complete by hfscale's marker or by its own files, hfscale.resume);
- ``--use_cpu true`` when the rank sees no GPU (no ``/dev/nvidia<N>`` or ``/dev/kfd``, or
  ``CUDA_VISIBLE_DEVICES`` empty),

unless ARGS give them already, adds hfscale's ProgressCallback to every Trainer the script makes
(hfscale.trainer_hook: the hang watchdog's steps), and then runs SCRIPT as ``__main__`` with ``sys.argv`` and
``sys.path[0]`` as ``python SCRIPT ARGS`` would set them, in this same process (so the launcher's
signals reach it). When SCRIPT ends normally the process ends with ``hfscale.shutdown.exit_cleanly``:
the ``atexit`` hooks run (loggers finish), the process group is left, and the interpreter teardown
in which gloo/DeepSpeed threads can abort a rank that finished its work (SIGABRT) is skipped. An
exception or ``sys.exit(N)`` from SCRIPT ends the process as it would without hfscale.

It does not run SCRIPT when the newest checkpoint is already at ``--max_steps`` (the Trainer would
take one more step and save it; exit 0), and never lets it start over in an output_dir that holds
checkpoints of which none is complete: at the job's first start (not a restart) it exits with
code 2 and says why. Plain Python until SCRIPT imports torch.
"""

from __future__ import annotations

import glob
import os
import runpy
import sys
from typing import Mapping, Sequence

from .resume import decide, first_start, scan_output
from .shutdown import exit_cleanly
from .trainer_args import given_flags

EXIT_BAD_INPUT = 2
RESUME_FLAG = "--resume_from_checkpoint"
CPU_FLAG = "--use_cpu"


def sees_gpu(env: Mapping[str, str]) -> bool:
    """Whether this process can use a GPU: a CUDA or ROCm device node, not hidden by CUDA_VISIBLE_DEVICES."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def _value(args: Sequence[str], name: str) -> str | None:
    given = given_flags(args, {name})
    return given[-1].words[0] if given and given[-1].words else None  # HfArgumentParser keeps the last


def plan_start(args: list[str], env: Mapping[str, str]) -> tuple[list[str] | None, str, int]:
    """(ARGS with the rank's flags added, or None: do not run; what to say; exit code if not run)."""
    given = {f.name for f in given_flags(args, {"resume_from_checkpoint", "use_cpu"})}
    extra: list[str] = []
    if "use_cpu" not in given and not sees_gpu(env):
        extra += [CPU_FLAG, "true"]
    output_dir = _value(args, "output_dir")
    if "resume_from_checkpoint" in given or not output_dir:
        return args + extra, "", 0
    max_steps = _value(args, "max_steps")
    try:
        limit = int(max_steps) if max_steps is not None and int(max_steps) > 0 else None
    except ValueError:
        limit = None
    d = decide(scan_output(output_dir, int(env.get("WORLD_SIZE") or 1)), limit)
    if d.action == "resume":
        return args + extra + [RESUME_FLAG, d.checkpoint or ""], f"hfscale: resuming from {d.checkpoint}", 0
    if d.action == "done":
        return None, f"hfscale: nothing to train: {d.reason}", 0
    if d.action == "refuse" and first_start(env):
        return None, (f"hfscale: {d.reason}. Resume one by hand with -- {RESUME_FLAG} PATH, or start over with "
                      "hfscale launch --restart (it moves them aside)."), EXIT_BAD_INPUT
    return args + extra, "", 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python -m hfscale.run_script SCRIPT [ARGS...]", file=sys.stderr)
        return EXIT_BAD_INPUT
    script = argv[0]
    args, say, code = plan_start(argv[1:], os.environ)
    if say and os.environ.get("RANK", "0") == "0":
        print(say, file=sys.stderr if code else sys.stdout, flush=True)
    if args is None:
        return code
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    if os.environ.get("HFSCALE_RUN_DIR"):  # launched by hfscale: the hang watchdog needs the steps
        from .trainer_hook import install

        install()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    return 0


if __name__ == "__main__":
    code = main()
    if code:
        sys.exit(code)
    exit_cleanly(0)
