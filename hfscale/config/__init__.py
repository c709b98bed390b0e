"""The config: its pydantic model (model, base, accelerate, deepspeed, runners), the YAML source with
lines, errors, the host file, the template and the generated reference, the job's environment variables,
the library keys hfscale does not type (extra_keys), the classes DeepSpeed builds for an optimizer or
scheduler section and their defaults (engine_defaults) and, in ``sources``, readers of the installed
engines' own source (no engine is imported).

Layer 1: may import hfscale.core.
"""


def __getattr__(name: str) -> object:
    """The previous release's module of this name (hfscale.core.moved.MOVED_INTO_PACKAGE): its names
    still work, with a DeprecationWarning naming the module that holds them now."""
    from hfscale.core.moved import moved_name

    return moved_name(__name__, name)
