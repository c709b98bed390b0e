"""What every runner's plan starts from: the runner-independent part, computed once by
``hfscale.plan.build_plan`` (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from ..launch_plan import Watch
from ..shell import Secret


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
