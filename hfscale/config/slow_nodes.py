"""The ``recovery.slow_nodes`` section: a node that holds the job back is replaced at the next checkpoint.

In synchronous data-parallel training every rank waits for the slowest in the collectives, so one slow
node (a throttled GPU, a thermal limit, a noisy neighbour) sets the whole job's pace. The ranks time
their own forward passes (hfscale.training.callbacks.reporting.StragglerCallback); over windows of
``window`` seconds each node's forward time is compared with the other nodes' median, and a node over
``factor`` in ``windows`` windows running is stopped at the job's next checkpoint and replaced: by a
spare that passed its probe, else left out where ``recovery.min_nodes`` allows
(hfscale.training.slow_nodes, hfscale.launch.recovery.policy).
"""

from __future__ import annotations

from pydantic import Field

from hfscale.config.base import Strict


class SlowNodesConfig(Strict):
    """When a node is slow enough, for long enough, to be replaced."""

    enabled: bool = Field(True, description="Watch for slow nodes when recovery is on (runners pdsh and slurm), the "
                          "job has more than one node and a spare or recovery.min_nodes lets one be replaced (check "
                          "says whether it is watched).")
    factor: float = Field(1.5, gt=1.0, le=1000.0, description="A node is slow when its ranks' forward passes take "
                          "more than this many times the other nodes' median over a window.")
    window: int = Field(60, ge=1, le=86_400, description="Seconds of training per window (whole straggler reports: "
                        "every training.logging_steps steps). Short windows on a loaded machine are noise: on the "
                        "2-core test machine, even jobs' windows of 5 s reached 1.75x.")
    windows: int = Field(3, ge=1, le=1000, description="Windows running in which the same node is slow before it is "
                         "replaced, at the job's next checkpoint (nothing is recomputed).")
