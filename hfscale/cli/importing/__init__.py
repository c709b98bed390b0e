"""``hfscale import``: existing Accelerate/DeepSpeed/FSDP configs translated into an hfscale YAML draft,
checked against the engines' source and hfscale's rules.

Part of the cli layer.
"""
