"""Runner type kubernetes: a Kubeflow PyTorchJob (kubeflow.org/v1) and the objects it reads.

Pure: the manifests are plain dicts built from the job, the launch context, the generated files
and the ranks' environment; nothing is read, written or sent here and neither the Kubernetes nor
the Kubeflow client is imported. ``render_manifests`` turns them into the multi-document YAML that
``--dry-run`` prints and ``kubectl apply -f`` reads.

What ``kubernetes_manifests`` returns, in the order ``kubectl apply`` must create them:

1. a ``ConfigMap`` ``hfscale-<job id>`` holding the generated files (accelerate YAML, DeepSpeed
   JSON, resolved config), mounted read-only at ``CONFIG_DIR`` in every pod, so the pods need no
   shared file system for them. The caller renders the files with paths under ``CONFIG_DIR``
   (the accelerate YAML names ``/etc/hfscale/ds_config.json``) and the environment with
   ``rank_env(job, CONFIG_DIR, ctx)``.
2. a ``Secret`` ``hfscale-<job id>-env`` (only when the environment holds a ``Secret`` value):
   the value sits in the Secret's ``stringData`` (``***`` unless ``shown=False``, for
   ``kubectl apply``) and the pods read it through ``valueFrom.secretKeyRef``, so the
   PyTorchJob never holds it.
3. the ``PyTorchJob``: ``Master`` (1 replica) and ``Worker`` (nodes - 1, left out on one node);
   with ``runner.kubernetes.elastic`` only ``Worker`` replicas (the operator scales those between
   minReplicas and maxReplicas and rendezvous at ``<job>-worker-0``).

No value ever reaches a shell: the container command is an argv list (no ``sh -c``) and the file
goes to ``kubectl apply -f``. Kubernetes itself expands ``$(NAME)`` in ``command`` and in ``env``
values, so every ``$`` of a config value is written as ``$$`` (``k8s_literal``); only hfscale's
own ``Var`` words (``$(MASTER_ADDR)``, ``$(MASTER_PORT)``, ``$(RANK)``, ``$(PET_RDZV_ENDPOINT)``,
which the training operator sets in every pod) are left to expand. The settings a pod cannot
honour (``runner.setup``, elastic with accelerate) are refused when the config is loaded
(hfscale.rules.resolved); the launcher's argv comes from hfscale.launch.node.command, as for every runner.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import yaml

from hfscale.config.envvars import RDMA_PRESETS
from hfscale.config.yaml_source import Dumper
from hfscale.core.shell import Cat, Secret, Var, Word, value
from hfscale.launch.context import LaunchContext
from hfscale.launch.node.command import Rendezvous, launcher_argv
from hfscale.rules.resolved import Job

CONFIG_DIR = "/etc/hfscale"
API_VERSION = "kubeflow.org/v1"
CONTAINER = "pytorch"  # the operator finds its container (and the port below) by these names
PORT_NAME = "pytorchjob-port"
LABEL = "hfscale.job"
# the operator names a Service <job>-worker-<i> for every replica; DNS labels stop at 63
NAME_MAX = 63 - len("-worker-99999")
_LABEL_VALUE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DATA_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def k8s_literal(text: str) -> str:
    """``text`` as a literal in a container command or env value: Kubernetes reads ``$$`` as ``$``,
    so ``$(HOME)`` in a config value stays ``$(HOME)`` instead of being expanded."""
    return text.replace("$", "$$")


def k8s_word(word: Word) -> str:
    """A word of the container command: literal text escaped, hfscale's variables as ``$(NAME)``."""
    if isinstance(word, Cat):
        return "".join(k8s_word(p) for p in word.parts)
    if isinstance(word, Var):
        return f"$({word.name})"
    return k8s_literal(value(word, shown=True))


def job_name(config_name: str, job_id: str) -> str:
    """``<config name>-<job id>`` as a DNS-1035 label (the PyTorchJob webhook's rule): lower case,
    letters, digits and '-', starting with a letter; the config name is shortened so that the
    whole job id survives and the operator's ``<name>-worker-<i>`` Service names fit 63 characters."""
    base = re.sub(r"[^a-z0-9]+", "-", config_name.lower()).strip("-")
    if not base[:1].isalpha():
        base = ("hfscale-" + base).rstrip("-")
    room = NAME_MAX - len(job_id) - 1
    if room < 1:
        return ("j" + job_id)[:NAME_MAX].rstrip("-")
    return f"{base[:room].rstrip('-')}-{job_id}"


def configmap_name(job_id: str) -> str:
    return f"hfscale-{job_id}"


def secret_name(job_id: str) -> str:
    return f"hfscale-{job_id}-env"


def launcher_command(job: Job, ctx: LaunchContext) -> list[str]:
    """The container command: one argv list, run without a shell, every config word escaped for
    Kubernetes' ``$(VAR)`` expansion.

    launcher torchrun: c10d rendezvous on the Master's ``$(MASTER_ADDR):$(MASTER_PORT)`` (the
    operator's variables), ``--nnodes MIN:MAX`` and the operator's ``$(PET_RDZV_ENDPOINT)`` when
    elastic. launcher accelerate: ``accelerate launch`` with the generated config (the only way
    its FSDP/DeepSpeed settings reach an ``Accelerator``), node rank ``$(RANK)`` from the operator
    and accelerate's static rendezvous at ``$(MASTER_ADDR):$(MASTER_PORT)``.
    """
    k = job.config.runner.kubernetes
    assert k is not None
    elastic = k.elastic
    rdzv = Rendezvous(rank=Var("RANK"), master=Var("MASTER_ADDR"), port=Var("MASTER_PORT"), c10d=True,
                      endpoint=Var("PET_RDZV_ENDPOINT") if elastic is not None else None,
                      nnodes=f"{elastic.min_nodes}:{elastic.max_nodes}" if elastic is not None else None)
    argv = launcher_argv(job, job.config.runner.python or "python", CONFIG_DIR, ctx, rdzv)
    return [k8s_word(w) for w in argv]


def _env(env: Mapping[str, str | Secret], secret: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name, v in env.items():
        if isinstance(v, Secret):
            out.append({"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name}}})
        else:
            out.append({"name": name, "value": k8s_literal(v)})
    return out


def _volumes(job: Job, job_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container volumeMounts): /dev/shm in memory, the config files, the mounts."""
    k = job.config.runner.kubernetes
    assert k is not None
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}},
        {"name": "hfscale-config", "configMap": {"name": configmap_name(job_id)}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "hfscale-config", "mountPath": CONFIG_DIR, "readOnly": True},
    ]
    for i, m in enumerate(k.mounts):
        name = f"mount-{i}"
        if m.claim is not None:
            source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": m.claim, "readOnly": m.readonly}}
        else:
            source = {"hostPath": {"path": m.host_path}}
        volumes.append({"name": name, **source})
        mounts.append({"name": name, "mountPath": m.container, "readOnly": m.readonly})
    return volumes, mounts


def _pod_template(job: Job, ctx: LaunchContext, env: Mapping[str, str | Secret]) -> dict[str, Any]:
    cfg = job.config
    k = cfg.runner.kubernetes
    assert k is not None
    rdma = cfg.network.preset in RDMA_PRESETS
    limits = {k.gpu_resource: str(job.procs_per_node)}  # on Kubernetes every process is a GPU
    if rdma:
        limits[k.rdma_resource] = "1"
    volumes, mounts = _volumes(job, ctx.job_id)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": k.image,
        "imagePullPolicy": k.image_pull_policy,
        "command": launcher_command(job, ctx),
    }
    if cfg.runner.workdir:
        container["workingDir"] = cfg.runner.workdir
    container.update(
        env=_env(env, secret_name(ctx.job_id)),
        ports=[{"name": PORT_NAME, "containerPort": cfg.cluster.master_port, "protocol": "TCP"}],
        resources={"limits": limits},
    )
    if rdma:  # registering RDMA memory needs locked pages
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    container["volumeMounts"] = mounts
    spec: dict[str, Any] = {}
    if k.service_account:
        spec["serviceAccountName"] = k.service_account
    spec.update(containers=[container], volumes=volumes)
    return {"metadata": {"labels": {LABEL: ctx.job_id}}, "spec": spec}


def _metadata(name: str, namespace: str, job_id: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": {LABEL: job_id}}


def kubernetes_manifests(job: Job, ctx: LaunchContext, files: Mapping[str, str], env: Mapping[str, str | Secret],
                         shown: bool = True) -> list[dict]:
    """ConfigMap, Secret (when ``env`` holds a ``Secret``) and PyTorchJob for ``job``.

    ``files``: generated file name -> text, rendered for ``CONFIG_DIR``; ``env``: the ranks'
    environment (``rank_env(job, CONFIG_DIR, ctx)``); ``shown``: secret values as ``***`` (for
    display and the record on disk), else real (for ``kubectl apply``).
    Raises ValueError for a job id or file name Kubernetes does not accept.
    """
    cfg = job.config
    k = cfg.runner.kubernetes
    if cfg.runner.type != "kubernetes" or k is None:
        raise ValueError(f"runner.type is {cfg.runner.type!r}, not 'kubernetes' with a kubernetes section")
    if not _LABEL_VALUE.match(ctx.job_id):
        raise ValueError(f"job id {ctx.job_id!r} is not a Kubernetes label value (63 characters, ends alphanumeric)")
    for name in files:
        if not _DATA_KEY.match(name):
            raise ValueError(f"{name!r} cannot be a ConfigMap key (letters, digits, '-', '_', '.')")

    out: list[dict[str, Any]] = [{
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(configmap_name(ctx.job_id), k.namespace, ctx.job_id),
        "data": dict(files),
    }]
    secrets = {n: value(v, shown) for n, v in env.items() if isinstance(v, Secret)}
    if secrets:
        out.append({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _metadata(secret_name(ctx.job_id), k.namespace, ctx.job_id),
            "type": "Opaque",
            "stringData": secrets,  # read through secretKeyRef: never expanded, so not escaped
        })

    template = _pod_template(job, ctx, env)

    def replica(n: int) -> dict[str, Any]:
        return {"replicas": n, "restartPolicy": "OnFailure", "template": copy.deepcopy(template)}

    # Running: when the job ends, pods still running (say, waiting in a rendezvous) are deleted and
    # give their GPUs back; finished pods stay for `kubectl logs`
    spec: dict[str, Any] = {"runPolicy": {"cleanPodPolicy": "Running"}}
    if k.elastic is not None:
        spec["elasticPolicy"] = {
            "rdzvBackend": "c10d",
            "minReplicas": k.elastic.min_nodes,
            "maxReplicas": k.elastic.max_nodes,
            "maxRestarts": k.elastic.max_restarts,
        }
        spec["pytorchReplicaSpecs"] = {"Worker": replica(job.num_nodes)}
    else:
        specs = {"Master": replica(1)}
        if job.num_nodes > 1:
            specs["Worker"] = replica(job.num_nodes - 1)
        spec["pytorchReplicaSpecs"] = specs
    out.append({
        "apiVersion": API_VERSION,
        "kind": "PyTorchJob",
        "metadata": _metadata(job_name(cfg.name, ctx.job_id), k.namespace, ctx.job_id),
        "spec": spec,
    })
    return out


class _ManifestDumper(Dumper):
    """Strings that YAML 1.1 or 1.2 readers (kubectl's included) could take for anything else
    are double-quoted; multi-line texts are literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_PLAIN = re.compile(r"^(?:[A-Za-z/]|--?[A-Za-z])[A-Za-z0-9_./-]*$")
_WORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null", "inf", "infinity", "nan"})


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    if "\n" in text:
        style: str | None = "|"
    elif _PLAIN.match(text) and text.lstrip("-").lower() not in _WORDS:
        style = None
    else:
        style = '"'
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_ManifestDumper.add_representer(str, _str)


def render_manifests(manifests: list[dict]) -> str:
    """Multi-document YAML (``---`` between objects) in the manifests' own key order."""
    docs = [yaml.dump(m, Dumper=_ManifestDumper, sort_keys=False, allow_unicode=True, width=1 << 30)
            for m in manifests]
    return "---\n".join(docs)
