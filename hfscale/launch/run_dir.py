"""The run directory: made at the start of a launch, with the plan's files (private ones 0600),
and the checkpoints ``--restart`` moves aside. Files only, no processes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hfscale.core.atomic_files import write_files
from hfscale.core.pid_identity import ProcessIdentity, this_process
from hfscale.core.shell import Command
from hfscale.core.untrusted import Missing, Unreadable, parse_record, read_bytes, read_record, read_trusted
from hfscale.launch.spec import LaunchPlan
from hfscale.training.heartbeat import FLIGHT_DIR, METRICS_FILE, PROGRESS_DIR, STACKS_DIR

if TYPE_CHECKING:
    from hfscale.core.records import LauncherState, Rank0Metrics

PLAN_FILE = "plan.txt"  # the plan as --dry-run prints it
CONFIG_COPY = "config.yaml"  # the resolved config the ranks read ($HFSCALE_CONFIG)
LOGS_DIR = "logs"  # one log per node (and prepare.log)
CLEANUP_FILE = "cleanup.json"  # the plan's cleanup, for ``hfscale stop`` of a run whose launcher died
HANG_REPORT = "hang-report.txt"  # the hang watchdog's report
SLURM_JOB_ID_FILE = "slurm_job_id"  # the id sbatch answered
STOP_MARKER = "stopping"  # written when the launch stops the job: node lines that start later exit at once
ATTEMPTS_DIR = "attempts"  # a relaunch (hfscale.launch.recovery.supervisor) moves the previous attempt's files here
BEATS_DIR = "alive"  # the nodes' heartbeats, one file per host (hfscale.launch.attempt.beats)
ORPHANED_DIR = "orphaned"  # <host>: that node stopped its job because its launcher's beat stopped
BEAT_ADDR = "beat.addr"  # the launcher's heartbeat line: "<port> <token> <address>", 0600 (hfscale.launch.attempt.beat_server)
LAUNCHER_BEAT = "launcher.beat"  # the launcher's heartbeat (hfscale.launch.attempt.beats.LauncherBeat)
STORE_ADDR = "inprocess.store"  # the in-process restarts' store: "<port>", 0600 (hfscale.training.inprocess.store_host)
UNREACHED = "unreached"  # hosts a Slurm stop or stack dump could not launch on, a line each (hfscale.launch.recovery.settle)
_PER_ATTEMPT = (LOGS_DIR, PROGRESS_DIR, STACKS_DIR, FLIGHT_DIR, BEATS_DIR, ORPHANED_DIR, STOP_MARKER, HANG_REPORT, STORE_ADDR,
                UNREACHED, PLAN_FILE)


def write_run_dir(plan: LaunchPlan, record: str, attempt: int = 0) -> Path:
    """Create the run directory with the generated files, the plan as text, logs/, and the private
    files (real secret values) readable by this user only. ``attempt`` > 0: a relaunch into the
    same directory; the previous attempt's logs, progress, stacks, stop marker and plan move to
    attempts/<attempt - 1>/ first, and the files are written again (hosts and batch may differ)."""
    run_dir = Path(plan.run_dir)
    # the batch script of a supervised Slurm job runs its first attempt in what its submission made
    taken = attempt == 0 and plan.runner == "slurm" and plan.mode == "stream" and os.path.isfile(run_dir / SLURM_JOB_ID_FILE)
    if attempt > 0:
        keep = run_dir / ATTEMPTS_DIR / str(attempt - 1)
        keep.mkdir(parents=True, exist_ok=False)
        for name in _PER_ATTEMPT:
            if os.path.lexists(run_dir / name):
                os.rename(run_dir / name, keep / name)
    else:
        run_dir.mkdir(parents=True, exist_ok=taken)
    write_files(run_dir, {**dict(plan.files), PLAN_FILE: record})
    private = {name: text.real for name, text in plan.private}
    if plan.cleanup is not None:
        c = plan.cleanup  # real values (its environment may carry ssh options): this user only
        private[CLEANUP_FILE] = json.dumps({"argv": c.real_argv(), "env": c.real_env(), "cwd": c.cwd}) + "\n"
    write_files(run_dir, private, mode=0o600)
    (run_dir / LOGS_DIR).mkdir(exist_ok=taken)
    if plan.keeper is not None:  # the nodes' keepers write here (hfscale.launch.node.keeper)
        Path(plan.keeper.beats_dir).mkdir()
        Path(plan.keeper.orphaned_dir).mkdir()
    elif plan.follow is not None:
        Path(plan.follow.beats_dir).mkdir()
    if plan.watch is not None:  # the ranks write here; made now so a rank's first write cannot race another's
        Path(plan.watch.progress_dir).mkdir()
        Path(plan.watch.stacks_dir).mkdir()
    return run_dir


def read_cleanup(run_dir: str | Path) -> Command:
    """The cleanup ``write_run_dir`` recorded. It is run as a command, so only a file this user
    alone could have written counts (hfscale.core.untrusted.read_trusted, up to the runs directory).
    Raises Unreadable (Missing, Untrusted) naming the file and the reason."""
    from hfscale.core.records import CLEANUP_CAP, CleanupRecord

    run_dir = Path(run_dir)
    path = run_dir / CLEANUP_FILE
    doc = parse_record(read_trusted(path, run_dir.parent, CLEANUP_CAP), CleanupRecord, path)
    return Command(tuple(doc.argv), tuple(doc.env.items()), doc.cwd)


def mark_stopping(marker: str | Path) -> str | None:
    """Write the stop marker (``<run dir>/stopping``): a node line that starts from now on starts
    nothing (hfscale.launch.node.line). Why it could not be written, or None."""
    try:
        Path(marker).touch()
    except OSError as e:
        return e.strerror or str(e)
    return None


def move_aside(moves: tuple[tuple[str, str], ...], echo: Callable[[str], None]) -> bool:
    """Do the plan's moves (--restart's checkpoints); False, said, when one fails."""
    for src, dst in moves:
        try:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.rename(src, dst)
        except OSError as e:
            echo(f"hfscale: cannot move {src} to {dst}: {e.strerror or e}; nothing was started")
            return False
    if moves:
        echo(f"hfscale: moved {len(moves)} checkpoint(s) to {os.path.dirname(moves[0][1])}")
    return True


STATE_FILE = "state.json"


def read_state(run_dir: str | Path) -> "LauncherState":
    """``<run dir>/state.json`` (empty when missing); raises Unreadable when it is not a regular
    file, too big, not JSON, or holds a value of the wrong type or range."""
    from hfscale.core.records import STATE_CAP, LauncherState

    try:
        return read_record(Path(run_dir) / STATE_FILE, LauncherState, STATE_CAP, run_dir)
    except Missing:
        return LauncherState()


def read_unreached(run_dir: str | Path, hosts: tuple[str, ...]) -> tuple[str, ...]:
    """The hosts among ``hosts`` that this attempt's Slurm stop or stack dump could not launch on
    (``UNREACHED``, a line each, written by the steps: read as untrusted, a link or an oversized file
    is none; names not among ``hosts`` are ignored), in ``hosts``' order."""
    try:
        text = read_bytes(Path(run_dir) / UNREACHED, 4 << 20, run_dir).decode("utf-8", "replace")
    except (Unreadable, OSError):
        return ()
    said = set(text.split("\n"))
    return tuple(h for h in hosts if h in said)


def read_metrics(run_dir: str | Path) -> "Rank0Metrics":
    """Rank 0's latest numbers, ``<run dir>/progress/metrics.json`` (hfscale.training.heartbeat.report; empty
    when none yet); raises Unreadable for a file that is not such a record."""
    from hfscale.core.records import METRICS_CAP, Rank0Metrics

    try:
        return read_record(Path(run_dir) / PROGRESS_DIR / METRICS_FILE, Rank0Metrics, METRICS_CAP, run_dir)
    except Missing:
        return Rank0Metrics()


def this_launcher() -> dict[str, object]:
    """The state.json fields a launch starts with: the launching process (its identity: a pid alone
    is not proof, hfscale.core.pid_identity), its host and directory."""
    me = this_process()
    return {"pid": me.pid, "proc_start": me.start, "boot_id": me.boot_id, "pid_ns": me.pid_ns, "host": me.host,
            "cwd": os.getcwd(), "started": time.time()}


def launcher_of(state: "LauncherState") -> ProcessIdentity | None:
    """The recorded launcher's identity (None: none recorded, or without its start time or boot id:
    unprovable)."""
    if state.pid is None or state.host is None or not state.proc_start or state.boot_id is None:
        return None
    return ProcessIdentity(state.pid, state.proc_start, state.boot_id, state.host, state.pid_ns)


def record_state(run_dir: str | Path, **fields: object) -> None:
    """Merge ``fields`` into ``<run dir>/state.json`` (what ``hfscale runs``/``status``/``stop`` read):
    at the start this_launcher() and the state, at the end the state and exit code. A state.json
    that cannot be read is replaced."""
    from hfscale.core.records import LauncherState

    try:
        doc = read_state(run_dir).model_dump(exclude_none=True)
    except Unreadable:
        doc = {}
    try:
        merged = LauncherState.model_validate({**doc, **fields}).model_dump(exclude_none=True)
    except ValueError:  # a value out of its record's range: written as it is, readers say it is unreadable
        merged = {**doc, **fields}
    try:
        write_files(Path(run_dir), {STATE_FILE: json.dumps(merged, indent=1) + "\n"})
    except OSError:
        pass  # the run goes on; hfscale runs then shows it without a state
