"""The ``hfscale plan`` command: the memory estimate per GPU, the model's shape read from its config, the
cheapest change that makes a setting fit, and the exact parameter count on the meta device.

Layer 8: may import the layers below (core .. runs).
"""


def __getattr__(name: str) -> object:
    """The previous release's module of this name (hfscale.core.moved.MOVED_INTO_PACKAGE): its names
    still work, with a DeprecationWarning naming the module that holds them now."""
    from hfscale.core.moved import moved_name

    return moved_name(__name__, name)
