"""The bookkeeping of one running plan (no processes: hfscale.launch.attempt.execute starts and stops
them): its output routed (hfscale.launch.attempt.run_output), the first failure said once, and with
in-process restarts the failures the ranks heal (hfscale.launch.attempt.in_process)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable, Protocol

from hfscale.core.exitcodes import signal_name
from hfscale.launch.attempt.beats import LaunchBeats
from hfscale.launch.attempt.in_process import HealedEnds
from hfscale.launch.attempt.node_lines import Failure
from hfscale.launch.attempt.run_output import RunOutput
from hfscale.launch.spec import LaunchPlan


FINISHED_GRACE_S = 30.0  # in-process restarts: after a node finished the job, the standbys left end within seconds


class MainProcess(Protocol):
    """What the bookkeeping needs of the main process (a subprocess.Popen)."""

    pid: int

    def wait(self, timeout: float | None = None) -> int: ...

    def poll(self) -> int | None: ...


class RunState:
    """Bookkeeping for one running plan: logs, the first failure, stopping once (``stop``: hfscale.launch.attempt.execute's)."""

    def __init__(self, plan: LaunchPlan, run_dir: Path, echo: Callable[[str], None], signals: list[int],
                 beats: LaunchBeats | None = None):  # the launcher's heartbeats: its file and line
        self.plan, self.beats, self.echo = plan, beats, echo
        self._signals = signals  # execute's signal handler appends the first stop signal here
        self.healing = HealedEnds() if plan.store is not None else None  # in-process restarts: the ranks heal
        self.out = RunOutput(plan.logs, plan.runner, run_dir, echo, self._node_failed, every=self.healing is not None)
        self.failure: tuple[str, int] | None = None  # (where, exit code) of the first failure
        self.what, self.failed_at = "", 0.0  # what was said of it, and when
        self.hung = False  # the failure is the hang watchdog's (a node may exit 4 too)
        self._stop_lock = threading.Lock()
        self._stopping = False
        self._stopper: threading.Thread | None = None  # execute's cleanup
        self.proc: MainProcess | None = None  # main (execute sets it once started)
        self.following = False  # main started a detached job and ended: its process group is gone
        self.ended = threading.Event()  # the job is over: the watchdog stops watching

    @property
    def signalled(self) -> int | None:
        """The signal that stopped the job, if one did."""
        return self._signals[0] if self._signals else None

    @property
    def exited(self) -> set[str]:
        """The hosts that printed their exit line."""
        return self.out.nodes.exited

    def route(self, line: str) -> None:
        self.out.route(line, self.failure is not None or self.signalled is not None)

    def _node_failed(self, f: Failure) -> None:
        if self.healing is not None and self.failure is None and self.healing.heals(f):
            self.echo(f"hfscale: {f.what}; the other nodes restart in process")
        elif self.signalled is None:
            self.fail(f.where, f.rc, f.what)

    def fail(self, where: str, rc: int, what: str) -> None:
        """The first failure: say it and stop the job everywhere."""
        with self._stop_lock:
            if self.failure is not None:
                return
            self.failure, self.what, self.failed_at = (where, rc), what, time.time()
        self.echo(f"hfscale: {what}; stopping the job on every node")
        self.stop()

    def watch_main(self) -> None:
        """``main`` killed by a signal hfscale did not send (pdsh, srun, the launcher): the job's
        ranks live on and the processes it left hold its output open, so stop the job."""
        assert self.proc is not None
        rc = self.proc.wait()
        if rc < 0 and self.failure is None and self.signalled is None and not self._stopping:
            name = os.path.basename(self.plan.main.real_argv()[0])
            if self.plan.runner == "local":  # a shell that became the launcher (exec)
                name = os.path.basename(self.plan.nodes[0].command.items[0])  # type: ignore[arg-type]
            self.fail(name, 128 - rc, f"{name} was killed ({signal_name(-rc)})")

    def stop_the_rest(self, grace_s: float = FINISHED_GRACE_S) -> None:
        """In-process restarts: once a node has finished the job, what still runs ``grace_s`` later is a
        rank that will never end by itself (frozen, or cut off from the others): stop it."""
        while not self.ended.wait(1.0):
            if self.out.nodes.succeeded:
                break
        if self.ended.wait(grace_s) or self.failure is not None or self.signalled is not None:
            return
        left = sorted(set(self.plan.logs) - self.out.nodes.exited) if self.plan.logs else []
        self.echo(f"hfscale: the job finished on {sorted(self.out.nodes.succeeded)[0]}; {grace_s:.0f} s later "
                  f"{', '.join(left) or 'some nodes'} still run (a rank frozen or cut off): stopping them")
        self.stop()

    def stop(self) -> None:
        """Stop the job on every node (once): hfscale.launch.attempt.execute's."""
        raise NotImplementedError

    def close(self) -> None:
        self.ended.set()
        self.out.close()
