"""hfscale: one YAML compiles into the Accelerate config, the DeepSpeed JSON and the host file.

The public face, what a training script imports: these names stay here whatever moves inside the
package. Each is loaded on first use, so ``import hfscale`` imports no torch::

    import hfscale

    resume = hfscale.instrument(trainer)   # the callbacks the launch's YAML asks for
    trainer.train(resume_from_checkpoint=resume)
    hfscale.exit_cleanly()                 # last line: leave the process group, skip the teardown

In a plain loop: ``hfscale.step(n)`` after each optimizer step (the hang watchdog),
``hfscale.report(step=..., max_steps=..., loss=...)`` (the progress line), ``hfscale.load_job(path)``
(the YAML's batch geometry and training settings). With ``recovery.in_process``: ``sys.exit(
hfscale.restart_in_process(main))``, ``main`` building and resuming its training at every call
(hfscale.training.inprocess.opt_in). Everything else may move; the previous release's
module paths (``hfscale.callbacks``, ``hfscale.progress``, ``hfscale.resume``, ...) still work, with a
DeprecationWarning naming the new one (hfscale.core.moved).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hfscale.core.moved import install as _install_moved

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "instrument": "hfscale.training.instrument",
    "CheckpointCompleteCallback": "hfscale.training.callbacks.checkpoints",
    "MetricsCallback": "hfscale.training.callbacks.reporting",
    "StragglerCallback": "hfscale.training.callbacks.reporting",
    "PreemptionCallback": "hfscale.training.callbacks.preemption",
    "ProgressCallback": "hfscale.training.callbacks.steps",
    "DataStateCallback": "hfscale.training.callbacks.data_state",
    "latest_checkpoint": "hfscale.checkpoints.resume",
    "IncompleteCheckpointWarning": "hfscale.checkpoints.resume",
    "exit_cleanly": "hfscale.training.shutdown",
    "step": "hfscale.training.heartbeat",
    "alive": "hfscale.training.heartbeat",
    "report": "hfscale.training.heartbeat",
    "load_job": "hfscale.rules.config_file",
    "restart_in_process": "hfscale.training.inprocess.opt_in",
}
__all__ = ["__version__", *_PUBLIC]

if TYPE_CHECKING:  # for editors and type checkers; at run time each name loads on first use
    from hfscale.checkpoints.resume import IncompleteCheckpointWarning, latest_checkpoint
    from hfscale.rules.config_file import load_job
    from hfscale.training.callbacks.checkpoints import CheckpointCompleteCallback
    from hfscale.training.callbacks.data_state import DataStateCallback
    from hfscale.training.callbacks.preemption import PreemptionCallback
    from hfscale.training.callbacks.reporting import MetricsCallback, StragglerCallback
    from hfscale.training.callbacks.steps import ProgressCallback
    from hfscale.training.heartbeat import alive, report, step
    from hfscale.training.inprocess.opt_in import restart_in_process
    from hfscale.training.instrument import instrument
    from hfscale.training.shutdown import exit_cleanly


def __getattr__(name: str) -> object:
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'hfscale' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    """The public face and the module's own dunders: not what this file imports to work (TYPE_CHECKING,
    annotations, importlib) nor the subpackages loaded so far (core, ...)."""
    return sorted({*__all__, *(n for n in globals() if n.startswith("__") and n.endswith("__"))})


_install_moved()
