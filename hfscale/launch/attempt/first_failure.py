"""Which node's failure to name when several fail at once (no processes, one timer thread).

When a rank dies, the ranks waiting on it in a collective fail too (gloo's "Connection closed by
peer", NCCL's remote error), and their node may report before the node that failed first. A
failure marked ``lost_peer`` (hfscale.launch.attempt.node_lines) is therefore held for ``PEER_WAIT_S``: a
failure of another node that did not just lose a peer is named instead; if none comes (or every
node has reported, ``settle``), the held one is named, saying so.
"""

from __future__ import annotations

import threading
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

    def settle(self) -> None:
        """Name the held failure now (its wait ended, or every node has reported)."""
        with self._lock:
            held = self._held
            if self._done or held is None:
                return
            self._finish()
        self._name(Failure(held.where, held.rc, f"{held.what}: its ranks lost a peer, and no other node "
                                                f"reported a failure within {self._wait_s:g} s", lost_peer=True))

    def _finish(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
