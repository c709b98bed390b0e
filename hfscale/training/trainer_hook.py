"""For a Trainer script run by hfscale.training.run_script: every transformers ``Trainer`` it creates gets
hfscale's ProgressCallback (the hang watchdog's steps), DataStateCallback (a streaming dataset
resumes from its saved position instead of being replayed) and LossGuardCallback (a loss spike or a NaN
stops training for a rollback, as ``training.loss_guard`` says), with no change to the script.

An import hook: nothing is imported or changed until the script itself imports
``transformers.trainer``; then ``Trainer.__init__`` adds the callback unless the script added one.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys

_MODULE = "transformers.trainer"


class _TrainerHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # once, and so that the lookup below finds the real module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            trainer = getattr(module, "Trainer", None)
            if trainer is not None:
                _add_progress(trainer)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _add_progress(trainer_cls: type) -> None:
    init = trainer_cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        from hfscale.training.callbacks.steps import ProgressCallback

        if not any(isinstance(c, ProgressCallback) for c in self.callback_handler.callbacks):
            self.add_callback(ProgressCallback())
        from hfscale.training.callbacks.data_state import attach

        attach(self)  # a streaming dataset resumes from its saved position, not by replay
        from hfscale.training.callbacks.loss_guard import attach as guard
        from hfscale.training.instrument import launch_job

        job = launch_job()  # the loss guard as the YAML says (on by default): a spike or a NaN stops for a rollback
        config = job.config.training.loss_guard if job is not None else None
        if config is None or config.enabled:
            guard(self, config)

    trainer_cls.__init__ = __init__


def install() -> None:
    """Add the hook (before the script runs); a second call does nothing."""
    if _MODULE in sys.modules:
        _add_progress(sys.modules[_MODULE].Trainer)
    elif not any(isinstance(f, _TrainerHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TrainerHook())
