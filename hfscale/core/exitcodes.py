"""hfscale's own exit codes (otherwise ``launch`` exits with the training's code, 128+N for signal N)."""

import signal
from typing import Literal

OK = 0
BAD_INPUT = 2  # a config, argument or output directory that cannot be used; nothing was started
UNREACHABLE = 3  # a host (or a scheduler) that cannot be reached
HUNG = 4  # the hang watchdog found no rank finishing a step (hfscale.launch.attempt.watchdog); stacks in the run directory
UNHEALTHY = 69  # EX_UNAVAILABLE: a node failed its health gate (hfscale.launch.node.health_gate); it is not admitted
LOSS_ALARM = 65  # EX_DATAERR: a rank's loss guard stopped training (hfscale.checkpoints.rollbacks); relaunched, it rolls back
SLOW_NODE = 76  # a node was slow: every rank stopped after a complete checkpoint (hfscale.training.slow_nodes); relaunched without it
RELAUNCH = 75  # EX_TEMPFAIL: a rank's in-process restart could not go on (hfscale.training.inprocess); relaunch the job


def signal_name(sig: int) -> str:
    """SIGTERM for 15; "signal N" for a number that is not a signal here."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


EndState = Literal["finished", "submitted", "stopped", "hung", "failed"]  # how a launch ended


def state_of(rc: int, *, submitted: bool = False, signalled: bool = False, hung: bool = False) -> EndState:
    """A launch's end as ``hfscale runs`` shows it, from what ended it (a node's own exit code of 4
    or 143 is a failure, not a hang or a stop); preempted is told by rank 0 (hfscale.training.heartbeat)."""
    if rc == OK:
        return "submitted" if submitted else "finished"
    return "stopped" if signalled else "hung" if hung else "failed"
