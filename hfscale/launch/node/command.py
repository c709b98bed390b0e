"""What every runner starts on a node: the launcher argv, the ranks' environment, the entry.

Pure, and the one owner of these rules for every runner (local, pdsh, containers, Slurm,
Kubernetes): a runner says how its nodes meet (``Rendezvous``: this node's rank and the master,
as values or as variables set where the launcher runs), the argv comes from here.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from hfscale.config.envvars import FLIGHT_DUMP_NAME, FLIGHT_ENTRIES, flight_recorder_env, installed_torch, job_env, secret_names
from hfscale.core.shell import Cat, Secret, Word
from hfscale.launch.context import LaunchContext
from hfscale.launch.run_dir import CONFIG_COPY, STORE_ADDR
from hfscale.render.artifacts import ACCELERATE_FILE, DEEPSPEED_FILE
from hfscale.rules.recovery import slow_nodes_unwatched
from hfscale.rules.resolved import Job
from hfscale.rules.script import PLAIN_FLAG, SCRIPT_ENTRY, script_argv
from hfscale.training.heartbeat import FLIGHT_DIR
from hfscale.training.inprocess.restart import ENV_JOIN, ENV_RESTARTS, ENV_TIMEOUT
from hfscale.training.slow_nodes import ENV_WATCH
from hfscale.training.warm_launcher import preload_groups

BUILTIN_ENTRY = "hfscale.training.train"


def restarts(job: Job) -> int:
    """How often the launcher restarts failed workers (torchrun's --max-restarts)."""
    k = job.config.runner.kubernetes
    return k.elastic.max_restarts if k is not None and k.elastic is not None else job.config.runner.max_restarts


def torchrun_expands(job: Job) -> bool:
    """Whether the entry's arguments pass through torchrun's elastic agent, which expands ``$$``
    and ``${local_rank}`` in every one of them (string.Template): every launch but accelerate's
    single-process one (DDP on one process: accelerate runs the script directly)."""
    cfg = job.config
    return not (cfg.runner.launcher == "accelerate" and cfg.distributed.backend == "ddp" and job.world_size == 1)


def plain_needs_entry(job: Job) -> bool:
    """Whether a plain script (pass_args: none) starts through ``hfscale.training.run_script --plain``: a job of
    more than one process (a rank without a GPU must tell accelerate to use the CPU, or set up its
    process state, before the script's Accelerator: hfscale.training.run_script.plain_mode), and every job
    under accelerate's DeepSpeed launcher."""
    return job.world_size > 1 or (job.config.runner.launcher == "accelerate" and job.deepspeed is not None)


def training_target(job: Job, run_dir: str, ctx: LaunchContext, expands: bool | None = None
                    ) -> tuple[list[str], list[str]]:
    """(launcher flags that select the entry, [entry, *args]): hfscale's built-in entry point reading
    the resolved config from ``run_dir``; a Trainer script through ``hfscale.training.run_script`` with the
    YAML's flags (hfscale.rules.script); a plain script with its own arguments only (through
    ``hfscale.training.run_script --plain`` where plain_needs_entry). Every ``$`` is doubled where torchrun
    would expand it, so the script gets its arguments as written."""
    t = job.config.training
    if t.script is None:
        flag, target = ["--module"], [BUILTIN_ENTRY, "--config", posixpath.join(run_dir, CONFIG_COPY)]
    else:
        argv = script_argv(job, posixpath.join(run_dir, DEEPSPEED_FILE), ctx.extra_args)
        if t.pass_args == "none" and not plain_needs_entry(job):
            flag, target = [], argv
        else:
            plain = [PLAIN_FLAG] if t.pass_args == "none" else []
            flag, target = ["--module"], [SCRIPT_ENTRY, *plain, *argv]
    if torchrun_expands(job) if expands is None else expands:
        target = [w.replace("$", "$$") for w in target]
    return flag, target


@dataclass(frozen=True)
class Rendezvous:
    """How a runner's nodes find each other.

    ``rank``: this node's rank; ``master``/``port``: the rank-0 node (None: the values in the
    accelerate config); ``c10d``: torchrun rendezvous through a c10d store with the job id (what
    restarts and elastic jobs need) instead of fixed ranks; ``endpoint``/``nnodes`` override the
    c10d endpoint (``master:port``) and the node count ("1:4" for an elastic job)."""

    rank: Word = "0"
    master: Word | None = None
    port: Word | None = None
    c10d: bool = False
    endpoint: Word | None = None
    nnodes: str | None = None


def default_rendezvous(job: Job, rank: Word, master: Word | None = None) -> Rendezvous:
    """Fixed ranks, or c10d when the launcher restarts workers (a fresh round needs a fresh store)."""
    return Rendezvous(rank=rank, master=master, c10d=restarts(job) > 0)


NODE_AGENT = "hfscale.training.inprocess.node_agent"
# how long the first rank back waits for the others before an in-process restart goes on without them: once
# enough have come to fill every rank it waits only 0.5 s more; with too few (no standby left), long enough
# for a node agent to start a killed rank again (its imports take seconds), which then takes its rank back
IN_PROCESS_JOIN_S = 30
STORE_HOST = "hfscale.training.inprocess.store_host"


def in_process(job: Job) -> bool:
    """Whether the job restarts in process (recovery.in_process): every node, spares too, runs
    hfscale's node agent in torchrun's place, and the launch hosts the ranks' store."""
    return job.config.recovery.in_process


def launched_nodes(job: Job) -> int:
    """The nodes a launch starts: the job's, and with in-process restarts its spares too (standbys)."""
    return job.num_nodes + (len(job.spares) if in_process(job) else 0)


def node_agent_argv(job: Job, python: str, run_dir: str, ctx: LaunchContext, node_rank: Word, reach: str
                    ) -> list[Word]:
    """argv of a node's in-process agent (hfscale.training.inprocess.node_agent) and its ranks' entry
    (which it starts as given: no torchrun to expand ``$``): the ranks of spare nodes (node ranks
    from ``num_nodes`` on) are the standbys."""
    p = job.procs_per_node
    module_flag, target = training_target(job, run_dir, ctx, expands=False)
    return [python, "-m", NODE_AGENT, "--nproc", str(p), "--node-rank", node_rank, "--world", str(job.world_size),
            "--launched", str(launched_nodes(job) * p), "--store-file", posixpath.join(run_dir, STORE_ADDR),
            "--reach", reach, "--restarts", str(job.config.recovery.max_restarts),
            *(["--preload", ",".join(preload_groups(job))] if job.config.runner.warm_start else []), "--",
            *(["-m"] if module_flag else []), *target]


WARM_LAUNCHER = "hfscale.training.warm_launcher"


def warm_start(job: Job) -> bool:
    """Whether the node's launcher forks its ranks after importing what they need (runner.warm_start): where
    its workers start through torch's elastic agent (torchrun_expands: not accelerate's single process)."""
    return job.config.runner.warm_start and torchrun_expands(job)


def launcher_argv(job: Job, python: str, run_dir: str, ctx: LaunchContext, rdzv: Rendezvous,
                  reach: str = "ssh") -> list[Word]:
    """argv of the per-node launcher (accelerate launch, torchrun, or with in-process restarts hfscale's
    node agent: ``reach`` is how a node finds the launcher's host), its entry and arguments."""
    cfg = job.config
    if in_process(job):
        return node_agent_argv(job, python, run_dir, ctx, rdzv.rank, reach)
    module_flag, target = training_target(job, run_dir, ctx)
    warm = [python, "-m", WARM_LAUNCHER, "--preload", ",".join(preload_groups(job))] if warm_start(job) else [python, "-m"]
    master: Word = rdzv.master if rdzv.master is not None else job.master_addr
    port: Word = rdzv.port if rdzv.port is not None else str(cfg.cluster.master_port)
    argv: list[Word]
    if cfg.runner.launcher == "accelerate":
        argv = [*warm, "accelerate.commands.launch", "--config_file", posixpath.join(run_dir, ACCELERATE_FILE)]
        if job.deepspeed is not None and cfg.precision == "fp8":
            # accelerate refuses mixed_precision in the file beside deepspeed_config_file, but takes the flag
            argv += ["--mixed_precision", "fp8"]
        if job.num_nodes > 1:
            argv += ["--machine_rank", rdzv.rank]
            if rdzv.master is not None:
                argv += ["--main_process_ip", rdzv.master]
            if rdzv.port is not None:
                argv += ["--main_process_port", rdzv.port]
        return argv + module_flag + target
    argv = [*warm, "torch.distributed.run", "--nnodes", rdzv.nnodes or str(job.num_nodes),
            "--nproc_per_node", str(job.procs_per_node)]
    if rdzv.c10d:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv.endpoint or _join_endpoint(master, port),
                 "--rdzv-id", ctx.job_id, "--max-restarts", str(restarts(job))]
    else:
        argv += ["--node_rank", rdzv.rank, "--master_addr", master, "--master_port", port]
    return argv + (["-m"] if module_flag else []) + target


def _join_endpoint(master: Word, port: Word) -> Word:
    if isinstance(master, str) and isinstance(port, str):
        return f"{master}:{port}"
    parts = [p for w in (master, ":", port) for p in (w.parts if isinstance(w, Cat) else (w,))]
    return Cat(tuple(parts))  # type: ignore[arg-type]


def watched(job: Job, ctx: LaunchContext) -> bool:
    """Whether hfscale's hang watchdog follows this launch: runners that hfscale runs to the end
    (not a submitted Slurm or Kubernetes job), with watchdog.timeout set."""
    r = job.config.runner.type
    ours = r in ("local", "pdsh", "pdsh_docker") or (r == "slurm" and "SLURM_JOB_ID" in dict(ctx.shell_env))
    return ours and job.config.watchdog.timeout is not None


def rank_env(job: Job, run_dir: str, ctx: LaunchContext) -> dict[str, str | Secret]:
    """Environment of every rank: the job's variables plus hfscale's own; secret values (by name,
    or forwarded from the shell and not public: hfscale.config.envvars.secret_names) as Secret."""
    shell = dict(ctx.shell_env)
    values = job_env(job.config, shell)
    hidden = secret_names(job.config, values, shell)
    env: dict[str, str | Secret] = {k: Secret(k, v) if k in hidden else v for k, v in values.items()}
    env.update(
        HFSCALE_JOB_ID=ctx.job_id,
        HFSCALE_RUN_DIR=run_dir,
        HFSCALE_CONFIG=posixpath.join(run_dir, CONFIG_COPY),
        PYTHONUNBUFFERED="1",
    )
    if job.deepspeed is not None:
        env["HFSCALE_DS_CONFIG"] = posixpath.join(run_dir, DEEPSPEED_FILE)
    if watched(job, ctx):
        # the flight recorder (gloo and NCCL) keeps each rank's last collectives for the hang report;
        # NCCL also writes it here when its own watchdog times out
        env.update(flight_recorder_env(FLIGHT_ENTRIES, posixpath.join(run_dir, FLIGHT_DIR, FLIGHT_DUMP_NAME),
                                       installed_torch(), values))
    if in_process(job):  # hfscale.training.inprocess.restart.Session
        env[ENV_RESTARTS] = str(job.config.recovery.max_restarts)
        env[ENV_JOIN] = str(IN_PROCESS_JOIN_S)
        if job.config.watchdog.timeout is not None:  # a collective waits this long for a frozen or cut-off peer
            env[ENV_TIMEOUT] = str(job.config.watchdog.timeout)
    if slow_nodes_unwatched(job) is None:  # this attempt can replace a slow node (its free spares, its min_nodes)
        env[ENV_WATCH] = "1"
    if restarts(job):
        # restarted workers reconnecting through a shared rendezvous store fail intermittently
        # with gloo (pytorch/pytorch#135712); a separate store per round avoids it
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env
