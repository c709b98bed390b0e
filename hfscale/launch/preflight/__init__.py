"""Preflight: ``probes`` (what to ask every host before a launch and what the answers mean, pure
but for ``local_need``) and ``network`` (``hfscale preflight --network``: which hosts measure each
other when, and what the numbers say; hfscale.launch.netcheck measures on each host).

May import the layers below hfscale.launch, the top modules of hfscale.launch and node/ (probes reach
a host as the launch does); no runner, nothing of attempt/ or recovery/ (tests/test_architecture.py
holds this). attempt.execute runs the probes, recovery.supervisor asks them between attempts.
"""


def __getattr__(name: str) -> object:
    """The previous release's module of this name (hfscale.core.moved.MOVED_INTO_PACKAGE): its names
    still work, with a DeprecationWarning naming the module that holds them now."""
    from hfscale.core.moved import moved_name

    return moved_name(__name__, name)
