"""The exact parameter count of a transformers config: the model built on the meta device (no
memory, no download). The one place ``hfscale plan`` imports torch and transformers."""

from __future__ import annotations

from typing import Any


def built_params(cfg: dict[str, Any]) -> tuple[int | None, str]:
    """(parameters of ``AutoModelForCausalLM`` built from ``cfg`` on the meta device, "") or
    (None, why it could not be built)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging
    except ImportError as e:
        return None, f"not built on the meta device: {e}"
    logging.set_verbosity_error()
    try:
        kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
        config = AutoConfig.for_model(cfg["model_type"], **kwargs)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # any config transformers refuses: the estimate stands on hfscale's count
        return None, f"not built on the meta device: {type(e).__name__}: {e}"
    return sum(p.numel() for p in model.parameters()), ""
