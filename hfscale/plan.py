"""config -> an immutable launch plan (pure: no process is started and no file is written here).

The plan is what ``--dry-run`` prints and what ``hfscale.execute`` runs, the same object.
Build it with ``mask=True`` for anything shown or stored: secret values become ``***``.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field, replace

from .artifacts import DEEPSPEED_FILE, render_artifacts
from .config import HfscaleConfig
from .envvars import RDMA_PRESETS, deepspeed_env_file, host_env, is_secret, masked
from .errors import ConfigError, Problem
from .job import Job
from .launcher import CONFIG_COPY, LaunchContext, launcher_argv, rank_env
from .render_kubernetes import CONFIG_DIR, kubernetes_manifests, render_manifests
from .render_slurm import MASTER, NODE_RANK, render_sbatch
from .render_slurm import SCRIPT as SBATCH_FILE
from .resume import decide
from .schedule import schedule_note
from .script_rules import extra_args_problems
from .trainer_args import given_flags
from .shell import Command, Raw, exports, join
from .yamlsource import dump

EXIT_MARK = "HFSCALE_EXIT"
RANK_VAR = "HFSCALE_NODE_RANK"
LOCAL_HOST = "local"


@dataclass(frozen=True)
class NodeLaunch:
    """What one node runs: its rank and the command line (remote shell line for pdsh)."""

    host: str
    node_rank: int
    command: str


@dataclass(frozen=True)
class LaunchPlan:
    job_id: str
    runner: str
    run_dir: str
    files: tuple[tuple[str, str], ...]
    hosts: tuple[str, ...]
    nodes: tuple[NodeLaunch, ...]
    main: Command
    cleanup: Command | None
    notes: tuple[str, ...] = field(default=())
    # stream: run main, relay its output per node; submit: main hands the job to a scheduler and
    # returns; done: nothing to train (the newest checkpoint is at max_steps), nothing is started
    mode: str = "stream"
    show: tuple[str, ...] = ()  # files printed in full by render() (the sbatch script, manifests)
    moves: tuple[tuple[str, str], ...] = ()  # (from, to) before anything starts: --restart's checkpoints

    def render(self) -> str:
        """The plan as text: files, per-node commands, the process hfscale starts, cleanup."""
        out = [f"# hfscale launch plan: job {self.job_id}, runner {self.runner}", f"run directory: {self.run_dir}"]
        if self.moves:
            out.append("first, move:")
            out += [f"  {a} -> {b}" for a, b in self.moves]
        out.append("files:")
        out += [f"  {posixpath.join(self.run_dir, name)} ({len(text.splitlines())} lines)" for name, text in self.files]
        out.append("nodes:")
        out += [f"  [{n.node_rank}] {n.host}: {n.command}" for n in self.nodes]
        for name in self.show:
            text = dict(self.files)[name]
            out += [f"--- {posixpath.join(self.run_dir, name)}", text.rstrip("\n"), "---"]
        out += ["run:", f"  {self.main.shell()}"]
        if self.cleanup is not None:
            out += ["on failure or Ctrl-C:", f"  {self.cleanup.shell()}"]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out) + "\n"


def _docker_argv(job: Job, env_names: list[str], rank: str, workdir: str, launcher: list[str], ctx: LaunchContext) -> list[str]:
    cfg = job.config
    d = cfg.runner.docker
    assert d is not None
    argv = [
        d.binary, "run", "--rm",
        "--name", Raw(f"hfscale-{ctx.job_id}-{rank}") if isinstance(rank, Raw) else f"hfscale-{ctx.job_id}-{rank}",
        "--label", f"hfscale.job={ctx.job_id}",
        "--network", "host", "--ipc", d.ipc,
    ]
    if d.shm_size is not None:
        argv += ["--shm-size", d.shm_size]
    if d.gpus is not None:
        argv += ["--gpus", d.gpus]
    if cfg.network.preset in RDMA_PRESETS:
        argv += ["--device", "/dev/infiniband", "--cap-add", "IPC_LOCK", "--ulimit", "memlock=-1:-1"]
    for m in d.mounts:
        argv += ["-v", f"{m.host}:{m.container}" + (":ro" if m.readonly else "")]
    # names only: values come from the environment docker is started in, so they never sit on its argv
    for name in env_names:
        argv += ["-e", name]
    argv += ["-w", d.workdir or workdir, *d.extra_args, d.image]
    return argv + launcher


def _node_line(job: Job, run_dir: str, workdir: str, python: str, env: dict[str, str], ctx: LaunchContext,
               rank: str) -> tuple[str, str]:
    """The shell line one node runs (after the per-host prelude sets the rank)."""
    cfg = job.config
    docker = cfg.runner.type == "pdsh_docker"
    launcher = launcher_argv(job, cfg.runner.docker.python if docker else python, run_dir, rank, ctx)  # type: ignore[union-attr]
    if docker:
        names = [*env, *(k for values in cfg.env.per_host.values() for k in values), RANK_VAR]
        launcher = _docker_argv(job, list(dict.fromkeys(names)), rank, workdir, launcher, ctx)
    parts = [f"cd {join([workdir])}"]
    if cfg.runner.setup:
        parts.append("{ " + cfg.runner.setup + " ; }")
    parts.append(exports(env))
    return " && ".join(parts), join(launcher)


def _pdsh_script(job: Job, prelude: str, launcher: str, hosts: tuple[str, ...], mask: bool) -> str:
    """The one command line pdsh sends to every host; ``%h`` selects the host's rank and overrides.

    pdsh expands ``%h``, ``%n`` and ``%u`` anywhere in the line, so every literal ``%`` is doubled
    piece by piece and only hfscale's own ``%h`` is inserted afterwards.
    """
    cfg = job.config

    def assigns(i: int, host: str) -> str:
        extra = masked(host_env(cfg, host)) if mask else host_env(cfg, host)
        return _escape_pdsh(f"export {RANK_VAR}={i}" + "".join(f" {k}={join([v])}" for k, v in extra.items()))

    if len(hosts) == 1:
        rank_switch = assigns(0, hosts[0])
    else:
        cases = " ".join(f"{h}) {assigns(i, h)} ;;" for i, h in enumerate(hosts))
        rank_switch = f"case %h in {cases} *) echo 'hfscale: host %h is not in the plan' >&2; exit 97 ;; esac"
    tail = f'rc=$?; echo "{EXIT_MARK} rc=$rc"; exit $rc'
    return f"{_escape_pdsh(prelude)} && {rank_switch} && {_escape_pdsh(launcher)}; {tail}"


def _escape_pdsh(text: str) -> str:
    return text.replace("%", "%%")


def _kill_line(job_id: str) -> str:
    # kill only processes whose environment carries this job's id: never a pattern match on names
    probe = (
        f"for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -qx 'HFSCALE_JOB_ID={job_id}' "
        "&& kill -{sig} ${{p#/proc/}} 2>/dev/null; done"
    )
    return f"{probe.format(sig='TERM')}; sleep 3; {probe.format(sig='KILL')}; true"


def _pdsh_base(job: Job, hosts: tuple[str, ...]) -> tuple[list[str], tuple[tuple[str, str], ...]]:
    r = job.config.runner
    # pdsh puts its own -oConnectTimeout (from -t) first and ssh keeps the first value: use -t
    argv = ["pdsh", "-R", "ssh", "-S", "-t", str(r.connect_timeout), "-f", str(max(32, len(hosts))),
            "-w", ",".join(hosts)]
    if r.ssh_user:
        argv += ["-l", r.ssh_user]
    ssh_args = f"-p {r.ssh_port} -o BatchMode=yes"
    return argv, (("PDSH_SSH_ARGS_APPEND", ssh_args),)


def resolved_config_yaml(job: Job) -> str:
    """The config with hosts resolved (host file read) and secret values masked."""
    data = job.config.model_dump(mode="json")
    data["cluster"]["hosts"] = [{"host": h.host, "slots": h.slots} for h in job.hosts] or None
    data["cluster"]["hostfile"] = None
    data["env"]["vars"] = masked(data["env"]["vars"])
    data["env"]["per_host"] = {h: masked(v) for h, v in data["env"]["per_host"].items()}
    data["network"]["env"] = masked(data["network"]["env"])
    head = f"# Resolved from {job.source} by hfscale (host file read, secrets masked).\n"
    return head + dump(data)


def _resume_step(job: Job, ctx: LaunchContext) -> tuple[list[str], tuple[tuple[str, str], ...], str | None]:
    """(notes, moves, why there is nothing to do) for the checkpoints already in training.output_dir.

    Raises ConfigError where the job would start over silently in an output_dir whose checkpoints
    are all incomplete."""
    scan, t = ctx.output, job.config.training
    chosen = given_flags([*t.script_args, *ctx.extra_args], {"resume_from_checkpoint"}) if t.script else []
    if scan is None or chosen:  # a checkpoint named by hand is the user's choice
        return [], (), None
    if ctx.restart:
        dest = posixpath.join(scan.output_dir, f"restarted-{ctx.job_id}")
        moves = tuple((posixpath.join(scan.output_dir, n), posixpath.join(dest, n)) for n in scan.found)
        return ([f"--restart: training starts at step 0; the {len(moves)} checkpoint(s) of {t.output_dir} move "
                 f"to {dest} first"] if moves else []), moves, None
    d = decide(scan, t.max_steps)
    if d.action == "refuse":
        path = ("training", "output_dir")
        raise ConfigError(job.source, [Problem("training.output_dir", f"{d.reason}. Resume one by hand with -- "
                                               "--resume_from_checkpoint PATH, or start over with --restart "
                                               "(the checkpoints are moved aside, not deleted)", job.line_of(path))])
    if d.action == "done":
        return [f"nothing to train: {d.reason} (raise training.max_steps to go on, or start over with --restart)"], \
            (), d.reason
    notes = []
    if d.action == "resume":
        notes.append(f"resumes from {d.checkpoint} (each rank checks again when it starts, so a restart "
                     "resumes from the newest complete checkpoint then)")
        if scan.state is not None:
            notes += [n for n in [schedule_note(t, scan.state, d.checkpoint or "")] if n]
    return notes, (), None


def build_plan(job: Job, ctx: LaunchContext, mask: bool = False) -> LaunchPlan:
    """The launch plan for ``job``. ``mask=True`` replaces secret values by ``***`` (for display).

    Raises ConfigError for arguments after ``--`` that contradict the YAML, and where the job would
    start over in an output_dir holding only incomplete checkpoints."""
    cfg: HfscaleConfig = job.config
    r = cfg.runner
    base = r.run_dir if os.path.isabs(r.run_dir) else posixpath.join(ctx.cwd, r.run_dir)
    run_dir = posixpath.normpath(posixpath.join(base, f"{cfg.name}-{ctx.job_id}"))
    workdir = r.workdir or ctx.cwd
    python = r.python or ctx.python
    problems = extra_args_problems(job, ctx.extra_args, posixpath.join(run_dir, DEEPSPEED_FILE))
    if problems:
        raise ConfigError(job.source, problems)
    resume_notes, moves, nothing_to_do = _resume_step(job, ctx)
    env = rank_env(job, run_dir, ctx, mask)

    files = dict(render_artifacts(job, posixpath.join(run_dir, DEEPSPEED_FILE)))
    files[CONFIG_COPY] = resolved_config_yaml(job)
    ds_env, left_out = deepspeed_env_file(env)
    files[".deepspeed_env"] = ds_env
    notes = list(resume_notes)
    if left_out:
        notes.append(f".deepspeed_env leaves out {', '.join(left_out)} (secret, or a value DeepSpeed's launcher "
                     "would pass to the shell unsafely)")

    hosts = tuple(h.host for h in job.hosts)
    remote = r.type in ("pdsh", "pdsh_docker") and bool(hosts)
    if remote:
        prelude, launcher = _node_line(job, run_dir, workdir, python, env, ctx, Raw(f'"${RANK_VAR}"'))
        script = _pdsh_script(job, prelude, launcher, hosts, mask)
        pdsh, pdsh_env = _pdsh_base(job, hosts)
        main = Command(tuple(pdsh + [script]), pdsh_env)
        if r.type == "pdsh_docker":
            d = r.docker
            assert d is not None
            kill = f"{join([d.binary])} ps -q --filter label=hfscale.job={ctx.job_id} | xargs -r {join([d.binary])} rm -f"
        else:
            kill = _kill_line(ctx.job_id)
        cleanup = Command(tuple(pdsh + [_escape_pdsh(kill)]), pdsh_env)
        nodes = tuple(NodeLaunch(h, i, launcher.replace(f'"${RANK_VAR}"', str(i))) for i, h in enumerate(hosts))
    elif r.type == "slurm":
        plan = _slurm_plan(job, ctx, run_dir, workdir, python, env, files, tuple(notes))
        return replace(plan, moves=moves, mode="done" if nothing_to_do else plan.mode)
    elif r.type == "kubernetes":
        return _kubernetes_plan(job, ctx, mask, run_dir)
    elif r.type == "pdsh_docker":
        # one local node in a container, no pdsh
        launcher = launcher_argv(job, r.docker.python, run_dir, "0", ctx)  # type: ignore[union-attr]
        names = list(env) + [RANK_VAR]
        argv = _docker_argv(job, names, "0", workdir, launcher, ctx)
        main = Command(tuple(argv), tuple(env.items()) + ((RANK_VAR, "0"),), workdir)
        cleanup = Command((r.docker.binary, "rm", "-f", f"hfscale-{ctx.job_id}-0"))  # type: ignore[union-attr]
        nodes = (NodeLaunch(LOCAL_HOST, 0, join(argv)),)
    else:
        argv = launcher_argv(job, python, run_dir, "0", ctx)
        main = Command(tuple(argv), tuple(env.items()), workdir)
        cleanup = None
        nodes = (NodeLaunch(hosts[0] if hosts else LOCAL_HOST, 0, join(argv)),)

    return LaunchPlan(
        job_id=ctx.job_id,
        runner=r.type,
        run_dir=run_dir,
        files=tuple(files.items()),
        hosts=hosts if remote else (nodes[0].host,),
        nodes=nodes,
        main=main,
        cleanup=cleanup,
        notes=tuple(notes),
        mode="done" if nothing_to_do else "stream",
        moves=moves,
    )


def _slurm_plan(job: Job, ctx: LaunchContext, run_dir: str, workdir: str, python: str,
                env: dict[str, str], files: dict[str, str], notes: tuple[str, ...]) -> LaunchPlan:
    """sbatch submission, or the same script run directly inside an existing allocation."""
    launcher = launcher_argv(job, python, run_dir, Raw(NODE_RANK), ctx, master=Raw(MASTER))
    # secret values never go into the script file: sbatch passes them on from its own environment
    plain = {k: v for k, v in env.items() if not is_secret(k)}
    secret = tuple((k, v) for k, v in env.items() if is_secret(k))
    files[SBATCH_FILE] = render_sbatch(job, run_dir, workdir, plain, launcher)
    script = posixpath.join(run_dir, SBATCH_FILE)
    inside = dict(ctx.shell_env).get("SLURM_JOB_ID")
    if inside:
        main, mode = Command(("bash", script), secret, workdir), "stream"
        notes += (f"inside Slurm allocation {inside}: the script runs here with srun, not submitted",)
    else:
        main, mode = Command(("sbatch", "--parsable", script), secret, workdir), "submit"
    node = NodeLaunch("each node ($SLURM_NODEID)", 0, join(launcher))
    return LaunchPlan(ctx.job_id, "slurm", run_dir, tuple(files.items()), ("slurm",), (node,), main, None,
                      notes, mode=mode, show=(SBATCH_FILE,))


MANIFESTS = "pytorchjob.yaml"


def _kubernetes_plan(job: Job, ctx: LaunchContext, mask: bool, run_dir: str) -> LaunchPlan:
    """ConfigMap (+ Secret) + PyTorchJob, applied with ``kubectl apply -f -``.

    The pods read the generated files from the ConfigMap at ``CONFIG_DIR``, so the run directory
    only keeps a record: its copy of the manifests always has the secrets masked; the real ones
    reach kubectl on stdin."""
    pod_files = dict(render_artifacts(job, posixpath.join(CONFIG_DIR, DEEPSPEED_FILE)))
    pod_files[CONFIG_COPY] = resolved_config_yaml(job)

    def manifests(masked: bool) -> str:
        return render_manifests(kubernetes_manifests(job, ctx, pod_files, rank_env(job, CONFIG_DIR, ctx, masked)))

    record = manifests(True)
    main = Command(("kubectl", "apply", "-f", "-"), stdin=record if mask else manifests(False))
    notes = (f"kubectl reads the manifests on stdin ({MANIFESTS} with the secrets' real values)",)
    node = NodeLaunch(f"{job.num_nodes} pod(s)", 0, "see the PyTorchJob's container command")
    files = (*pod_files.items(), (MANIFESTS, record))
    return LaunchPlan(ctx.job_id, "kubernetes", run_dir, files, ("kubernetes",), (node,), main, None,
                      notes, mode="submit", show=(MANIFESTS,))
