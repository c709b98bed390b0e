"""``hfscale stop`` and the scheduler commands about a run (files only; the commands run through
hfscale.launch.attempt.execute).

Nothing read from a run directory is trusted: a pid is signalled only when it is provably the
launcher recorded (hfscale.core.pid_identity), and what is run or handed to a scheduler (the recorded
cleanup, the Slurm job id, the Kubernetes objects) comes from files this user alone could have
written (hfscale.core.untrusted.read_trusted), checked by shape.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

from hfscale.core.pid_identity import liveness, signal_recorded
from hfscale.core.records import STATE_CAP, LauncherState
from hfscale.core.shell import Command, Text
from hfscale.core.untrusted import Unreadable, decode, printable, read_trusted
from hfscale.launch.run_dir import STATE_FILE, STOP_MARKER, mark_stopping, read_cleanup, read_state, record_state
from hfscale.runs.registry import RunError, RunInfo, slurm_job_id


STOP_WAIT_S = 120  # the launcher's stop: TERM, a grace period, KILL, on every node


def scheduler_command(i: RunInfo, action: str) -> Command | None:
    """The scheduler command that stops (``stop``) or asks about a submitted run: ``state``, the
    controller's record (Slurm: ``scontrol show job``, kept MinJobAge after the end), ``accounting``
    (Slurm: ``sacct``; hfscale.runs.slurm_state reads both). What
    it hands to the scheduler comes from files this user alone could have written
    (hfscale.core.untrusted.read_trusted), checked by shape: a Slurm job id, the Kubernetes objects the
    launch created. Raises RunError naming the file and the reason."""
    from hfscale.launch.runners.kubernetes import MANIFESTS, deletion
    from hfscale.runs.slurm_state import sacct_argv

    try:
        if i.runner == "slurm" or i.slurm_job:
            job = slurm_job_id(i.path, trusted=True)
            # the id is checked to be digits; "--" and "--jobs=" keep even a changed one from being an option
            if action == "stop":
                return Command(("scancel", "--", job))
            return Command(sacct_argv(job)) if action == "accounting" else \
                Command(("scontrol", "show", "job", "--oneliner", job))
        if i.runner == "kubernetes" and action == "stop":
            from hfscale.core.records import MANIFEST_CAP

            path = i.path / MANIFESTS
            text = decode(read_trusted(path, i.path.parent, MANIFEST_CAP), path)
            try:
                objects = deletion(text, i.job_id)
            except ValueError as e:
                raise Unreadable(path, str(e)) from None
            return Command(("kubectl", "delete", "--ignore-not-found", "-f", "-"), stdin=Text(objects, objects))
    except Unreadable as e:
        raise RunError(f"{e}; nothing was handed to {i.runner or 'the scheduler'}") from None
    return None


def stop(i: RunInfo, say: Callable[[str], object]) -> int:
    """Stop run ``i`` on every host: its launcher gets SIGTERM (it runs the cleanup everywhere)
    and is waited for; a submitted run is cancelled through its scheduler; a run whose launcher
    died gets the cleanup that launcher recorded. The exit code.

    A pid is signalled only when it is provably the launcher recorded (hfscale.core.pid_identity:
    host, boot, pid namespace, pid and start time) in a state.json only this user could have
    written; otherwise nothing is signalled."""
    name = i.shown
    launcher = f"its launcher (pid {i.pid})" if i.pid is not None else "its launcher"
    if i.state == "unreadable":
        raise RunError(f"{name}: its state cannot be read ({printable(i.problem or '')}); nothing was stopped")
    supervised = i.slurm_job is not None and i.state in ("running", "died")  # its supervisor runs in the allocation
    if i.state == "submitted" or supervised:
        if supervised:  # the stop marker first: a node line that starts from now on starts nothing
            mark_stopping(i.path / STOP_MARKER)
        cmd = scheduler_command(i, "stop")
        if cmd is None:
            raise RunError(f"{name}: submitted to {i.runner or 'a scheduler'}; hfscale does not know how to cancel it")
        _run_stop(i, cmd, cmd.shell(), 60)
        say(f"hfscale: {cmd.shell()}: done; {name} stopped")
        return 0
    if i.state == "died":
        try:
            cmd = read_cleanup(i.path)
        except Unreadable as e:
            raise RunError(f"{name}: {launcher} died, and its recorded cleanup cannot be used: {e}; stop its "
                           "processes by hand") from None
        mark_stopping(i.path / STOP_MARKER)  # a node line its pdsh starts from now on starts nothing
        what = f"the recorded cleanup ({printable(os.path.basename(cmd.real_argv()[0]))})"
        say(f"hfscale: {name}: {launcher} died; running {what} on every host")
        _run_stop(i, cmd, what, STOP_WAIT_S)
        say(f"hfscale: {name} stopped")
        return 0
    if i.state != "running":
        raise RunError(f"{name} is not running (state {i.state})")
    who = i.launcher
    if who is None or liveness(who) == "elsewhere":
        raise RunError(f"{name} was launched on {i.host} (pid {i.pid}): run hfscale stop there")
    try:  # what names the pid to signal must be this user's own record
        read_trusted(i.path / STATE_FILE, i.path.parent, STATE_CAP)
    except Unreadable as e:
        raise RunError(f"{e}; nothing was signalled") from None
    say(f"hfscale: stopping {name}: SIGTERM to {launcher}, which stops every node")
    record_state(i.path, stop_requested=time.time())  # the ranks' preemption save then reads as stopped
    if not signal_recorded(who, signal.SIGTERM):
        raise RunError(f"{name}: {launcher} is gone (that pid is no longer the process recorded); nothing was "
                       f"signalled. hfscale stop {name} again runs its recorded cleanup")
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        try:
            doc = read_state(i.path)
        except Unreadable:
            doc = LauncherState(state="running")
        if doc.state != "running":
            say(f"hfscale: {name} {doc.state} (exit code {doc.exit_code})")
            return 0
        if liveness(who) == "gone":
            say(f"hfscale: {name}: {launcher} ended without recording how")
            return 0
        time.sleep(0.5)
    raise RunError(f"{name}: {launcher} did not end within {STOP_WAIT_S} s")


def _run_stop(i: RunInfo, cmd: Command, what: str, timeout: float) -> None:
    """Run the command that stops ``i`` (a scheduler's cancel, or the cleanup a launcher that died
    recorded: it stops the job's processes on every host), then record the run as stopped."""
    from hfscale.launch.attempt.execute import run_probe

    record_state(i.path, stop_requested=time.time())
    rc, out, err = run_probe(cmd, timeout=timeout)
    if rc != 0:
        raise RunError(f"{i.shown}: {what} failed (exit code {rc}): {printable((err or out).strip())}")
    record_state(i.path, state="stopped", ended=time.time())
