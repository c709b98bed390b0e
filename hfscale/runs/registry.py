"""The runs in a runs directory, as ``hfscale runs``/``status``/``logs``/``stop`` find them (files
only: the run directory's state.json, rank 0's progress/metrics.json, the ranks' progress files,
the logs; ``hfscale stop`` and the scheduler commands: hfscale.runs.stop; what status prints: hfscale.runs.status).

A run's state: ``running`` while the launching hfscale process lives (checked when it runs on
this host: the process recorded, by pid and start time, hfscale.core.pid_identity), ``died`` when it
is gone without a word (killed -9, a lost login node), ``submitted`` for scheduler jobs, else what
its exit code says (hfscale.core.exitcodes.state_of) or ``preempted`` when rank 0 reported a
preemption save; ``unreadable`` when state.json cannot be read (the reason is shown).

Everything is read through hfscale.core.untrusted and hfscale.core.records: the files of a run directory
may have been written by anything.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Union

from hfscale.core.pid_identity import ProcessIdentity, liveness
from hfscale.core.records import LauncherState, Rank0Metrics, RunState
from hfscale.training.heartbeat import PROGRESS_DIR, Progress, read_progress
from hfscale.launch.run_dir import (CONFIG_COPY, LOGS_DIR, PLAN_FILE, SLURM_JOB_ID_FILE, STATE_FILE, launcher_of,
                     read_metrics, read_state)
from hfscale.core.untrusted import Unreadable, decode, open_regular, printable, read_bytes, read_text, read_trusted, real_dir


class RunError(ValueError):
    """A run that cannot be found or used; the message names it."""


# a run as ``hfscale runs`` shows it: its recorded state, or died (recorded running, its launcher gone),
# unknown (none recorded), unreadable (no state.json to read)
ShownState = Union[RunState, Literal["died", "unknown", "unreadable"]]


@dataclass(frozen=True)
class RunInfo:
    """One run directory, read. ``problem``: why its state.json cannot be read (state
    ``unreadable``); ``notes``: files skipped while reading it, and why."""

    path: Path
    job_id: str
    runner: str
    state: ShownState
    step: int | None
    max_steps: int | None
    loss: float | None
    started: float | None
    ended: float | None
    exit_code: int | None
    pid: int | None
    host: str | None
    slurm_job: str | None = None
    launcher: ProcessIdentity | None = None
    problem: str | None = None
    notes: tuple[str, ...] = ()
    tokens_per_s: float | None = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def shown(self) -> str:
        """The name as a terminal may show it (a folder name may hold escape sequences)."""
        return printable(self.path.name)


def unreadable(path: Path, why: str) -> RunInfo:
    return RunInfo(path, "", "", "unreadable", None, None, None, None, None, None, None, None, problem=why)


def rank_progress(path: Path) -> tuple[list[Progress], int]:
    """(the ranks' progress files that read as such, how many ``rank-*`` files did not); a progress
    folder that is a link is not followed."""
    if not real_dir(path / PROGRESS_DIR):
        return [], 0
    try:
        entries = [e.name for e in os.scandir(path / PROGRESS_DIR) if e.name.startswith("rank-")]
    except OSError:
        return [], 0
    found = [p for name in entries if (p := read_progress(path / PROGRESS_DIR / name, path)) is not None]
    return found, len(entries) - len(found)


def run_info(path: str | Path) -> RunInfo:
    """What ``path`` (a run directory) says about its run. Never raises for what its files hold: a
    state.json that cannot be read makes the state ``unreadable`` (the reason in ``problem``),
    other files that cannot be read are left out and named in ``notes``."""
    path = Path(path)
    try:
        doc = read_state(path)
    except Unreadable as e:
        return unreadable(path, e.reason if e.path == str(path / STATE_FILE) else str(e))
    notes = []
    try:
        m = read_metrics(path)
    except Unreadable as e:
        m = Rank0Metrics()
        notes.append(f"{e}; skipped")
    step = m.step
    if step is None:  # rank 0 reported no step (a plain loop without progress.report): the ranks' files
        ranks, bad = rank_progress(path)
        step = max((p.step for p in ranks), default=None)
        if bad:
            notes.append(f"{path / PROGRESS_DIR}: {bad} unreadable progress file(s) skipped")
    slurm = None
    if doc.runner == "slurm" or (path / SLURM_JOB_ID_FILE).exists():
        try:
            slurm = slurm_job_id(path)
        except Unreadable as e:
            notes.append(f"{e}; skipped")
    return RunInfo(path, doc.job_id or "", doc.runner or "", _state(doc, m), step, m.max_steps, m.loss,
                   doc.started, doc.ended, doc.exit_code, doc.pid, doc.host, slurm, launcher_of(doc),
                   notes=tuple(notes), tokens_per_s=m.tokens_per_s)


def _state(doc: LauncherState, metrics: Rank0Metrics) -> ShownState:
    """The run's state from its state.json and rank 0's metrics. A run recorded as running whose
    launcher runs on this host but cannot be proven to be the process recorded (gone, its pid
    reused, no start time or boot id recorded) has ``died``."""
    state = doc.state or "unknown"
    if state == "running":
        who = launcher_of(doc)
        if (who is None and (doc.host is None or doc.host == socket.gethostname())) or \
                (who is not None and liveness(who) in ("gone", "unknown")):
            state = "died"
    if metrics.preempted and state in ("finished", "stopped", "failed") and doc.stop_requested is None:
        state = "preempted"
    return state


def slurm_job_id(run: Path, trusted: bool = False) -> str:
    """The Slurm job id ``sbatch`` answered, from ``<run>/slurm_job_id``: digits, or
    ``digits_digits`` for an array task, and nothing else (a value such as ``--me`` would be read
    by scancel as an option). ``trusted``: the id will be handed to the scheduler, so the file
    must pass hfscale.core.untrusted.read_trusted. Raises Unreadable."""
    from hfscale.core.records import ID_CAP, SLURM_JOB_ID

    path = run / SLURM_JOB_ID_FILE
    data = read_trusted(path, run.parent, ID_CAP) if trusted else read_bytes(path, ID_CAP, run)
    text = decode(data, path).strip()
    if not SLURM_JOB_ID.fullmatch(text):
        raise Unreadable(path, f"{text!r:.40} is not a Slurm job id (digits, or digits_digits for an array task)")
    return text


def _launch_cwd(run_dir: Path, run_dir_setting: str) -> Path | None:
    """The directory ``hfscale launch`` ran in: run_dir is ``<cwd>/<runner.run_dir>/<name>-<id>``."""
    if os.path.isabs(run_dir_setting):
        return None  # the cwd is not part of the path
    parts = tuple(p for p in Path(os.path.normpath(run_dir_setting)).parts if p != ".")
    base = run_dir.resolve().parent.parts
    if ".." in parts or (parts and base[-len(parts):] != parts):
        return None
    return Path(*base[:len(base) - len(parts)])


def output_dir_of(run_dir: Path, cfg: dict[str, Any], launch_cwd: str | None = None) -> Path:
    """training.output_dir as the ranks saw it: relative to runner.workdir, itself relative to the
    launch directory (hfscale.launch.context.output_dir_to_scan): ``launch_cwd`` where state.json
    recorded it and that directory is still there (the output_dir under it, whether made yet or not:
    a folder of the same name elsewhere, this process's ./output, is not this run's); else the first
    of the recorded one, one inferred from the run directory's path and this process's whose
    output_dir exists, else the recorded (or most likely) one."""
    def section(name: str) -> dict[str, Any]:
        v = cfg.get(name)
        return v if isinstance(v, dict) else {}

    def setting(v: object, default: str) -> str:
        return v if isinstance(v, str) and v else default

    out = setting(section("training").get("output_dir"), "output")
    runner = section("runner")
    workdir = setting(runner.get("workdir"), "")
    rel = os.path.join(workdir, out)
    if os.path.isabs(rel):
        return Path(rel)
    if launch_cwd and os.path.isdir(launch_cwd):
        return Path(launch_cwd) / rel
    bases = [Path(launch_cwd) if launch_cwd else None, _launch_cwd(run_dir, setting(runner.get("run_dir"), "runs")),
             Path.cwd()]
    candidates = [b / rel for b in bases if b is not None]
    return next((c for c in candidates if c.is_dir()), candidates[0])


def read_config_copy(run: Path) -> tuple[str, dict[str, Any]]:
    """(text, mapping) of run directory ``run``'s resolved config copy; RunError when unusable."""
    from hfscale.core.records import TEXT_CAP
    from hfscale.config.yaml_source import parse

    try:
        text = read_text(run / CONFIG_COPY, TEXT_CAP, run)
    except Unreadable as e:
        raise RunError(f"{e} (the run's config copy)") from None
    doc, problems = parse(text)
    if doc is None or problems:
        why = problems[0].message if problems else "not a mapping"
        what = "not a YAML mapping" if "top level must be a mapping" in why else f"cannot read the run's config ({why})"
        raise RunError(f"{printable(str(run / CONFIG_COPY))}: {what}, not the config copy hfscale launch writes")
    return text, doc.data


def run_output_dir(run: Path) -> Path:
    """The training.output_dir of run directory ``run`` (its config copy and state.json)."""
    try:
        cwd = read_state(run).cwd
    except Unreadable:
        cwd = None
    return output_dir_of(run, read_config_copy(run)[1], cwd)


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a folder hfscale launch made (its plan and logs/ are there); links are
    not followed."""
    try:
        return real_dir(path) and os.path.lexists(path / PLAN_FILE) and real_dir(path / LOGS_DIR)
    except (OSError, ValueError):
        return False


def _run_dirs(root: Path) -> list[Path]:
    try:
        with os.scandir(root) as it:
            names = [e.name for e in it if e.is_dir(follow_symlinks=False)]
    except OSError as e:
        raise RunError(f"{printable(str(root))}: cannot list it ({e.strerror or e})") from None
    return [root / n for n in names if is_run_dir(root / n)]


def list_runs(root: str | Path) -> list[RunInfo]:
    """The runs under ``root``, oldest first; one whose state.json cannot be read is listed as
    ``unreadable`` with the reason (it never hides the others)."""
    root = Path(root)
    if not root.is_dir():
        raise RunError(f"{printable(str(root))} is not a directory of runs (runner.run_dir; default: runs)")
    infos = [run_info(p) for p in _run_dirs(root)]
    return sorted(infos, key=lambda i: (i.started or 0.0, i.name))


def find_run(ref: str, root: str | Path = "runs") -> Path:
    """A run directory: ``ref`` itself, or the one run under ``root`` whose name is ``ref`` or ends
    with ``-<ref>`` (a job id, or its tail: ``3820dc``). An empty reference (an unset variable in a
    script) and one that matches several runs are refused, naming the matches."""
    if not ref.strip():
        raise RunError("an empty run reference names no run (an unset variable?); give a run directory, "
                       "its name or its job id")
    if is_run_dir(Path(ref)):
        return Path(ref)
    root = Path(root)
    if not root.is_dir():
        raise RunError(f"no run directory {printable(ref)!r}, and no runs directory {printable(str(root))}")
    runs = _run_dirs(root)
    of_job = re.compile(re.escape(ref) + r"-\d{8}-\d{6}-[0-9a-f]{6}$")  # <job name>-<job id>
    found = ([p for p in runs if p.name == ref] or [p for p in runs if p.name.endswith("-" + ref)]
             or [p for p in runs if of_job.match(p.name)])
    if len(found) == 1:
        return found[0]
    if not found:
        raise RunError(f"no run {printable(ref)!r} in {printable(str(root))} (hfscale runs {root} lists them)")
    names = sorted(printable(p.name) for p in found)
    more = f" and {len(names) - 20} more" if len(names) > 20 else ""
    raise RunError(f"{printable(ref)!r} matches {len(found)} runs in {printable(str(root))}: "
                   f"{', '.join(names[:20])}{more}; give more of the name or job id (the newest: {names[-1]})")


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t is not None else "-"


def _steps(i: RunInfo) -> str:
    if i.step is None:
        return "-"
    return f"{i.step}/{i.max_steps}" if i.max_steps else str(i.step)


def runs_table(infos: list[RunInfo]) -> str:
    """One line per run: name, runner, state, steps, last loss, started (``unreadable: <reason>``
    in place of a state that cannot be read)."""
    rows = [["run", "runner", "state", "steps", "loss", "started"]]
    for i in infos:
        state = f"unreadable: {printable(i.problem or '', 200)}" if i.state == "unreadable" else i.state
        rows.append([printable(i.name, 120), i.runner or "-", state, _steps(i),
                     f"{i.loss:.4f}" if i.loss is not None else "-", _when(i.started)])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)] + [0]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows) + "\n"


def log_files(path: Path) -> list[Path]:
    """The node logs of a run, in name order."""
    try:
        with os.scandir(path / LOGS_DIR) as it:
            return sorted(path / LOGS_DIR / e.name for e in it if e.name.endswith(".log"))
    except OSError:
        return []


def pick_log(path: Path, node: str | None) -> list[Path]:
    """The logs ``--node`` names (a host name or its index in name order); all without it."""
    logs = log_files(path)
    if node is None:
        return logs
    names = [p.stem for p in logs]
    if node in names:
        return [logs[names.index(node)]]
    if node.isascii() and node.isdigit() and len(node) <= 18 and int(node) < len(logs):  # int() of 4,300+ digits raises
        return [logs[int(node)]]
    shown = ", ".join(printable(n, 80) for n in names[:50]) or "none"
    raise RunError(f"no log of node {printable(node, 60)!r} (--node) in {printable(str(path / LOGS_DIR))}; there are: {shown}")


def print_log(path: Path, write: Callable[[bytes], object]) -> str | None:
    """Write the node log ``path`` to ``write`` in pieces (a log of any size, in constant memory);
    why it cannot be read (not a regular file, a link), or None."""
    try:
        fd, _ = open_regular(path, path.parent.parent)  # inside the run directory
    except Unreadable as e:
        return str(e)
    try:
        while chunk := os.read(fd, 1 << 20):
            write(chunk)
    except OSError as e:
        return f"{printable(str(path))}: {e.strerror or e}"
    finally:
        os.close(fd)
    return None


def follow_logs(run: Path, logs: list[Path], write: Callable[[str], object], poll_s: float = 0.5) -> None:
    """Write what ``logs`` hold, then what is appended, until the run is no longer running."""
    from hfscale.launch.attempt.follow import LogTail

    tail = LogTail({str(p): p for p in logs})
    prefix = {str(p): f"[{printable(p.stem, 80)}] " if len(logs) > 1 else "" for p in logs}
    while True:
        try:  # read first: what was written before it ended is drained below
            running = _state(read_state(run), Rank0Metrics()) == "running"
        except Unreadable:
            running = False
        while batch := tail.lines():  # a long log comes in pieces of follow.READ_LIMIT
            for name, line in batch:
                write(prefix[name] + line)
        if not running:
            for name, line in tail.rest():
                write(prefix[name] + line)
            return
        time.sleep(poll_s)
