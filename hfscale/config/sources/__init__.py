"""Readers of the installed engines' source (accelerate, DeepSpeed, transformers), read as text with ast:
what their configs accept, without importing them.

Part of the config layer: may import hfscale.core and hfscale.config.
"""
