"""Runner type pdsh_docker: the pdsh fan-out, each node running its launcher in a container.

``docker run --rm --network host`` with a per-job name and label, the mounts, ``--gpus``, and the
RDMA device and locked memory with the infiniband/roce presets. Values are exported in the host
shell and passed as ``-e NAME`` only, so they never sit on docker's argv. With no hosts the
container runs on this node without pdsh. Cleanup removes the job's containers by label, then
stops what is left of the job on the host (hfscale.launch.node.stopping: ``runner.setup``, the docker
client).
"""

from __future__ import annotations

import posixpath

from hfscale.config.envvars import RDMA_PRESETS
from hfscale.core.shell import Cat, Command, Line, Sh, Var, Word, words
from hfscale.launch.context import Common, LaunchContext
from hfscale.launch.node.command import default_rendezvous, launcher_argv
from hfscale.launch.node.controls import controls
from hfscale.launch.node.keeper import keeper_of
from hfscale.launch.node.line import HOSTS_FILE, RANK_VAR, hosts_file, launch, prelude, private_files
from hfscale.launch.node.reach import here, pdsh_argv
from hfscale.launch.node.stopping import stop_script
from hfscale.launch.run_dir import STOP_MARKER
from hfscale.launch.spec import LaunchPlan, NodeLaunch
from hfscale.rules.resolved import Job

RANK_DIR: str | None = None  # the ranks read the generated files in the run directory


def docker_argv(job: Job, env_names: list[str], rank: Word, workdir: str, launcher: list[Word], job_id: str
                ) -> list[Word]:
    """``docker run`` of ``launcher`` for the node of ``rank``, passing ``env_names`` by name."""
    d = job.config.runner.docker
    assert d is not None
    argv: list[Word] = [
        d.binary, "run", "--rm",
        "--name", Cat((f"hfscale-{job_id}-", rank)) if isinstance(rank, Var) else f"hfscale-{job_id}-{rank}",
        "--label", f"hfscale.job={job_id}",
        "--network", "host", "--ipc", d.ipc,
    ]
    if d.shm_size is not None:
        argv += ["--shm-size", d.shm_size]
    if d.gpus is not None:
        argv += ["--gpus", d.gpus]
    if job.config.network.preset in RDMA_PRESETS:
        argv += ["--device", "/dev/infiniband", "--cap-add", "IPC_LOCK", "--ulimit", "memlock=-1:-1"]
    for m in d.mounts:
        argv += ["-v", f"{m.host}:{m.container}" + (":ro" if m.readonly else "")]
    # names only: values come from the environment docker is started in, so they never sit on its argv
    for name in env_names:
        argv += ["-e", name]
    argv += ["-w", d.workdir or workdir, *d.extra_args, d.image]
    return argv + launcher


def plan(job: Job, ctx: LaunchContext, c: Common) -> LaunchPlan:
    cfg = job.config
    d = cfg.runner.docker
    assert d is not None
    hosts = tuple(h.host for h in job.hosts)
    names = [*c.env, *(k for values in cfg.env.per_host.values() for k in values), RANK_VAR]
    names = list(dict.fromkeys(names))

    def node_argv(rank: Word) -> list[Word]:
        launcher = launcher_argv(job, d.python, c.rank_dir, ctx, default_rendezvous(job, rank))
        return docker_argv(job, names, rank, c.workdir, launcher, ctx.job_id)

    if not hosts:  # one local node in a container, no pdsh
        argv = node_argv("0")
        main = Command(tuple(argv), (*c.env.items(), (RANK_VAR, "0")), c.workdir)  # type: ignore[arg-type]
        cleanup = Command((d.binary, "rm", "-f", f"hfscale-{ctx.job_id}-0"))
        # the container's processes are this host's too: their stacks are dumped from here
        dump = controls(here, ctx.job_id, c.watch, c.python).dump
        return LaunchPlan(ctx.job_id, "pdsh_docker", c.run_dir, c.files, (NodeLaunch("local", 0, words(argv)),),
                          ("local",), main, cleanup, c.mode, c.notes, moves=c.moves,  # type: ignore[arg-type]
                          watch=c.watch, dump=dump)
    listing = posixpath.join(c.run_dir, HOSTS_FILE)
    binary = words([d.binary])
    remove = Line((binary, Sh("ps -q --filter"), f"label=hfscale.job={ctx.job_id}", Sh("| xargs -r"), binary,
                   Sh("rm -f"), Sh(";", glue=True), Sh(stop_script(ctx.job_id))))
    main, logs, follow = launch(job, c, ctx.job_id, hosts, prelude(job, c, gate=False), node_argv(Var(RANK_VAR)),
                                     remove)
    stop, stop_env = pdsh_argv(job, listing, min(len(hosts), cfg.runner.fanout))
    # the containers go first (docker rm -f kills), then what is left of the job on the host
    cleanup, dump, kill = controls(lambda line: Command((*stop, Line(line.items, pdsh=True)), stop_env), ctx.job_id,
                                   c.watch, c.python, first=remove.items[:-1])
    nodes = tuple(NodeLaunch(h, i, words(node_argv(str(i)))) for i, h in enumerate(hosts))
    return LaunchPlan(ctx.job_id, "pdsh_docker", c.run_dir, (*c.files, hosts_file(hosts)), nodes, logs, main,
                      cleanup, c.mode, c.notes, moves=c.moves,  # type: ignore[arg-type]
                      private=private_files(job, c, hosts), follow=follow, watch=c.watch, dump=dump,
                      stop_marker=posixpath.join(c.run_dir, STOP_MARKER), keeper=keeper_of(c.run_dir), kill=kill)
