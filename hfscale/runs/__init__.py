"""Runs that exist: the registry of run directories (runs/status/logs), a run's history and its report,
and stopping a run.

Layer 7: may import the layers below (core .. launch).
"""


def __getattr__(name: str) -> object:
    """The previous release's module of this name (hfscale.core.moved.MOVED_INTO_PACKAGE): its names
    still work, with a DeprecationWarning naming the module that holds them now."""
    from hfscale.core.moved import moved_name

    return moved_name(__name__, name)
