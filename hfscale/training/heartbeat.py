"""Training progress, reported by each rank to ``hfscale launch``'s hang watchdog.

In a plain training loop, one line per optimizer step is all it takes (``step``, ``alive`` and
``report`` are public: ``hfscale.step``, ...)::

    import hfscale
    ...
    hfscale.step(step)      # after each optimizer step

The hfscale callbacks do this for the HF Trainer (hfscale.ProgressCallback; a Trainer
script launched by ``hfscale launch`` gets it without a change), and so does the built-in entry
point. Outside ``hfscale launch`` (no ``HFSCALE_RUN_DIR`` in the environment) it does nothing.

Each rank writes ``<run dir>/progress/rank-<RANK>``: ``<step> <pid> <host> <beat>`` (a few bytes,
replaced atomically; the beat counts every write, so ``alive()`` between steps shows work too). The first call also arranges for the rank's Python stack to be written to
``<run dir>/stacks/rank-<RANK>.fh`` on SIGUSR2 (``faulthandler``, from C: it works while the rank
is blocked inside a collective), which the watchdog uses where py-spy is not installed, and
starts a thread that writes the rank's flight recorder (its last collectives) when the watchdog
asks through ``stacks/rank-<RANK>.fifo``.
Standard library only: importing it costs nothing.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import MutableMapping

PROGRESS_DIR = "progress"
STACKS_DIR = "stacks"
FLIGHT_DIR = "flight"
FAULTHANDLER_SUFFIX = ".fh"
FIFO_SUFFIX = ".fifo"
METRICS_FILE = "metrics.json"
_state: dict[str, object] = {}


def _target() -> tuple[Path, str] | None:
    run_dir = os.environ.get("HFSCALE_RUN_DIR")
    if not run_dir:
        return None
    return Path(run_dir), os.environ.get("RANK", "0")


def step(n: int) -> None:
    """Record that this rank finished optimizer step ``n``; never raises (training goes on)."""
    _write(int(n))


def alive() -> None:
    """Record that this rank is working between steps (an evaluation batch, a save): the watchdog
    counts it as progress, the step stays. Cheap enough for every evaluation batch."""
    last = _state.get("step")
    _write(last if isinstance(last, int) else 0)


def report(**values: object) -> None:
    """Rank 0's latest numbers (step, max_steps, loss, learning_rate, tokens_per_s, eta_s, ...; resumed:
    the step this start resumed from, said once before the first ``step``) for
    ``hfscale launch``'s progress line and ``hfscale runs``: merged into ``progress/metrics.json``
    (replaced atomically). Other ranks, and runs outside ``hfscale launch``, write nothing. In a
    plain loop: ``hfscale.report(step=step, max_steps=total, loss=loss.item())``."""
    target = _target()
    if target is None or target[1] != "0":
        return
    merged = {**_state.get("metrics", {}), **{k: v for k, v in values.items() if _plain(v)}}  # type: ignore[dict-item]
    _state["metrics"] = merged
    folder = target[0] / PROGRESS_DIR
    try:
        folder.mkdir(exist_ok=True)
        _replace(folder / METRICS_FILE, json.dumps({**merged, "time": time.time()}))
    except OSError:
        pass


# A start's parts, in order (issue 38): rank 0 marks when each ended, on its clock; the supervisor turns
# them into the parts of a restart (hfscale.launch.recovery.supervisor). "process": the interpreter's own
# start (from /proc); "imports" and "model": the built-in entry point marks them, a user script's Trainer
# marks "model" when it is built (its imports inside); "engine" and "checkpoint": DeepSpeed's
# load_checkpoint starts and ends (without one, both at train begin); "data": the first step begins
# (the Trainer fast-forwarded its data and fetched the first batch); "first_step": it ended.
PHASES = ("process", "imports", "model", "engine", "checkpoint", "data", "first_step")


def phase(name: str, at: float | None = None) -> None:
    """Rank 0 marks that part ``name`` of this start ended (now, or ``at``); a part is marked once per
    process (the first mark stays). Outside ``hfscale launch``, and on other ranks, nothing."""
    target = _target()
    if target is None or target[1] != "0" or name not in PHASES:
        return
    marks = _state.setdefault("phases", {})
    if name in marks:  # type: ignore[operator]
        return
    if not marks and name != "process" and (started := process_started()) is not None:
        marks["process"] = started  # type: ignore[index]
    marks[name] = time.time() if at is None else at  # type: ignore[index]
    report(phases=dict(marks))  # type: ignore[call-overload]


def begin_attempt(at: float, attempt: int = 0, why: str = "") -> None:
    """An in-process restart's new attempt ``attempt`` (hfscale.training.inprocess.restart) began in
    this process: its start's parts are marked again, from ``at`` (when the previous attempt ended,
    ``why``): no process started, so the "process" part is that moment. Rank 0 reports the attempt,
    why and its last step before it, for the launch's timeline (hfscale.launch.recovery.in_process_events)."""
    last = _state.get("step")
    _state["phases"] = {}
    report(in_process=attempt, in_process_why=why[:500], failed_step=last if isinstance(last, int) else None,
           resumed=None)
    phase("process", at)


def parts(marks: dict[str, float], launched: float | None) -> dict[str, float]:
    """The seconds each part of a start took, from the mark before it ("process": from ``launched``,
    when the launch started it); a part not marked gives its time to the next one marked."""
    out: dict[str, float] = {}
    before = launched
    for name in PHASES:
        at = marks.get(name)
        if at is None:
            continue
        if before is not None:
            out[name] = round(max(0.0, at - before), 3)
        before = at
    return out


def process_started() -> float | None:
    """When this process started (its start time in /proc on this host's clock), or None off Linux."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, the 22nd field: clock ticks after boot
        running = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - running
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _plain(v: object) -> bool:
    if isinstance(v, dict):  # the phases: names and times
        return all(isinstance(k, str) and isinstance(t, float) and _plain(t) for k, t in v.items())
    return v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and v == v and abs(v) != float("inf"))


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: readers (the watchdog, hfscale runs) never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write(n: int) -> None:
    target = _target()
    if target is None:
        return
    run_dir, rank = target
    beat = int(_state.get("beat", 0)) + 1  # type: ignore[call-overload]
    _state["step"], _state["beat"] = n, beat
    try:
        if "stacks" not in _state:
            _state["stacks"] = _install_stack_dump(run_dir, rank)
            _state["flight"] = _serve_flight_recorder(run_dir, rank)
        folder = run_dir / PROGRESS_DIR
        folder.mkdir(exist_ok=True)
        _replace(folder / f"rank-{rank}", f"{n} {os.getpid()} {socket.gethostname()} {beat}\n")
    except OSError:
        pass  # a full or read-only disk must not stop training; the watchdog then sees no progress


def _install_stack_dump(run_dir: Path, rank: str) -> object:
    """faulthandler on SIGUSR2, into stacks/rank-<RANK>.fh (kept open: a stuck rank cannot open files)."""
    try:
        folder = run_dir / STACKS_DIR
        folder.mkdir(exist_ok=True)
        out = open(folder / f"rank-{rank}{FAULTHANDLER_SUFFIX}", "w")  # noqa: SIM115 (open for the process)
        faulthandler.register(signal.SIGUSR2, file=out, all_threads=True, chain=False)
        return out
    except (OSError, ValueError, RuntimeError):
        return None


def _serve_flight_recorder(run_dir: Path, rank: str) -> object:
    """A thread waiting on ``stacks/rank-<RANK>.fifo``: when the watchdog writes to it, the rank's
    flight recorder (its last collectives, as torch.distributed keeps them: TORCH_FR_BUFFER_SIZE)
    goes to ``flight/rank-<RANK>.json``. It runs while the main thread waits inside a collective
    (the wait releases the GIL)."""
    fifo = run_dir / STACKS_DIR / f"rank-{rank}{FIFO_SUFFIX}"
    try:
        if fifo.is_fifo():
            fifo.unlink()
        os.mkfifo(fifo, 0o600)
    except OSError:
        return None
    out = run_dir / FLIGHT_DIR / f"rank-{rank}.json"
    thread = threading.Thread(target=_flight_loop, args=(fifo, out), name="hfscale-flight-recorder", daemon=True)
    thread.start()
    return thread


def fit_flight_recorder(environ: MutableMapping[str, str] = os.environ) -> None:
    """Before torch starts in a rank launched by hfscale: the flight recorder values hfscale set,
    under the names this node's torch reads (the launching machine's torch chose them;
    hfscale.config.envvars.flight_recorder_on_node)."""
    run_dir = environ.get("HFSCALE_RUN_DIR")
    if not run_dir:
        return
    from hfscale.config.envvars import FLIGHT_DUMP_NAME, FLIGHT_ENTRIES, flight_recorder_on_node, installed_torch

    dump = os.path.join(run_dir, FLIGHT_DIR, FLIGHT_DUMP_NAME)
    for name, value in flight_recorder_on_node(environ, installed_torch(), FLIGHT_ENTRIES, dump).items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def _flight_loop(fifo: Path, out: Path) -> None:
    while True:
        try:
            with open(fifo) as f:  # blocks until the watchdog's dump writes to it
                f.read()
        except OSError:
            return
        c10d = sys.modules.get("torch._C._distributed_c10d")
        dumps = []
        for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
            fn = getattr(c10d, name, None)
            if fn is not None:
                try:
                    dumps.append({"source": name, **json.loads(fn())})
                except Exception:  # noqa: BLE001 (a trace the runtime cannot give is left out)
                    pass
        try:
            out.parent.mkdir(exist_ok=True)
            _replace(out, json.dumps(dumps))
        except OSError:
            pass


@dataclass(frozen=True)
class Progress:
    """What a rank last reported."""

    rank: int
    step: int
    pid: int
    host: str
    beat: int = 0


PROGRESS_CAP = 4096  # a rank's progress file is one short line
_RANK_FILE = re.compile(r"^rank-([0-9]{1,7})$")
_LINE = re.compile(r"^([0-9]{1,15}) ([0-9]{1,7}) ([A-Za-z0-9_.:-]{1,255})(?: ([0-9]{1,15}))?$")


def read_progress(path: Path, root: Path | None = None) -> Progress | None:
    """A rank's progress file, or None when it is missing, half-written or not one (a FIFO, a link,
    a huge file, other text: hfscale.core.untrusted reads it; ``root``: a folder it must be inside)."""
    from hfscale.core.untrusted import Unreadable, read_bytes

    name = _RANK_FILE.fullmatch(path.name)
    if name is None:
        return None
    try:
        text = read_bytes(path, PROGRESS_CAP, root).decode("ascii").strip()
    except (Unreadable, UnicodeDecodeError):
        return None
    m = _LINE.fullmatch(text)
    if m is None:
        return None
    return Progress(int(name.group(1)), int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4) or 0))


def rank0_last_step(run_dir: Path) -> tuple[float, int] | None:
    """(when, step) of rank 0's last progress in ``run_dir`` (its progress file's modification time,
    on this host's clock), or None when there is none to read."""
    path = Path(run_dir) / PROGRESS_DIR / "rank-0"
    p = read_progress(path, Path(run_dir))
    try:
        return (os.lstat(path).st_mtime, p.step) if p is not None else None
    except OSError:
        return None
