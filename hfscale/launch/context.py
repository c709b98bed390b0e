"""What a plan is built from, beside the config (pure data): ``LaunchContext`` (everything from
outside the config a plan depends on, gathered by the caller, and ``output_dir_to_scan``, where
the caller looks for checkpoints), the attempt ids of a run, and
``Common`` (the runner-independent part of a plan, computed once by hfscale.launch.build.build_plan
and handed to the runner of ``runner.type``)."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Mapping

from hfscale.checkpoints.resume import OutputScan
from hfscale.core.shell import Secret
from hfscale.launch.spec import HangWatch
from hfscale.rules.resolved import Job

JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_ATTEMPT = re.compile(r"-r[0-9]{1,6}$")  # a relaunch's job id: <the run's job id>-r<attempt>


def attempt_id(job_id: str, attempt: int) -> str:
    """The job id of attempt ``attempt`` of a run (hfscale.launch.recovery.supervisor): the run's own for the
    first, ``<id>-r<n>`` after: a relaunch's processes must not carry the id the previous attempt's
    stop still kills by (hfscale.launch.node.stopping)."""
    return job_id if attempt == 0 else f"{job_id}-r{attempt}"


def run_of(job_id: str) -> str:
    """The run's job id of an attempt's (``attempt_id`` undone)."""
    return _ATTEMPT.sub("", job_id)


@dataclass(frozen=True)
class LaunchContext:
    """Everything from outside the config that a plan depends on, gathered by the caller."""

    cwd: str
    python: str
    job_id: str
    shell_env: tuple[tuple[str, str], ...] = ()
    extra_args: tuple[str, ...] = ()
    output: OutputScan | None = None  # the checkpoints in training.output_dir (output_dir_to_scan)
    restart: bool = False  # --restart: move the checkpoints aside and start at step 0
    run_id: str | None = None  # a relaunch's: the run directory's job id (job_id is the attempt's)
    # a relaunch's: hosts of the previous attempt that did not answer after its stop (hfscale.launch.recovery.settle);
    # a Slurm step of theirs cannot end before Slurm notices them, so the next step does not wait for it
    unreachable: tuple[str, ...] = ()

    @staticmethod
    def of(cwd: str, python: str, job_id: str, shell_env: Mapping[str, str], extra_args=(),
           output: OutputScan | None = None, restart: bool = False, attempt: int = 0) -> "LaunchContext":
        if not JOB_ID_RE.match(job_id) or not JOB_ID_RE.match(attempt_id(job_id, attempt)):
            raise ValueError(f"job id {job_id!r}: lower-case letters, digits and '-' only")
        return LaunchContext(cwd, python, attempt_id(job_id, attempt), tuple(sorted(shell_env.items())),
                             tuple(extra_args), output, restart, job_id if attempt else None)


def output_dir_to_scan(job: Job) -> str | None:
    """Where the launch host looks for checkpoints before it starts anything: training.output_dir
    under the working directory, for the entries that resume (the built-in one, Trainer scripts);
    None where it cannot look."""
    cfg = job.config
    if cfg.runner.type == "kubernetes" or (cfg.training.script is not None and cfg.training.pass_args == "none"):
        return None  # the pods' volumes are not visible here; a plain script keeps its own checkpoints
    # relative to the directory hfscale runs in (the default workdir), as people wrote it
    return posixpath.join(cfg.runner.workdir, cfg.training.output_dir) if cfg.runner.workdir else cfg.training.output_dir


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
    watch: HangWatch | None = None  # the hang watchdog, for runners hfscale follows to the end

    @property
    def mode(self) -> str:
        return "done" if self.done else "stream"
