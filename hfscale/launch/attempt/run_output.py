"""Where each line a running job prints goes (files only, no processes): to its node's log in the
run directory, to the terminal, and into the nodes' state (hfscale.launch.attempt.node_lines), which says
when a node failed; hfscale.launch.attempt.first_failure picks the failure to name."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TextIO

from hfscale.launch.attempt.disk_full import Signs
from hfscale.launch.attempt.first_failure import FirstFailure
from hfscale.launch.attempt.node_lines import HOST_PREFIX, Failure, Nodes, parse
from hfscale.launch.run_dir import LOGS_DIR


class RunOutput:
    """The job's output, line by line: logged per node, shown, and watched for a node's failure."""

    def __init__(self, logs: frozenset[str], runner: str, run_dir: Path, echo: Callable[[str], None],
                 on_failure: Callable[[Failure], None], every: bool = False):
        self.runner = runner
        self.echo = echo
        self.logs: dict[str, TextIO] = {h: open(run_dir / LOGS_DIR / f"{h}.log", "a", encoding="utf-8") for h in logs}
        self.nodes = Nodes()  # each host's state, from its lines
        self.disk = Signs()  # a full disk, as the ranks' errors show it (hfscale.launch.attempt.disk_full)
        self.first = FirstFailure(on_failure)  # the ranks a dead rank took down wait for it
        self.every = on_failure if every else None  # in-process restarts: each node's failure, as it comes

    def route(self, line: str, failed: bool) -> None:
        """One line; ``failed``: the job already failed or was signalled (no failure is looked for)."""
        m = HOST_PREFIX.match(line)
        host = m["host"] if m and m["host"] in self.logs else None
        if host is None and len(self.logs) == 1:
            host = next(iter(self.logs))
        if host is not None:
            self.logs[host].write(line + "\n")
            self.logs[host].flush()
        self.echo(line)
        self.disk.see(host or (m["host"] if m else self.runner), line)
        failure = self.nodes.see(parse(line))
        if failure is not None and not failed:
            if self.every is not None:
                self.every(failure)
            else:
                self.first.offer(failure)

    def close(self) -> None:
        for f in self.logs.values():
            f.close()
