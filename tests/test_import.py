"""``hfscale import`` round trips: existing accelerate configs (in the style of TRL's presets) and
DeepSpeed JSONs (in the style of DeepSpeed's and transformers' documented examples) become an
hfscale YAML, ``hfscale config`` writes them back, and the files mean the same.

"The same" is judged through accelerate's own code: the DeepSpeed config each accelerate file
hands a rank is built by accelerate's DeepSpeedPlugin from the launch environment (as
``Accelerator()`` does), for the original and for the written-back file. A key may differ only
where the original said "auto" (resolved by the import), or where one side leaves out a key the
other side sets to the library's default."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT, run_cli
from hfscale.config.sources.accelerate import accelerate_keys
from hfscale.config.sources.deepspeed import deepspeed_keys
from hfscale.config.sources.engine import UNKNOWN
from test_consumers import _deepspeed_plugin_as_launched

DATA = ROOT / "tests" / "data" / "import"
CASES = {  # name -> (accelerate config, --deepspeed, --hostfile)
    "trl_zero1": ("trl_zero1.yaml", None, None),
    "trl_zero2": ("trl_zero2.yaml", None, None),
    "trl_zero3": ("trl_zero3.yaml", None, None),
    "trl_fsdp2": ("trl_fsdp2.yaml", None, None),
    "trl_multi_gpu": ("trl_multi_gpu.yaml", None, None),
    "hf_zero3_offload_auto_2_nodes": ("ds_file.yaml", None, "hosts"),  # the JSON named inside the accelerate file
    "zero2_explicit_every_section": ("ds_plain.yaml", "ds_zero2_explicit.json", None),
    "zeropp_nvme_aio": ("ds_plain.yaml", "ds_zeropp_nvme.json", None),
}
# DeepSpeed defaults the key tree cannot read (computed, or set by accelerate for "never")
DS_DEFAULTS: dict[tuple, Any] = {("bf16", "enabled"): False, ("fp16", "enabled"): False,
                                 ("steps_per_print",): None, ("wall_clock_breakdown",): False,
                                 # deepspeed/runtime/lr_schedules.py: WarmupLR and WarmupCosineLR arguments
                                 ("scheduler", "params", "warmup_type"): "log",
                                 ("scheduler", "params", "cos_min_ratio"): 0.0001,
                                 # deepspeed/ops/adam (FusedAdam, DeepSpeedCPUAdam): the optimizer's own defaults
                                 ("optimizer", "params", "betas"): [0.9, 0.999], ("optimizer", "params", "eps"): 1e-8,
                                 ("optimizer", "params", "weight_decay"): 0.0}


def _import(tmp_path: Path, name: str) -> tuple[Path, Path]:
    acc, ds, hosts = CASES[name]
    out = tmp_path / "job.yaml"
    args = ["import", str(DATA / acc), "--out", str(out)]
    if ds:
        args += ["--deepspeed", str(DATA / ds)]
    if hosts:
        args += ["--hostfile", str(DATA / hosts)]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    gen = tmp_path / "gen"
    r = run_cli("config", str(out), "--out", str(gen))
    assert r.returncode == 0, r.stderr
    return out, gen


def _leaves(node: Any, here: tuple = ()) -> dict[tuple, Any]:
    if isinstance(node, dict):
        out: dict[tuple, Any] = {}
        for k, v in node.items():
            out.update(_leaves(v, here + (k,)))
        return out
    return {here: node}


def _canonical(path: tuple) -> tuple:
    """DeepSpeed's own spelling of a key path (aliases and renamed keys followed)."""
    section, out = deepspeed_keys(), []
    for part in path:
        name = section.canonical(part) if section is not None else part
        out.append(name)
        key = section.keys.get(name) if section is not None else None
        section = key.section if key is not None else None
    return tuple(out)


def _ds_default(path: tuple, stage: int) -> Any:
    if path in DS_DEFAULTS:
        return DS_DEFAULTS[path]
    if path == ("zero_optimization", "overlap_comm"):
        return stage == 3  # DeepSpeed's default depends on the stage
    section, key = deepspeed_keys(), None
    for part in path:
        key = section.keys.get(part) if section is not None else None
        section = key.section if key is not None else None
    return key.default if key is not None else UNKNOWN


def _same(a: Any, b: Any) -> bool:
    never = (None, math.inf)  # steps_per_print: accelerate writes inf for "never", DeepSpeed's default is None
    return a == b or (a in never and b in never) or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                                     and not isinstance(a, bool) and float(a) == float(b))


def compare_deepspeed(orig: dict, back: dict, world: int) -> list[str]:
    """What differs between two DeepSpeed configs beyond resolved autos and restated defaults."""
    o = {_canonical(k): v for k, v in _leaves(orig).items()}
    b = {_canonical(k): v for k, v in _leaves(back).items()}
    stage = b.get(("zero_optimization", "stage"), 0)
    # what DeepSpeed derives when a key is absent (runtime/config.py, _set_batch_related_parameters);
    # ``world``: its data-parallel world (under sequence parallelism, world size / sp_size)
    micro, ga, total = (b.get((k,)) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                             "train_batch_size"))
    derived = {}
    if micro and ga:
        derived[("train_batch_size",)] = micro * ga * world
    if total and micro:
        derived[("gradient_accumulation_steps",)] = total // (micro * world)
    if total and ga:
        derived[("train_micro_batch_size_per_gpu",)] = total // (ga * world)
    out = []
    for path in sorted(set(o) | set(b), key=str):
        if o.get(path) == "auto":
            continue  # resolved by the import (its comment says from where)
        if derived.get(path, UNKNOWN) == (b[path] if path in b else o[path]) and (path not in o or path not in b):
            continue  # what DeepSpeed derives itself when the key is absent
        if path in o and path in b:
            if not _same(o[path], b[path]):
                out.append(f"{'.'.join(map(str, path))}: {o[path]!r} became {b[path]!r}")
            continue
        value = o[path] if path in o else b[path]
        if not _same(value, _ds_default(path, stage)):
            side = "left out" if path in o else "added"
            out.append(f"{'.'.join(map(str, path))}: {value!r} {side}, not DeepSpeed's default")
    return out


# what accelerate launch uses where its file has no value (launch.py: port 29500, all GPUs)
# and what accelerate's loader fills in (BaseConfig.process_config: debug, use_cpu, compute_environment)
LAUNCH_DEFAULTS = {"main_process_port": 29500, "gpu_ids": "all", "num_machines": 1, "debug": False, "use_cpu": False,
                   "compute_environment": "LOCAL_MACHINE"}
# the one place the round trip changes meaning, on purpose: accelerate writes "bf16": {"enabled": false}
# beside a JSON that uses DeepSpeed's old name "bfloat16", and DeepSpeed reads "bf16" first, so the
# original trained fp32 under accelerate launch; the import takes the JSON's bf16 (and says so)
EXPECTED = {"zero2_explicit_every_section": ["bf16.enabled: False became True"]}


def compare_accelerate(orig: dict, back: dict, first_host: str | None = None) -> list[str]:
    keys = accelerate_keys()
    out = []
    for key in sorted(set(orig) | set(back)):
        if key in ("deepspeed_config", "fsdp_config", "mixed_precision"):
            continue  # compared through accelerate's plugins below
        a, b = orig.get(key, UNKNOWN), back.get(key, UNKNOWN)
        if key == "parallelism_config" and a and b and isinstance(a, dict) and isinstance(b, dict):
            a, b = _parallelism_as_launched(a), _parallelism_as_launched(b)
        if key == "gpu_ids" and isinstance(a, str) and isinstance(b, str):
            a, b = _cuda_ids(a), _cuda_ids(b)  # accelerate launch puts them into CUDA_VISIBLE_DEVICES as written
        if key == "distributed_type" and isinstance(a, bool):
            a = "NO"  # YAML's false (an unquoted no): accelerate launch matches it to no type, as NO
        if key == "distributed_type" and (a, b) == ("NO", "MULTI_GPU") and (orig.get("num_processes") or 1) > 1:
            # accelerate launch turns multi-GPU on itself for NO with num_processes > 1 where there is more
            # than one GPU (commands/launch.py, _validate_launch_command: "More than one GPU was found")
            continue
        spec = keys.keys.get(key)
        if a is not UNKNOWN and b is not UNKNOWN:
            if a != b and not (spec is not None and spec.unread):
                out.append(f"{key}: {a!r} became {b!r}")
            continue
        value = a if a is not UNKNOWN else b
        default = LAUNCH_DEFAULTS.get(key, spec.default if spec is not None else UNKNOWN)
        if value in ([], {}, None, default):
            continue
        if key == "main_process_ip" and a is UNKNOWN and value == first_host:
            continue  # multi-node: the rendezvous address, the host file's first host
        if spec is not None and spec.unread:
            continue  # accelerate launch never reads it from a file: dropped with a note
        out.append(f"{key}: {value!r} {'left out' if b is UNKNOWN else 'added'}")
    return out


def _cuda_ids(ids: str) -> str:
    """The devices CUDA reads from CUDA_VISIBLE_DEVICES=ids: up to the first empty or unreadable entry."""
    out = []
    for part in ids.split(","):
        if not part.strip().isdigit():
            break
        out.append(part.strip())
    return ",".join(out)


def _parallelism_as_launched(raw: dict) -> dict:
    """parallelism_config as accelerate launch reads it: each of its arguments, its default where the
    file has no value (commands/launch.py, ParallelismConfig Arguments)."""
    from accelerate.commands.launch import launch_command_parser

    defaults = {a.dest: a.default for a in launch_command_parser()._actions
                if a.dest.startswith("parallelism_config_")}
    return {**defaults, **raw}


def _fsdp(raw: dict) -> dict:
    return {str(k).removeprefix("fsdp_"): v for k, v in (raw.get("fsdp_config") or {}).items()}


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip(name, tmp_path, monkeypatch):
    out, gen = _import(tmp_path, name)
    acc, _, hosts = CASES[name]
    orig = yaml.safe_load((DATA / acc).read_text())
    back = yaml.safe_load((gen / "accelerate_config.yaml").read_text())
    first = (DATA / hosts).read_text().split()[0] if hosts else None
    assert compare_accelerate(orig, back, first) == []
    if orig["distributed_type"] == "DEEPSPEED":
        with monkeypatch.context() as m:
            m.chdir(DATA)  # a deepspeed_config_file is relative to where accelerate launch runs
            if CASES[name][1]:  # given on the command line: the original pair is that accelerate file + JSON
                merged = {**orig, "deepspeed_config": {**orig["deepspeed_config"],
                                                       "deepspeed_config_file": str(DATA / CASES[name][1])}}
                (tmp_path / "orig.yaml").write_text(yaml.safe_dump(merged))
                source = tmp_path / "orig.yaml"
            else:
                source = DATA / acc
            before = _deepspeed_plugin_as_launched(m, source)
        with monkeypatch.context() as m:
            after = _deepspeed_plugin_as_launched(m, gen / "accelerate_config.yaml")
        got = compare_deepspeed(before.deepspeed_config, after.deepspeed_config, back["num_processes"])
        assert got == EXPECTED.get(name, [])
        if after.zero_stage == 3:
            assert after.zero3_init_flag == before.zero3_init_flag
    else:
        assert orig.get("mixed_precision", "no") == back["mixed_precision"]
    if orig["distributed_type"] == "FSDP":
        want = {k: v for k, v in _fsdp(orig).items() if k != "version"}
        got = _fsdp(back)
        assert {k: got[k] for k in want} == want and str(got.get("version")) == "2"
    if hosts:
        assert (gen / "hostfile").read_text() == (DATA / hosts).read_text()


def test_auto_values_are_resolved_with_a_comment(tmp_path):
    out, _ = _import(tmp_path, "hf_zero3_offload_auto_2_nodes")
    text = out.read_text()
    assert "reduce_bucket_size: 500000000  # auto: the Trainer derives it from the model's hidden size" in text
    assert "micro_batch_size: 1  # auto: the Trainer's per_device_train_batch_size; set yours" in text
    assert "learning_rate: 5.0e-05  # auto: the Trainer's learning_rate; hfscale's default" in text
    assert "precision: 'no'  # auto: the Trainer's --bf16/--fp16 (off unless your command line set them; hfscale " \
        "writes them from precision): set yours" in text
    assert "runner:\n  type: pdsh" in text


def test_deprecated_aliases_are_normalised(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": True},
          "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                                "prefetch_bucket_size": 1000, "cpu_offload": True}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    r = run_cli("import", str(DATA / "ds_plain.yaml"), "--deepspeed", str(tmp_path / "ds.json"), "--out", "-")
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(r.stdout)
    d = doc["distributed"]["deepspeed"]
    assert doc["precision"] == "bf16" and d["gather_16bit_weights_on_model_save"] is True
    assert d["stage3_prefetch_bucket_size"] == 1000 and d["offload_optimizer"] == {"device": "cpu"}


def test_what_hfscale_cannot_express_is_listed_whole_and_nothing_is_written(tmp_path):
    acc = dict(yaml.safe_load((DATA / "ds_plain.yaml").read_text()), num_machines=2, num_processes=16)
    acc["deepspeed_config"] = {**acc["deepspeed_config"], "deepspeed_exclusion_filter": "gpu-b:0"}
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(acc))
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_scater": True},
          "optimizer": {"type": "SGD"}, "gradient_predivide_factor": "auto", "fp16": {"enabled": True}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "job.yaml"
    r = run_cli("import", str(tmp_path / "acc.yaml"), "--deepspeed", str(tmp_path / "ds.json"), "--out", str(out))
    assert r.returncode == 2 and not out.exists()
    lines = r.stderr.splitlines()
    assert lines[0] == f"error: {tmp_path / 'acc.yaml'}: 5 problems"
    assert sorted(lines[1:]) == sorted([
        f"  - {tmp_path / 'acc.yaml'}: num_machines: 2 machines: give their names with --hostfile ('host slots=N' "
        "lines); hfscale launches on named hosts",
        f"  - {tmp_path / 'acc.yaml'}: deepspeed_config.deepspeed_exclusion_filter: hfscale cannot express it",
        f"  - {tmp_path / 'ds.json'}: optimizer.type: 'SGD' is not one of Adam, AdamW, Lamb, Lion, OneBitAdam, "
        "ZeroOneAdam, OneBitLamb",
        f"  - {tmp_path / 'ds.json'}: gradient_predivide_factor: 'auto' here is not a TrainingArguments value; write "
        "a value",
        f"  - {tmp_path / 'ds.json'}: zero_optimization.reduce_scater: unknown key 'reduce_scater'; did you mean "
        "'reduce_scatter'?",
    ])


def test_an_existing_out_file_is_kept_without_force(tmp_path):
    out = tmp_path / "job.yaml"
    out.write_text("mine\n")
    r = run_cli("import", str(DATA / "trl_zero2.yaml"), "--out", str(out))
    assert r.returncode == 2 and out.read_text() == "mine\n" and "pass --force" in r.stderr
    assert run_cli("import", str(DATA / "trl_zero2.yaml"), "--out", str(out), "--force").returncode == 0
    assert run_cli("check", str(out)).returncode == 0


def test_errors_name_the_source_file_and_its_key_not_the_yaml_never_written(tmp_path):
    """A value hfscale refuses is told as the user wrote it: their file and key, no line of the
    hfscale YAML the import did not write."""
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
                                                  "zero_optimization": {"stage": 2, "reduce_bucket_size": -5}}))
    r = run_cli("import", str(DATA / "ds_plain.yaml"), "--deepspeed", str(tmp_path / "ds.json"), "--out", "-")
    assert r.returncode == 2 and "(line" not in r.stderr
    assert f"  - {tmp_path / 'ds.json'}: zero_optimization.reduce_bucket_size: must be >= 0, got -5" in r.stderr
    assert f"  - {tmp_path / 'ds.json'}: steps_per_print: must be >= 1, got 0" in r.stderr
    (tmp_path / "acc.yaml").write_text("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 4\n"
                                       "main_process_ip: head_node!\n")
    (tmp_path / "hosts").write_text("a slots=2\nb slots=2\n")
    r = run_cli("import", str(tmp_path / "acc.yaml"), "--hostfile", str(tmp_path / "hosts"), "--out", "-")
    assert r.returncode == 2 and "cluster.master_addr" not in r.stderr
    assert f"  - {tmp_path / 'acc.yaml'}: main_process_ip: 'head_node!' is not a host name" in r.stderr


def test_floats_and_sizes_deepspeed_accepts_are_accepted(tmp_path):
    """transformers' own ZeRO-3 test config writes sub_group_size 1e14; open-instruct's write
    steps_per_print 1e5 (JSON floats): DeepSpeed takes both."""
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1e5, '
                                      '"zero_optimization": {"stage": 3, "sub_group_size": 1e14}}')
    r = run_cli("import", str(DATA / "ds_plain.yaml"), "--deepspeed", str(tmp_path / "ds.json"), "--out", "-")
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(r.stdout)["distributed"]["deepspeed"]
    assert doc["sub_group_size"] == 10**14 and doc["steps_per_print"] == 100000


@pytest.mark.parametrize("accelerate, ds", [
    ("distributed_type: [1]\n", None),
    ("distributed_type: MULTI_GPU\nnum_processes: '4'\n", None),
    ("distributed_type: DEEPSPEED\ndeepspeed_config: abc\n", None),
    ("distributed_type: FSDP\nfsdp_config: abc\n", None),
    ("distributed_type: FSDP\nfsdp_config: {fsdp_version: 1, fsdp_transformer_layer_cls_to_wrap: [A], "
     "fsdp_sharding_strategy: [1]}\n", None),
    ("distributed_type: FSDP\nparallelism_config: [a]\n", None),
    ("distributed_type: DEEPSPEED\nmixed_precision: bogus\ndeepspeed_config: {zero_stage: 2}\n", None),
    (None, {"bf16": True, "fp16": "auto"}),
    (None, {"optimizer": {"type": "AdamW", "params": "auto"}}),
    (None, {"scheduler": {"type": ["x"], "params": [1]}}),
    (None, {"train_batch_size": 8, "gradient_accumulation_steps": 0}),
    (None, {"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}),
    (None, {"sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 1}),
])
def test_odd_sources_are_exit_2_with_the_key_never_a_traceback(tmp_path, accelerate, ds):
    acc = tmp_path / "acc.yaml"
    acc.write_text(accelerate or (DATA / "ds_plain.yaml").read_text())
    args = ["import", str(acc), "--out", "-"]
    if ds is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        args += ["--deepspeed", str(tmp_path / "ds.json")]
    r = run_cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"error: {acc}: ")


def test_fsdp1_numeric_strategy_and_its_default_layout(tmp_path):
    """Older FSDP1 configs write the strategy as torch's enum number; FSDP1 saves a full state dict
    by default, which FSDP2 would change: both carried over."""
    (tmp_path / "acc.yaml").write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n"
                                       "  fsdp_sharding_strategy: 2\n  fsdp_version: 1\n")
    r = run_cli("import", str(tmp_path / "acc.yaml"), "--out", "-")
    assert r.returncode == 0, r.stderr
    fsdp = yaml.safe_load(r.stdout)["distributed"]["fsdp"]
    assert fsdp["reshard_after_forward"] is False and fsdp["state_dict_type"] == "FULL_STATE_DICT"
    assert "fsdp_sharding_strategy SHARD_GRAD_OP became reshard_after_forward false" in r.stdout


def test_inline_deepspeed_errors_name_the_accelerate_keys(tmp_path):
    """accelerate builds a DeepSpeed config from deepspeed_config's own keys; a bad value is told
    under the key the user wrote (deepspeed_config.zero_stage), not DeepSpeed's (zero_optimization.stage)."""
    (tmp_path / "acc.yaml").write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 5\n  offload_optimizer_device: disk\n"
        "  offload_param_nvme_path: 7\n  gradient_accumulation_steps: 0\n  gradient_clipping: -1\n"
        "mixed_precision: bf16\nnum_machines: 1\nnum_processes: 2\n")
    r = run_cli("import", str(tmp_path / "acc.yaml"), "--out", "-", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    for said in ("acc.yaml: deepspeed_config.zero_stage: must be one of 0, 1, 2 or 3, got 5",
                 "acc.yaml: deepspeed_config.offload_optimizer_device: must be one of 'none', 'cpu' or 'nvme'",
                 "acc.yaml: deepspeed_config.gradient_accumulation_steps: must be >= 1, got 0",
                 "acc.yaml: deepspeed_config.gradient_clipping: must be > 0.0, got -1"):
        assert said in r.stderr, r.stderr
    assert "zero_optimization" not in r.stderr and "Traceback" not in r.stderr
