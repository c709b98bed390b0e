"""Reading pickled checkpoint files as tensors only (``torch.load(weights_only=True)``), also
through libraries that ask for ``weights_only=False`` (DeepSpeed's ``zero_to_fp32``): a checkpoint
is hostile input, and a pickle that runs code when loaded must fail instead.

torch is imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re

# the DeepSpeed classes pickled into ZeRO checkpoints (plain data: enums, a config-free loss scaler);
# found by reading ZeRO-1/2/3 checkpoints with weights_only=True, which names each refused global
DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address")


def refusal(e: Exception) -> str:
    """What torch's weights-only unpickler refused, in one line."""
    m = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", str(e))
    what = f"a pickled {m.group(1)}" if m else "a pickled object that is not a tensor"
    return (f"refused: it holds {what}; hfscale export reads tensors only (torch.load weights_only), so a "
            "checkpoint that would run code when loaded is never loaded")


@contextlib.contextmanager
def tensors_only():
    """Every ``torch.load`` inside (DeepSpeed's readers pass ``weights_only=False``) reads tensors
    and plain containers only: ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, with the DeepSpeed classes its
    checkpoints hold allow-listed (DEEPSPEED_GLOBALS). A pickle that would run code fails with
    ``pickle.UnpicklingError`` instead (:func:`refusal` says what it held)."""
    import torch

    saved = {k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    try:
        with torch.serialization.safe_globals(_deepspeed_globals()):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _deepspeed_globals() -> list:
    """The classes of DEEPSPEED_GLOBALS that the installed DeepSpeed has."""
    found = []
    for dotted in DEEPSPEED_GLOBALS:
        module, _, name = dotted.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found
