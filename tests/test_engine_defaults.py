"""hfscale.config.engine_defaults against the installed engines: for each optimizer section, the class
DeepSpeed's own ``DeepSpeedEngine._configure_basic_optimizer`` builds (run on a config parsed by
``DeepSpeedConfig``, with the classes replaced by recorders, as FusedAdam cannot be built without a
GPU), and every default hfscale writes where a section leaves a parameter out, read from that class's
signature with inspect; the same for each scheduler of deepspeed/runtime/lr_schedules.py."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch
from deepspeed.ops import adam as ds_adam
from deepspeed.ops import lamb as ds_lamb
from deepspeed.ops import lion as ds_lion
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine

from conftest import job_of
from hfscale.config.engine_defaults import (
    ONEBIT,
    OPTIMIZER_DEFAULTS,
    OPTIMIZER_LR,
    PARAMS,
    SCHEDULER_DEFAULTS,
    built_optimizer,
)
from hfscale.config.errors import ConfigError

BUILT = {  # what _configure_basic_optimizer can build, by the name hfscale gives it: (module, attribute)
    "torch.optim.Adam": (torch.optim, "Adam"), "torch.optim.AdamW": (torch.optim, "AdamW"),
    "deepspeed.ops.adam.FusedAdam": (ds_adam, "FusedAdam"),
    "deepspeed.ops.adam.DeepSpeedCPUAdam": (ds_adam, "DeepSpeedCPUAdam"),
    "deepspeed.ops.lamb.FusedLamb": (ds_lamb, "FusedLamb"), "deepspeed.ops.lion.FusedLion": (ds_lion, "FusedLion"),
    "deepspeed.ops.lion.DeepSpeedCPULion": (ds_lion, "DeepSpeedCPULion"),
}
CLASSES = {name: getattr(module, attr) for name, (module, attr) in BUILT.items()}  # before any recorder
SECTIONS = [  # (optimizer section, offload_optimizer device)
    ({"type": "Adam", "params": {"torch_adam": True, "lr": 4e-5}}, "none"),  # the issue's: torch's AdamW
    ({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}, "none"),
    ({"type": "AdamW", "params": {"torch_adam": True, "adam_w_mode": False}}, "none"),  # AdamW stays AdamW
    ({"type": "Adam"}, "none"), ({"type": "AdamW", "params": {"lr": 1e-4}}, "none"),
    ({"type": "adam"}, "cpu"), ({"type": "AdamW"}, "nvme"), ({"type": "Adam", "params": {"torch_adam": True}}, "cpu"),
    ({"type": "Lamb"}, "none"), ({"type": "Lion"}, "none"), ({"type": "Lion"}, "cpu"),
]


def signature_defaults(cls: type) -> dict[str, Any]:
    return {k: p.default for k, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}


def _engine(ds: dict) -> DeepSpeedEngine:
    """An engine that is only its config: enough for _configure_basic_optimizer."""
    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)
    object.__setattr__(engine, "_config", DeepSpeedConfig({"train_batch_size": 1, **ds}))
    object.__setattr__(engine, "zenflow", False)
    object.__setattr__(engine, "client_optimizer", None)  # the JSON names the optimizer
    return engine


def engine_builds(ds: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, Any]]:
    """(the class DeepSpeed's engine builds for DeepSpeed JSON ``ds``, the keyword arguments it
    passes); every class it can build replaced by a recorder."""
    built: list[tuple[str, dict]] = []
    for name, (module, attr) in BUILT.items():
        monkeypatch.setattr(module, attr, lambda params, *a, _n=name, **kw: built.append((_n, kw)))
    _engine(ds)._configure_basic_optimizer([torch.nn.Parameter(torch.zeros(1))])
    assert len(built) == 1
    return built[0]


def effective_optimizer(ds: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, Any]]:
    """The class built and every parameter it is built with: its signature's defaults, then what
    the JSON gives."""
    name, kwargs = engine_builds(ds, monkeypatch)
    out = {**signature_defaults(CLASSES[name]), **kwargs}
    return name, {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


def _with_offload(section: dict, device: str) -> dict:
    return {"optimizer": section, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": device}}}


@pytest.mark.parametrize("section, device", SECTIONS)
def test_the_class_hfscale_names_is_the_one_deepspeed_builds(section, device, monkeypatch):
    name, kwargs = engine_builds(_with_offload(section, device), monkeypatch)
    assert built_optimizer(section["type"], section.get("params", {}), device != "none") == name
    assert not set(PARAMS) - set(section.get("params", {})) & set(kwargs)  # an absent one is the class's default


def test_every_optimizer_default_hfscale_writes_is_the_signatures():
    for name, cls in CLASSES.items():
        sig = signature_defaults(cls)
        want = {k: sig[k] for k in PARAMS if k in sig}
        assert OPTIMIZER_DEFAULTS[name] == want, name
    assert signature_defaults(torch.optim.AdamW)["weight_decay"] == 0.01 != OPTIMIZER_DEFAULTS["torch.optim.Adam"][
        "weight_decay"]  # the difference the import used to lose
    # ZenFlowCPUAdam (zero_optimization.zenflow with CPU offload) takes DeepSpeedCPUAdam's arguments
    zenflow = inspect.signature(ds_adam.ZenFlowCPUAdam).parameters
    assert issubclass(ds_adam.ZenFlowCPUAdam, ds_adam.DeepSpeedCPUAdam) and "kwargs" in zenflow


@pytest.mark.parametrize("kind", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_the_one_bit_optimizers_are_refused_where_deepspeed_cannot_build_them(kind, monkeypatch):
    if kind.lower() in DEEPSPEED_OPTIMIZERS:  # an older DeepSpeed: its class, its defaults
        module, attr = ONEBIT[kind.lower()].rsplit(".", 1)
        sig = signature_defaults(getattr(importlib.import_module(module), attr))
        assert OPTIMIZER_DEFAULTS[ONEBIT[kind.lower()]] == {k: sig[k] for k in PARAMS if k in sig}
        return
    with pytest.raises(AttributeError):  # the engine looks any other type up in torch.optim
        engine_builds({"optimizer": {"type": kind}}, monkeypatch)
    for stage in (0, 2):
        with pytest.raises(ConfigError) as e:
            job_of(f"name: x\nbatch: {{micro_batch_size: 1}}\n"
                   f"distributed: {{deepspeed: {{stage: {stage}, optimizer: {{type: {kind}}}}}}}\n")
        assert f"{kind}: the installed DeepSpeed does not build it" in e.value.render()
    assert job_of("name: x\nbatch: {micro_batch_size: 1}\ndistributed: {deepspeed: {optimizer: {type: Lion}}}\n")


def test_every_scheduler_default_hfscale_writes_is_the_signatures():
    for kind, defaults in SCHEDULER_DEFAULTS.items():
        sig = signature_defaults(getattr(lr_schedules, kind))
        sig.pop("last_batch_iteration")
        assert defaults == sig, kind
    # WarmupLR without warmup_max_lr peaks at the optimizer's lr (what OPTIMIZER_LR stands for)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    assert SCHEDULER_DEFAULTS["WarmupLR"]["warmup_max_lr"] is OPTIMIZER_LR
    assert lr_schedules.WarmupLR(opt, warmup_num_steps=2).max_lrs == [0.3]
    assert lr_schedules.WarmupDecayLR(opt, total_num_steps=4, warmup_num_steps=2).max_lrs == [0.001]
