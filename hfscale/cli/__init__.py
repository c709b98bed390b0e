"""The command line: parse, call the library, print, map errors to exit codes (commands, runs, the summary
``check`` prints: check_summary), and ``importing``: the ``hfscale import`` translation of existing Accelerate and
DeepSpeed configs, which only this command uses.

Layer 9 (top): may import every layer.
"""

from hfscale.cli.commands import main

__all__ = ["main"]


def __getattr__(name: str) -> object:
    """The previous release's module hfscale/cli.py (now hfscale.cli.commands): its other names still
    work, with a DeprecationWarning naming the new module."""
    from hfscale.core.moved import moved_name

    return moved_name(__name__, name)
