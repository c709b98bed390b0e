"""The previous release's module paths, and where each module lives now.

The re-layout into ten subpackages moved every module (``hfscale/progress.py`` ->
``hfscale/training/heartbeat.py``, ...). Scripts written against the old paths keep working for a
release: ``import hfscale.progress``, ``from hfscale.callbacks import MetricsCallback`` and
``python -m hfscale.train`` load the module at its new path, with a ``DeprecationWarning`` naming
it (as transformers keeps a moved name working with a warning). Four old modules share their name
with a package now (``hfscale.config``, ``hfscale.memory``, ``hfscale.runs``, ``hfscale.cli``): their
names are served by that package's ``__getattr__`` (``moved_name``), from the module that holds them
now.

``install()`` (run by ``import hfscale``) puts one finder first on ``sys.meta_path``; it answers only
for the old names below, none of which is a file now (first: ``hfscale.callbacks.reporting`` must not
load ``training/callbacks/reporting.py`` a second time, as another module, through the aliased
package's path). The new paths are strings here: nothing is imported until an old path is used.
Imports nothing from hfscale.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

# old module -> the module that holds its contents now (git: ddc25f8 "hfscale in ten layered subpackages")
MOVED = {
    "hfscale.accelerate_rules": "hfscale.rules.accelerate",
    "hfscale.accelerate_source": "hfscale.config.sources.accelerate",
    "hfscale.artifacts": "hfscale.render.artifacts",
    "hfscale.callbacks": "hfscale.training.callbacks",
    "hfscale.callbacks.checkpoints": "hfscale.training.callbacks.checkpoints",
    "hfscale.callbacks.collectives": "hfscale.training.callbacks.collectives",
    "hfscale.callbacks.preemption": "hfscale.training.callbacks.preemption",
    "hfscale.callbacks.progress": "hfscale.training.callbacks.steps",
    "hfscale.callbacks.reporting": "hfscale.training.callbacks.reporting",
    "hfscale.checkpoint_files": "hfscale.checkpoints.files",
    "hfscale.cli_runs": "hfscale.cli.runs",
    "hfscale.config_accelerate": "hfscale.config.accelerate",
    "hfscale.config_base": "hfscale.config.base",
    "hfscale.config_deepspeed": "hfscale.config.deepspeed",
    "hfscale.config_runners": "hfscale.config.runners",
    "hfscale.console": "hfscale.launch.attempt.console",
    "hfscale.deepspeed_rules": "hfscale.rules.deepspeed",
    "hfscale.deepspeed_source": "hfscale.config.sources.deepspeed",
    "hfscale.disk_full": "hfscale.launch.attempt.disk_full",
    "hfscale.docs_reference": "hfscale.config.docs_reference",
    "hfscale.engine_source": "hfscale.config.sources.engine",
    "hfscale.envvars": "hfscale.config.envvars",
    "hfscale.errors": "hfscale.config.errors",
    "hfscale.execute": "hfscale.launch.attempt.execute",
    "hfscale.exitcodes": "hfscale.core.exitcodes",
    "hfscale.export": "hfscale.checkpoints.export",
    "hfscale.extra_keys": "hfscale.config.extra_keys",
    "hfscale.files": "hfscale.core.atomic_files",
    "hfscale.fit": "hfscale.memory.fit",
    "hfscale.follow": "hfscale.launch.attempt.follow",
    "hfscale.hostfile": "hfscale.config.hostfile",
    "hfscale.import_deepspeed": "hfscale.cli.importing.deepspeed",
    "hfscale.import_draft": "hfscale.cli.importing.draft",
    "hfscale.import_fsdp": "hfscale.cli.importing.fsdp",
    "hfscale.importer": "hfscale.cli.importing.importer",
    "hfscale.job": "hfscale.rules.check",  # Job, resolve (Job itself is defined in hfscale.rules.resolved)
    "hfscale.launch_plan": "hfscale.launch.spec",
    "hfscale.launcher": "hfscale.launch.node.command",
    "hfscale.load": "hfscale.rules.config_file",
    "hfscale.meta_count": "hfscale.memory.meta_count",
    "hfscale.model_config": "hfscale.config.model_config",
    "hfscale.model_shape": "hfscale.memory.model_shape",
    "hfscale.netcheck": "hfscale.launch.netcheck",
    "hfscale.network": "hfscale.launch.preflight.network",
    "hfscale.output_lock": "hfscale.launch.attempt.output_lock",
    "hfscale.parallelism_rules": "hfscale.rules.parallelism",
    "hfscale.pid_identity": "hfscale.core.pid_identity",
    "hfscale.plan": "hfscale.launch.build",
    "hfscale.preflight": "hfscale.launch.preflight.probes",
    "hfscale.presets": "hfscale.render.presets",
    "hfscale.progress": "hfscale.training.heartbeat",
    "hfscale.records": "hfscale.core.records",
    "hfscale.render_accelerate": "hfscale.render.accelerate",
    "hfscale.render_deepspeed": "hfscale.render.deepspeed",
    "hfscale.render_kubernetes": "hfscale.launch.runners.kubernetes_manifest",
    "hfscale.render_slurm": "hfscale.launch.runners.slurm_script",
    "hfscale.report": "hfscale.runs.report",
    "hfscale.reshard": "hfscale.checkpoints.reshard",
    "hfscale.resume": "hfscale.checkpoints.resume",
    "hfscale.run_history": "hfscale.runs.history",
    "hfscale.run_script": "hfscale.training.run_script",
    "hfscale.run_stop": "hfscale.runs.stop",
    "hfscale.rundir": "hfscale.launch.run_dir",
    "hfscale.runners": "hfscale.launch.runners",
    "hfscale.runners.common": "hfscale.launch.runners.shared",
    "hfscale.runners.kubernetes": "hfscale.launch.runners.kubernetes",
    "hfscale.runners.local": "hfscale.launch.runners.local",
    "hfscale.runners.pdsh": "hfscale.launch.runners.pdsh",
    "hfscale.runners.pdsh_docker": "hfscale.launch.runners.pdsh_docker",
    "hfscale.runners.slurm": "hfscale.launch.runners.slurm",
    "hfscale.runners.stopping": "hfscale.launch.node.stopping",
    "hfscale.schedule": "hfscale.checkpoints.lr_schedule",
    "hfscale.schema_errors": "hfscale.config.schema_errors",
    "hfscale.script_rules": "hfscale.rules.script",
    "hfscale.shell": "hfscale.core.shell",
    "hfscale.shutdown": "hfscale.training.shutdown",
    "hfscale.sizing": "hfscale.memory.plan_command",
    "hfscale.ssh": "hfscale.launch.node.reach",
    "hfscale.summary": "hfscale.cli.check_summary",
    "hfscale.template": "hfscale.config.template",
    "hfscale.tensors_only": "hfscale.checkpoints.tensors_only",
    "hfscale.train": "hfscale.training.train",
    "hfscale.trainer_args": "hfscale.rules.trainer_args",
    "hfscale.trainer_hook": "hfscale.training.trainer_hook",
    "hfscale.transformers_source": "hfscale.config.sources.transformers",
    "hfscale.untrusted": "hfscale.core.untrusted",
    "hfscale.watchdog": "hfscale.launch.attempt.watchdog",
    "hfscale.yamlsource": "hfscale.config.yaml_source",
    # launch/ in rooms (issue 37): the previous release's hfscale.launch paths
    **{f"hfscale.launch.{m}": f"hfscale.launch.attempt.{m}" for m in (
        "beats", "console", "disk_full", "execute", "first_failure", "follow", "node_lines", "output_lock",
        "run_output", "watchdog")},
    **{f"hfscale.launch.{m}": f"hfscale.launch.recovery.{m}" for m in ("requeue", "settle", "supervisor", "timeline")},
    "hfscale.launch.network": "hfscale.launch.preflight.network",
    "hfscale.launch.node_command": "hfscale.launch.node.command",
    "hfscale.launch.ssh": "hfscale.launch.node.reach",
    "hfscale.launch.runners.keeper": "hfscale.launch.node.keeper",
    "hfscale.launch.runners.stopping": "hfscale.launch.node.stopping",
    "hfscale.launch.runners.slurm_state": "hfscale.runs.slurm_state",
}
# old modules whose name is a package now: their names come from this module of the package
MOVED_INTO_PACKAGE = {
    "hfscale.cli": "hfscale.cli.commands",
    "hfscale.config": "hfscale.config.model",
    "hfscale.launch.preflight": "hfscale.launch.preflight.probes",
    "hfscale.launch.recovery": "hfscale.launch.recovery.policy",
    "hfscale.memory": "hfscale.memory.estimate",
    "hfscale.runs": "hfscale.runs.registry",
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    # stacklevel: past this function and its callers (frames of importlib itself are skipped by
    # warnings), so that the warning names the line of the script that used the old path
    warnings.warn(f"{old} moved to {new}: import it from there ({old} will be removed in a future release)",
                  DeprecationWarning, stacklevel=stacklevel + 1)


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path (the same module object under both names)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module ran once, under its new name

    def get_code(self, fullname: str):
        """For ``python -m <old path>``: runpy runs the new module's code as ``__main__``."""
        spec = importlib.util.find_spec(self.new)
        return spec.loader.get_code(self.new)  # type: ignore[union-attr]


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the previous release's module paths (``MOVED``) at their new place, with a warning."""

    def find_spec(self, fullname, path, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        _warn(fullname, new, 2)
        real = importlib.util.find_spec(new)
        is_package = real is not None and real.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), is_package=is_package)


def install() -> None:
    """Add the finder once, first: an old path is never a file of its own."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())


def moved_name(package: str, name: str) -> object:
    """For a package's ``__getattr__``: ``name`` of the old module ``package`` was before it became a
    package (``MOVED_INTO_PACKAGE``), from its new module, with a warning; AttributeError otherwise."""
    new = MOVED_INTO_PACKAGE.get(package)
    # a private name, or a submodule not imported yet (``from hfscale.config import model``: the import
    # system asks for the attribute first, then imports the submodule), is not the old module's
    if new is None or name.startswith("_") or importlib.util.find_spec(f"{package}.{name}") is not None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module = importlib.import_module(new)
    if not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{new}.{name}", 3)  # past the package's __getattr__
    return getattr(module, name)
