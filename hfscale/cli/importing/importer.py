"""``hfscale import``: an accelerate config, the DeepSpeed JSON it names (or one given) and a host
file, into one commented hfscale YAML that ``hfscale check`` accepts.

Every key of the sources lands in a typed hfscale key, in an ``extra`` mapping, or in a note
saying why it can be left out (a value accelerate launch never reads, a default restated); what
hfscale cannot express is a problem, and all problems are reported together (exit 2).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfscale.cli.importing.deepspeed import import_deepspeed
from hfscale.cli.importing.draft import Draft, as_bool, render_draft
from hfscale.cli.importing.fsdp import import_fsdp
from hfscale.config.accelerate import ParallelismConfig
from hfscale.config.errors import ConfigError, Problem
from hfscale.config.extra_keys import check_extra
from hfscale.config.hostfile import parse_hostfile
from hfscale.config.sources.accelerate import accelerate_keys
from hfscale.config.sources.deepspeed import deepspeed_keys
from hfscale.config.yaml_source import parse
from hfscale.rules.config_file import _read, load_text

BACKENDS = {"DEEPSPEED": "deepspeed", "FSDP": "fsdp", "MULTI_GPU": "ddp", "NO": "ddp"}
# accelerate launch's multi_gpu path serves these too (commands/launch.py, _validate_launch_command)
SAME_AS_MULTI_GPU = ("MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON")
# keys hfscale writes itself (render_accelerate), with the value that needs no mention
WRITTEN = {"compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0, "main_training_function": "main",
           "use_cpu": False, "rdzv_backend": "static", "same_network": True, "downcast_bf16": "no"}
PLUGIN = {"zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
          "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping", "zero3_save_16bit_model"}

# accelerate launch: multi_gpu_launcher (torch.distributed.run) for MULTI_GPU whatever num_processes; the
# Accelerator then reports MULTI_GPU but wraps DDP only for more than one process (use_distributed)
_ONE_PROCESS = ("distributed_type {kind} with 1 process: accelerate launch starts it through torch.distributed.run as "
                "a process group of one (OMP_NUM_THREADS=1; the Accelerator reports a multi-process type), kept")


@dataclass(frozen=True)
class Source:
    """One input file: the path it is named by in messages, its directory, its text."""

    path: str
    text: str

    @property
    def directory(self) -> Path:
        return Path(self.path).parent


def read_source(path: str, what: str, base: Path | None = None) -> Source:
    """Read ``path`` (relative to ``base`` when it is there, else to the working directory) as
    hfscale reads configs: a regular file up to 1 MiB; ConfigError naming it otherwise."""
    candidate = Path(path)
    if base is not None and not candidate.is_absolute() and (base / candidate).exists():
        candidate = base / candidate
    text, why = _read(candidate)
    if text is None:
        raise ConfigError(what, [Problem("", why or "unreadable")])
    return Source(str(candidate), text)


def _mapping(src: Source) -> dict[str, Any]:
    doc, problems = parse(src.text)
    if doc is None or problems:
        raise ConfigError(src.path, problems)
    if not isinstance(doc.data, dict):
        raise ConfigError(src.path, [Problem("", "expected a mapping at the top")])
    return doc.data


def follow(accelerate: Source, deepspeed: str | None, hostfile: str | None) -> tuple[Source | None, Source | None]:
    """The DeepSpeed JSON and host file to import beside ``accelerate``: the ones given, else the
    ones its deepspeed_config names (relative to its directory, then the working directory)."""
    data = _mapping(accelerate)
    plugin = data.get("deepspeed_config") if isinstance(data.get("deepspeed_config"), dict) else {}
    named = plugin.get("deepspeed_config_file") if isinstance(plugin.get("deepspeed_config_file"), str) else None
    ds = read_source(deepspeed or named, "--deepspeed", None if deepspeed else accelerate.directory) \
        if (deepspeed or named) else None
    named_hosts = plugin.get("deepspeed_hostfile") if isinstance(plugin.get("deepspeed_hostfile"), str) else None
    hosts = read_source(hostfile or named_hosts, "--hostfile", None if hostfile else accelerate.directory) \
        if (hostfile or named_hosts) else None
    return ds, hosts


def import_configs(accelerate: Source, deepspeed: Source | None, hostfile: Source | None, out_dir: Path | None) -> str:
    """The hfscale YAML for these files; ConfigError listing everything that cannot be expressed.
    ``out_dir``: where the YAML will be written (the host file is named relative to it)."""
    acc = dict(_mapping(accelerate))
    draft = Draft(source=accelerate.path)
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", Path(accelerate.path).stem).strip("-.") or "imported"
    draft.set(("name",), stem[:64], "from the accelerate config's file name")
    where = accelerate.path
    env = acc.pop("compute_environment", "LOCAL_MACHINE")
    if env != "LOCAL_MACHINE":
        draft.refuse(f"{where}: compute_environment", f"{env!r}: hfscale launches on your machines (LOCAL_MACHINE)")
    _legacy(acc, draft, where)
    kind = acc.pop("distributed_type", "NO")
    if isinstance(kind, bool):  # `distributed_type: no` unquoted is YAML's false: accelerate launch runs it as NO
        draft.notes.append(f"{where}: distributed_type {str(kind).lower()} (YAML reads an unquoted no, off, false, yes "
                           "or on as a boolean): accelerate launch matches it to no type and runs it as it runs NO; "
                           "so does hfscale")
        kind = "NO"
    kind = kind if isinstance(kind, str) else repr(kind)
    backend = BACKENDS.get(kind)
    if kind in SAME_AS_MULTI_GPU:
        backend = "ddp"
        draft.notes.append(f"{where}: distributed_type {kind}: accelerate launch starts it as it starts MULTI_GPU "
                           "(one process per device, the device type found at run time)" + (
                               "" if acc.get("num_processes") == 1 else "; hfscale writes MULTI_GPU"))
    if backend is None:
        draft.refuse(f"{where}: distributed_type", f"{kind!r}: hfscale writes {', '.join(BACKENDS)}")
        backend = "ddp"
    draft.set(("distributed", "backend"), backend, key="distributed_type")
    precision = acc.pop("mixed_precision", None)
    if precision not in (None, "no", "bf16", "fp16", "fp8"):
        draft.refuse(f"{where}: mixed_precision", f"{precision!r}: accelerate takes no, fp16, bf16 or fp8")
        precision = None
    procs = acc.get("num_processes")
    world = procs if isinstance(procs, int) and not isinstance(procs, bool) and procs > 0 else 1
    if backend == "ddp" and kind != "NO" and procs == 1 and not isinstance(procs, bool):
        draft.set(("distributed", "process_group"), True, _ONE_PROCESS.format(kind=kind))
    if kind == "NO" and world > 1:  # accelerate launch's own rule (commands/launch.py, _validate_launch_command)
        draft.notes.append(f"{where}: distributed_type NO with num_processes {world}: accelerate launch turns multi-GPU "
                           "training on itself where the machine has more than one GPU (and runs one process where it "
                           f"has one); hfscale writes MULTI_GPU with {world} processes")
    _cluster(acc, hostfile, out_dir, draft, where)
    sp = _sequence_parallel(acc.get("parallelism_config"), world)
    world //= sp  # the batch is per data-parallel rank
    plugin = acc.pop("deepspeed_config", None) or {}
    fsdp = acc.pop("fsdp_config", None) or {}
    if not isinstance(plugin, dict):
        draft.refuse(f"{where}: deepspeed_config", f"must be a mapping, got {type(plugin).__name__}")
        plugin = {}
    if backend == "deepspeed":
        if precision is not None and (deepspeed is not None or "deepspeed_config_file" in plugin):
            draft.refuse(f"{where}: mixed_precision", "beside deepspeed_config_file: accelerate's DeepSpeedPlugin "
                         "refuses the pair (it would be ignored); " + (
                             "fp8 cannot go in the JSON: remove it here and launch with accelerate launch "
                             "--mixed_precision fp8 (hfscale launch passes it for precision: fp8)"
                             if precision == "fp8" else "set bf16/fp16 in the JSON"))
        _deepspeed(plugin, deepspeed, precision, draft, where, world, sp)
    else:
        draft.set(("precision",), precision or "no", key="mixed_precision")
        if plugin:
            draft.refuse(f"{where}: deepspeed_config", f"DeepSpeed settings, but distributed_type is {kind}")
        if deepspeed is not None:
            draft.refuse(deepspeed.path, f"a DeepSpeed config, but distributed_type is {kind}")
    if fsdp and backend != "fsdp":  # accelerate launch sets FSDP's variables for distributed_type FSDP only
        draft.notes.append(f"{where}: left out fsdp_config: distributed_type is {kind}, and accelerate launch reads "
                           "fsdp_config only for FSDP (nothing reads it here)")
    elif fsdp:
        import_fsdp(fsdp, draft, where, backend)
    _parallelism(acc.pop("parallelism_config", None) or {}, draft, where)
    if backend == "deepspeed" and sp > 1:
        draft.set(("training", "script"), "train.py", "the script accelerate launch ran: set yours (hfscale's "
                  "built-in entry point cannot train with sequence parallelism)")
    _rest(acc, draft, where)
    if backend != "deepspeed" or draft.get(("batch", "micro_batch_size")) is None:
        draft.set(("batch", "micro_batch_size"), 1, "accelerate's config has no batch size: the script's; set yours")
    _order(draft)
    if draft.problems:
        raise ConfigError(accelerate.path, draft.problems)
    sources = ", ".join(s.path for s in (accelerate, deepspeed, hostfile) if s is not None)
    text = render_draft(draft, [f"Imported by hfscale from {sources}.",
                                "Check it with `hfscale check`; `hfscale config` writes the files back."])
    try:  # what import writes, check accepts; else the user hears of the keys of their own files
        load_text(text, f"the hfscale YAML imported from {sources}", out_dir or Path("."))
    except ConfigError as e:
        raise ConfigError(accelerate.path, [draft.origin_of(p) for p in e.problems]) from None
    return text


def _legacy(acc: dict[str, Any], draft: Draft, where: str) -> None:
    """Old keys as accelerate's loader converts them (commands/config/config_args.py, from_yaml_file)."""
    if "fp16" in acc and "mixed_precision" not in acc:
        acc["mixed_precision"] = "fp16" if acc.pop("fp16") else "no"
        draft.notes.append(f"{where}: fp16 is accelerate's old spelling of mixed_precision: {acc['mixed_precision']}")
    if "dynamo_backend" in acc:
        legacy = acc.pop("dynamo_backend")
        acc["dynamo_config"] = {} if legacy == "NO" else {"dynamo_backend": legacy}  # the loader replaces it
        draft.notes.append(f"{where}: dynamo_backend {legacy} is accelerate's old spelling of dynamo_config"
                           f"{'' if legacy == 'NO' else ' dynamo_backend'}")


def _cluster(acc: dict, hostfile: Source | None, out_dir: Path | None, draft: Draft, where: str) -> None:
    for key in ("num_machines", "num_processes"):
        if key in acc and not (isinstance(acc[key], int) and not isinstance(acc[key], bool)):
            draft.refuse(f"{where}: {key}", f"must be a whole number, got {acc.pop(key)!r}")
    machines = acc.pop("num_machines", 1)
    if "num_processes" not in acc:
        draft.notes.append(f"{where} has no num_processes (accelerate launch then takes --num_processes from its "
                           "command line): hfscale starts 1 process per node; set cluster.nproc_per_node")
    procs = acc.pop("num_processes", 1)
    acc.pop("machine_rank", None)  # per node: hfscale gives each node its rank
    if hostfile is not None:
        hosts, problems = parse_hostfile(hostfile.text, hostfile.path)
        draft.problems += problems
        ref = os.path.relpath(os.path.abspath(hostfile.path), os.path.abspath(out_dir)) if out_dir else \
            os.path.abspath(hostfile.path)
        draft.set(("cluster", "hostfile"), ref, key="--hostfile" if hostfile.path != where else "deepspeed_hostfile")
        draft.set(("runner", "type"), "pdsh", "hfscale starts every host over ssh (accelerate ran on each by hand)")
        if hosts and (len(hosts) != machines or sum(h.slots for h in hosts) != procs):
            draft.refuse(f"{where}: num_machines, num_processes", f"{machines} machine(s), {procs} process(es), but "
                         f"{hostfile.path} lists {len(hosts)} host(s) with {sum(h.slots for h in hosts)} slots")
    elif machines == 1:
        if procs > 1:
            draft.set(("cluster", "nproc_per_node"), procs, key="num_processes")
    else:
        draft.refuse(f"{where}: num_machines", f"{machines} machines: give their names with --hostfile "
                     "('host slots=N' lines); hfscale launches on named hosts")
    ip, port = acc.pop("main_process_ip", None), acc.pop("main_process_port", None)
    if ip and hostfile is not None:
        draft.set(("cluster", "master_addr"), ip, key="main_process_ip")
    if port not in (None, 29500):
        draft.set(("cluster", "master_port"), port, key="main_process_port")
    ids = acc.pop("gpu_ids", None)
    if isinstance(ids, str) and re.fullmatch(r"[0-9]+(,[0-9]+)*,+", ids.replace(" ", "")):
        # accelerate launch sets CUDA_VISIBLE_DEVICES to it as written; CUDA reads the ids up to the first
        # empty one (as torch.cuda._parse_visible_devices does), so "0," is GPU 0
        read = ids.replace(" ", "").rstrip(",")
        draft.notes.append(f"{where}: gpu_ids {ids!r}: accelerate launch puts it into CUDA_VISIBLE_DEVICES as "
                           f"written, where the empty id ends the list: GPUs {read}; written as {read!r}")
        ids = read
    if ids not in (None, "all"):
        draft.set(("accelerate", "gpu_ids"), str(ids), key="gpu_ids")


# the DeepSpeed keys accelerate's DeepSpeedPlugin builds from its inline deepspeed_config keys
INLINE_NAMES = {
    "zero_optimization.stage": "deepspeed_config.zero_stage",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "deepspeed_config.zero3_save_16bit_model",
    "gradient_accumulation_steps": "deepspeed_config.gradient_accumulation_steps",
    "gradient_clipping": "deepspeed_config.gradient_clipping",
    "bf16": "mixed_precision", "fp16": "mixed_precision",
    **{f"zero_optimization.{part}.{field}": f"deepspeed_config.{part}_{field}"
       for part in ("offload_optimizer", "offload_param") for field in ("device", "nvme_path")},
}


def _deepspeed(plugin: dict, deepspeed: Source | None, precision: str | None, draft: Draft, where: str,
               world: int, sp: int = 1) -> None:
    plugin = dict(plugin)
    plugin.pop("deepspeed_config_file", None)
    plugin.pop("deepspeed_hostfile", None)
    launcher = plugin.pop("deepspeed_multinode_launcher", "standard")
    if launcher not in ("standard", "pdsh"):
        draft.refuse(f"{where}: deepspeed_config.deepspeed_multinode_launcher",
                     f"{launcher!r}: hfscale starts the nodes itself (runner.type pdsh, slurm, ...)")
    init = plugin.pop("zero3_init_flag", None)
    plugin_save = None
    if deepspeed is not None:
        beside = sorted(set(plugin) & PLUGIN)
        if beside:
            draft.refuse(f"{where}: deepspeed_config", f"{', '.join(beside)} beside deepspeed_config_file: accelerate "
                         "refuses that pair; keep them in the JSON")
        ds = _mapping(deepspeed)
        source = deepspeed.path
    else:  # the plugin's keys: what accelerate's DeepSpeedPlugin builds a DeepSpeed config from
        z: dict[str, Any] = {"stage": plugin.pop("zero_stage", 2)}
        for name in ("offload_optimizer", "offload_param"):
            device = plugin.pop(f"{name}_device", "none")
            path = plugin.pop(f"{name}_nvme_path", None)
            if name == "offload_param" and device not in (None, "none") and z["stage"] in (0, 1, 2):
                # accelerate writes it into the config at every stage; DeepSpeed reads it at stage 3 only
                draft.notes.append(f"{where}: left out deepspeed_config.offload_param_device {device}: DeepSpeed does "
                                   f"not use it at ZeRO stage {z['stage']}")
            elif device not in (None, "none"):
                z[name] = {"device": device, **({"nvme_path": path} if device == "nvme" and path else {})}
        if "zero3_save_16bit_model" in plugin:
            plugin_save = plugin.pop("zero3_save_16bit_model")
            z["stage3_gather_16bit_weights_on_model_save"] = as_bool(plugin_save)
        ds = {"zero_optimization": z}
        if precision == "fp16":  # what accelerate's DeepSpeedPlugin.set_mixed_precision adds to its config
            ds["fp16"] = {"enabled": True, "auto_cast": True}
        elif precision == "bf16":
            ds["bf16"] = {"enabled": True}
        if "gradient_accumulation_steps" in plugin:
            ds["gradient_accumulation_steps"] = plugin.pop("gradient_accumulation_steps")
        clip = plugin.pop("gradient_clipping", None)
        if clip:  # accelerate writes it only when truthy: 0 leaves DeepSpeed's default, 1.0
            ds["gradient_clipping"] = clip
        source = f"{where} (deepspeed_config)"
    launch_keys = accelerate_keys()
    section = launch_keys.keys["deepspeed_config"].section if launch_keys and "deepspeed_config" in launch_keys.keys \
        else None
    unread = [k for k in plugin if section is not None and not section.open and k not in section.keys]
    if unread:  # accelerate launch copies only its own --deepspeed arguments from this section
        ds_keys = deepspeed_keys()
        json_keys = [k for k in unread if ds_keys is not None and k in ds_keys.keys]
        draft.notes.append(f"{where}: left out deepspeed_config.{', '.join(unread)}: not an argument of accelerate "
                           "launch, which never reads it" + (f" ({', '.join(json_keys)}: a key of DeepSpeed's JSON, "
                           "where distributed.deepspeed.extra would write it)" if json_keys else ""))
    for key in plugin:
        if key not in unread and not (deepspeed is not None and key in PLUGIN):  # those are refused above
            draft.refuse(f"{where}: deepspeed_config.{key}", "hfscale cannot express it")
    since = len(draft.problems)
    import_deepspeed(ds, draft, source, precision, world, as_bool(plugin_save) is True, sequence_parallel=sp)
    if precision == "fp8":  # accelerate adds bf16 {enabled: true} at run time, as hfscale's fp8 JSON leaves it to
        draft.set(("precision",), "fp8", key="mixed_precision")
    if deepspeed is None:  # errors name the accelerate YAML's keys, not the DeepSpeed config built from them
        draft.rename(source, INLINE_NAMES, where, since)
    if init is not None and draft.get(("distributed", "deepspeed", "stage")) == 3:
        draft.set(("distributed", "deepspeed", "zero3_init"), as_bool(init), key="deepspeed_config.zero3_init_flag")
    elif init is not None:
        draft.notes.append("left out zero3_init_flag: it is for ZeRO stage 3 only")


def _parallelism(pc: dict, draft: Draft, where: str) -> None:
    if not isinstance(pc, dict):
        draft.refuse(f"{where}: parallelism_config", f"must be a mapping, got {type(pc).__name__}")
        return
    for key, value in pc.items():
        short = str(key).removeprefix("parallelism_config_")
        if short in ParallelismConfig.model_fields:
            if short == "sp_seq_length_is_variable" and isinstance(value, str):  # read as str(value).lower() == "true"
                if value.lower() not in ("true", "false"):
                    draft.notes.append(f"{where}: parallelism_config.{key} {value!r} reads as false in accelerate")
                value = value.lower() == "true"
            elif short == "sp_seq_length" and isinstance(value, str):  # an argument of type str, read with int()
                digits = value.strip().isdigit() and len(value) < 19
                value = None if value == "None" else int(value) if digits else value
            draft.set(("distributed", "parallelism", short), value, key=f"parallelism_config.{key}")
        else:
            extra = draft.get(("accelerate", "extra"), {})
            extra.setdefault("parallelism_config", {})[key] = value
            draft.set(("accelerate", "extra"), extra)


def _sequence_parallel(pc: Any, world: int) -> int:
    """The parallelism_config's sp_size where it divides the world (1 otherwise: check says why)."""
    sp = pc.get("parallelism_config_sp_size", pc.get("sp_size", 1)) if isinstance(pc, dict) else 1
    return sp if isinstance(sp, int) and not isinstance(sp, bool) and sp > 0 and world % sp == 0 else 1


def _rest(acc: dict, draft: Draft, where: str) -> None:
    """The accelerate keys left: hfscale's own values, defaults, unread keys, or accelerate.extra."""
    keys = accelerate_keys()
    extra: dict[str, Any] = dict(draft.get(("accelerate", "extra"), {}))
    unread = []
    for key, value in acc.items():
        spec = keys.keys.get(key) if keys else None
        if WRITTEN.get(key, object()) == as_bool(value) or WRITTEN.get(key, object()) == value:
            continue
        if spec is not None and (value in (None, [], {}, spec.default) or (spec.default is None and value is False)):
            continue  # a default restated
        if spec is not None and spec.unread:
            unread.append(key)
            continue
        extra[key] = value
    if unread:
        draft.notes.append(f"left out, as accelerate launch never reads them from a config file: {', '.join(unread)}")
    if extra and keys is not None:  # a section's short names as accelerate launch reads them (fp8_config.backend)
        for name, value in list(extra.items()):
            section = keys.keys[name].section if name in keys.keys else None
            if isinstance(value, dict) and section is not None and not section.open:
                extra[name] = {section.canonical(k) if isinstance(k, str) else k: v for k, v in value.items()}
    if extra:
        if keys is not None:
            for path, message in check_extra(extra, keys, {}):
                draft.refuse(f"{where}: {'.'.join(map(str, path))}", message)
        draft.set(("accelerate", "extra"), extra)
        draft.origins.update({("accelerate", "extra", str(k)): f"{where}: {k}" for k in extra})


def _order(draft: Draft) -> None:
    """Top-level keys in the order of hfscale's own template."""
    order = ["name", "cluster", "runner", "distributed", "precision", "batch", "gradient_clipping", "accelerate",
             "training"]
    draft.data = {k: draft.data[k] for k in order if k in draft.data} | {
        k: v for k, v in draft.data.items() if k not in order}
