"""The commented starter config that ``hfscale init`` writes, built from the field descriptions."""

from __future__ import annotations

import textwrap
from typing import Any

import yaml
from pydantic import BaseModel

from hfscale.config.model import HfscaleConfig

EXAMPLE: dict[str, Any] = {
    "name": "my-run",
    "cluster": {"hosts": None, "nproc_per_node": 8},
    "runner": {"type": "local"},
    "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}},
    "precision": "bf16",
    "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 8},
    "training": {
        "max_steps": 1000,
        "learning_rate": 3.0e-4,
        "warmup_steps": 100,
        "save_steps": 200,
        "save_total_limit": 3,
        "model": {"config": {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}},
    },
}


def _scalar(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").removesuffix(
        "..."
    ).strip()


def _comment(text: str, pad: str) -> list[str]:
    return [f"{pad}# {line}" for line in textwrap.wrap(text, width=96 - len(pad))]


def _emit(model: BaseModel, depth: int, out: list[str]) -> None:
    pad = "  " * depth
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if field.description:
            out += _comment(field.description, pad)
        if isinstance(value, BaseModel):
            out.append(f"{pad}{name}:")
            _emit(value, depth + 1, out)
        elif isinstance(value, tuple) and value and isinstance(value[0], BaseModel):
            out.append(f"{pad}{name}:")
            out += [f"{pad}  - {_scalar(item.model_dump())}" for item in value]
        else:
            out.append(f"{pad}{name}: {_scalar(value)}")
        if depth == 0:
            out.append("")


def render_template() -> str:
    """A complete, valid config with every key present and described."""
    cfg = HfscaleConfig.model_validate(EXAMPLE)
    out = [
        "# hfscale config: one file for the accelerate config, the DeepSpeed JSON and the host file.",
        "# Check it with `hfscale check FILE`; write the artifacts with `hfscale config FILE --out DIR`.",
        "",
    ]
    _emit(cfg, 0, out)
    return "\n".join(out).rstrip() + "\n"
