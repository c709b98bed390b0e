"""An attempt its ranks stopped to replace a slow node: what the supervisor makes of it.

The ranks judge the nodes' speed themselves (hfscale.training.slow_nodes); when one is slow they train on
to the job's next checkpoint, stop there, and rank 0 names the node in ``progress/metrics.json``
(``slow``, ``slow_host``, written as the ranks stop: hfscale.training.callbacks.slow_nodes). The attempt
then ends with every rank's exit 76 (exitcodes.SLOW_NODE): a ``slow`` fault against that host, which a
spare replaces or the job leaves out (hfscale.launch.recovery.policy); the relaunch resumes from the
checkpoint the ranks stopped at, so nothing is recomputed. Reads the run directory only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfscale.core.untrusted import Unreadable
from hfscale.launch.run_dir import read_metrics


@dataclass(frozen=True)
class SlowStop:
    """The node the ranks stopped for, why, and the step of the checkpoint they stopped at."""

    host: str
    what: str
    step: int | None


def slow_stop(run_dir: str, hosts: tuple[str, ...]) -> SlowStop | None:
    """What rank 0 said when the ranks of this attempt stopped for a slow node among ``hosts``; None when
    they did not (or the record is unreadable, or names a host that is not the attempt's)."""
    try:
        m = read_metrics(run_dir)
    except (Unreadable, OSError):
        return None
    if m.slow_host is None or m.slow_host not in hosts or not m.slow:
        return None
    at = f"; the job stopped at its checkpoint of step {m.step} to replace it" if m.step is not None else ""
    return SlowStop(m.slow_host, f"{m.slow}{at}", m.step)
