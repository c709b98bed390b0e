"""The corpus of real configs (tests/data/real_configs, SOURCES.md) taken through
``hfscale import`` -> ``check`` -> ``config``, and what came back compared with the original
through the engines' own loaders (accelerate's launch code and DeepSpeedPlugin, DeepSpeed's
DeepSpeedConfig). Used by tests/test_real_configs.py; ``python tests/real_corpus.py`` prints the
table of outcomes per repository.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
CORPUS = HERE / "data" / "real_configs"
WORLD = 2  # processes per node where a wrapped DeepSpeed JSON needs an accelerate config

Outcome = str  # "faithful" | "refused" | "changed"


@dataclass(frozen=True)
class Row:
    file: str
    repository: str
    path: str
    commit: str
    deepspeed_config: str | None


@dataclass
class Result:
    row: Row
    outcome: Outcome
    details: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    accelerate_refuses_original: bool = False  # compared as DeepSpeed alone reads both JSONs


def rows() -> list[Row]:
    out = []
    for line in (CORPUS / "SOURCES.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("file", "---") or set(cells[0]) <= {"-", " "}:
            continue
        out.append(Row(cells[0], cells[1], cells[2], cells[3], None if cells[4] == "-" else cells[4]))
    return out


def load_any(path: Path) -> Any:
    text = path.read_text()
    try:
        return json.loads(text)
    except ValueError:
        return yaml.safe_load(text)


def is_accelerate(data: Any) -> bool:
    return isinstance(data, dict) and ("distributed_type" in data or "compute_environment" in data)


def cases() -> list[tuple[Row, Path, Path | None]]:
    """(row, accelerate YAML, DeepSpeed JSON given with --deepspeed): each accelerate YAML with
    the JSON it names; each DeepSpeed JSON no accelerate YAML of the corpus names, beside a plain
    DeepSpeed accelerate config (tests/data/import/ds_plain.yaml)."""
    all_rows = rows()
    paired = {r.deepspeed_config for r in all_rows if r.deepspeed_config}
    out = []
    plain = HERE / "data" / "import" / "ds_plain.yaml"
    for r in all_rows:
        data = load_any(CORPUS / r.file)
        if is_accelerate(data):
            out.append((r, CORPUS / r.file, CORPUS / r.deepspeed_config if r.deepspeed_config else None))
        elif r.file not in paired:
            out.append((r, plain, CORPUS / r.file))
    return out


def world_for(ds: dict) -> int:
    """The process count a DeepSpeed JSON was written for, when its batch keys fix it (under
    accelerate gradient accumulation is 1 when absent); else 8, a node of GPUs."""
    total, micro, ga = (ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                            "gradient_accumulation_steps"))
    ga = ga if isinstance(ga, int) else 1
    if isinstance(total, int) and isinstance(micro, int) and total % (micro * ga) == 0:
        return total // (micro * ga)
    return 8


def wrapper(ds_path: Path, tmp: Path) -> Path:
    """A plain DeepSpeed accelerate config for a JSON no accelerate config of the corpus names,
    with the process count the JSON was written for."""
    acc = yaml.safe_load((HERE / "data" / "import" / "ds_plain.yaml").read_text())
    acc["num_processes"] = world_for(load_any(ds_path))
    path = tmp / "accelerate.yaml"
    path.write_text(yaml.safe_dump(acc))
    return path


def hostfile_for(acc: dict, tmp: Path) -> Path | None:
    """A host file for a multi-node accelerate config, as its user would write one."""
    machines = int(acc.get("num_machines", 1) or 1)
    if machines <= 1:
        return None
    procs = int(acc.get("num_processes", machines) or machines)
    path = tmp / "hosts"
    path.write_text("".join(f"node{i} slots={procs // machines}\n" for i in range(machines)))
    return path


class _DataParallel:
    """DeepSpeed's ``mpu`` interface: the data-parallel world size of the job the JSON was
    written for (the test process is one rank of a group of one)."""

    def __init__(self, world: int):
        self.world = world

    def get_data_parallel_world_size(self) -> int:
        return self.world

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def join_group_of_one(tmp: Path) -> None:
    """torch's and DeepSpeed's process group with this process alone (DeepSpeedConfig asks it for
    the rank), once per process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp / 'rendezvous'}", rank=0, world_size=1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def deepspeed_loads(path: Path, world: int) -> str | None:
    """Why DeepSpeed's own DeepSpeedConfig refuses the JSON at ``path``, or None."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(json.loads(path.read_text()), mpu=_DataParallel(world))
    except Exception as e:  # noqa: BLE001 - any refusal of DeepSpeed's is the finding
        return f"{type(e).__name__}: {e}"
    return None


def scheduler_builds(path: Path) -> str | None:
    """Why DeepSpeed's own scheduler class refuses the JSON's scheduler section (DeepSpeedConfig
    does not build it), or None; "auto" as the Trainer fills it."""
    import torch
    from deepspeed.runtime import lr_schedules

    sched = json.loads(path.read_text()).get("scheduler")
    if not sched:
        return None
    params = {k: (100 if v == "auto" else v) for k, v in sched.get("params", {}).items()}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    try:
        getattr(lr_schedules, sched["type"])(optimizer, **params)
    except Exception as e:  # noqa: BLE001 - any refusal of DeepSpeed's is the finding
        return f"{sched['type']}: {type(e).__name__}: {e}"
    return None


def run_case(row: Row, acc_path: Path, ds_path: Path | None, tmp: Path, monkeypatch) -> Result:
    """One corpus case through import, check and config; the outcome and what differs."""
    from test_consumers import _deepspeed_plugin_as_launched
    from test_import import compare_accelerate, compare_deepspeed

    from hfscale.render.artifacts import DEEPSPEED_FILE, render_artifacts
    from hfscale.config.errors import ConfigError
    from hfscale.core.atomic_files import write_files
    from hfscale.cli.importing.importer import follow, import_configs, read_source
    from hfscale.rules.config_file import load_job

    tmp.mkdir(parents=True, exist_ok=True)
    if not is_accelerate(load_any(CORPUS / row.file)):
        acc_path = wrapper(CORPUS / row.file, tmp)
    orig = load_any(acc_path)
    hosts = hostfile_for(orig, tmp)
    job_yaml = tmp / "job.yaml"
    try:
        acc = read_source(str(acc_path), str(acc_path))
        ds, hf = follow(acc, str(ds_path) if ds_path else None, str(hosts) if hosts else None)
        text = import_configs(acc, ds, hf, tmp)
    except ConfigError as e:
        return Result(row, "refused", [f"import: {p}" for p in e.problems])
    job_yaml.write_text(text)
    notes = [line[4:] for line in text.splitlines() if line.startswith("# - ")]
    try:
        job = load_job(job_yaml)
    except ConfigError as e:
        return Result(row, "refused", [f"check: {p}" for p in e.problems], notes)
    gen = tmp / "gen"
    write_files(gen, render_artifacts(job, str((gen / DEEPSPEED_FILE).resolve())))
    back = yaml.safe_load((gen / "accelerate_config.yaml").read_text())
    first = hosts.read_text().split()[0] if hosts else None
    diffs = compare_accelerate(loaded(acc_path), loaded(gen / "accelerate_config.yaml"), first)
    if "num_processes" not in orig:  # given on accelerate launch's command line: the import says so
        diffs = [d for d in diffs if not d.startswith("num_processes:")]
    if orig.get("distributed_type") in SAME_AS_MULTI_GPU:
        diffs = [d for d in diffs if not d.startswith("distributed_type:")] + same_launch(acc_path, gen / "accelerate_config.yaml")
    fp8 = orig.get("mixed_precision") == "fp8" or "fp8_config" in orig
    if fp8 and orig.get("distributed_type") != "DEEPSPEED":
        # the import writes fp8_config's keys as accelerate launch names them (backend: fp8_backend)
        diffs = [d for d in diffs if not d.startswith("fp8_config:")]
        diffs += fp8_launch(acc_path, gen / "accelerate_config.yaml")
    raw = False
    if back.get("distributed_type") == "DEEPSPEED":
        # DeepSpeed's data-parallel world: sequence-parallel ranks share their samples
        world = int(back["num_processes"]) // int((back.get("parallelism_config") or {}).get(
            "parallelism_config_sp_size", 1))
        why = deepspeed_loads(gen / DEEPSPEED_FILE, world) or scheduler_builds(gen / DEEPSPEED_FILE)
        if why:
            diffs.append(f"DeepSpeed refuses the written JSON: {why}")
        source = acc_path
        if ds_path is not None:  # the pair as accelerate launch reads it: the JSON by absolute path
            merged = {**orig, "deepspeed_config": {**(orig.get("deepspeed_config") or {}),
                                                   "deepspeed_config_file": str(ds_path)}}
            source = tmp / "orig_accelerate.yaml"
            source.write_text(yaml.safe_dump(merged))
        try:
            with monkeypatch.context() as m:
                before = _deepspeed_plugin_as_launched(m, source).deepspeed_config
            with monkeypatch.context() as m:
                after = _deepspeed_plugin_as_launched(m, gen / "accelerate_config.yaml").deepspeed_config
        except ValueError:  # accelerate refuses the original pair: both JSONs as DeepSpeed reads them
            before, after = load_any(ds_path) if ds_path is not None else {}, json.loads((gen / DEEPSPEED_FILE).read_text())
            raw = True
        diffs += [d for d in compare_deepspeed(before, after, world) if not ignored_at_stage(d, after)
                  and not ignored_by_deepspeed(d)]
    if orig.get("distributed_type") == "FSDP":
        diffs += compare_fsdp(orig, back)
    return Result(row, "changed" if diffs else "faithful", diffs, notes, raw)


SAME_AS_MULTI_GPU = ("MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON")


def loaded(path: Path) -> dict:
    """The accelerate config as accelerate's own loader reads it (old keys converted)."""
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(path)).to_dict()


def same_launch(orig: Path, gen: Path) -> list[str]:
    """What accelerate launch hands a rank, for the original and the written config: equal but for
    the config file's own path."""
    from test_consumers import _launch_env

    (a_args, a_env, _), (b_args, b_env, _) = _launch_env(orig), _launch_env(gen)
    out = [] if a_args.multi_gpu == b_args.multi_gpu else [f"multi_gpu: {a_args.multi_gpu} became {b_args.multi_gpu}"]
    for key in sorted(set(a_env or {}) | set(b_env or {})):
        if (a_env or {}).get(key) != (b_env or {}).get(key) and key.startswith(("ACCELERATE_", "FSDP_")):
            out.append(f"launch env {key}: {(a_env or {}).get(key)!r} became {(b_env or {}).get(key)!r}")
    return out


def fp8_launch(orig: Path, gen: Path) -> list[str]:
    """What accelerate launch hands a rank of mixed_precision and fp8_config (ACCELERATE_MIXED_PRECISION,
    ACCELERATE_FP8_*: utils/launch.py, setup_fp8_env), for the original and the written config. It
    refuses fp8 where neither Transformer Engine, torchao nor MS-AMP is installed (none is, on
    this CPU machine), so their presence is assumed."""
    import pytest
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch

    envs = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(launch, "is_fp8_available", lambda: True)
        for path in (orig, gen):
            args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
                ["--config_file", str(path), "train.py"]))
            _, env = launch.prepare_simple_launcher_cmd_env(args)
            envs.append({k: v for k, v in env.items()
                         if k == "ACCELERATE_MIXED_PRECISION" or k.startswith("ACCELERATE_FP8_")})
    a, b = envs
    return [f"launch env {k}: {a.get(k)!r} became {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def ignored_by_deepspeed(diff: str) -> bool:
    """A top-level key DeepSpeedConfig never reads (it ignores keys it does not know)."""
    from hfscale.config.sources.deepspeed import deepspeed_keys

    return diff.split(":")[0].split(".")[0] not in deepspeed_keys().keys


@functools.lru_cache(maxsize=1)
def zero_reads() -> dict[int, frozenset[str]]:
    """The zero_optimization keys DeepSpeed's engine reads at each stage, recorded by running it
    (tests/zero_reads.py), not taken from hfscale's own table."""
    import subprocess

    r = subprocess.run([sys.executable, str(Path(__file__).with_name("zero_reads.py"))], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("ZERO_READS ")), None)
    assert line is not None, r.stderr[-3000:]
    return {int(k): frozenset(v) for k, v in json.loads(line.split(" ", 1)[1]).items()}


def ignored_at_stage(diff: str, after: dict) -> bool:
    """A zero_optimization key the import left out (with a note) that DeepSpeed's engine does not
    read at the config's stage, as recorded by running it."""
    stage = (after.get("zero_optimization") or {}).get("stage", 0)
    if not diff.startswith("zero_optimization.") or ":" not in diff:
        return False
    key = diff.split(":")[0].split(".")[1]
    return key != "stage" and (key not in zero_reads()[int(stage)] or (key, int(stage)) in READ_WITHOUT_EFFECT)


# read by the engine below stage 3 but without effect there: it only builds qgZ's all-to-all group
# (engine.py, "Using quantized gradients"); ZeRO-1/2's optimizer never reads it (a test checks)
READ_WITHOUT_EFFECT = {("zero_quantized_gradients", 0), ("zero_quantized_gradients", 1),
                       ("zero_quantized_gradients", 2)}


def compare_fsdp(orig: dict, back: dict) -> list[str]:
    """The FSDP settings: the original as accelerate's own ``accelerate to-fsdp2`` converts it,
    against what hfscale wrote (keys without the fsdp_ prefix; a default restated is no change)."""
    import copy

    from accelerate.commands.to_fsdp2 import convert_config_to_fsdp2

    version = (orig.get("fsdp_config") or {}).get("fsdp_version", 1)
    want = convert_config_to_fsdp2(copy.deepcopy(orig)).get("fsdp_config") or {}
    norm = {str(k).removeprefix("fsdp_"): v for k, v in want.items()}
    got = {str(k).removeprefix("fsdp_"): v for k, v in (back.get("fsdp_config") or {}).items()}
    defaults = {"auto_wrap_policy": None, "offload_params": False, "cpu_ram_efficient_loading": True,
                "activation_checkpointing": False, "reshard_after_forward": True,
                # accelerate's default layout: FULL for FSDP1, SHARDED for FSDP2 (utils/dataclasses.py)
                "state_dict_type": "FULL_STATE_DICT" if str(version) == "1" else "SHARDED_STATE_DICT",
                "activation_checkpointing_offload": False,  # accelerate's plugin: FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD
                "version": 2}
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import str_to_bool

    # a key accelerate launch has no argument for is copied onto its arguments and read by nothing
    args = {a.dest.removeprefix("fsdp_") for a in launch_command_parser()._actions if a.dest.startswith("fsdp_")}
    out = []
    for key in sorted(set(norm) | set(got)):
        if key not in args:
            continue
        a, b = norm.get(key, defaults.get(key)), got.get(key, defaults.get(key))
        if key == "reshard_after_forward":  # FSDP2 reads it with str_to_bool (1 is true)
            a, b = (str_to_bool(str(v).lower(), to_bool=True) if str(v).lower() in _BOOLS else v for v in (a, b))
        if str(a) != str(b):
            out.append(f"fsdp_config.{key}: {a!r} became {b!r}")
    return out


_BOOLS = {"y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0"}  # accelerate's str_to_bool


def survey(tmp: Path) -> list[Result]:
    import pytest

    join_group_of_one(tmp)
    out = []
    with pytest.MonkeyPatch().context() as m:
        for i, (row, acc, ds) in enumerate(cases()):
            out.append(run_case(row, acc, ds, tmp / f"case{i}", m))
    return out


def table(results: list[Result]) -> str:
    by_repo: dict[str, dict[str, int]] = {}
    for r in results:
        counts = by_repo.setdefault(r.row.repository, {"faithful": 0, "refused": 0, "changed": 0})
        counts[r.outcome] += 1
    lines = ["| repository | cases | faithful | refused | changed |", "| --- | --- | --- | --- | --- |"]
    for repo, c in sorted(by_repo.items()):
        lines.append(f"| {repo} | {sum(c.values())} | {c['faithful']} | {c['refused']} | {c['changed']} |")
    total = {k: sum(c[k] for c in by_repo.values()) for k in ("faithful", "refused", "changed")}
    lines.append(f"| all | {len(results)} | {total['faithful']} | {total['refused']} | {total['changed']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory() as d:
        results = survey(Path(d))
    for r in results:
        if r.outcome != "faithful":
            print(f"== {r.outcome}: {r.row.file}")
            for line in r.details:
                print(f"   {line}")
    print(table(results))
    print("accelerate refuses the original:", [r.row.file for r in results if r.accelerate_refuses_original])
