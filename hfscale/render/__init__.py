"""The generated files of a job, as names and texts (the Accelerate config, the DeepSpeed JSON, the host
file) and the ready-made presets.

Layer 4: may import the layers below (core, config, checkpoints, rules).
"""
