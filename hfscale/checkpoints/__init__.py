"""Checkpoints in an output_dir: the files and their completeness, what a resume starts from, resharding,
export, the learning-rate schedule a resumed run continues, and reading pickles as tensors only.

Layer 2: may import hfscale.core and hfscale.config.
"""
