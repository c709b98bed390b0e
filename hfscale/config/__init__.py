"""The config: its pydantic model (model, base, accelerate, deepspeed, runners), the YAML source with
lines, errors, the host file, the template and the generated reference, the job's environment variables,
the library keys hfscale does not type (extra_keys), the classes DeepSpeed builds for an optimizer or
scheduler section and their defaults (engine_defaults) and, in ``sources``, readers of the installed
engines' own source (no engine is imported).

Layer 1: may import hfscale.core.
"""
