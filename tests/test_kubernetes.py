"""Runner type kubernetes: whole manifest lists, exact; read back by the Kubeflow training SDK's models."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from hfscale.launch.build import resolved_config_yaml
from hfscale.launch.context import LaunchContext
from hfscale.launch.node.command import rank_env
from hfscale.render.artifacts import render_artifacts
from hfscale.launch.runners.kubernetes_manifest import (
    CONFIG_DIR,
    job_name,
    k8s_literal,
    kubernetes_manifests,
    launcher_command,
    render_manifests,
)

from conftest import job_of

JOB_ID = "20261122-120000-abcdef"
CTX = LaunchContext.of("/work", "/py", JOB_ID, {
    "WANDB_API_KEY": "wk-secret", "WANDB_PROJECT": "proj", "HOME": "/root", "HF_TOKEN": "hf_secret"})
FILES = {"accelerate_config.yaml": "a: 1\n", "config.yaml": "name: demo\n"}
LABELS = {"hfscale.job": JOB_ID}
ODD = "a b  $(HOME) $USER 'single' \"double\" $$ end$"


def manifests(job, mask: bool = False, files=FILES) -> list[dict]:
    return kubernetes_manifests(job, CTX, files, rank_env(job, CONFIG_DIR, CTX), shown=mask)


def configmap(namespace: str = "default") -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"hfscale-{JOB_ID}", "namespace": namespace, "labels": LABELS},
            "data": FILES}


def hfscale_env(*extra: tuple[str, str]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in (
        ("HFSCALE_JOB_ID", JOB_ID), ("HFSCALE_RUN_DIR", "/etc/hfscale"), ("HFSCALE_CONFIG", "/etc/hfscale/config.yaml"),
        ("PYTHONUNBUFFERED", "1"), ("HFSCALE_DS_CONFIG", "/etc/hfscale/ds_config.json"), *extra)]


BASE_VOLUMES = [
    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
    {"name": "hfscale-config", "configMap": {"name": f"hfscale-{JOB_ID}"}},
]
BASE_MOUNTS = [
    {"name": "dshm", "mountPath": "/dev/shm"},
    {"name": "hfscale-config", "mountPath": "/etc/hfscale", "readOnly": True},
]

# (a) 2 nodes x 8 GPUs, InfiniBand, a hostPath and a PVC mount, awkward values, a forwarded secret
TWO_NODES = """
    name: llama_SFT
    cluster: {num_nodes: 2, nproc_per_node: 8, master_port: 29400}
    runner:
      type: kubernetes
      launcher: torchrun
      max_restarts: 2
      workdir: /code
      kubernetes:
        image: registry.example.com/team/train:2026.11
        namespace: ml
        service_account: trainer
        shm_size: 128Gi
        mounts:
          - {container: /data, host_path: /mnt/datasets, readonly: true}
          - {container: /ckpt, claim: ckpt-pvc}
    network: {preset: infiniband}
    env:
      vars:
        ODD: "a b  $(HOME) $USER 'single' \\"double\\" $$ end$"
      forward: [WANDB_*]
      public: [WANDB_PROJECT]
    batch: {micro_batch_size: 1}
    training: {pass_args: none, script: train.py, script_args: [--note, "$(HOME) x; rm -rf /", --lr, "1e-3", "y"]}
"""

SECRET_REF = {"secretKeyRef": {"name": f"hfscale-{JOB_ID}-env", "key": "WANDB_API_KEY"}}

POD_A = {
    "metadata": {"labels": LABELS},
    "spec": {
        "serviceAccountName": "trainer",
        "containers": [{
            "name": "pytorch",
            "image": "registry.example.com/team/train:2026.11",
            "imagePullPolicy": "IfNotPresent",
            "command": [
                "python", "-m", "hfscale.training.warm_launcher", "--preload", "accelerate,deepspeed",
                "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "8",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "$(MASTER_ADDR):$(MASTER_PORT)", "--rdzv-id", JOB_ID,
                "--max-restarts", "2", "-m", "hfscale.training.run_script", "--plain",
                "train.py", "--note", "$$$$(HOME) x; rm -rf /", "--lr", "1e-3", "y",
            ],
            "workingDir": "/code",
            "env": [
                {"name": "NCCL_IB_DISABLE", "value": "0"},
                {"name": "NCCL_IB_HCA", "value": "mlx5"},
                {"name": "NCCL_SOCKET_IFNAME", "value": "^lo,docker0"},
                {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"},
                {"name": "WANDB_API_KEY", "valueFrom": SECRET_REF},
                {"name": "WANDB_PROJECT", "value": "proj"},
                {"name": "ODD", "value": "a b  $$(HOME) $$USER 'single' \"double\" $$$$ end$$"},
                *hfscale_env(("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")),
            ],
            "ports": [{"name": "pytorchjob-port", "containerPort": 29400, "protocol": "TCP"}],
            "resources": {"limits": {"nvidia.com/gpu": "8", "rdma/hca": "1"}},
            "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
            "volumeMounts": BASE_MOUNTS + [
                {"name": "mount-0", "mountPath": "/data", "readOnly": True},
                {"name": "mount-1", "mountPath": "/ckpt", "readOnly": False},
            ],
        }],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "128Gi"}},
            BASE_VOLUMES[1],
            {"name": "mount-0", "hostPath": {"path": "/mnt/datasets"}},
            {"name": "mount-1", "persistentVolumeClaim": {"claimName": "ckpt-pvc", "readOnly": False}},
        ],
    },
}


def test_two_nodes_infiniband_mounts_secret_exact():
    assert manifests(job_of(TWO_NODES)) == [
        configmap("ml"),
        {"apiVersion": "v1", "kind": "Secret",
         "metadata": {"name": f"hfscale-{JOB_ID}-env", "namespace": "ml", "labels": LABELS},
         "type": "Opaque",
         "stringData": {"WANDB_API_KEY": "wk-secret"}},
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
         "metadata": {"name": f"llama-sft-{JOB_ID}", "namespace": "ml", "labels": LABELS},
         "spec": {
             "runPolicy": {"cleanPodPolicy": "Running"},
             "pytorchReplicaSpecs": {
                 "Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": POD_A},
                 "Worker": {"replicas": 1, "restartPolicy": "OnFailure", "template": POD_A},
             }}},
    ]


# (b) elastic 1..4 nodes on the built-in entry point
ELASTIC = """
    name: elastic
    cluster: {num_nodes: 2, nproc_per_node: 4}
    runner:
      type: kubernetes
      launcher: torchrun
      kubernetes:
        image: "train:1"
        elastic: {min_nodes: 1, max_nodes: 4, max_restarts: 5}
    batch: {micro_batch_size: 2}
"""


def test_elastic_builtin_entry_exact():
    pod = {
        "metadata": {"labels": LABELS},
        "spec": {
            "containers": [{
                "name": "pytorch",
                "image": "train:1",
                "imagePullPolicy": "IfNotPresent",
                "command": [
                    "python", "-m", "hfscale.training.warm_launcher", "--preload", "trainer,deepspeed,builtin",
                    "torch.distributed.run", "--nnodes", "1:4", "--nproc_per_node", "4",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "$(PET_RDZV_ENDPOINT)", "--rdzv-id", JOB_ID,
                    "--max-restarts", "5",
                    "-m", "hfscale.training.train", "--config", "/etc/hfscale/config.yaml",
                ],
                "env": hfscale_env(("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")),
                "ports": [{"name": "pytorchjob-port", "containerPort": 29500, "protocol": "TCP"}],
                "resources": {"limits": {"nvidia.com/gpu": "4"}},
                "volumeMounts": BASE_MOUNTS,
            }],
            "volumes": BASE_VOLUMES,
        },
    }
    assert manifests(job_of(ELASTIC)) == [
        configmap(),
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
         "metadata": {"name": f"elastic-{JOB_ID}", "namespace": "default", "labels": LABELS},
         "spec": {
             "runPolicy": {"cleanPodPolicy": "Running"},
             "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 4, "maxRestarts": 5},
             # elastic: Worker replicas only (the operator scales them; rendezvous at <job>-worker-0)
             "pytorchReplicaSpecs": {"Worker": {"replicas": 2, "restartPolicy": "OnFailure", "template": pod}},
         }},
    ]


# (c) one node, accelerate launcher, a secret written in the YAML
ONE_NODE = """
    name: single
    cluster: {nproc_per_node: 2}
    runner: {type: kubernetes, kubernetes: {image: "train:1", image_pull_policy: Always}}
    env: {vars: {HF_TOKEN: hf_yaml_secret}}
    batch: {micro_batch_size: 1}
    training: {script: train.py, pass_args: none}
"""

ONE_NODE_YAML = f"""\
apiVersion: v1
kind: ConfigMap
metadata:
  name: hfscale-{JOB_ID}
  namespace: default
  labels:
    hfscale.job: "{JOB_ID}"
data:
  accelerate_config.yaml: |
    a: 1
  config.yaml: |
    name: demo
---
apiVersion: v1
kind: Secret
metadata:
  name: hfscale-{JOB_ID}-env
  namespace: default
  labels:
    hfscale.job: "{JOB_ID}"
type: Opaque
stringData:
  HF_TOKEN: "***"
---
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: single-{JOB_ID}
  namespace: default
  labels:
    hfscale.job: "{JOB_ID}"
spec:
  runPolicy:
    cleanPodPolicy: Running
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: OnFailure
      template:
        metadata:
          labels:
            hfscale.job: "{JOB_ID}"
        spec:
          containers:
          - name: pytorch
            image: "train:1"
            imagePullPolicy: Always
            command:
            - python
            - -m
            - hfscale.training.warm_launcher
            - --preload
            - "accelerate,deepspeed"
            - accelerate.commands.launch
            - --config_file
            - /etc/hfscale/accelerate_config.yaml
            - --module
            - hfscale.training.run_script
            - --plain
            - train.py
            env:
            - name: HF_TOKEN
              valueFrom:
                secretKeyRef:
                  name: hfscale-{JOB_ID}-env
                  key: HF_TOKEN
            - name: HFSCALE_JOB_ID
              value: "{JOB_ID}"
            - name: HFSCALE_RUN_DIR
              value: /etc/hfscale
            - name: HFSCALE_CONFIG
              value: /etc/hfscale/config.yaml
            - name: PYTHONUNBUFFERED
              value: "1"
            - name: HFSCALE_DS_CONFIG
              value: /etc/hfscale/ds_config.json
            ports:
            - name: pytorchjob-port
              containerPort: 29500
              protocol: TCP
            resources:
              limits:
                nvidia.com/gpu: "2"
            volumeMounts:
            - name: dshm
              mountPath: /dev/shm
            - name: hfscale-config
              mountPath: /etc/hfscale
              readOnly: true
          volumes:
          - name: dshm
            emptyDir:
              medium: Memory
              sizeLimit: "64Gi"
          - name: hfscale-config
            configMap:
              name: hfscale-{JOB_ID}
"""


def test_one_node_has_no_worker_and_renders_exact_yaml():
    job = job_of(ONE_NODE)
    shown = manifests(job, mask=True)
    assert list(shown[-1]["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert render_manifests(shown) == ONE_NODE_YAML


def test_accelerate_on_several_nodes_takes_rank_and_master_from_the_operator():
    job = job_of(ONE_NODE.replace("cluster: {nproc_per_node: 2}", "cluster: {num_nodes: 3, nproc_per_node: 2}"))
    assert launcher_command(job, CTX) == [
        "python", "-m", "hfscale.training.warm_launcher", "--preload", "accelerate,deepspeed",
        "accelerate.commands.launch", "--config_file", "/etc/hfscale/accelerate_config.yaml", "--machine_rank", "$(RANK)", "--main_process_ip", "$(MASTER_ADDR)", "--main_process_port", "$(MASTER_PORT)",
        "--module", "hfscale.training.run_script", "--plain", "train.py",
    ]
    specs = manifests(job)[-1]["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 2)


# --- the Kubeflow training SDK reads every generated object back unchanged -------------------

class _Response:
    """What ApiClient.deserialize reads: a response whose ``data`` is the JSON body."""

    def __init__(self, obj: dict):
        self.data = json.dumps(obj)


ALL = {"two_nodes": TWO_NODES, "elastic": ELASTIC, "one_node": ONE_NODE}


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("which", sorted(ALL))
def test_sdk_models_read_every_manifest_back(which, mask):
    training = pytest.importorskip("kubeflow.training", reason="pip install kubeflow-training")
    kclient = pytest.importorskip("kubernetes.client")
    job = job_of(ALL[which])
    objs = manifests(job, mask)
    sdk, core = training.ApiClient(), kclient.ApiClient()
    for obj in objs:
        if obj["kind"] == "PyTorchJob":
            model = sdk.deserialize(_Response(obj), "KubeflowOrgV1PyTorchJob")
            assert isinstance(model, training.KubeflowOrgV1PyTorchJob)
            # nothing dropped as an unknown key, nothing renamed, no value retyped
            assert sdk.sanitize_for_serialization(model) == obj
            specs = model.spec.pytorch_replica_specs
            for spec in specs.values():
                pod = spec.template.spec
                (c,) = pod.containers
                assert (c.name, c.image, c.command) == ("pytorch", job.config.runner.kubernetes.image,
                                                        launcher_command(job, CTX))
                assert c.resources.limits["nvidia.com/gpu"] == str(job.procs_per_node)
                assert [v.name for v in pod.volumes][:2] == ["dshm", "hfscale-config"]
                assert pod.volumes[0].empty_dir.medium == "Memory"
                assert pod.volumes[1].config_map.name == f"hfscale-{JOB_ID}"
            if which == "elastic":
                e = model.spec.elastic_policy
                assert (e.min_replicas, e.max_replicas, e.max_restarts, e.rdzv_backend) == (1, 4, 5, "c10d")
                assert {k: s.replicas for k, s in specs.items()} == {"Worker": 2}
            else:
                assert model.spec.elastic_policy is None
                assert specs["Master"].replicas == 1
                assert specs["Master"].template == specs.get("Worker", specs["Master"]).template
            if which == "two_nodes":
                pod = specs["Worker"].template.spec
                assert specs["Worker"].replicas == 1
                assert pod.containers[0].resources.limits["rdma/hca"] == "1"
                assert pod.containers[0].security_context.capabilities.add == ["IPC_LOCK"]
                assert pod.volumes[2].host_path.path == "/mnt/datasets"
                assert pod.volumes[3].persistent_volume_claim.claim_name == "ckpt-pvc"
                assert pod.service_account_name == "trainer"
        else:
            model = core.deserialize(_Response(obj), "V1" + obj["kind"])
            assert isinstance(model, getattr(kclient, "V1" + obj["kind"]))
            assert core.sanitize_for_serialization(model) == obj


# --- secrets ---------------------------------------------------------------------------------

def _by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


def test_masked_rendering_shows_stars_and_never_the_secret():
    text = render_manifests(manifests(job_of(TWO_NODES), mask=True))
    assert "wk-secret" not in text and "hf_secret" not in text
    assert 'WANDB_API_KEY: "***"' in text


def test_real_rendering_keeps_the_secret_in_the_secret_object_only():
    objs = _by_kind(manifests(job_of(TWO_NODES)))
    assert objs["Secret"]["stringData"] == {"WANDB_API_KEY": "wk-secret"}
    assert "wk-secret" not in json.dumps(objs["PyTorchJob"]) and "wk-secret" not in json.dumps(objs["ConfigMap"])
    # a secret written in the YAML goes the same way
    objs = _by_kind(manifests(job_of(ONE_NODE)))
    assert objs["Secret"]["stringData"] == {"HF_TOKEN": "hf_yaml_secret"}
    assert "hf_yaml_secret" not in json.dumps(objs["PyTorchJob"])
    # and without a secret there is no Secret object
    assert [o["kind"] for o in manifests(job_of(ELASTIC))] == ["ConfigMap", "PyTorchJob"]


# --- $(VAR) expansion by Kubernetes -----------------------------------------------------------

def k8s_expand(text: str, env: dict[str, str]) -> str:
    """kubernetes third_party/forked/golang/expansion Expand: ``$$`` -> ``$``, ``$(NAME)`` -> its value
    (kept as written when undefined), any other ``$`` as is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2:end]
                    out.append(env.get(name, f"$({name})"))
                    i = end + 1
                    continue
                out.append("$(")
                i += 2
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def test_kubernetes_expands_only_hfscales_own_references():
    job = job_of(TWO_NODES)
    (container,) = manifests(job)[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    pod_env = {"HOME": "/root", "USER": "u", "MASTER_ADDR": f"llama-sft-{JOB_ID}-master-0", "MASTER_PORT": "29400"}
    pod_env.update({e["name"]: k8s_expand(e["value"], pod_env) for e in container["env"] if "value" in e})
    assert pod_env["ODD"] == ODD
    expanded = [k8s_expand(w, pod_env) for w in container["command"]]
    entry = expanded.index("train.py")
    assert expanded[:entry] == [
        "python", "-m", "hfscale.training.warm_launcher", "--preload", "accelerate,deepspeed",
        "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "8",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"llama-sft-{JOB_ID}-master-0:29400", "--rdzv-id", JOB_ID,
        "--max-restarts", "2", "-m", "hfscale.training.run_script", "--plain"]
    # torchrun's own expansion of the worker's arguments ($$, ${local_rank}) is the last step
    from torch.distributed.elastic.utils.api import macros

    assert macros.substitute(expanded[entry:], "0") == ["train.py", "--note", "$(HOME) x; rm -rf /", "--lr", "1e-3",
                                                        "y"]
    # no shell anywhere: the command is the launcher's own argv
    assert container["command"][0] == "python" and "-c" not in container["command"]


@given(st.text(alphabet=st.sampled_from("$()ab{}`'\" \\"), max_size=20))
def test_k8s_literal_survives_expansion(text):
    assert k8s_expand(k8s_literal(text), {"a": "X", "b": "Y", "": "Z"}) == text


# --- files, names, YAML ------------------------------------------------------------------------

def test_pods_read_the_real_generated_files_from_the_configmap():
    job = job_of(ELASTIC)
    files = dict(render_artifacts(job, f"{CONFIG_DIR}/ds_config.json"))
    files["config.yaml"] = resolved_config_yaml(job)
    objs = _by_kind(manifests(job, files=files))
    data = objs["ConfigMap"]["data"]
    assert "deepspeed_config_file: /etc/hfscale/ds_config.json" in data["accelerate_config.yaml"]
    assert json.loads(data["ds_config.json"])["train_micro_batch_size_per_gpu"] == 2
    assert yaml.safe_load(data["config.yaml"])["runner"]["type"] == "kubernetes"
    (container,) = objs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    paths = [w for w in container["command"] if w.startswith(CONFIG_DIR)]
    paths += [e["value"] for e in container["env"] if e.get("value", "").startswith(CONFIG_DIR + "/")]
    assert paths and {p.rsplit("/", 1)[1] for p in paths} <= set(data)
    # the YAML text reads back as the same objects
    assert list(yaml.safe_load_all(render_manifests(list(objs.values())))) == list(objs.values())


@pytest.mark.parametrize("name, expected", [
    ("demo", f"demo-{JOB_ID}"),
    ("Llama_3.1-SFT", f"llama-3-1-sft-{JOB_ID}"),
    ("7b--run_", f"hfscale-7b-run-{JOB_ID}"),
    ("x" * 64, f"{'x' * 27}-{JOB_ID}"),
])
def test_job_names_are_dns_labels_with_room_for_the_operators_services(name, expected):
    got = job_name(name, JOB_ID)
    assert got == expected
    assert re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", got) and len(got + "-worker-99999") <= 63


def test_values_yaml_readers_could_retype_are_quoted():
    job = job_of(TWO_NODES.replace('"y"]', '"y", "0o17", "-inf", "null", "True", "12:30", "~"]'))
    text = render_manifests(manifests(job))
    for word in ("y", "0o17", "-inf", "null", "True", "12:30", "~", "1e-3", "2", "^lo,docker0"):
        assert f'- "{word}"\n' in text or f'value: "{word}"\n' in text, word
    (job_doc,) = [d for d in yaml.safe_load_all(text) if d["kind"] == "PyTorchJob"]
    command = job_doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert all(isinstance(w, str) for w in command)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.replace("runner: {type: kubernetes,", "runner: {type: kubernetes, setup: 'source /venv/bin/activate',"),
     "runner.setup"),
    (lambda t: t.replace("image_pull_policy: Always}", "image_pull_policy: Always, elastic: {min_nodes: 1, max_nodes: 2}}"),
     "launcher: torchrun"),
])
def test_settings_a_pod_cannot_honour_are_refused(change, message):
    from hfscale.config.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):  # refused when the config is loaded
        job_of(change(ONE_NODE))
