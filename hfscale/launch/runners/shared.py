"""What every runner shares: the ``Runner`` interface (and ``Scheduler``, for runners that hand the job
to a scheduler), and ``Common``, the runner-independent part of a plan, computed once by
``hfscale.launch.build.build_plan`` (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from hfscale.core.shell import Command, Secret
from hfscale.launch.node.command import LaunchContext
from hfscale.launch.spec import LaunchPlan, Watch
from hfscale.rules.resolved import Job


@dataclass(frozen=True)
class Common:
    """The parts of a plan that do not depend on the runner.

    ``run_dir``: where hfscale writes this run's record; ``rank_dir``: where the ranks read the
    generated files (``run_dir``, or a runner's own place such as a Kubernetes ConfigMap);
    ``files``: the generated files for ``rank_dir``; ``env``: the ranks' environment, secret
    values as ``Secret``; ``done``: nothing to train, nothing will start."""

    run_dir: str
    rank_dir: str
    workdir: str
    python: str
    env: dict[str, str | Secret]
    files: tuple[tuple[str, str], ...]
    notes: tuple[str, ...]
    moves: tuple[tuple[str, str], ...]
    done: bool
    watch: Watch | None = None  # the hang watchdog, for runners hfscale follows to the end

    @property
    def mode(self) -> str:
        return "done" if self.done else "stream"


class Unavailable(NamedTuple):
    """What to say when the scheduler cannot be reached, and the exit code."""

    message: str
    exit_code: int


class Submitted(NamedTuple):
    """After the scheduler took the job: files to record in the run directory, and what to say."""

    files: dict[str, str]
    message: str


@runtime_checkable
class Runner(Protocol):
    """One ``runner.type``: how its nodes are reached and its job started (``hfscale.launch.runners.RUNNERS``)."""

    name: str
    rank_dir: str | None  # where its ranks read the generated files; None: the run directory

    def plan(self, job: Job, ctx: LaunchContext, common: Common) -> LaunchPlan:
        """The launch plan (pure: the job taken through the runner's own renderers once)."""
        ...


@runtime_checkable
class Scheduler(Runner, Protocol):
    """A runner that hands the job to a scheduler (the plan's ``mode == "submit"``)."""

    def probe(self, plan: LaunchPlan) -> Command | None:
        """A command asked before submitting (exit 0: the scheduler is there), or None."""
        ...

    def unavailable(self, plan: LaunchPlan) -> Unavailable:
        ...

    def submitted(self, plan: LaunchPlan, stdout: str) -> Submitted:
        ...
