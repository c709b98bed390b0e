"""The config sections of the runners that need their own settings: containers (pdsh_docker),
Slurm and Kubernetes."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from hfscale.config.base import K8S_LABEL, K8S_SUBDOMAIN, PositiveInt, Strict, _seq, must_match

_RESOURCE = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def _absolute(v: str) -> str:
    if not v.startswith("/"):
        raise ValueError(f"{v!r} must be an absolute path")
    return v


class Mount(Strict):
    """A host directory made visible inside the container."""

    host: str = Field(description="Absolute path on every host.")
    container: str = Field(description="Absolute path inside the container.")
    readonly: bool = Field(False, description="Mount read-only.")

    @field_validator("host", "container")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or "\n" in v or "," in v or ":" in v:
            raise ValueError(f"{v!r} must be an absolute path without ',' or ':'")
        return v


class DockerConfig(Strict):
    """The container each node runs its launcher in (runner type pdsh_docker)."""

    image: str = Field(description="Image with your code and its Python environment, present on every host.")
    binary: str = Field("docker", description="Container CLI: docker, or podman (same arguments).")
    mounts: tuple[Mount, ...] = _seq(description="Host directories to mount, e.g. code, data, checkpoints.")
    gpus: str | None = Field("all", description="Value of --gpus (all, or a device list). Null: no GPUs.")
    ipc: Literal["host", "private", "shareable"] = Field(
        "host", description="IPC namespace. host: the host's /dev/shm, unlimited, what NCCL and data loader "
        "workers need; private/shareable: the container's own /dev/shm of shm_size.")
    shm_size: str | None = Field(None, description="Size of the container's own /dev/shm (only with ipc: private "
                                 "or shareable; docker ignores it and podman refuses it with ipc: host). "
                                 "Null: the engine's default (64m).")
    python: str = Field("python", description="Interpreter inside the container.")
    workdir: str | None = Field(None, description="Working directory inside the container. Default: runner.workdir.")
    extra_args: tuple[str, ...] = _seq(description="More 'docker run' arguments, passed as separate words.")

    @field_validator("shm_size")
    @classmethod
    def _shm(cls, v: str | None) -> str | None:
        return must_match(v, r"^[0-9]+[bkmgBKMG]?$", " is not a size like 64g")


class SlurmConfig(Strict):
    """sbatch settings (runner type slurm); written as literal #SBATCH lines."""

    partition: str | None = Field(None, description="Partition (queue) to submit to.")
    account: str | None = Field(None, description="Account to charge.")
    time: str | None = Field(None, description="Time limit, e.g. 2-00:00:00 or 04:00:00.")
    gpus_per_node: PositiveInt | None = Field(None, description="GPUs to request per node. Null: none requested.")
    cpus_per_task: PositiveInt | None = Field(None, description="CPUs for each node's launcher task.")
    job_name: str | None = Field(None, description="Job name. Default: the config's name.")
    signal: str | None = Field(
        "USR1@120", description="Preemption notice: signal and seconds before the time limit (sbatch --signal); "
        "the ranks save a checkpoint and stop. Null: none.")
    requeue: bool = Field(False, description="Let Slurm requeue the job (preemption, node failure); it resumes "
                          "from the newest complete checkpoint.")
    extra: tuple[str, ...] = _seq(description="More sbatch options, one per item, e.g. --qos=high.")

    @field_validator("partition", "account", "job_name")
    @classmethod
    def _word(cls, v: str | None) -> str | None:
        return must_match(v, r"^[A-Za-z0-9][A-Za-z0-9._,-]*$", ": letters, digits, '.', '_', ',' and '-' only")

    @field_validator("time")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        return must_match(v, r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$",
                          " is not a Slurm time such as 04:00:00 or 2-00:00:00")

    @field_validator("signal")
    @classmethod
    def _signal(cls, v: str | None) -> str | None:
        return must_match(v, r"^(B:)?(SIG)?[A-Z0-9]+(@\d+)?$", " is not a signal spec such as USR1@120")

    @field_validator("extra")
    @classmethod
    def _extra(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for item in v:
            if not re.match(r"^--[a-z][a-z0-9-]*(=[^\s'\"`$\\;&|<>]+)?$", item):
                raise ValueError(f"{item!r} is not an sbatch option like --qos=high (no spaces or shell characters)")
        return v


class K8sMount(Strict):
    """A volume in every pod: a host path or a persistent volume claim."""

    container: str = Field(description="Absolute path inside the container.")
    host_path: str | None = Field(None, description="Directory on the Kubernetes node (hostPath).")
    claim: str | None = Field(None, description="Name of a PersistentVolumeClaim.")
    readonly: bool = Field(False, description="Mount read-only.")

    @field_validator("container", "host_path")
    @classmethod
    def _paths(cls, v: str | None) -> str | None:
        return None if v is None else _absolute(v)

    @field_validator("claim")
    @classmethod
    def _claim(cls, v: str | None) -> str | None:
        return must_match(v, K8S_SUBDOMAIN, " is not a claim name (RFC 1123: lower-case letters, digits, '-' and '.')")


class ElasticConfig(Strict):
    """Elastic training (Kubeflow elasticPolicy; torchrun c10d rendezvous)."""

    min_nodes: PositiveInt = Field(description="Fewest nodes to train with.")
    max_nodes: PositiveInt = Field(description="Most nodes to train with.")
    max_restarts: int = Field(3, ge=0, le=1000, description="Restarts of the worker group before the job fails.")


class KubernetesConfig(Strict):
    """Kubeflow PyTorchJob settings (runner type kubernetes)."""

    image: str = Field(description="Image with your code, Python, torch, transformers, accelerate, deepspeed, hfscale.")
    namespace: str = Field("default", description="Namespace of the PyTorchJob.")
    mounts: tuple[K8sMount, ...] = _seq(description="Volumes mounted in every pod.")
    shm_size: str = Field("64Gi", description="Size of the memory-backed /dev/shm.")
    gpu_resource: str = Field("nvidia.com/gpu", description="Extended resource name of a GPU.")
    rdma_resource: str = Field("rdma/hca", description="RDMA device resource requested with the infiniband/roce presets.")
    service_account: str | None = Field(None, description="Service account of the pods.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="When to pull.")
    elastic: ElasticConfig | None = Field(None, description="Elastic policy. Null: a fixed number of nodes.")

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        return must_match(v, K8S_LABEL,
                          " is not a namespace (RFC 1123 label: up to 63 lower-case letters, digits, '-')")

    @field_validator("service_account")
    @classmethod
    def _account(cls, v: str | None) -> str | None:
        return must_match(v, K8S_SUBDOMAIN,
                          " is not a service account name (RFC 1123: lower-case letters, digits, '-', '.')")

    @field_validator("gpu_resource", "rdma_resource")
    @classmethod
    def _resource(cls, v: str) -> str:
        return must_match(v, _RESOURCE, " is not a resource name such as nvidia.com/gpu")

    @field_validator("shm_size")
    @classmethod
    def _size(cls, v: str) -> str:
        return must_match(v, _QUANTITY, " is not a Kubernetes quantity such as 64Gi")
