"""hfscale: one YAML compiles into the Accelerate config, the DeepSpeed JSON and the host file."""

__version__ = "0.1.0"
