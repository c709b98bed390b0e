"""A plan's controls of its job on the nodes, built once for every runner (pure): ``cleanup`` (the
stop: TERM, then KILL after the grace period), ``dump`` (the ranks' stacks, after a hang) and
``kill`` (the stop after a hang, no grace), from hfscale.launch.node.stopping's shell text.

A runner gives only its way to reach its nodes (``reach``: a node's shell line -> the command that
runs it on every node: this host, ``pdsh``, an srun step per node) and, for containers, what goes
before the stop on a node (``first``: removing the job's containers).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from hfscale.core.shell import Command, Item, Line, Sh
from hfscale.launch.node.stopping import dump_script, stop_script
from hfscale.launch.spec import HangWatch


class Controls(NamedTuple):
    """The plan's ``cleanup``, ``dump`` and ``kill`` (the last two None without the hang watchdog)."""

    cleanup: Command
    dump: Command | None
    kill: Command | None


def controls(reach: Callable[[Line], Command], job_id: str, watch: HangWatch | None, python: str,
             first: tuple[Item, ...] = ()) -> Controls:
    """The stop, stack dump and kill of job ``job_id`` on every node ``reach`` runs a line on."""
    cleanup = reach(Line((*first, Sh(stop_script(job_id)))))
    if watch is None:
        return Controls(cleanup, None, None)
    return Controls(cleanup, reach(Line((Sh(dump_script(job_id, watch.stacks_dir, python)),))),
                    reach(Line((*first, Sh(stop_script(job_id, grace_s=0))))))
