"""A run's history as ``hfscale report`` shows it: the Trainer's ``log_history`` (the newest
checkpoint's ``trainer_state.json`` merged with the output_dir's), hfscale's metrics and straggler
records (``hfscale_metrics.jsonl``), state.json, the resolved config and the plan. Everything is
read through hfscale.core.untrusted and typed by hfscale.core.records; what cannot be read becomes a note.
No matplotlib here: reading a run costs nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError

from hfscale.checkpoints.files import TRAINER_STATE, read_trainer_state
from hfscale.checkpoints.resume import checkpoints
from hfscale.core.records import METRICS_LINE_CAP, METRICS_LINES_CAP, TEXT_CAP, LauncherState, LogEntry, MetricsLine, TrainerState
from hfscale.core.untrusted import Missing, Unreadable, printable, read_json_lines, read_text
from hfscale.launch.run_dir import CONFIG_COPY, PLAN_FILE, read_state
from hfscale.runs.registry import RunError, output_dir_of, read_config_copy

METRICS_FILE = "hfscale_metrics.jsonl"  # hfscale.training.callbacks.collectives.METRICS_FILE (that module imports torch)
MAX_RANK_LINES = 16  # beyond this many ranks the memory plot shows min / median / max instead
MAX_METRICS_LINES = 100_000  # the newest records of hfscale_metrics.jsonl read (1,000,000 steps logged every 10)


class ReportError(ValueError):
    """The path is not a run directory (or the report cannot be written); the message says why."""


@dataclass
class RunData:
    """What the report shows, read from a run directory and its training output_dir."""

    run_dir: Path
    name: str
    config_text: str
    plan_text: str
    output_dir: Path
    history: list[dict[str, Any]] = field(default_factory=list)  # log_history entries, by step
    metrics: list[dict[str, Any]] = field(default_factory=list)  # "metrics" events, file order
    stragglers: list[dict[str, Any]] = field(default_factory=list)  # "straggler" events, file order
    state: LauncherState = field(default_factory=LauncherState)  # state.json (hfscale.launch.run_dir.record_state)
    notes: list[str] = field(default_factory=list)  # oddities found while reading, shown on the page


_KEPT = ("event", "step", "job", "time", "world_size", "tokens_per_s", "mfu", "mem_peak_mb_per_rank",
         "forward_s_per_rank", "step_time_s_per_rank", "hosts", "slowest_rank", "slowest_host", "ratio",
         "median_forward_s", "threshold", "straggler")
PER_RANK = ("forward_s_per_rank", "step_time_s_per_rank", "hosts")


class RankStats(NamedTuple):
    """The spread of one number over the ranks."""

    min: float
    median: float
    max: float


def rank_stats(values: list[float | None]) -> RankStats | None:
    """(min, median, max) of the numbers in ``values``."""
    vals = sorted(v for v in values if v is not None)
    return RankStats(vals[0], vals[round((len(vals) - 1) / 2)], vals[-1]) if vals else None


def _compact():
    """What the report keeps of each record, newest first: the fields it shows; per-rank peak
    memory as (min, median, max) beyond MAX_RANK_LINES ranks; the per-rank lists of the newest
    straggler report only. Memory then grows with the records, not with the ranks."""
    newest_straggler = True
    newer: tuple[list, dict[str, Any]] | None = None  # the next newer metrics record: its peaks, its dict

    def keep(r: MetricsLine) -> dict[str, Any]:
        nonlocal newest_straggler, newer
        d = {k: v for k in _KEPT if (v := getattr(r, k)) is not None}
        mem = d.get("mem_peak_mb_per_rank")
        if r.event == "metrics" and mem is not None:
            if newer is not None and any(b < a for a, b in zip(mem, newer[0]) if a is not None and b is not None):
                newer[1]["relaunch"] = True  # a rank's peak fell: only a new process lowers it (decided here,
            newer = (mem, d)                 # while every rank's peak is still at hand)
        if mem is not None and len(mem) > MAX_RANK_LINES:
            del d["mem_peak_mb_per_rank"]
            d["mem_peak_mb_stats"] = rank_stats(mem)
        if r.event == "straggler":
            if not newest_straggler:
                for k in PER_RANK:
                    d.pop(k, None)
            newest_straggler = False
        return d
    return keep


def _read_metrics_lines(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The records of hfscale_metrics.jsonl (hfscale.core.records.MetricsLine; NaN and infinities read as
    None); lines that are not records (half a line left by a killed job, wrong types) are skipped
    and counted in ``notes``."""
    try:
        lines = read_json_lines(path, MetricsLine, METRICS_LINE_CAP, METRICS_LINES_CAP, MAX_METRICS_LINES, path.parent,
                                keep=_compact())
    except Missing:
        return []
    except Unreadable as e:
        notes.append(f"{e}; not read")
        return []
    note = lines.note(path)
    if note:
        notes.append(note)
    return lines.records


def _log_history(output_dir: Path, notes: list[str]) -> list[dict[str, Any]]:
    """log_history of the newest readable checkpoint and of output_dir's own trainer_state.json,
    merged by step (the newer state wins): each holds the whole history up to its step."""
    states = []
    for c in reversed(checkpoints(output_dir)):
        state = _read_trainer_state(c.path / TRAINER_STATE, notes)
        if state is not None:
            states.append(state)
            break
    root = _read_trainer_state(output_dir / TRAINER_STATE, notes)
    if root is not None:
        states.append(root)
    by_step: dict[int, dict[str, Any]] = {}
    bad = 0
    for state in sorted(states, key=lambda s: s.global_step):
        for e in state.log_history:
            try:
                entry = LogEntry.model_validate(e)
            except ValidationError:
                bad += 1
                continue
            if isinstance(e, dict) and "loss" in e:  # training-loss entries
                by_step[entry.step] = entry.model_dump(exclude_none=True)
    if bad:
        notes.append(f"{bad} unreadable log_history entries skipped (trainer_state.json)")
    return [by_step[k] for k in sorted(by_step)]


def _read_trainer_state(path: Path, notes: list[str]) -> TrainerState | None:
    try:
        return read_trainer_state(path)
    except Missing:
        return None
    except Unreadable as e:
        notes.append(f"{printable(str(path))}: unreadable ({e.reason}), skipped")
        return None


def read_run(run_dir: str | Path) -> RunData:
    """Everything the report shows. Raises ReportError when ``run_dir`` is not a run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{printable(str(run_dir))}: no such run directory (hfscale launch makes them under "
                          "runner.run_dir)")
    missing = [n for n in (PLAN_FILE, CONFIG_COPY) if not os.path.lexists(run_dir / n)]
    if missing:
        raise ReportError(f"{printable(str(run_dir))} is not an hfscale run directory: {' and '.join(missing)} "
                          "missing (hfscale launch writes both)")
    try:
        config_text, cfg = read_config_copy(run_dir)
        plan_text = read_text(run_dir / PLAN_FILE, TEXT_CAP, run_dir)
    except RunError as e:
        raise ReportError(str(e)) from None
    except Unreadable as e:
        raise ReportError(f"{e} (the run's plan)") from None
    notes: list[str] = []
    try:
        state = read_state(run_dir)
    except Unreadable as e:
        notes.append(f"{e}; skipped")
        state = LauncherState()
    data = RunData(run_dir, str(cfg.get("name") or run_dir.name), config_text, plan_text,
                   output_dir_of(run_dir, cfg, state.cwd), state=state, notes=notes)
    data.history = _log_history(data.output_dir, data.notes)
    events = _read_metrics_lines(data.output_dir / METRICS_FILE, data.notes)
    data.metrics = [r for r in events if r.get("event") == "metrics"]
    data.stragglers = [r for r in events if r.get("event") == "straggler"]
    return data


