"""hfscale's own exit codes (otherwise ``launch`` exits with the training's code, 128+N for signal N)."""

import signal

OK = 0
BAD_INPUT = 2  # a config, argument or output directory that cannot be used; nothing was started
UNREACHABLE = 3  # a host (or a scheduler) that cannot be reached
HUNG = 4  # the hang watchdog found no rank finishing a step (hfscale.watchdog); stacks in the run directory


def signal_name(sig: int) -> str:
    """SIGTERM for 15; "signal N" for a number that is not a signal here."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def state_of(rc: int) -> str:
    """A launch's end as ``hfscale runs`` shows it (preempted is told by rank 0, hfscale.progress)."""
    if rc == OK:
        return "finished"
    if rc == HUNG:
        return "hung"
    if rc in (128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGHUP):
        return "stopped"
    return "failed"
