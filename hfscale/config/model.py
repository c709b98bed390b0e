"""The hfscale config model: one YAML file describes the whole job.

Every model is strict (no silent ``"4"`` -> ``4``), frozen, and rejects unknown keys. Checks that
span several fields (batch math against the world size, offload against the ZeRO stage) live in
``hfscale.rules.resolved`` and ``hfscale.rules.script`` so that all problems are collected and reported together.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from hfscale.config.base import (
    MAX_INT,
    MemorySize,
    NAME_RE,
    USER_RE,
    EnvValue,
    HostName,
    PositiveInt,
    Strict,
    Word,
    must_match,
    _check_env_names,
    _seq,
)
from hfscale.config.accelerate import AccelerateSection, FsdpSection, ParallelismConfig
from hfscale.config.deepspeed import DeepSpeedSection
from hfscale.config.health import HealthCheckConfig
from hfscale.config.slow_nodes import SlowNodesConfig
from hfscale.config.loss_guard import LossGuardConfig
from hfscale.config.runners import DockerConfig, KubernetesConfig, SlurmConfig


class HostSpec(Strict):
    """One node of the cluster."""

    host: HostName = Field(description="Host name (RFC 1123) or IP address as reached by ssh.")
    slots: int = Field(ge=1, le=1024, description="Processes (GPUs) to start on this host.")
    spare: bool = Field(False, description="A hot spare: not trained on; recovery puts it in place of a host that "
                        "fails, at the same world size (host file: 'host slots=N spare').")


class ClusterConfig(Strict):
    """Where the job runs: a list of hosts, a host file, or one local node."""

    hosts: tuple[HostSpec, ...] | None = _seq(
        None,
        description="Nodes with their slots, e.g. [{host: node0, slots: 8}]. Null: one local node.",
    )
    hostfile: str | None = Field(
        None,
        description="Path of a host file ('host slots=N' lines), relative to this YAML. "
        "Alternative to 'hosts'.",
    )
    nproc_per_node: int | None = Field(
        None, ge=1, le=1024,
        description="Processes on the local node when neither 'hosts' nor 'hostfile' is set (default 1).",
    )
    num_nodes: PositiveInt | None = Field(
        None,
        description="Nodes a scheduler allocates (runner slurm or kubernetes), each running nproc_per_node "
        "processes; the scheduler picks the hosts.",
    )
    master_addr: HostName | None = Field(
        None,
        description="Address every rank connects to. Default: the first host, or 127.0.0.1 on one local node "
        "(schedulers: the first node of the allocation, found at run time).",
    )
    master_port: int = Field(
        29500, ge=1, le=65535, description="Fixed rendezvous port on the master (never random)."
    )
    gpu_memory: MemorySize | None = Field(
        None, description="Memory of one GPU, e.g. 81559MiB or 80GB (10^9 bytes; an H100 80GB has 81559 MiB, "
        "preflight shows it): check and plan say whether the job fits and what to change. Null: plan needs "
        "--gpu-memory.")


class RunnerConfig(Strict):
    """How processes are started on the nodes."""

    type: Literal["local", "pdsh", "pdsh_docker", "slurm", "kubernetes"] = Field(
        "local",
        description="local: this node only; pdsh: one launcher per host over ssh; "
        "pdsh_docker: the same inside a container on each host; slurm: an sbatch job; "
        "kubernetes: a Kubeflow PyTorchJob.",
    )
    launcher: Literal["accelerate", "torchrun"] = Field(
        "accelerate", description="Per-node launcher: 'accelerate launch' with the generated config, or torchrun."
    )
    warm_start: bool = Field(
        True, description="Ranks start warm: the node's launcher imports what they need (torch, transformers, "
        "deepspeed, accelerate) once and forks them (torch's elastic agent, start method fork), instead of every rank "
        "starting a new interpreter that imports them again (7-9 CPU-s a rank, at every start and relaunch). Falls back "
        "to new interpreters, and says so, where an import initialized CUDA. false: every rank a new 'python -u'.")
    python: str | None = Field(
        None, description="Python interpreter on every node. Default: the one running hfscale (same path everywhere)."
    )
    workdir: str | None = Field(
        None, description="Working directory on every node. Default: the directory hfscale is started from."
    )
    setup: str | None = Field(
        None,
        description="Shell line run on each node before the launcher, as written "
        "(e.g. 'source /opt/venv/bin/activate'). The only config value that is not quoted.",
    )
    max_restarts: int = Field(
        0, ge=0, le=1000, description="Times torchrun restarts all local workers after one fails; the training "
        "resumes from the newest complete checkpoint.")
    ssh_port: int = Field(22, ge=1, le=65535, description="ssh port on every host.")
    ssh_user: str | None = Field(None, description="ssh user. Default: your ssh config's.")
    connect_timeout: int = Field(10, ge=1, le=3600, description="Seconds to wait for ssh to connect to a host.")
    fanout: int = Field(256, ge=1, le=10_000, description="Most ssh sessions at a time. Up to this many hosts the "
                        "launch holds one per host and streams the output; with more it starts the nodes detached, this "
                        "many at a time, and follows their logs and heartbeats in the run directory.")
    run_dir: str = Field(
        "runs",
        description="Where run directories are made (one per launch). Multi-node: a path every node sees.",
    )
    docker: DockerConfig | None = Field(None, description="Container settings for runner type pdsh_docker.")
    slurm: SlurmConfig | None = Field(None, description="sbatch settings for runner type slurm.")
    kubernetes: KubernetesConfig | None = Field(None, description="PyTorchJob settings for runner type kubernetes.")

    @field_validator("ssh_user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        return must_match(v, USER_RE, " is not a user name")


class NetworkConfig(Strict):
    """NCCL / UCX / libfabric settings for the interconnect."""

    preset: Literal["none", "ethernet", "infiniband", "roce", "efa"] = Field(
        "none", description="Known variables for the fabric: none, ethernet, infiniband, roce or efa."
    )
    env: dict[str, EnvValue | None] = Field(
        default_factory=dict, description="Overrides of preset variables, e.g. NCCL_IB_HCA: mlx5_0. Null removes one."
    )

    @field_validator("env")
    @classmethod
    def _names(cls, v: dict[str, str | None]) -> dict[str, str | None]:
        return _check_env_names(v)


class EnvConfig(Strict):
    """Environment of every rank on every node."""

    vars: dict[str, EnvValue] = Field(default_factory=dict, description="Literal values; always quoted, never expanded.")
    forward: tuple[str, ...] = _seq(
        description="Names copied from the launching shell, globs allowed (e.g. WANDB_*, HF_TOKEN). Their values are "
        "secret unless listed in 'public': masked in every printout, written only to a file only you can read, never "
        "on a command line."
    )
    per_host: dict[str, dict[str, EnvValue]] = Field(
        default_factory=dict, description="Per-host values on top of the rest, e.g. {node3: {NCCL_SOCKET_IFNAME: eth1}} "
        "(secret unless listed in 'public')."
    )
    public: tuple[str, ...] = _seq(
        description="Names (globs allowed) of forwarded and per-host variables whose values may be shown, e.g. "
        "WANDB_PROJECT, NCCL_*. Names such as *TOKEN*, *SECRET*, *KEY* stay secret even here."
    )

    @field_validator("vars")
    @classmethod
    def _vars(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env_names(v)

    @field_validator("forward", "public")
    @classmethod
    def _patterns(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            if not re.match(r"^[A-Za-z_*?][A-Za-z0-9_*?]*$", p):
                raise ValueError(f"{p!r} is not a variable name or glob (letters, digits, _, * and ?)")
        return v

    @field_validator("per_host")
    @classmethod
    def _per_host(cls, v: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        for values in v.values():
            _check_env_names(values)
        return v


class DistributedConfig(Strict):
    """Which data-parallel engine shards the model."""

    backend: Literal["deepspeed", "fsdp", "ddp"] = Field("deepspeed", description="deepspeed, fsdp or ddp.")
    deepspeed: DeepSpeedSection | None = Field(None, description="Settings for backend deepspeed.")
    fsdp: FsdpSection | None = Field(None, description="Settings for backend fsdp.")
    parallelism: ParallelismConfig | None = Field(
        None, description="accelerate's parallelism_config: data-parallel replicas x shards x tensor x context "
        "(FSDP2) x sequence (DeepSpeed) parallel ranks = world size. Null: every rank is a data-parallel rank.")
    process_group: bool = Field(
        False, description="Backend ddp with one process: start it as accelerate's MULTI_GPU does (torch.distributed.run,"
        " a process group of one, OMP_NUM_THREADS=1) instead of one plain process (NO). What hfscale import writes for "
        "a MULTI_GPU config with num_processes 1. More than one process always has a process group.")


class BatchConfig(Strict):
    """Batch geometry. global = micro_batch_size x gradient_accumulation_steps x world size."""

    micro_batch_size: PositiveInt = Field(description="Samples per device per forward pass.")
    gradient_accumulation_steps: PositiveInt | None = Field(
        None, description="Micro batches per optimizer step. Null: derived from global_batch_size, else 1."
    )
    global_batch_size: PositiveInt | None = Field(
        None, description="Samples per optimizer step over all ranks. Checked, or used to derive accumulation."
    )


# what the built-in entry point trains when training.model names nothing: a tiny GPT-2 over bytes
DEFAULT_MODEL_CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256,
                        "n_positions": 128}


class ModelConfig(Strict):
    """The model the built-in entry point trains (a script builds its own)."""

    path: str | None = Field(None, description="Local directory of a pretrained model (config + weights).")
    config: dict[str, Any] | None = Field(
        None, description="A transformers config as a mapping (model_type plus sizes): random init, no download. "
        "Checked against the model type's transformers config class: keys, types, sizes."
    )


class DataConfig(Strict):
    """Training data for the built-in entry point (a script reads its own)."""

    files: tuple[str, ...] = _seq(description="Local data files (globs allowed). Empty: the built-in corpus.")
    format: Literal["text", "json", "parquet"] = Field("text", description="File format, read with datasets.")
    text_field: str = Field("text", description="Column holding the text (json, parquet).")
    block_size: PositiveInt = Field(128, description="Tokens per packed training sequence.")


class LocalCheckpointsConfig(Strict):
    """The local tier of checkpoints: frequent ones on each node's own disk, copied to one buddy node."""

    every: PositiveInt = Field(description="Save a local checkpoint every N optimizer steps (the durable ones stay at "
                               "training.save_steps, on the shared file system).")
    dir: str = Field(description="A folder on each node's own disk (an NVMe), the same path on every node; '{host}' "
                     "in it is replaced by the node's host name.")
    keep: int = Field(2, ge=1, le=1000, description="Local checkpoints kept on each node (its own part and its "
                      "buddy's copy of each).")
    buddy: bool = Field(True, description="Copy each node's part to the next node, so that losing one node loses "
                        "nothing. False: a lost node's local checkpoints are lost with it.")


class TrainingConfig(Strict):
    """What the Trainer does; also the source of the TrainingArguments."""

    script: str | None = Field(None, description="Your training script. Null: hfscale's built-in entry point.")
    pass_args: Literal["trainer", "none"] = Field(
        "trainer", description="What the script gets on its command line. trainer: the TrainingArguments flags this "
        "file determines (batch, steps, learning rate and schedule, saving, logging, precision, clipping, seed, "
        "output_dir, --deepspeed), --use_cpu on ranks without a GPU and --resume_from_checkpoint on relaunch, for an "
        "HfArgumentParser script (transformers' examples, TRL); none: nothing but script_args, for a plain loop "
        "that reads $HFSCALE_CONFIG itself.")
    script_args: tuple[Word, ...] = _seq(
        description="Arguments for the script (a number as written: 1.0e-3 stays 1.0e-3), e.g. --model_name_or_path; "
        "a TrainingArguments flag this file determines may appear only with the same value.")
    output_dir: str = Field("output", description="Checkpoints and logs, relative to the working directory.")
    max_steps: PositiveInt | None = Field(None, description="Optimizer steps to run. Null: num_train_epochs.")
    num_train_epochs: float = Field(1.0, gt=0, le=1e6, description="Epochs, when max_steps is null.")
    learning_rate: float = Field(5e-5, gt=0, le=100, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=100, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, gt=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, gt=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, le=1, description="AdamW epsilon.")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="Learning-rate schedule."
    )
    warmup_steps: int = Field(0, ge=0, le=MAX_INT, description="Linear warm-up steps.")
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Random seed (data order and initialisation).")
    logging_steps: PositiveInt = Field(10, description="Log every N steps.")
    save_steps: PositiveInt = Field(500, description="Save a checkpoint every N steps.")
    save_total_limit: PositiveInt | None = Field(None, description="Keep at most N checkpoints. Null: keep all.")
    local_checkpoints: LocalCheckpointsConfig | None = Field(
        None, description="Frequent checkpoints on each node's own disk and one buddy's (the built-in entry point, and "
        "a script that calls hfscale.instrument(trainer)): a restart resumes from the newest one complete across "
        "the nodes left, when it is newer than the durable tier's. Null: off.")
    async_save: bool = Field(
        False, description="Write each checkpoint's DeepSpeed shards in the background (DeepSpeed's decoupled "
        "checkpoint writer: a writer process per rank) while training goes on; the checkpoint counts as complete "
        "(hfscale_complete.json) only once every rank's writes are committed, at the next optimizer step or the end "
        "of training. DeepSpeed ZeRO stage 1-3 only; the model's safetensors file is still written by the Trainer "
        "before training goes on. See docs/engines.md.")
    loss_guard: LossGuardConfig = Field(
        default_factory=LossGuardConfig, description="Loss spikes and NaNs: the job stops without saving, rolls back, "
        "replays once and skips the spike's batches if it comes back (hfscale.config.loss_guard).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute each layer's activations in backward (the Trainer's gradient_checkpointing): "
        "about a third more compute for a fraction of the activation memory.")
    report_to: tuple[str, ...] = _seq(("none",), description="Trainer loggers: tensorboard, wandb, mlflow, or none.")
    peak_tflops: float | None = Field(
        None, gt=0, le=1e6, description="Peak dense TFLOP/s of one device at the training precision, for MFU (the built-in "
        "entry point's, and a script's that calls hfscale.instrument(trainer)) (989 for an H100 SXM in bf16). Null: looked up for known GPUs, else MFU is not reported.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model for the built-in entry point.")
    data: DataConfig = Field(default_factory=DataConfig, description="Data for the built-in entry point.")


class WatchdogConfig(Strict):
    """The hang watchdog of ``hfscale launch`` (local and pdsh runners; the ranks report their steps)."""

    timeout: int | None = Field(
        600, ge=1, le=7 * 86400, description="Seconds without any rank finishing an optimizer step before hfscale "
        "writes every rank's stack, names the stuck rank(s) and stops the job (exit 4). Null: off.")
    first_step: int | None = Field(
        None, ge=1, le=7 * 86400, description="Seconds allowed before the first step (loading, compiling). Null: "
        "not watched.")
    script_reports_steps: bool = Field(
        False, description="training.pass_args none only: the script calls hfscale.step(n) after each "
        "optimizer step, so the watchdog sees its steps (a Trainer script and the built-in entry point report "
        "them through hfscale). Without it, first_step is refused: it would stop a healthy job.")


class RecoveryConfig(Strict):
    """What ``hfscale launch`` does after a rank fails, a node is lost or the job hangs: stop the job and
    relaunch it from the newest complete checkpoint, without a host that keeps failing (runners local,
    pdsh and pdsh_docker)."""

    max_restarts: int = Field(
        0, ge=0, le=10_000, description="Relaunches hfscale makes by itself after a rank failure, a lost node or a "
        "hang: it stops the whole job and starts it again from the newest complete checkpoint. 0: off. Not "
        "runner.max_restarts (torchrun restarting one node's processes in place).")
    window: int | None = Field(
        None, ge=60, le=10**8, description="Seconds: count only the restarts within this many seconds, so a long "
        "job is not stopped by failures days apart. Null: every restart of the job counts.")
    strikes: int = Field(
        2, ge=1, le=1000, description="Failures attributed to one host before it is excluded from the next launches.")
    min_nodes: PositiveInt | None = Field(
        None, description="Fewest nodes the job may shrink to by excluding hosts. Null: never shrink (a failed host "
        "is retried in place).")
    keep_global_batch: bool = Field(
        True, description="When the job shrinks, keep the global batch: gradient accumulation is derived again for "
        "the ranks left (check says at which node counts it can be). False: the global batch shrinks with the job.")
    probe_excluded: bool = Field(
        True, description="Between restarts, probe the excluded hosts (ssh and preflight) and admit a healthy one back "
        "at the next restart.")
    spares: int | None = Field(
        None, ge=0, le=10_000, description="Hot spares: a failed or lost node is replaced by a healthy spare at the same "
        "world size (no checkpoint conversion, the batch math unchanged); only when none is left does the job shrink "
        "(min_nodes). With pdsh the spares are the hosts marked spare (cluster.hosts[].spare, or 'spare' in the host "
        "file) and this, when set, must count them. Null: as many as are marked.")
    in_process: bool = Field(
        False, description="Restart in process: after a rank fails or a node is lost, the ranks on healthy nodes keep "
        "their processes (imports done) and join the next attempt's process group; each spare host runs standby ranks, "
        "imports done, that take the lost ranks' places, and a node whose rank died starts it again as a new standby. "
        "Up to max_restarts in-process restarts per launch; when one cannot complete (too few standbys, a survivor "
        "that does not rejoin) the job is relaunched as without it. Runners local, pdsh and slurm, launcher torchrun, "
        "hfscale's built-in entry point.")
    health_check: HealthCheckConfig | None = Field(
        None, description="A site's own health check each host passes before it is trusted (every launch and "
        "relaunch, every spare or excluded host admitted), beside the built-in GPU checks. Null: the built-in checks only.")
    slow_nodes: SlowNodesConfig = Field(
        default_factory=SlowNodesConfig, description="A node slower than the others for long enough is replaced at "
        "the next checkpoint, by a spare or by shrinking (recovery.min_nodes); again slow, it is struck.")


class HfscaleConfig(Strict):
    """One training job: cluster, launch, sharding, precision, batch geometry and training."""

    name: str = Field(description="Job name: letters, digits, '.', '-', '_' (used for run directories).")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Nodes and rendezvous.")
    runner: RunnerConfig = Field(default_factory=RunnerConfig, description="How processes are started.")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="Sharding engine.")
    precision: Literal["bf16", "fp16", "fp8", "no"] = Field(
        "bf16", description="Mixed precision: bf16, fp16, no (fp32) or fp8 (settings: accelerate.extra.fp8_config).")
    batch: BatchConfig = Field(description="Batch geometry.")
    gradient_clipping: float | None = Field(1.0, gt=0, le=1e6, description="Clip gradient norm to this value. Null: off.")
    network: NetworkConfig = Field(default_factory=NetworkConfig, description="Interconnect presets (NCCL/UCX).")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Environment variables of the ranks.")
    accelerate: AccelerateSection = Field(default_factory=AccelerateSection,
                                          description="accelerate settings beyond the engine's.")
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig, description="Hang detection.")
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig,
                                     description="Relaunches after a failure or a hang, on fewer hosts if need be.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Trainer settings.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return must_match(v, NAME_RE, " is not a job name: 1-64 of letters, digits, '.', '-', '_'")
