"""One node's agent for in-process restarts: it starts the node's ranks in torchrun's stead and keeps
them going. ``python -m hfscale.training.inprocess.node_agent --nproc P --node-rank N --world W
--launched L --store-file F --reach ssh --restarts K [--preload G] -- -m hfscale.training.train --config C``.

torchrun's agent does not serve here: a node that loses one rank stops and restarts all of them, a
worker that asks for a relaunch is restarted like any failed one, and at its end it waits for every
other node's agent (its exit barrier), which a lost node's never reaches. This agent:

- starts rank process ``i`` (0 .. P-1) with torchrun's variables (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK``), ``RANK`` = its uid ``N * P + i`` and ``WORLD_SIZE`` = ``L``, every process the launch
  started, standbys included, ``HFSCALE_INPROCESS_WORLD`` = ``W``, the active ranks, and
  ``MASTER_ADDR``/``MASTER_PORT`` = the store (hfscale.training.inprocess.store_host: its port read from
  ``F``, its host the launcher's as this node sees it: ``--reach``);
- starts again a process that died (a signal, the OOM killer, a crash outside the training function),
  up to K times, with ``HFSCALE_INPROCESS_RESTARTED`` = how often: it joins as a standby at the next
  attempt (hfscale.training.inprocess.restart), so a spare used up is replaced by the node it left;
- ends with 75 (RELAUNCH_EXIT) as soon as one of its processes does (the others are stopped: the job is
  relaunched), and with 0 once all of them ended with 0.
A TERM or INT goes to every process it started, and nothing is started again after it.

With ``--preload`` (``runner.warm_start``) it imports those groups once (hfscale.training.warm_launcher.PRELOADS)
and forks each rank process from itself (hfscale.training.warm_launcher.fork_rank), the ones it starts again
too: a killed rank's replacement is a standby at once, with nothing to import.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Protocol

from hfscale.core.exitcodes import signal_name
from hfscale.training.inprocess.restart import ENV_RESTARTED, ENV_WORLD, RELAUNCH_EXIT
from hfscale.training.warm_launcher import fork_rank, preload_modules, warm_up

STORE_WAIT_S = 60.0  # the launch writes the store's port before it starts the nodes: this bounds a slow file system
STOP_GRACE_S = 10.0
REACH = {"local": None, "ssh": "SSH_CONNECTION", "srun": "SLURM_LAUNCH_NODE_IPADDR"}


def store_port(path: str, wait_s: float = STORE_WAIT_S) -> int:
    """The store's port from its file (a regular file of one number); ValueError naming the file."""
    from hfscale.core.untrusted import Missing, Unreadable, read_bytes

    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = read_bytes(path, 64).decode("ascii", "replace").strip()
            break
        except Missing:
            if time.monotonic() >= deadline:
                raise ValueError(f"{path}: not written within {wait_s:.0f} s (the launch starts the store first)") from None
            time.sleep(0.2)
        except Unreadable as e:
            raise ValueError(str(e)) from None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{path}: {text[:20]!r} is not a port")
    return int(text)


def store_host(reach: str, env: dict[str, str]) -> str:
    """The launcher's address as this node sees it; ValueError when the variable it is read from is unset."""
    var = REACH[reach]
    if var is None:
        return "127.0.0.1"
    value = env.get(var, "").split(" ")[0]
    if not value:
        raise ValueError(f"--reach {reach}: ${var} is not set here")
    return value


def rank_env(base: dict[str, str], a: argparse.Namespace, local: int, host: str, port: int, restarted: int
             ) -> dict[str, str]:
    env = dict(base)
    env.update(RANK=str(a.node_rank * a.nproc + local), WORLD_SIZE=str(a.launched), LOCAL_RANK=str(local),
               LOCAL_WORLD_SIZE=str(a.nproc), GROUP_RANK=str(a.node_rank), MASTER_ADDR=host, MASTER_PORT=str(port),
               **{ENV_WORLD: str(a.world), ENV_RESTARTED: str(restarted)})
    if a.nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for more than one process on a node
    return env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hfscale.training.inprocess.node_agent")
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--launched", type=int, required=True)
    p.add_argument("--store-file", required=True)
    p.add_argument("--reach", choices=sorted(REACH), required=True)
    p.add_argument("--restarts", type=int, default=0)
    p.add_argument("--preload", default="", help="the ranks are forked after these imports (warm_launcher.PRELOADS)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the rank's python arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    try:
        preloads = preload_modules(a.preload)
    except ValueError as e:
        print(f"hfscale: node agent: {e}", file=sys.stderr)
        return 2
    if not command or not 1 <= a.nproc <= 1024 or a.node_rank < 0 or not 1 <= a.world <= a.launched \
            or (a.node_rank + 1) * a.nproc > a.launched or a.restarts < 0:
        print("hfscale: node agent: bad arguments (--nproc, --node-rank, --world, --launched, --restarts, command)",
              file=sys.stderr)
        return 2
    try:
        host, port = store_host(a.reach, dict(os.environ)), store_port(a.store_file)
    except ValueError as e:
        print(f"hfscale: node agent: {e}; the job is relaunched", file=sys.stderr, flush=True)
        return RELAUNCH_EXIT
    stopping: list[int] = []
    procs: dict[int, RankProcess] = {}

    def on_signal(signum, _frame):
        stopping.append(signum)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)

    forks = bool(preloads) and warm_up(preloads)
    if stopping:  # a TERM or INT while it imported: nothing is started
        return 128 + stopping[0]

    def start(local: int, restarted: int) -> None:
        env = rank_env(dict(os.environ), a, local, host, port, restarted)
        procs[local] = ForkedRank(fork_rank(command, env)) if forks else subprocess.Popen([sys.executable, *command], env=env)

    for local in range(a.nproc):
        start(local, 0)
    restarts = {local: 0 for local in range(a.nproc)}
    left = a.restarts
    while procs:
        local, rc = _wait_any(procs)
        uid = a.node_rank * a.nproc + local
        if rc == 0:
            continue
        if rc == RELAUNCH_EXIT or stopping or left <= 0:
            _stop(procs)
            if rc == RELAUNCH_EXIT or stopping:
                return RELAUNCH_EXIT if rc == RELAUNCH_EXIT else rc if rc > 0 else 128 - rc
            print(f"hfscale: rank process {uid} ended ({_how(rc)}) and the node has restarted {a.restarts} already",
                  file=sys.stderr, flush=True)
            return rc if rc > 0 else 128 - rc
        left -= 1
        restarts[local] += 1
        print(f"hfscale: rank process {uid} ended ({_how(rc)}); started again, as a standby "
              f"({a.restarts - left} of {a.restarts})", file=sys.stderr, flush=True)
        start(local, restarts[local])
    return 0


class RankProcess(Protocol):
    """What the agent does with a rank's process: a subprocess.Popen (a new interpreter) or a ForkedRank."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class ForkedRank:
    """A rank forked from this agent (hfscale.training.warm_launcher.fork_rank), with Popen's calls the agent uses."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by _wait_any's os.wait, which sets the code (unknown till then: 0, as Popen)
                self.returncode = 0
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        # the pid is this agent's own child, from its fork, and poll found it not reaped (waitpid WNOHANG): a child
        # not reaped keeps its pid, exited or not, so the signal reaches it and no other process. The only reaper
        # besides poll is _wait_any, in this same thread, which sets returncode (and poll then answers it)
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _wait_any(procs: dict[int, RankProcess]) -> tuple[int, int]:
    """The local index and exit code of the next process to end (removed from ``procs``)."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # none left that we started: each ended and was reaped
            local = next(iter(procs))
            return local, procs.pop(local).wait()
        except InterruptedError:
            continue
        for local, p in list(procs.items()):
            if p.pid == pid:
                p.returncode = os.waitstatus_to_exitcode(status)
                del procs[local]
                return local, p.returncode


def _how(rc: int) -> str:
    return f"signal {signal_name(-rc)}" if rc < 0 else f"exit code {rc}"


def _stop(procs: dict[int, RankProcess]) -> None:
    """TERM to the processes left, KILL after STOP_GRACE_S."""
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
