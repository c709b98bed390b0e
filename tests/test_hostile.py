"""Every string and number field of the config, taken from the schema, with hostile values: each is
a clean exit-2 error (ConfigError) or is carried through quoted, never a traceback, a hang or
execution. The generated shell lines (pdsh, containers, Slurm) are run for real with a stand-in
interpreter: no payload may create its marker file, and values that are accepted arrive intact."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from hfscale.config.errors import ConfigError
from hfscale.config.model import HfscaleConfig
from hfscale.launch.build import build_plan
from hfscale.launch.context import LaunchContext
from hfscale.launch.runners.kubernetes_manifest import k8s_literal
from hfscale.rules.config_file import load_text

CTX_ENV = {"WANDB_API_KEY": "wk-secret"}

FAKE_PYTHON = """#!/bin/sh
# stands in for the interpreter on a node: records what it was given
printf '%s\\n' "$@" > "$HOSTILE_OUT/argv"
env > "$HOSTILE_OUT/env"
"""

PDSH = {
    "name": "hostile",
    "cluster": {"hosts": [{"host": "node0", "slots": 1}, {"host": "node1", "slots": 1}], "master_port": 29700,
                "master_addr": "node0", "gpu_memory": "80GiB"},
    "runner": {"type": "pdsh", "launcher": "torchrun", "ssh_user": "alice", "workdir": "/w", "run_dir": "runs",
               "connect_timeout": 5, "ssh_port": 22, "max_restarts": 1, "fanout": 64},
    "network": {"preset": "infiniband", "env": {"NCCL_IB_HCA": "mlx5_0"}},
    "env": {"vars": {"A_VAR": "a"}, "forward": ["WANDB_*"], "per_host": {"node1": {"NCCL_SOCKET_IFNAME": "eth1"}},
            "public": ["NCCL_*"]},
    "distributed": {"backend": "deepspeed", "deepspeed": {
        "stage": 3, "reduce_bucket_size": 1000, "allgather_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 1000,
        "stage3_param_persistence_threshold": 1000, "stage3_max_live_parameters": 1000,
        "stage3_max_reuse_distance": 1000, "steps_per_print": 10,
        "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 5, "buffer_size": 1000,
                          "max_in_cpu": 1000},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 4, "ratio": 1.0},
        "sub_group_size": 1000, "zero_hpz_partition_size": 2, "communication_data_type": "bf16",
        "grad_accum_dtype": "fp32", "aio": {"block_size": 4096, "queue_depth": 4, "intra_op_parallelism": 2},
        "activation_checkpointing": {"number_checkpoints": 4},
        "flops_profiler": {"module_depth": 2, "output_file": "flops.txt", "profile_step": 3, "top_modules": 2},
        "comms_logger": {"prof_ops": ["all_reduce"]}, "tensorboard": {"job_name": "j", "output_path": "tb"},
        "csv_monitor": {"job_name": "j", "output_path": "csv"},
        "wandb": {"group": "g", "project": "p", "team": "t"},
        "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupCosineLR"}}},
    "accelerate": {"gpu_ids": "0"},
    "watchdog": {"timeout": 300, "first_step": 900, "script_reports_steps": True},
    "recovery": {"max_restarts": 3, "window": 3600, "strikes": 2, "min_nodes": 1, "keep_global_batch": True,
                 "probe_excluded": True, "spares": 0,
                 # run by the health gate on each node as one quoted argument (the stand-in python never runs it):
                 # a payload here that creates the marker got out of its quotes
                 "health_check": {"command": "test -w /scratch", "timeout": 30},
                 "slow_nodes": {"enabled": True, "factor": 2.0, "window": 30, "windows": 2}},
    "precision": "bf16",
    "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": 2},
    "gradient_clipping": 1.0,
    "training": {"script": "train.py", "pass_args": "none", "script_args": ["--note", "x"], "output_dir": "out",
                 "max_steps": 10, "num_train_epochs": 1.0, "learning_rate": 0.001, "weight_decay": 0.01,
                 "adam_beta1": 0.9, "adam_beta2": 0.99, "adam_epsilon": 1e-8, "lr_scheduler_type": "cosine",
                 "warmup_steps": 2, "seed": 3, "logging_steps": 2, "save_steps": 5, "save_total_limit": 2,
                 "local_checkpoints": {"every": 2, "dir": "/nvme/{host}", "keep": 2},
                 "loss_guard": {"window": 50, "warmup": 10, "patience": 2, "loss_factor": 3.0, "loss_rise": 1.0,
                                "grad_norm_factor": 20.0, "skip_margin": 5, "max_rollbacks": 2},
                 "report_to": ["none"], "peak_tflops": 100.0},
}
HOSTFILE = {"name": "hostile-h", "cluster": {"hostfile": "hosts.txt"}, "runner": {"type": "pdsh"},
            "batch": {"micro_batch_size": 1}, "training": {"model": {"path": "/models/x"}}}
BUILTIN = {
    "name": "hostile-b",
    "distributed": {"backend": "fsdp", "fsdp": {"transformer_layer_cls_to_wrap": ["GPT2Block"],
                                                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "min_num_params": 1000,
                                                "state_dict_type": "FULL_STATE_DICT"},
                    "parallelism": {"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1, "cp_size": 1,
                                    "sp_size": 1, "sp_backend": "deepspeed", "sp_seq_length": 64,
                                    "sp_attn_implementation": "sdpa"}},
    "batch": {"micro_batch_size": 1, "global_batch_size": 1},
    "training": {"model": {"config": {"model_type": "gpt2", "n_layer": 2}},
                 "data": {"files": ["data/*.txt"], "format": "json", "text_field": "text", "block_size": 64}},
}
DOCKER = {
    **PDSH, "name": "hostile-d",
    "runner": {"type": "pdsh_docker", "docker": {"image": "img:1", "binary": "podman", "python": "python3",
                                                 "workdir": "/code", "gpus": "all", "ipc": "private",
                                                 "shm_size": "8g", "extra_args": ["--ulimit", "nofile=8:8"],
                                                 "mounts": [{"host": "/data", "container": "/data"}]}},
}
SLURM = {
    **PDSH, "name": "hostile-s", "recovery": {},  # not built for slurm yet: refused with max_restarts
    "cluster": {"num_nodes": 2, "nproc_per_node": 1},
    "runner": {"type": "slurm", "setup": "true", "workdir": "/w", "python": "/opt/py",
               "slurm": {"partition": "gpu", "account": "a", "time": "01:00:00", "job_name": "j", "signal": "USR1@60",
                         "gpus_per_node": 1, "cpus_per_task": 4, "extra": ["--qos=high"]}},
    "env": {"vars": {"A_VAR": "a"}, "forward": ["WANDB_*"]},
}
K8S = {
    **PDSH, "name": "hostile-k", "recovery": {},  # restarts there are the operator's: refused with max_restarts
    "cluster": {"num_nodes": 2, "nproc_per_node": 1},
    "runner": {"type": "kubernetes", "launcher": "torchrun", "python": "python3", "workdir": "/w",
               "kubernetes": {"image": "img:1", "namespace": "ml", "service_account": "sa", "shm_size": "8Gi",
                              "gpu_resource": "nvidia.com/gpu", "rdma_resource": "rdma/hca",
                              "mounts": [{"container": "/data", "claim": "data"}, {"container": "/x", "host_path": "/y"}],
                              "image_pull_policy": "Always",
                              "elastic": {"min_nodes": 1, "max_nodes": 2, "max_restarts": 1}}},
    "env": {"vars": {"A_VAR": "a"}, "forward": ["WANDB_*"]},
}
BASES = {"pdsh": PDSH, "builtin": BUILTIN, "docker": DOCKER, "slurm": SLURM, "kubernetes": K8S, "hostfile": HOSTFILE}
# the runner variants repeat PDSH's other sections: their runs change what reaches their own artifacts
FOCUS = {"docker": ("runner", "env", "network", "training"), "slurm": ("runner", "env", "cluster", "training"),
         "kubernetes": ("runner", "env", "cluster", "training")}


def payloads(marker: Path) -> list[Any]:
    m = str(marker)
    return [
        f"$(touch {m})", f"`touch {m}`", f"; touch {m}", f"' ; touch {m} ; '", f'" ; touch {m} ; "', f"| touch {m}",
        f"&& touch {m}", f"x\ntouch {m}", f"x\rtouch {m}", "nul\x00byte", "esc\x1b[2J", "lone\udc80", "%h %n %u %%",
        "$HOME ${IFS} $$ ${local_rank}", "-rf", "", " ", "ü", "{\"j\": [1]}", "x" * 200_000, "a\u2028b",
    ]


NUMBERS: list[Any] = [-1, 0, 10**20, 1e300, float("inf"), float("nan"), True, "٣", "3", 1.5]


def _leaves(d: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(d, dict):
        return [leaf for k, v in d.items() for leaf in _leaves(v, path + (k,))]
    if isinstance(d, list):
        return [leaf for i, v in enumerate(d) for leaf in _leaves(v, path + (i,))]
    return [(path, d)]


def _set(d: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    out = (list(d) if isinstance(d, list) else dict(d))
    out[path[0]] = _set(out[path[0]], path[1:], value)
    return out


@functools.lru_cache(maxsize=1)
def _schema() -> dict:
    return HfscaleConfig.model_json_schema()


def _shape(path: tuple) -> str:
    """A leaf path as the schema names it: list items ``[]``, free mapping keys (variables, hosts) ``*``."""
    schema = _schema()
    defs = schema["$defs"]
    node: dict = schema
    out = []
    for part in path:
        node = defs[node["$ref"].split("/")[-1]] if "$ref" in node else node
        node = next((k for k in node.get("anyOf", [node]) if k.get("type") != "null"), node)
        node = defs[node["$ref"].split("/")[-1]] if "$ref" in node else node
        if isinstance(part, int):
            out.append("[]")
            node = node.get("items", {})
        elif part in node.get("properties", {}):
            out.append(part)
            node = node["properties"][part]
        else:
            out.append("*")
            node = node.get("additionalProperties", {}) if isinstance(node.get("additionalProperties"), dict) else {}
    return ".".join(out)


def schema_leaves() -> set[str]:
    """Every scalar field of the config model, as a path shape."""
    schema = _schema()
    defs = schema["$defs"]
    out: set[str] = set()

    def walk(node: dict, path: list[str]) -> None:
        node = defs[node["$ref"].split("/")[-1]] if "$ref" in node else node
        kinds = node.get("anyOf", [node])
        for k in kinds:
            k = defs[k["$ref"].split("/")[-1]] if "$ref" in k else k
            if "properties" in k:
                for name, sub in k["properties"].items():
                    walk(sub, path + [name])
            elif k.get("type") == "array":
                walk(k.get("items", {}), path + ["[]"])
            elif k.get("type") == "object" and isinstance(k.get("additionalProperties"), dict):
                walk(k["additionalProperties"], path + ["*"])
            elif k.get("type") in ("string", "integer", "number") or "enum" in k or "const" in k:
                out.add(".".join(path))

    walk(schema, [])
    return out


# Fields whose text is shell by design (runner.setup) or that only the built-in entry point reads
# where no shell ever sees it; everything else is checked by running what the plan generates.
RAW_SHELL = {"runner.setup"}
LEAVES = [(name, path, value) for name, base in BASES.items() for path, value in _leaves(base)]


def test_the_bases_cover_every_scalar_field_of_the_schema():
    covered = {_shape(p) for _, p, _ in LEAVES}
    missing = sorted(schema_leaves() - covered)
    assert missing == [], f"add these fields to a base config of this test: {missing}"


def _plan(doc: dict, tmp: Path):
    job = load_text(yaml.safe_dump(doc, allow_unicode=True), "hostile.yaml", tmp)
    return build_plan(job, LaunchContext.of(str(tmp), str(tmp / "fake-python"), "20261123-000000-abcdef", CTX_ENV))


def _pdsh_substitute(line: str, host: str) -> str:
    return re.sub(r"%(.)", lambda m: {"%": "%", "h": host}.get(m.group(1), m.group(0)), line)


def _run_pdsh_line(plan, tmp: Path) -> None:
    """The remote line as a node runs it (pdsh's %-substitution, then sh), up to a stand-in launcher,
    with the run directory's files (the environment, the rank table) in place."""
    run = Path(plan.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    for name, text in plan.private:
        (run / name).write_text(text.real)
    line = _pdsh_substitute(plan.main.real_argv()[-1], "node1")
    line = line.replace("cd /w &&", f"cd {tmp} &&", 1).replace("cd /code &&", f"cd {tmp} &&", 1)
    subprocess.run(["sh", "-c", line], cwd=tmp, capture_output=True, timeout=20,
                   env={"PATH": f"{tmp}/bin:/usr/bin:/bin", "HOSTILE_OUT": str(tmp)})


@pytest.mark.parametrize("name", sorted(BASES))
def test_hostile_values_are_refused_or_carried_through_quoted(name, tmp_path):
    marker = tmp_path / "pwned"
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    (tmp_path / "bin").mkdir()
    # container engine and Slurm stand-ins: drop their options, run the rest (the image name is a word too)
    drop = 'while [ "${1#-}" != "$1" ]; do shift; done\n'
    for tool, body in (("podman", drop + 'shift\nexec "$@"\n'), ("srun", drop + 'exec "$@"\n')):
        (tmp_path / "bin" / tool).write_text("#!/bin/sh\n" + body)
        (tmp_path / "bin" / tool).chmod(0o755)
    base = BASES[name]
    (tmp_path / "hosts.txt").write_text("node0 slots=1\nnode1 slots=1\n")
    counts = {"refused": 0, "carried": 0}
    for path, value in _leaves(base):
        if name in FOCUS and (path[0] not in FOCUS[name] or (path[0] == "training" and path[1] != "script_args")):
            continue
        shape = _shape(path)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        for payload in (NUMBERS if number else payloads(marker)):
            doc = _set(base, path, payload)
            try:
                plan = _plan(doc, tmp_path)
            except ConfigError as e:
                assert e.problems and all(p.message for p in e.problems)
                counts["refused"] += 1
                continue
            counts["carried"] += 1
            text = plan.render()
            assert "wk-secret" not in text
            for _, content in plan.files:
                yaml.safe_load_all(content) if plan.runner == "kubernetes" else None
            if shape in RAW_SHELL:
                continue
            if plan.runner in ("pdsh", "pdsh_docker"):
                _run_pdsh_line(plan, tmp_path)
            elif plan.runner == "slurm":
                script = dict(plan.files)["job.sbatch"]
                assert subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0
                srun = next(l for l in script.splitlines() if l.startswith("srun ")).removesuffix(" &")
                srun = srun.replace("cd /w &&", f"cd {tmp_path} &&").replace("/opt/py", str(fake))
                subprocess.run(["bash", "-c", srun], cwd=tmp_path, capture_output=True, timeout=20,
                               env={"PATH": f"{tmp_path}/bin:/usr/bin:/bin", "HOSTILE_OUT": str(tmp_path),
                                    "SLURM_NODEID": "0", "MASTER_ADDR": "n0"})
            assert not marker.exists(), f"{shape} = {payload!r} was executed"
    assert counts["refused"] > 0 and counts["carried"] > 0, counts


def test_an_accepted_value_arrives_as_written(tmp_path):
    """The script's arguments and the ranks' variables reach the stand-in launcher unchanged."""
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    odd = "$(id) `id` ; '\" %h %% $$ ${local_rank} ü {\"j\": 1}"
    doc = _set(_set(PDSH, ("training", "script_args"), ["--note", odd]), ("env", "vars", "A_VAR"), odd)
    plan = _plan(doc, tmp_path)
    _run_pdsh_line(plan, tmp_path)
    argv = (tmp_path / "argv").read_text().splitlines()
    # the stand-in is torchrun's interpreter: torchrun would turn $$ back into $ for the script
    from torch.distributed.elastic.utils.api import macros

    assert macros.substitute(argv[argv.index("train.py"):], "0") == ["train.py", "--note", odd]
    assert f"A_VAR={odd}" in (tmp_path / "env").read_text()


def test_kubernetes_values_survive_their_escaping():
    assert k8s_literal("$(HOME)") == "$$(HOME)"
    assert json.loads(json.dumps(k8s_literal("a$b"))) == "a$$b"


def test_the_issues_yaml_cases_are_errors_not_tracebacks(tmp_path):
    cases = {
        "alias bomb": "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
            f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")),
        "cyclic alias": "name: &n [*n]\n",
        "deep nesting": "training: {model: {config: " + "{a: " * 300 + "1" + "}" * 300 + "}}\n",
        "huge integer": f"name: x\nbatch: {{micro_batch_size: {'9' * 4301}}}\n",
        "stage true": "name: x\nbatch: {micro_batch_size: 1}\ndistributed: {deepspeed: {stage: true}}\n",
        "infinite rate": "name: x\nbatch: {micro_batch_size: 1}\ntraining: {learning_rate: .inf}\n",
        "NaN clipping": "name: x\nbatch: {micro_batch_size: 1}\ngradient_clipping: .nan\n",
        "slots 1e20": "name: x\nbatch: {micro_batch_size: 1}\ncluster: {hosts: [{host: a, slots: 100000000000000000000}]}\n",
        "case duplicate": "name: x\nbatch: {micro_batch_size: 1}\nrunner: {type: pdsh}\n"
                          "cluster: {hosts: [{host: node0, slots: 1}, {host: NODE0, slots: 1}]}\n",
        "master_addr": "name: x\nbatch: {micro_batch_size: 1}\ncluster: {master_addr: '::::::'}\n",
        "namespace": "name: x\nbatch: {micro_batch_size: 1}\ncluster: {num_nodes: 1}\n"
                     "runner: {type: kubernetes, launcher: torchrun, kubernetes: {image: i, namespace: Bad_NS}}\n",
    }
    for what, text in cases.items():
        with pytest.raises(ConfigError):
            load_text(textwrap.dedent(text), f"{what}.yaml", tmp_path)


def test_host_file_digits_and_contents(tmp_path):
    (tmp_path / "arabic").write_text("node0 slots=\u0663\n")
    (tmp_path / "secrets").write_text("HF_TOKEN=hf_abcdefghijklmnop\n")
    for name, expect in (("arabic", "ASCII digits"), ("secrets", "got 'HF_TOKEN'")):
        with pytest.raises(ConfigError) as e:
            load_text(f"name: x\nbatch: {{micro_batch_size: 1}}\nrunner: {{type: pdsh}}\ncluster: {{hostfile: {name}}}\n",
                      "h.yaml", tmp_path)
        assert expect in e.value.render() and "abcdefghijklmnop" not in e.value.render()


def test_cli_files_that_are_not_files(tmp_path):
    import os

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for target in (str(fifo), "/dev/zero"):
        r = subprocess.run([sys.executable, "-m", "hfscale", "check", target], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 2 and "is not a regular file" in r.stderr and "Traceback" not in r.stderr
