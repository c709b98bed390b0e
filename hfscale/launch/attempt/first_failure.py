"""Which node's failure to name when several fail at once (no processes, one timer thread).

When a rank dies, the ranks waiting on it in a collective fail too (gloo's "Connection closed by
peer", NCCL's remote error), and their node may report before the node that failed first. A
failure marked ``lost_peer`` (hfscale.launch.attempt.node_lines: a victim's, a task the stop or Slurm
killed, a task srun said ended before its own lines came) is therefore held for ``PEER_WAIT_S``: a
failure that is not in doubt is named instead; if none comes (or every node's line has ended,
``settle``), the held one is named, saying why it was held.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Callable

from hfscale.launch.attempt.node_lines import Failure

PEER_WAIT_S = 5.0  # a node whose ranks only lost a peer waits this long for the node that failed first


class FirstFailure:
    """Takes the nodes' failures in the order they arrive; calls ``name`` once with the one to report."""

    def __init__(self, name: Callable[[Failure], None], wait_s: float = PEER_WAIT_S):
        self._name = name
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._held: Failure | None = None
        self._timer: threading.Timer | None = None
        self._done = False

    def offer(self, failure: Failure) -> None:
        """A node failed: name it now, or hold it while the node that failed first may still report."""
        with self._lock:
            if self._done:
                return
            held = self._held
            if failure.lost_peer:
                if held is None:
                    self._held = failure
                    self._timer = threading.Timer(self._wait_s, self.settle)
                    self._timer.daemon = True
                    self._timer.start()
                return
            if held is not None and held.where != failure.where:
                failure = Failure(failure.where, failure.rc, f"{failure.what} ({held.where}'s ranks lost it as a peer)")
            self._finish()
        self._name(failure)

    def settle(self, all_ended: bool = False) -> None:
        """Name the held failure now: its wait ended, or (``all_ended``) every node's line has ended."""
        with self._lock:
            held = self._held
            if self._done or held is None:
                return
            self._finish()
        why = ("every node's line ended and none failed otherwise" if all_ended
               else f"no other node reported a failure within {self._wait_s:g} s")
        self._name(replace(held, what=f"{held.what}: {held.doubt}, and {why}"))

    def _finish(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
