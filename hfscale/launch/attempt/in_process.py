"""What a launch with in-process restarts (recovery.in_process) makes of its nodes' ends (pure).

Its ranks heal a lost or failed node themselves (hfscale.training.inprocess): a standby takes each
lost rank and the others go on in their processes. So a node's failure does not stop the job here;
a node that ends with ``exitcodes.RELAUNCH`` does (its ranks found no in-process restart possible:
too few standbys, a survivor that did not rejoin, the store lost), and the launch relaunches it as
it would without in-process restarts. At the end the job has finished if a node ended with 0 (a
rank ends with 0 only when training did, a standby only when told the job finished); otherwise the
first failure healed is the job's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hfscale.core import exitcodes
from hfscale.launch.attempt.node_lines import Failure


@dataclass
class HealedEnds:
    """The nodes' failures the ranks heal, in the order they came."""

    healed: list[Failure] = field(default_factory=list)

    def heals(self, f: Failure) -> bool:
        """Whether the job goes on without the node ``f`` names (and ``f`` is kept): every failure but
        a relaunch asked for."""
        if f.rc == exitcodes.RELAUNCH:
            return False
        self.healed.append(f)
        return True

    def finished(self, succeeded: set[str]) -> bool:
        """Whether the job finished, by the nodes whose exit line said 0 (a rank ends with 0 only when
        training did, a standby only when told so), though some failed and were healed around."""
        return bool(succeeded)
