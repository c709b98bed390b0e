"""The real consumers accept what hfscale generates. Nothing of accelerate, DeepSpeed or transformers is mocked.

* accelerate: its config loader reads every generated YAML; its ``accelerate launch`` argument handling
  turns the YAML into the environment a training process sees, and the DeepSpeed / FSDP plugin is
  built from that environment, as ``Accelerator()`` does in each rank.
* DeepSpeed: ``DeepSpeedConfig`` parses every generated JSON at the job's real world size (a fake
  process group of that size, one fresh interpreter per world size) and checks the batch math.
* transformers: ``HfTrainerDeepSpeedConfig`` finds no mismatch between the JSON and the
  ``TrainingArguments`` hfscale builds from the same YAML, at that world size.

Every positive check has a negative twin showing the consumer does reject a wrong input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT, run_cli
from hfscale.render.accelerate import FORBIDDEN_BESIDE_DS_FILE
from hfscale.rules.config_file import load_job

from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env


# --------------------------------------------------------------------------------------------------
# The matrix: hfscale YAMLs and what each one must mean, written out by hand (not derived by hfscale).
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    doc: dict[str, Any]
    world: int
    nodes: int
    distributed_type: DistributedType
    micro: int = 0
    ga: int = 0
    global_batch: int = 0
    stage: int | None = None
    offload_optimizer: str = "none"
    offload_param: str = "none"
    hostfile: str | None = None  # text of a host file next to the YAML
    fsdp: dict[str, Any] = field(default_factory=dict)  # expected FullyShardedDataParallelPlugin fields

    @property
    def precision(self) -> str:
        return self.doc.get("precision", "bf16")


def _ds(name: str, cluster: dict, ds: dict, precision: str, batch: dict, **kw: Any) -> dict:
    doc = {"name": name, "cluster": cluster, "distributed": {"backend": "deepspeed", "deepspeed": ds},
           "precision": precision, "batch": batch, **kw}
    if "hosts" in cluster or "hostfile" in cluster:
        doc["runner"] = {"type": "pdsh"}
    return doc


TWO_NODES_2 = {"hosts": [{"host": "node0", "slots": 2}, {"host": "node1", "slots": 2}], "master_port": 29612}
TWO_NODES_8 = {"hosts": [{"host": "node0", "slots": 8}, {"host": "node1", "slots": 8}]}
DEEPSPEED = DistributedType.DEEPSPEED

CASES = [
    Case("z0_no_1x2", _ds("z0", {"nproc_per_node": 2}, {"stage": 0}, "no",
                          {"micro_batch_size": 4, "gradient_accumulation_steps": 1}),
         world=2, nodes=1, distributed_type=DEEPSPEED, micro=4, ga=1, global_batch=8, stage=0),
    Case("z1_bf16_1x4", _ds("z1", {"nproc_per_node": 4}, {"stage": 1}, "bf16",
                            {"micro_batch_size": 2, "global_batch_size": 32}),
         world=4, nodes=1, distributed_type=DEEPSPEED, micro=2, ga=4, global_batch=32, stage=1),
    Case("z2_fp16_1x2", _ds("z2", {"nproc_per_node": 2}, {"stage": 2}, "fp16",
                            {"micro_batch_size": 4, "gradient_accumulation_steps": 2}),
         world=2, nodes=1, distributed_type=DEEPSPEED, micro=4, ga=2, global_batch=16, stage=2),
    Case("z2_offload_cpu_1x4", _ds("z2o", {"nproc_per_node": 4},
                                   {"stage": 2, "offload_optimizer": {"device": "cpu"}, "optimizer": {"type": "AdamW"}},
                                   "bf16",
                                   {"micro_batch_size": 1, "gradient_accumulation_steps": 8},
                                   training={"learning_rate": 2.0e-4, "weight_decay": 0.1}),
         world=4, nodes=1, distributed_type=DEEPSPEED, micro=1, ga=8, global_batch=32, stage=2,
         offload_optimizer="cpu"),
    Case("z2_ds_optimizer_scheduler_1x4",
         _ds("z2s", {"nproc_per_node": 4}, {"stage": 2, "optimizer": {"type": "AdamW"},
                                            "scheduler": {"type": "WarmupDecayLR"}}, "bf16",
             {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
             training={"max_steps": 10, "warmup_steps": 2, "learning_rate": 1.0e-4, "weight_decay": 0.01}),
         world=4, nodes=1, distributed_type=DEEPSPEED, micro=2, ga=1, global_batch=8, stage=2),
    Case("z2_bf16_2x8", _ds("z2n", TWO_NODES_8, {"stage": 2}, "bf16",
                            {"micro_batch_size": 8, "global_batch_size": 256}),
         world=16, nodes=2, distributed_type=DEEPSPEED, micro=8, ga=2, global_batch=256, stage=2),
    Case("z3_bf16_2x2", _ds("z3n", TWO_NODES_2, {"stage": 3}, "bf16",
                            {"micro_batch_size": 2, "global_batch_size": 64}),
         world=4, nodes=2, distributed_type=DEEPSPEED, micro=2, ga=8, global_batch=64, stage=3),
    Case("z3_nvme_1x2", _ds("z3nvme", {"nproc_per_node": 2},
                            {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
                             "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
                             "optimizer": {"type": "AdamW"}}, "bf16",
                            {"micro_batch_size": 1}),
         world=2, nodes=1, distributed_type=DEEPSPEED, micro=1, ga=1, global_batch=2, stage=3,
         offload_optimizer="nvme", offload_param="nvme"),
    Case("z3_offload_cpu_hostfile_2x2", _ds("z3o", {"hostfile": "hosts.txt"},
                                            {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                             "offload_param": {"device": "cpu"}, "optimizer": {"type": "AdamW"}}, "no",
                                            {"micro_batch_size": 2, "gradient_accumulation_steps": 2}),
         world=4, nodes=2, distributed_type=DEEPSPEED, micro=2, ga=2, global_batch=16, stage=3,
         offload_optimizer="cpu", offload_param="cpu", hostfile="node0 slots=2\nnode1 slots=2\n"),
    Case("fsdp_bf16_1x2", {"name": "f1", "cluster": {"nproc_per_node": 2}, "distributed": {"backend": "fsdp"},
                           "precision": "bf16", "batch": {"micro_batch_size": 2}},
         world=2, nodes=1, distributed_type=DistributedType.FSDP,
         fsdp={"reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT", "offload": False,
               "wrap": "transformer_auto_wrap_policy", "transformer_cls_names_to_wrap": None,
               "min_num_params": None, "activation_checkpointing": False, "cpu_ram_efficient_loading": True}),
    Case("fsdp_offload_size_2x4",
         {"name": "f2", "cluster": {"hosts": [{"host": "n0", "slots": 4}, {"host": "n1", "slots": 4}]},
          "runner": {"type": "pdsh"},
          "distributed": {"backend": "fsdp", "fsdp": {
              "offload_params": True, "reshard_after_forward": False, "auto_wrap_policy": "SIZE_BASED_WRAP",
              "min_num_params": 1_000_000, "state_dict_type": "FULL_STATE_DICT", "activation_checkpointing": True,
              "cpu_ram_efficient_loading": False}},
          "precision": "fp16", "batch": {"micro_batch_size": 2}},
         world=8, nodes=2, distributed_type=DistributedType.FSDP,
         fsdp={"reshard_after_forward": False, "state_dict_type": "FULL_STATE_DICT", "offload": True,
               "wrap": "size_based_auto_wrap_policy", "transformer_cls_names_to_wrap": None,
               "min_num_params": 1_000_000, "activation_checkpointing": True, "cpu_ram_efficient_loading": False}),
    Case("fsdp_layers_no_1x4",
         {"name": "f3", "cluster": {"nproc_per_node": 4},
          "distributed": {"backend": "fsdp", "fsdp": {"transformer_layer_cls_to_wrap": ["GPT2Block", "GPT2MLP"]}},
          "precision": "no", "batch": {"micro_batch_size": 2}},
         world=4, nodes=1, distributed_type=DistributedType.FSDP,
         fsdp={"reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT", "offload": False,
               "wrap": "transformer_auto_wrap_policy", "transformer_cls_names_to_wrap": ["GPT2Block", "GPT2MLP"],
               "min_num_params": None, "activation_checkpointing": False, "cpu_ram_efficient_loading": True}),
    Case("ddp_no_1x1", {"name": "d1", "distributed": {"backend": "ddp"}, "precision": "no",
                        "batch": {"micro_batch_size": 2}},
         world=1, nodes=1, distributed_type=DistributedType.NO),
    Case("ddp_bf16_1x4", {"name": "d4", "cluster": {"nproc_per_node": 4}, "distributed": {"backend": "ddp"},
                          "precision": "bf16", "batch": {"micro_batch_size": 2}},
         world=4, nodes=1, distributed_type=DistributedType.MULTI_GPU),
    Case("ddp_fp16_2x2", {"name": "d22", "cluster": TWO_NODES_2, "runner": {"type": "pdsh"},
                          "distributed": {"backend": "ddp"}, "precision": "fp16", "batch": {"micro_batch_size": 2}},
         world=4, nodes=2, distributed_type=DistributedType.MULTI_GPU),
]
DS_CASES = [c for c in CASES if c.distributed_type == DEEPSPEED]
BY_NAME = {c.name: c for c in CASES}
PRESETS = sorted(p.stem for p in (ROOT / "examples" / "presets").glob("*.yaml"))


@dataclass(frozen=True)
class Generated:
    source: Path  # the hfscale YAML
    out: Path  # the directory `hfscale config --out` wrote

    @property
    def accelerate_yaml(self) -> Path:
        return self.out / "accelerate_config.yaml"

    @property
    def ds_json(self) -> Path:
        return self.out / "ds_config.json"


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, Generated]:
    """Every matrix case written as YAML and compiled by the real CLI (`hfscale config`)."""
    base = tmp_path_factory.mktemp("consumers")

    def build(case: Case) -> tuple[str, Generated]:
        d = base / case.name
        d.mkdir()
        src = d / "job.yaml"
        src.write_text(yaml.safe_dump(case.doc, sort_keys=False))
        if case.hostfile is not None:
            (d / case.doc["cluster"]["hostfile"]).write_text(case.hostfile)
        r = run_cli("config", str(src), "--out", str(d / "out"))
        assert r.returncode == 0, f"{case.name}: hfscale config failed\n{r.stdout}{r.stderr}"
        return case.name, Generated(src, d / "out")

    with ThreadPoolExecutor(4) as pool:
        return dict(pool.map(build, CASES))


# --------------------------------------------------------------------------------------------------
# accelerate
# --------------------------------------------------------------------------------------------------


def _raw(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _check_deepspeed_section(raw: dict[str, Any], loaded) -> None:
    assert loaded.distributed_type == DistributedType.DEEPSPEED
    assert "mixed_precision" not in raw, "accelerate refuses mixed_precision beside a DeepSpeed config file"
    assert loaded.mixed_precision is None  # accelerate's loader fills None when the key is absent
    bad = FORBIDDEN_BESIDE_DS_FILE & set(loaded.deepspeed_config)
    assert not bad, f"keys accelerate refuses beside deepspeed_config_file: {sorted(bad)}"


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_accelerate_loader_reads_generated_yaml(name, generated):
    case, gen = BY_NAME[name], generated[name]
    raw = _raw(gen.accelerate_yaml)
    loaded = load_config_from_file(str(gen.accelerate_yaml))
    assert loaded.distributed_type == case.distributed_type
    assert loaded.num_processes == case.world
    assert loaded.num_machines == case.nodes
    assert loaded.machine_rank == 0
    port = case.doc.get("cluster", {}).get("master_port", 29500)
    assert loaded.main_process_port == port
    if case.nodes > 1:
        first = (case.doc["cluster"].get("hosts") or [{"host": "node0"}])[0]["host"]
        assert loaded.main_process_ip == first
    if case.distributed_type == DEEPSPEED:
        _check_deepspeed_section(raw, loaded)
        ds_file = loaded.deepspeed_config["deepspeed_config_file"]
        assert ds_file == str(gen.ds_json.resolve()) and Path(ds_file).is_file()
        assert loaded.deepspeed_config.get("zero3_init_flag") == (True if case.stage == 3 else None)
        assert loaded.fsdp_config == {}
    else:
        assert loaded.mixed_precision == case.precision
        assert not gen.ds_json.exists()
        assert loaded.deepspeed_config == {}
        assert (loaded.fsdp_config != {}) == (case.distributed_type == DistributedType.FSDP)


@pytest.mark.parametrize("preset", PRESETS)
def test_accelerate_loader_reads_committed_presets(preset, monkeypatch):
    monkeypatch.chdir(ROOT)  # presets name their DeepSpeed JSON relative to the repository root
    path = ROOT / "accelerate_configs" / f"{preset}.yaml"
    job = load_job(ROOT / "examples" / "presets" / f"{preset}.yaml")
    loaded = load_config_from_file(str(path))
    assert loaded.num_processes == job.world_size
    assert loaded.num_machines == job.num_nodes
    backend = job.config.distributed.backend
    if backend == "deepspeed":
        _check_deepspeed_section(_raw(path), loaded)
        assert loaded.deepspeed_config["deepspeed_config_file"] == f"ds_configs/{preset}.json"
        assert Path(loaded.deepspeed_config["deepspeed_config_file"]).is_file()
    else:
        want = {"fsdp": DistributedType.FSDP, "ddp": DistributedType.MULTI_GPU}[backend]
        assert loaded.distributed_type == want
        assert loaded.mixed_precision == job.config.precision


def _launch_env(accelerate_yaml: Path) -> tuple[Any, dict[str, str], Any]:
    """What `accelerate launch --config_file Y train.py` hands each rank: (args, environment, cmd).

    Uses accelerate's own parser, config-merging and environment builders; only the few lines of
    ``launch_command`` that list the YAML's DeepSpeed keys are repeated here (they sit inside the
    function that also starts the processes).
    """
    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(accelerate_yaml), "train.py", "--some-arg"])
    args, defaults, mp_from_config_flag = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config.keys())
        if mp_from_config_flag:
            fields.append("mixed_precision")
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        cmd, env = prepare_deepspeed_cmd_env(args)
    elif args.use_fsdp or args.multi_gpu:
        cmd, env = None, prepare_multi_gpu_env(args)
    else:
        cmd, env = None, None
    return args, env, cmd


def _apply_accelerate_env(monkeypatch, env: dict[str, str]) -> None:
    for k, v in env.items():
        if k.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(k, v)


def _deepspeed_plugin_as_launched(monkeypatch, accelerate_yaml: Path) -> DeepSpeedPlugin:
    args, env, cmd = _launch_env(accelerate_yaml)
    assert args.use_deepspeed
    assert cmd is None, "multi-node DeepSpeed must use the 'standard' (torchrun) launcher, not pdsh from accelerate"
    _apply_accelerate_env(monkeypatch, env)
    plugin = DeepSpeedPlugin()  # as Accelerator() builds it in each rank: from ACCELERATE_* variables
    # AcceleratorState then applies the launch precision; it must not clash with the JSON.
    plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
    return plugin


@pytest.mark.parametrize("name", [c.name for c in DS_CASES])
def test_deepspeed_plugin_built_from_accelerate_launch_env(name, generated, monkeypatch):
    case, gen = BY_NAME[name], generated[name]
    plugin = _deepspeed_plugin_as_launched(monkeypatch, gen.accelerate_yaml)
    assert os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(gen.ds_json.resolve())
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "no"  # precision lives in the JSON only
    assert plugin.zero_stage == case.stage
    assert plugin.gradient_accumulation_steps == case.ga
    assert plugin.gradient_clipping == 1.0
    assert plugin.offload_optimizer_device == case.offload_optimizer
    assert plugin.offload_param_device == case.offload_param
    assert plugin.zero3_init_flag is (case.stage == 3)
    if case.offload_optimizer == "nvme":
        assert plugin.offload_optimizer_nvme_path == "/local_nvme"
    c = plugin.deepspeed_config
    assert c["train_batch_size"] == case.global_batch
    assert c["train_micro_batch_size_per_gpu"] == case.micro
    assert c["bf16"]["enabled"] is (case.precision == "bf16")
    assert c["fp16"]["enabled"] is (case.precision == "fp16")


@pytest.mark.parametrize("preset", [p for p in PRESETS if (ROOT / "ds_configs" / f"{p}.json").is_file()])
def test_deepspeed_plugin_from_committed_preset(preset, monkeypatch):
    monkeypatch.chdir(ROOT)
    job = load_job(ROOT / "examples" / "presets" / f"{preset}.yaml")
    plugin = _deepspeed_plugin_as_launched(monkeypatch, ROOT / "accelerate_configs" / f"{preset}.yaml")
    assert plugin.zero_stage == job.deepspeed.stage
    assert plugin.gradient_accumulation_steps == job.gradient_accumulation_steps
    assert plugin.deepspeed_config["train_batch_size"] == job.global_batch_size


def test_accelerate_launch_rejects_mixed_precision_beside_ds_file(generated, monkeypatch, tmp_path):
    """Negative twin of test_deepspeed_plugin_built_from_accelerate_launch_env: the same YAML plus a
    top-level mixed_precision is refused by accelerate."""
    raw = _raw(generated["z3_bf16_2x2"].accelerate_yaml)
    raw["mixed_precision"] = "bf16"
    bad = tmp_path / "accelerate_config.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="deepspeed_config_file"):
        _deepspeed_plugin_as_launched(monkeypatch, bad)


@pytest.mark.parametrize("key", sorted(FORBIDDEN_BESIDE_DS_FILE))
def test_accelerate_check_fires_on_each_forbidden_key(key, generated, monkeypatch):
    """Our FORBIDDEN list is accelerate's: each key, named as a YAML DeepSpeed field, is refused."""
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", f"deepspeed_config_file,{key}")
    with pytest.raises(ValueError, match="will be ignored"):
        DeepSpeedPlugin(hf_ds_config=str(generated["z2_fp16_1x2"].ds_json))


@pytest.mark.parametrize("name", [c.name for c in DS_CASES])
def test_accelerate_check_passes_on_our_fields(name, generated, monkeypatch):
    gen = generated[name]
    fields = load_config_from_file(str(gen.accelerate_yaml)).deepspeed_config
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(fields))
    plugin = DeepSpeedPlugin(hf_ds_config=str(gen.ds_json))
    assert plugin.zero_stage == BY_NAME[name].stage
    assert plugin.hf_ds_config.config["train_batch_size"] == BY_NAME[name].global_batch


def test_generated_keys_are_accelerate_launch_options(generated):
    """accelerate copies every deepspeed_config / fsdp_config key onto its launch arguments without
    checking it; a key it does not know is silently ignored. So each must be a real launch option."""
    dests = {a.dest for a in launch_command_parser()._actions}
    seen = set()
    for name, gen in generated.items():
        raw = _raw(gen.accelerate_yaml)
        keys = set(raw.get("deepspeed_config", {})) | set(raw.get("fsdp_config", {}))
        seen |= keys
        unknown = keys - dests
        assert not unknown, f"{name}: {sorted(unknown)} are not `accelerate launch` options"
    assert {"deepspeed_config_file", "zero3_init_flag", "fsdp_version", "fsdp_min_num_params"} <= seen


@pytest.mark.parametrize("name", [c.name for c in CASES if c.distributed_type == DistributedType.FSDP])
def test_fsdp_plugin_built_from_accelerate_launch_env(name, generated, monkeypatch):
    case, gen = BY_NAME[name], generated[name]
    args, env, _ = _launch_env(gen.accelerate_yaml)
    assert args.use_fsdp and not args.use_deepspeed
    assert env["ACCELERATE_MIXED_PRECISION"] == case.precision
    assert env["FSDP_VERSION"] == "2"
    _apply_accelerate_env(monkeypatch, env)
    plugin = FullyShardedDataParallelPlugin()  # as Accelerator() builds it in each rank
    want = case.fsdp
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is want["reshard_after_forward"]
    assert plugin.state_dict_type.name == want["state_dict_type"]
    assert plugin.auto_wrap_policy.__name__ == want["wrap"]
    assert plugin.transformer_cls_names_to_wrap == want["transformer_cls_names_to_wrap"]
    assert plugin.min_num_params == want["min_num_params"]
    assert plugin.activation_checkpointing is want["activation_checkpointing"]
    assert plugin.cpu_ram_efficient_loading is want["cpu_ram_efficient_loading"]
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) is want["offload"]


@pytest.mark.parametrize("name", [c.name for c in CASES if c.distributed_type != DEEPSPEED])
def test_ddp_and_fsdp_launch_precision(name, generated):
    case, gen = BY_NAME[name], generated[name]
    args, env, _ = _launch_env(gen.accelerate_yaml)
    assert args.mixed_precision == case.precision
    assert args.num_processes == case.world and args.num_machines == case.nodes
    if env is not None:  # multi-process: torchrun environment
        assert env["ACCELERATE_MIXED_PRECISION"] == case.precision
        assert args.nproc_per_node == str(case.world // case.nodes)


# --------------------------------------------------------------------------------------------------
# DeepSpeed and transformers, at the job's world size (fake process group, one interpreter per size)
# --------------------------------------------------------------------------------------------------

PROBE = textwrap.dedent(
    r'''
    import json, sys, traceback
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    spec = json.load(open(sys.argv[1]))
    W = spec["world"]
    dist.init_process_group("fake", rank=0, world_size=W, store=FakeStore())
    import deepspeed.comm as dc
    dc.init_distributed(dist_backend="gloo")
    from deepspeed.runtime.config import DeepSpeedConfig

    def err(fn):
        try:
            fn()
        except Exception as e:  # the consumer's own rejection, reported to the test
            return f"{type(e).__name__}: {e}"
        return None

    def device(offload):  # DeepSpeed stores the device as an enum or its value, by version
        d = offload.device if offload is not None else "none"
        return str(getattr(d, "value", d))

    out = {"world_size": dist.get_world_size(), "deepspeed": {}, "transformers": {}}

    def deepspeed_item(item):
        cfg = json.load(open(item["json"]))
        c = DeepSpeedConfig(dict(cfg))
        zc = c.zero_config
        bad = dict(cfg, train_batch_size=cfg["train_batch_size"] + cfg["train_micro_batch_size_per_gpu"])
        return {
            "world_size": c.world_size,
            "train_batch_size": c.train_batch_size,
            "micro": c.train_micro_batch_size_per_gpu,
            "ga": c.gradient_accumulation_steps,
            "stage": c.zero_optimization_stage,
            "offload_optimizer": device(zc.offload_optimizer),
            "offload_param": device(zc.offload_param),
            "bf16": c.bfloat16_config.enabled,
            "fp16": c.float16_config.enabled,
            "gradient_clipping": c.gradient_clipping,
            "optimizer": c.optimizer_name,
            "optimizer_params": c.optimizer_params,
            "wrong_batch_error": err(lambda: DeepSpeedConfig(bad)),
        }

    def guarded(fn, *a):  # one bad config fails its own test, not the whole probe
        try:
            return fn(*a)
        except Exception:
            return {"error": traceback.format_exc()}

    for item in spec["items"]:
        out["deepspeed"][item["name"]] = guarded(deepspeed_item, item)

    if spec["transformers"]:
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
        from hfscale.rules.config_file import load_job
        from hfscale.rules.trainer_args import training_arguments

        # Built before any TrainingArguments registers a ZeRO-3 config (no deepspeed.zero.Init here).
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256,
                                           bos_token_id=0, eos_token_id=0))

        def check(job_yaml, ds_json, **overrides):
            job = load_job(job_yaml)
            args = training_arguments(job, ds_json, use_cpu=True, **overrides)
            ds = json.load(open(ds_json))
            hf = HfTrainerDeepSpeedConfig(ds)
            hf.trainer_config_process(args)
            res = {"world_size": args.world_size, "mismatches": list(hf.mismatches),
                   "args_ds_batch": args.hf_deepspeed_config.config["train_batch_size"]}
            if not hf.mismatches:
                res["finalize_error"] = err(lambda: hf.trainer_config_finalize(args, model, 10))
                res["optimizer"] = hf.config.get("optimizer")
            return res

        def transformers_item(item):
            r = check(item["yaml"], item["json"])
            micro = json.load(open(item["json"]))["train_micro_batch_size_per_gpu"]
            r["wrong_micro"] = check(item["yaml"], item["json"], per_device_train_batch_size=micro + 1)["mismatches"]
            return r

        for item in spec["items"]:
            if item.get("yaml"):
                out["transformers"][item["name"]] = guarded(transformers_item, item)
        for name, neg in spec.get("wrong_world", {}).items():
            out["transformers"][name] = guarded(check, neg["yaml"], neg["json"])

    json.dump(out, open(sys.argv[2], "w"))
    '''
)


def _probe(tmp: Path, world: int, items: list[dict], transformers: bool, wrong_world: dict | None = None) -> dict:
    spec = {"world": world, "items": items, "transformers": transformers, "wrong_world": wrong_world or {}}
    script, spec_file, result = tmp / "probe.py", tmp / f"spec{world}.json", tmp / f"result{world}.json"
    script.write_text(PROBE)
    spec_file.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
    }
    r = subprocess.run([sys.executable, str(script), str(spec_file), str(result)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"probe at world size {world} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def probes(generated, tmp_path_factory) -> dict[int, dict]:
    """DeepSpeed (and transformers) verdicts on every generated and committed JSON, by world size."""
    tmp = tmp_path_factory.mktemp("probe")
    by_world: dict[int, list[dict]] = {}
    for c in DS_CASES:
        g = generated[c.name]
        by_world.setdefault(c.world, []).append({"name": c.name, "json": str(g.ds_json), "yaml": str(g.source)})
    for p in PRESETS:
        js = ROOT / "ds_configs" / f"{p}.json"
        if js.is_file():
            job = load_job(ROOT / "examples" / "presets" / f"{p}.yaml")
            by_world.setdefault(job.world_size, []).append({"name": f"preset:{p}", "json": str(js)})
    # A world-size-2 job's files checked at world size 4: transformers must see a batch mismatch.
    z2 = generated["z2_fp16_1x2"]
    wrong_world = {"wrong_world:z2_fp16_1x2": {"yaml": str(z2.source), "json": str(z2.ds_json)}}
    return {
        w: _probe(tmp, w, items, transformers=(w == 4), wrong_world=wrong_world if w == 4 else None)
        for w, items in sorted(by_world.items())
    }


def _verdict(probes: dict[int, dict], world: int, consumer: str, name: str) -> dict:
    got = probes[world][consumer][name]
    assert "error" not in got, f"{consumer} rejected {name} at world size {world}:\n{got.get('error')}"
    return got


@pytest.mark.parametrize("name", [c.name for c in DS_CASES])
def test_deepspeed_config_accepts_generated_json(name, probes):
    case = BY_NAME[name]
    got = _verdict(probes, case.world, "deepspeed", name)
    assert got["world_size"] == case.world
    assert got["train_batch_size"] == case.global_batch == case.micro * case.ga * case.world
    assert (got["micro"], got["ga"]) == (case.micro, case.ga)
    assert got["stage"] == case.stage
    assert got["offload_optimizer"] == case.offload_optimizer
    assert got["offload_param"] == case.offload_param
    assert got["bf16"] is (case.precision == "bf16")
    assert got["fp16"] is (case.precision == "fp16")
    assert got["gradient_clipping"] == 1.0
    if case.offload_optimizer != "none" or "optimizer" in case.doc["distributed"]["deepspeed"]:
        training = case.doc.get("training", {})
        assert got["optimizer"] == "adamw"
        assert got["optimizer_params"]["lr"] == training.get("learning_rate", 5e-5)
        assert got["optimizer_params"]["weight_decay"] == training.get("weight_decay", 0.0)
    else:
        assert got["optimizer"] is None


@pytest.mark.parametrize("name", [c.name for c in DS_CASES])
def test_deepspeed_rejects_wrong_batch_at_that_world_size(name, probes):
    err = _verdict(probes, BY_NAME[name].world, "deepspeed", name)["wrong_batch_error"]
    assert err is not None and "train_batch_size is not equal to" in err


@pytest.mark.parametrize("preset", [p for p in PRESETS if (ROOT / "ds_configs" / f"{p}.json").is_file()])
def test_deepspeed_config_accepts_committed_preset(preset, probes):
    job = load_job(ROOT / "examples" / "presets" / f"{preset}.yaml")
    got = _verdict(probes, job.world_size, "deepspeed", f"preset:{preset}")
    assert got["world_size"] == job.world_size
    assert got["train_batch_size"] == job.global_batch_size
    assert got["stage"] == job.deepspeed.stage
    assert got["bf16"] is (job.config.precision == "bf16")
    assert got["wrong_batch_error"] is not None


TRANSFORMERS_CASES = [c.name for c in DS_CASES if c.world == 4]


def test_transformers_matrix_covers_offload_and_zero3():
    cases = [BY_NAME[n] for n in TRANSFORMERS_CASES]
    assert any(c.offload_optimizer != "none" and c.stage == 3 for c in cases)
    assert any(c.offload_optimizer != "none" and c.stage == 2 for c in cases)
    assert any(c.stage == 3 and c.offload_param == "none" for c in cases)


@pytest.mark.parametrize("name", TRANSFORMERS_CASES)
def test_transformers_finds_no_mismatch(name, probes):
    case = BY_NAME[name]
    got = _verdict(probes, 4, "transformers", name)
    assert got["world_size"] == case.world
    assert got["args_ds_batch"] == case.global_batch
    assert got["mismatches"] == []
    assert got["finalize_error"] is None
    if "optimizer" in case.doc["distributed"]["deepspeed"]:
        assert got["optimizer"]["type"] == "AdamW"  # DeepSpeed builds the optimizer from the JSON's section


@pytest.mark.parametrize("name", TRANSFORMERS_CASES)
def test_transformers_reports_mismatch_for_other_batch_size(name, probes):
    wrong = _verdict(probes, 4, "transformers", name)["wrong_micro"]
    assert any("train_micro_batch_size_per_gpu" in m for m in wrong), wrong
    assert any(m.startswith("- ds train_batch_size=") for m in wrong), wrong


def test_transformers_reports_mismatch_at_other_world_size(probes):
    got = _verdict(probes, 4, "transformers", "wrong_world:z2_fp16_1x2")
    assert got["world_size"] == 4
    assert any("train_batch_size=16" in m and "32" in m for m in got["mismatches"]), got["mismatches"]
