"""Start a user's script as one rank: a Trainer script with the two flags only the rank can decide.

    python -m hfscale.training.run_script SCRIPT [ARGS...]     # as each rank (accelerate launch --module, torchrun -m)

``hfscale launch`` runs a ``training.script`` with ``training.pass_args: trainer`` through this
module, after the flags the YAML determines (hfscale.rules.script). When the rank starts, it adds

- ``--resume_from_checkpoint <newest complete checkpoint in --output_dir>``: decided at every
  start, so a relaunch, a torchrun restart or a Slurm requeue continues from the newest checkpoint
  (complete by hfscale's marker or by its own files, hfscale.checkpoints.resume);
- ``--use_cpu true`` when the rank sees no GPU (no ``/dev/nvidia<N>`` or ``/dev/kfd``, or
  ``CUDA_VISIBLE_DEVICES`` empty),

unless ARGS give them already, adds hfscale's ProgressCallback to every Trainer the script makes
(hfscale.training.trainer_hook: the hang watchdog's steps), and then runs SCRIPT as ``__main__`` with ``sys.argv`` and
``sys.path[0]`` as ``python SCRIPT ARGS`` would set them, in this same process (so the launcher's
signals reach it). When SCRIPT ends normally the process ends with ``hfscale.training.shutdown.exit_cleanly``:
the ``atexit`` hooks run (loggers finish), the process group is left, and the interpreter teardown
in which gloo/DeepSpeed threads can abort a rank that finished its work (SIGABRT) is skipped. An
exception or ``sys.exit(N)`` from SCRIPT ends the process as it would without hfscale.

It does not run SCRIPT when the newest checkpoint is already at ``--max_steps`` (the Trainer would
take one more step and save it; exit 0), and never lets it start over in an output_dir that holds
checkpoints of which none is complete and that are not the job's own: at the job's first start (not
a restart) it exits with code 2 and says why. At a fresh start (no checkpoint in ``--output_dir``),
rank 0 begins the output_dir's lineage first (hfscale.checkpoints.lineage), so that a save of this
job's cut short by a failure is set aside by the next launch instead.

On the CPU, a rank of a DeepSpeed job of more than one process (``--deepspeed`` and ``--use_cpu``,
WORLD_SIZE > 1) joins torch's process group and DeepSpeed's communication layer before SCRIPT runs:
``from_pretrained`` builds the model under ``deepspeed.zero.Init`` once TrainingArguments name a
stage-3 config, and its ``DeepSpeedConfig`` reads the world size from that layer (1 when it is not
initialised, so DeepSpeed rejects the batch sizes hfscale computed); with ``--use_cpu``,
TrainingArguments set up torch's gloo group only. Should DeepSpeed's batch assertion still end
SCRIPT, rank 0 says which world size DeepSpeed read against the job's WORLD_SIZE.

    python -m hfscale.training.run_script --plain SCRIPT [ARGS...]     # training.pass_args: none

runs SCRIPT with its own ARGS only. accelerate picks a backend on the CPU only when it is told to
use the CPU (``ACCELERATE_USE_CPU``, which ``accelerate launch`` sets to False from the config's
``use_cpu`` and torchrun not at all); without one, every rank of a job without GPUs counts itself
the only process and trains alone on all the data. So on a rank without a GPU, of a job of more
than one process, before SCRIPT runs (plain_mode):

- under ``accelerate launch`` with a DeepSpeed config (ACCELERATE_USE_DEEPSPEED), it sets up
  accelerate's process state with the gloo backend, as
  ``Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])`` would (ACCELERATE_USE_CPU
  would turn DeepSpeed off). SCRIPT's ``Accelerator`` then finds that state (the script itself must
  not initialise torch's default group again);
- under ``accelerate launch`` with an FSDP config (ACCELERATE_USE_FSDP) it refuses (exit 2, nothing
  run): accelerate trains FSDP on GPUs only; on the CPU it drops the FSDP plugin (MULTI_CPU is
  plain DDP) or, without ACCELERATE_USE_CPU, leaves every rank alone;
- otherwise (DDP under ``accelerate launch``; any backend under torchrun, where an Accelerator
  reads no accelerate config) it sets ``ACCELERATE_USE_CPU=true``, so the script's Accelerator
  (or TrainingArguments) takes accelerate's MULTI_CPU mode with gloo, the ranks form one group
  and DDP syncs them. A script that uses torch.distributed itself is not affected.

When SCRIPT ends normally and set up accelerate's state, the rank checks that accelerate counted
WORLD_SIZE processes (a script that called ``PartialState()`` before its Accelerator trained
alone): otherwise it says so and exits 1 instead of passing for a job that trained.

Plain Python until SCRIPT imports torch, except where a process group is set up first.
"""

from __future__ import annotations

import glob
import os
import re
import runpy
import sys
from typing import Mapping, NamedTuple, Sequence

from hfscale.checkpoints.lineage import begin_lineage
from hfscale.checkpoints.resume import checkpoints, decide, first_start, scan_output
from hfscale.core import exitcodes
from hfscale.rules.script import PLAIN_FLAG
from hfscale.rules.trainer_args import given_flags
from hfscale.training.heartbeat import fit_flight_recorder
from hfscale.training.inprocess.restart import ENV_WORLD
from hfscale.training.loss_guard import LossAlarm
from hfscale.training.shutdown import exit_cleanly
from hfscale.training.slow_nodes import SlowNodeStop

EXIT_BAD_INPUT = 2
RESUME_FLAG = "--resume_from_checkpoint"
CPU_FLAG = "--use_cpu"
USAGE = "usage: python -m hfscale.training.run_script [--plain] SCRIPT [ARGS...]"
_TRUE = ("yes", "true", "t", "y", "1")  # HfArgumentParser's true words (transformers.hf_argparser.string_to_bool)
_DDP_TIMEOUT = 1800  # TrainingArguments' ddp_timeout default, seconds


def sees_gpu(env: Mapping[str, str]) -> bool:
    """Whether this process can use a GPU: a CUDA or ROCm device node, not hidden by CUDA_VISIBLE_DEVICES."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def _value(args: Sequence[str], name: str) -> str | None:
    given = given_flags(args, {name})
    return given[-1].words[0] if given and given[-1].words else None  # HfArgumentParser keeps the last


def _on(args: Sequence[str], name: str) -> bool:
    """Whether the boolean flag ``name`` is on in ``args`` (``--x``, ``--x true``; the last one counts)."""
    given = given_flags(args, {name})
    return bool(given) and (not given[-1].words or given[-1].words[0].lower() in _TRUE)


def _world_size(env: Mapping[str, str]) -> int:
    try:
        return int(env.get("WORLD_SIZE") or 1)
    except ValueError:
        return 1


def joins_group_first(args: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether this rank joins the process group before SCRIPT runs: a DeepSpeed job (``--deepspeed``)
    of more than one process on the CPU (``--use_cpu``). On a GPU, accelerate initialises DeepSpeed's
    communication layer itself when TrainingArguments sets up the device."""
    return _value(args, "deepspeed") is not None and _on(args, "use_cpu") and _world_size(env) > 1


def join_group(args: Sequence[str]) -> None:
    """torch's default group (gloo, or ``--ddp_backend``; ``--ddp_timeout``) and DeepSpeed's
    communication layer on it, as the built-in entry point has them before it builds a model."""
    import datetime

    import deepspeed

    timeout = _value(args, "ddp_timeout")
    seconds = int(timeout) if timeout and timeout.isdigit() else _DDP_TIMEOUT
    deepspeed.init_distributed(dist_backend=_value(args, "ddp_backend") or "gloo", auto_mpi_discovery=False,
                               timeout=datetime.timedelta(seconds=seconds), verbose=False)


def plain_mode(env: Mapping[str, str]) -> str | None:
    """What a plain script's rank needs so that accelerate counts every rank: "deepspeed" (accelerate's
    state with gloo first), "cpu" (ACCELERATE_USE_CPU=true), "fsdp" (refuse: accelerate has no FSDP on
    the CPU), or None: a GPU, one process, or accelerate told to use the CPU already. accelerate takes
    a backend on the CPU only when told to use the CPU; without one, every rank counts itself as the
    only process."""
    if sees_gpu(env) or _world_size(env) <= 1 or env.get("ACCELERATE_USE_CPU", "").lower() in _TRUE:
        return None
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "deepspeed"
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp"
    return "cpu"


FSDP_ON_CPU = ("hfscale: distributed.backend fsdp on a rank without a GPU: accelerate trains FSDP on GPUs only (on "
               "the CPU it drops the FSDP plugin and trains DDP, or every rank alone), so this job would not train "
               "as written. Run it on GPU nodes, or set distributed.backend: ddp or deepspeed for a CPU run.")


def accelerate_processes() -> int | None:
    """How many processes accelerate's state counts in this process; None when nothing set it up."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None)
    return shared.get("num_processes") if shared else None


def alone_message(counted: int | None, world_size: int) -> str | None:
    """What to say when accelerate counted fewer processes than the job started (each trained alone)."""
    if counted is None or world_size <= 1 or counted == world_size:
        return None
    return (f"hfscale: accelerate counted {counted} process(es) but the job started WORLD_SIZE {world_size}: each "
            "rank trained on its own, on all the data. accelerate picks no backend on the CPU unless told to use "
            "the CPU: make the Accelerator (or TrainingArguments) the first thing that sets up accelerate's state, "
            "or pass cpu=True to an earlier PartialState().")


def set_up_accelerate() -> None:
    """accelerate's process state with the gloo backend (and through it torch's group and DeepSpeed's
    communication layer), as InitProcessGroupKwargs(backend="gloo") in the script would set it up."""
    from accelerate import PartialState

    PartialState(backend="gloo")


def batch_hint(error: AssertionError, env: Mapping[str, str]) -> str | None:
    """What DeepSpeed's batch assertion means, when it is one, for a job hfscale sized."""
    text = str(error)
    if "train_batch_size" not in text:
        return None
    seen = re.search(r"!= \d+ \* \d+ \* (\d+)", text)
    read = f" ({seen.group(1)})" if seen else ""
    return (f"hfscale: DeepSpeed compared train_batch_size in its config with micro batch x accumulation x the world "
            f"size it read from its communication layer{read}; this job has WORLD_SIZE {_world_size(env)}, and the "
            "JSON hfscale wrote agrees with it. A world size of 1 there means a DeepSpeedConfig (deepspeed.zero.Init "
            "in from_pretrained) was built before torch's process group and deepspeed.init_distributed() were set "
            "up in this process.")


class Start(NamedTuple):
    """How a rank starts the script: ``args`` with the rank's flags added (None: do not run), what to
    say first, and the exit code when it does not run."""

    args: list[str] | None
    say: str
    exit_code: int


def plan_start(args: list[str], env: Mapping[str, str]) -> Start:
    """How this rank starts the script (``Start``). With in-process restarts (``HFSCALE_INPROCESS_WORLD``)
    the script resumes by itself at every attempt (hfscale.restart_in_process): no checkpoint is added."""
    given = {f.name for f in given_flags(args, {"resume_from_checkpoint", "use_cpu"})}
    extra: list[str] = []
    if "use_cpu" not in given and not sees_gpu(env):
        extra += [CPU_FLAG, "true"]
    output_dir = _value(args, "output_dir")
    if "resume_from_checkpoint" in given or not output_dir or env.get(ENV_WORLD):
        return Start(args + extra, "", 0)
    max_steps = _value(args, "max_steps")
    try:
        limit = int(max_steps) if max_steps is not None and int(max_steps) > 0 else None
    except ValueError:
        limit = None
    d = decide(scan_output(output_dir, int(env.get("WORLD_SIZE") or 1)), limit)
    if d.action == "resume":
        return Start(args + extra + [RESUME_FLAG, d.checkpoint or ""], f"hfscale: resuming from {d.checkpoint}", 0)
    if d.action == "done":
        return Start(None, f"hfscale: nothing to train: {d.reason}", 0)
    if d.action == "refuse" and first_start(env):
        return Start(None, (f"hfscale: {d.reason}. Resume one by hand with -- {RESUME_FLAG} PATH, or start over "
                            "with hfscale launch --restart (it moves them aside)."), EXIT_BAD_INPUT)
    return Start(args + extra, "", 0)


def begin_fresh(args: list[str]) -> None:
    """On rank 0 of a job hfscale launched: an ``--output_dir`` that holds no checkpoint gets the
    job's lineage before training (hfscale.checkpoints.lineage: a save of this job's cut short is then
    set aside at the next start, not refused); one that has a lineage keeps it."""
    output_dir = _value(args, "output_dir")
    if output_dir and not checkpoints(output_dir):
        begin_lineage(output_dir, keep=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plain = argv[:1] == [PLAIN_FLAG]
    argv = argv[1:] if plain else argv
    if not argv or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return EXIT_BAD_INPUT
    script = argv[0]
    fit_flight_recorder()
    if plain:
        args = argv[1:]
    else:
        planned, say, code = plan_start(argv[1:], os.environ)
        if say and os.environ.get("RANK", "0") == "0":
            print(say, file=sys.stderr if code else sys.stdout, flush=True)
        if planned is not None and os.environ.get("RANK", "0") == "0" and os.environ.get("HFSCALE_RUN_DIR"):
            begin_fresh(planned)
        if planned is None:
            return code
        args = planned
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    if os.environ.get("HFSCALE_RUN_DIR") and not plain:  # launched by hfscale: the hang watchdog needs the steps
        from hfscale.training.async_save import prepare_env
        from hfscale.training.trainer_hook import install

        install()
        prepare_env()  # CROSS_RANK/CROSS_SIZE, which DeepSpeed's decoupled writer (training.async_save) reads
    world_size = _world_size(os.environ)
    mode = plain_mode(os.environ) if plain else None
    if mode == "fsdp":  # said by every rank: the first to exit has torchrun stop the others before they speak
        print(FSDP_ON_CPU, file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if mode == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"
    elif mode == "deepspeed":
        set_up_accelerate()
    elif not plain and joins_group_first(args, os.environ) and not os.environ.get(ENV_WORLD):
        # (with in-process restarts each attempt joins its own group: hfscale.restart_in_process)
        join_group(args)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    except LossAlarm:  # rank 0 said why; the launch rolls back (hfscale.checkpoints.rollbacks)
        return exitcodes.LOSS_ALARM
    except SlowNodeStop:  # rank 0 said which node; the relaunch replaces it (hfscale.training.slow_nodes)
        return exitcodes.SLOW_NODE
    except AssertionError as e:
        hint = batch_hint(e, os.environ)
        if hint and os.environ.get("RANK", "0") == "0":
            print(hint, file=sys.stderr, flush=True)
        raise
    alone = alone_message(accelerate_processes(), world_size) if plain else None
    if alone:
        if os.environ.get("RANK", "0") == "0":
            print(alone, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    if code:
        sys.exit(code)
    exit_cleanly(0)
