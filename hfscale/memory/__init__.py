"""The ``hfscale plan`` command: the memory estimate per GPU, the model's shape read from its config, the
cheapest change that makes a setting fit, and the exact parameter count on the meta device.

Layer 8: may import the layers below (core .. runs).
"""
