"""ssh as hfscale uses it, one owner for its options: the port, the user, the connect timeout,
keep-alives and never a password prompt, for single hosts (``ssh``) and the fan-out (``pdsh -R
ssh``)."""

from __future__ import annotations

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
