"""Between two attempts of a job that heals itself: has the stop taken on every node, which nodes
answer at all, and is the master port free again (pure: the probes and what their answers mean;
hfscale.launch.attempt.execute runs them, hfscale.launch.recovery.supervisor acts on them).

A stop sends TERM and returns at once (its KILL follows after the grace period, in the background:
hfscale.launch.node.stopping), and under Slurm the step's srun returns once its tasks' shells
ended, while their torchrun may still be shutting down. An attempt started at once would find the
previous one's torchrun still holding the master port on node 0 (``EADDRINUSE``: no host's fault),
or its clients would join the dying store; the previous attempt's ranks could still be writing the
checkpoint the relaunch plans to resume from or set aside. So before the relaunch is decided, each
node of the stopped attempt is asked, within one bound (ssh, or an ``srun --overlap`` step of its
own inside a Slurm allocation):

- to wait until no process carrying the stopped attempt's job id is left (at most the stop's grace
  and a few seconds: the stop's KILL comes after its grace), and to say how many are left;
- node 0 also waits, at most ``PORT_WAIT_S``, until the master port can be bound.

A node that does not answer within the bound is unreachable: after a hang that named no rank (a
cut link leaves every rank waiting in a collective), that is the node to leave out or replace,
found by hfscale itself, not by Slurm's ``SlurmdTimeout`` (300 s by default) or ssh's keep-alives.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfscale.core.shell import Command, Ran, render, words
from hfscale.launch.node.reach import reach_argv
from hfscale.launch.node.stopping import JOB_ID_VAR
from hfscale.rules.resolved import Job

MARK = "HFSCALE_SETTLE"
PORT_WAIT_S = 30  # node 0 waits this long for the master port (the previous attempt's store, a port in TIME_WAIT)
LEFT_AFTER_S = 2  # beyond the stop's grace, how long the previous attempt's processes may take to go
REACH_S = 10  # beyond the waits: ssh or srun reaching the node and starting the probe
LOCAL = "local"  # the key of a job without hosts (runner local): this machine


@dataclass(frozen=True)
class Settled:
    """What one node answered (None: it did not answer within the bound)."""

    left: int | None = None  # processes of the stopped attempt still there after the wait
    port: str | None = None  # node 0: "free", "busy" (after PORT_WAIT_S), "unknown" (no interpreter)

    @staticmethod
    def read(ran: Ran) -> "Settled | None":
        """The answer in a probe's output; None when the node did not answer: its probe never started
        there (the probe timed out, ssh could not connect, srun could not launch it: "Communication
        connection failure" after its MessageTimeout, or the node is DOWN)."""
        said: dict[str, str] = {}
        seen = False
        for line in ran.stdout.splitlines():
            if line.strip() == MARK:
                seen = True
            elif seen and "=" in line:
                k, v = line.split("=", 1)
                said[k.strip()] = v.strip()
        if not seen:
            return None
        left = said.get("left", "")
        return Settled(int(left) if left.isdigit() else None, said.get("port") or None)


def wait_s(grace_s: int) -> int:
    """How long a node waits for the stopped attempt's processes: the stop's grace, and a little."""
    return grace_s + LEFT_AFTER_S


def bound_s(grace_s: int, port: bool) -> float:
    """The most a node's probe may take before the node counts as unreachable."""
    return wait_s(grace_s) + (PORT_WAIT_S if port else 0) + REACH_S


def script(job_id: str | None, grace_s: int, python: str | None, port: int | None) -> str:
    """Shell text: wait (at most ``wait_s(grace_s)``) until no process of ``job_id`` is left on this
    node, say how many are (``job_id`` None: no such wait); with ``port``, wait (at most
    PORT_WAIT_S) until it can be bound (as torch's store binds it: SO_REUSEADDR) and say whether it
    is free. The probe runs in a shell started without the job id in its environment (a process's
    environment as /proc shows it is the one it was started with, and a forked shell keeps its
    parent's), so it never waits for itself."""
    lines = [f"echo {MARK}"]
    if job_id is not None:  # job ids are validated ([a-z0-9-]): safe inside single quotes
        find = f"grep -lsxzF '{JOB_ID_VAR}={job_id}' /proc/[0-9]*/environ"
        lines += [f"l() {{ {find}; }}",
                  f'n=0; while [ -n "$(l)" ] && [ $n -lt {wait_s(grace_s) * 5} ]; do sleep 0.2; n=$((n + 1)); done',
                  "echo left=$(l | wc -l)"]
    if port is not None and python:
        bind = ("import socket, time\n"
                f"end = time.monotonic() + {PORT_WAIT_S}\n"
                "while True:\n"
                "    s = socket.socket()\n"
                "    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                "    try:\n"
                f"        s.bind((\"\", {int(port)}))\n"
                "        print(\"port=free\")\n"
                "        break\n"
                "    except OSError:\n"
                "        if time.monotonic() >= end:\n"
                "            print(\"port=busy\")\n"
                "            break\n"
                "        time.sleep(0.2)\n"
                "    finally:\n"
                "        s.close()\n")
        lines.append(f"{render(words([python, '-c', bind]))} 2>/dev/null || echo port=unknown")
    return render(words(["exec", "env", "-u", JOB_ID_VAR, "sh", "-c", "; ".join(lines)]))


def probes(job: Job, hosts: tuple[str, ...], job_id: str, grace_s: int, python: str) -> dict[str, Command]:
    """One probe per host of the stopped attempt (``hosts``, in node-rank order; node 0 also waits for
    the master port); for a job without hosts, one on this machine under the key ``local``."""
    py = job.config.runner.python or python
    port = job.config.cluster.master_port
    if not hosts:
        return {LOCAL: Command(("sh", "-c", script(job_id, grace_s, py, port)))}
    return {h: Command(tuple(reach_argv(job, h) + [script(job_id, grace_s, py, port if i == 0 else None)]))
            for i, h in enumerate(hosts)}


def port_probe(job: Job, host: str, python: str) -> Command:
    """A probe of ``host`` (a new master: a spare in node 0's place) that only waits for the master port."""
    py = job.config.runner.python or python
    text = script(None, 0, py, job.config.cluster.master_port)
    return Command(tuple(reach_argv(job, host) + [text])) if job.hosts else Command(("sh", "-c", text))


def told(answers: dict[str, Settled | None], grace_s: int) -> list[str]:
    """What the terminal says of the settle: hosts where the stopped attempt's processes outlived the
    stop and its wait (at most 8 named)."""
    stuck = [f"{h} ({a.left})" for h, a in answers.items() if a is not None and a.left]
    if not stuck:
        return []
    named = ", ".join(stuck[:8]) + (f" and {len(stuck) - 8} more" if len(stuck) > 8 else "")
    return [f"processes of the stopped attempt still ran {wait_s(grace_s)} s after the stop on {named}: "
            "killed but not gone (a process in uninterruptible sleep: a hung file system or driver)"]
