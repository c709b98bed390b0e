"""What every runner module is: the ``Runner`` interface (and ``Scheduler``, for runners that hand the
job to a scheduler), with what a scheduler answers (``Unavailable``, ``Submitted``). The
runner-independent part of a plan a runner is given is hfscale.launch.context.Common."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from hfscale.core.shell import Command
from hfscale.launch.context import Common, LaunchContext
from hfscale.launch.spec import LaunchPlan
from hfscale.rules.resolved import Job


class Unavailable(NamedTuple):
    """What to say when the scheduler cannot be reached, and the exit code."""

    message: str
    exit_code: int


class Submitted(NamedTuple):
    """After the scheduler took the job: files to record in the run directory, and what to say."""

    files: dict[str, str]
    message: str


class Runner(Protocol):
    """One ``runner.type``'s module: how its nodes are reached and its job started
    (``hfscale.launch.runners.RUNNERS``)."""

    RANK_DIR: str | None  # where its ranks read the generated files; None: the run directory

    def plan(self, job: Job, ctx: LaunchContext, common: Common) -> LaunchPlan:
        """The launch plan (pure: the job taken through the runner's own renderers once)."""
        ...


class Scheduler(Runner, Protocol):
    """A runner that hands the job to a scheduler (the plan's ``mode == "submit"``)."""

    def probe(self, plan: LaunchPlan) -> Command | None:
        """A command asked before submitting (exit 0: the scheduler is there), or None."""
        ...

    def unavailable(self, plan: LaunchPlan) -> Unavailable:
        ...

    def submitted(self, plan: LaunchPlan, stdout: str) -> Submitted:
        ...
