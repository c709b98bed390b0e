"""What every runner starts on a node: the launcher argv, the ranks' environment, the entry.

Pure; shared by the launch plan (local, pdsh, Slurm) and the Kubernetes manifests.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Mapping

from .artifacts import ACCELERATE_FILE, DEEPSPEED_FILE
from .envvars import job_env, masked
from .job import Job
from .resume import OutputScan
from .script_rules import SCRIPT_ENTRY, script_argv
from .shell import Raw

BUILTIN_ENTRY = "hfscale.train"
CONFIG_COPY = "config.yaml"
JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")


@dataclass(frozen=True)
class LaunchContext:
    """Everything from outside the config that a plan depends on, gathered by the caller."""

    cwd: str
    python: str
    job_id: str
    shell_env: tuple[tuple[str, str], ...] = ()
    extra_args: tuple[str, ...] = ()
    output: OutputScan | None = None  # the checkpoints in training.output_dir (output_dir_to_scan)
    restart: bool = False  # --restart: move the checkpoints aside and start at step 0

    @staticmethod
    def of(cwd: str, python: str, job_id: str, shell_env: Mapping[str, str], extra_args=(),
           output: OutputScan | None = None, restart: bool = False) -> "LaunchContext":
        if not JOB_ID_RE.match(job_id):
            raise ValueError(f"job id {job_id!r}: lower-case letters, digits and '-' only")
        return LaunchContext(cwd, python, job_id, tuple(sorted(shell_env.items())), tuple(extra_args), output, restart)


def output_dir_to_scan(job: Job) -> str | None:
    """Where the launch host looks for checkpoints before it starts anything: training.output_dir
    under the working directory, for the entries that resume (the built-in one, Trainer scripts);
    None where it cannot look."""
    cfg = job.config
    if cfg.runner.type == "kubernetes" or (cfg.training.script is not None and cfg.training.pass_args == "none"):
        return None  # the pods' volumes are not visible here; a plain script keeps its own checkpoints
    # relative to the directory hfscale runs in (the default workdir), as people wrote it
    return posixpath.join(cfg.runner.workdir, cfg.training.output_dir) if cfg.runner.workdir else cfg.training.output_dir


def training_target(job: Job, run_dir: str, ctx: LaunchContext) -> tuple[list[str], list[str]]:
    """(launcher flags that select the entry, [entry, *args]): hfscale's built-in entry point reading
    the resolved config from ``run_dir``; a Trainer script through ``hfscale.run_script`` with the
    YAML's flags (hfscale.script_rules); a plain script with its own arguments only."""
    t = job.config.training
    if t.script is None:
        return ["--module"], [BUILTIN_ENTRY, "--config", posixpath.join(run_dir, CONFIG_COPY)]
    argv = script_argv(job, posixpath.join(run_dir, DEEPSPEED_FILE), ctx.extra_args)
    if t.pass_args == "none":
        return [], argv
    return ["--module"], [SCRIPT_ENTRY, *argv]


def launcher_argv(job: Job, python: str, run_dir: str, rank: str, ctx: LaunchContext, master: str | None = None
                  ) -> list[str]:
    """argv of the per-node launcher (accelerate launch or torchrun) for node ``rank``;
    ``master`` overrides the master address (a shell reference when a scheduler decides it)."""
    cfg = job.config
    module_flag, target = training_target(job, run_dir, ctx)
    restarts = cfg.runner.max_restarts
    master = master or job.master_addr
    if cfg.runner.launcher == "accelerate":
        argv = [python, "-m", "accelerate.commands.launch", "--config_file", posixpath.join(run_dir, ACCELERATE_FILE)]
        if job.num_nodes > 1:
            argv += ["--machine_rank", rank]
            if master != job.master_addr:
                argv += ["--main_process_ip", master]
        return argv + module_flag + target
    argv = [python, "-m", "torch.distributed.run", "--nnodes", str(job.num_nodes),
            "--nproc_per_node", str(job.procs_per_node)]
    endpoint = Raw(f"{master}:{cfg.cluster.master_port}") if isinstance(master, Raw) else f"{master}:{cfg.cluster.master_port}"
    if restarts:
        # a restart needs a fresh rendezvous round: c10d with a job-unique id (static reuses stale keys)
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", ctx.job_id,
                 "--max-restarts", str(restarts)]
    else:
        argv += ["--node_rank", rank, "--master_addr", master, "--master_port", str(cfg.cluster.master_port)]
    return argv + (["-m"] if module_flag else []) + target


def rank_env(job: Job, run_dir: str, ctx: LaunchContext, mask: bool) -> dict[str, str]:
    """Environment of every rank: the job's variables plus hfscale's own."""
    env = job_env(job.config, dict(ctx.shell_env))
    env = masked(env) if mask else env
    env.update(
        HFSCALE_JOB_ID=ctx.job_id,
        HFSCALE_RUN_DIR=run_dir,
        HFSCALE_CONFIG=posixpath.join(run_dir, CONFIG_COPY),
        PYTHONUNBUFFERED="1",
    )
    if job.deepspeed is not None:
        env["HFSCALE_DS_CONFIG"] = posixpath.join(run_dir, DEEPSPEED_FILE)
    if job.config.runner.max_restarts:
        # restarted workers reconnecting through a shared rendezvous store fail intermittently
        # with gloo (pytorch/pytorch#135712); a separate store per round avoids it
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env
