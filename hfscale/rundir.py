"""The run directory: made at the start of a launch, with the plan's files (private ones 0600),
and the checkpoints ``--restart`` moves aside. Files only, no processes."""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Callable

from .files import write_files
from .launch_plan import LaunchPlan
from .shell import Command

PLAN_FILE = "plan.txt"  # the plan as --dry-run prints it
CONFIG_COPY = "config.yaml"  # the resolved config the ranks read ($HFSCALE_CONFIG)
LOGS_DIR = "logs"  # one log per node (and prepare.log)
CLEANUP_FILE = "cleanup.json"  # the plan's cleanup, for ``hfscale stop`` of a run whose launcher died
HANG_REPORT = "hang-report.txt"  # the hang watchdog's report
SLURM_JOB_ID_FILE = "slurm_job_id"  # the id sbatch answered


def write_run_dir(plan: LaunchPlan, record: str) -> Path:
    """Create the run directory with the generated files, the plan as text, logs/, and the private
    files (real secret values) readable by this user only."""
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True, exist_ok=False)
    write_files(run_dir, {**dict(plan.files), PLAN_FILE: record})
    private = {name: text.real for name, text in plan.private}
    if plan.cleanup is not None:
        c = plan.cleanup  # real values (its environment may carry ssh options): this user only
        private[CLEANUP_FILE] = json.dumps({"argv": c.real_argv(), "env": c.real_env(), "cwd": c.cwd}) + "\n"
    write_files(run_dir, private, mode=0o600)
    (run_dir / LOGS_DIR).mkdir()
    if plan.follow is not None:
        Path(plan.follow.beats_dir).mkdir()
    if plan.watch is not None:  # the ranks write here; made now so a rank's first write cannot race another's
        Path(plan.watch.progress_dir).mkdir()
        Path(plan.watch.stacks_dir).mkdir()
    return run_dir


def read_cleanup(run_dir: str | Path) -> Command | None:
    """The cleanup ``write_run_dir`` recorded (None: none recorded, not readable as one, or a file
    this user did not write alone: it is run as a command)."""
    path = Path(run_dir) / CLEANUP_FILE
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None
        doc = json.loads(path.read_text())
        argv, env, cwd = doc["argv"], doc["env"], doc["cwd"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv) and isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
            and (cwd is None or isinstance(cwd, str))):
        return None
    return Command(tuple(argv), tuple(env.items()), cwd)


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


def read_state(run_dir: str | Path) -> dict:
    """``<run dir>/state.json`` ({} when missing or unreadable)."""
    try:
        doc = json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def this_launcher() -> dict[str, object]:
    """The state.json fields a launch starts with: the launching process, its host and directory."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "cwd": os.getcwd(), "started": time.time()}


def record_state(run_dir: str | Path, **fields: object) -> None:
    """Merge ``fields`` into ``<run dir>/state.json`` (what ``hfscale runs``/``status``/``stop`` read):
    at the start this_launcher() and the state, at the end the state and exit code."""
    doc = read_state(run_dir)
    try:
        write_files(Path(run_dir), {STATE_FILE: json.dumps({**doc, **fields}, indent=1) + "\n"})
    except OSError:
        pass  # the run goes on; hfscale runs then shows it without a state
