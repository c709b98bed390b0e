"""How hfscale reaches a node: ssh, one owner for its options (the port, the user, the connect
timeout, keep-alives and never a password prompt) for single hosts (``ssh``) and the fan-out
(``pdsh -R ssh``); an srun step on a host of a Slurm allocation (``probe_argv``); this host
(``here``); and a probe's way to a host (``reach_argv``)."""

from __future__ import annotations

from hfscale.core.shell import Command, Line, Sh
from hfscale.rules.resolved import Job


# a host that stops answering (network cut, kernel panic) ends its ssh after at most
# INTERVAL * (COUNT + 1) = 40 s of silence, exit code 255: node loss is noticed within a minute
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_COUNT = 3


def _options(job: Job) -> list[str]:
    return ["-p", str(job.config.runner.ssh_port), "-o", "BatchMode=yes",
            "-o", f"ServerAliveInterval={KEEPALIVE_INTERVAL_S}", "-o", f"ServerAliveCountMax={KEEPALIVE_COUNT}"]


def ssh_argv(job: Job, host: str) -> list[str]:
    """``ssh`` to ``host`` with the config's port, user and timeout, never asking for a password."""
    r = job.config.runner
    argv = ["ssh", *_options(job)[:2], "-o", f"ConnectTimeout={r.connect_timeout}", *_options(job)[2:]]
    if r.ssh_user:
        argv += ["-l", r.ssh_user]
    return argv + [host]


def pdsh_argv(job: Job, hosts_file: str, fanout: int) -> tuple[list[str], tuple[tuple[str, str], ...]]:
    """(``pdsh -R ssh`` over the hosts listed in ``hosts_file``, at most ``fanout`` at a time; the
    variables pdsh passes its options to ssh with). The host list is read from the file (``-w
    ^file``): one argument of a command line holds at most 128 KiB."""
    r = job.config.runner
    # pdsh puts its own -oConnectTimeout (from -t) first and ssh keeps the first value: use -t
    argv = ["pdsh", "-R", "ssh", "-S", "-t", str(r.connect_timeout), "-f", str(max(1, fanout)), "-w", f"^{hosts_file}"]
    if r.ssh_user:
        argv += ["-l", r.ssh_user]
    return argv, (("PDSH_SSH_ARGS_APPEND", " ".join(_options(job))),)


def probe_argv(host: str) -> list[str]:
    """The start of a probe of ``host`` (its command follows, as one shell line), instead of ssh: a step
    of its own, named so that the next attempt does not wait for one on a node that did not answer."""
    return ["srun", "--overlap", "--job-name=hfscale-probe", f"--nodelist={host}", "--nodes=1", "--ntasks=1",
            "--quiet", "bash", "-c"]


def here(script: str | Line) -> Command:
    """Shell text (or a line) run on this node."""
    return Command(("bash", "-c", script if isinstance(script, Line) else Line((Sh(script),))))


def reach_argv(job: Job, host: str) -> list[str]:
    """How a probe reaches ``host`` (its shell line follows): ssh, or for the hosts of a Slurm
    allocation (hfscale.launch.runners.slurm_step, whose probe is ``probe_argv``) an ``srun`` step on the host."""
    return probe_argv(host) if job.scheduled else ssh_argv(job, host)
