"""``hfscale report RUN``: one self-contained HTML page about a run directory.

The page shows, over the optimizer steps, the loss, learning rate and gradient norm (the Trainer's
``log_history`` in ``trainer_state.json``) and the tokens/s, MFU and peak memory per rank
(``hfscale_metrics.jsonl``, hfscale.training.callbacks.reporting), then the straggler reports, the resolved
config and the launch plan. Plots are matplotlib SVG inlined in the page, so it opens without a
network (a Content-Security-Policy forbids every fetch). Whatever is missing becomes a one-line
"not recorded" note; only a path that is not a run directory is an error (:class:`ReportError`).

matplotlib is imported only to draw a plot: config-only commands never pay for it, and without it
(the README's install) the page is written with a note in each plot's place.
"""

from __future__ import annotations

import html
import io
import math
import re
import time
from pathlib import Path
from typing import Any

from hfscale.core.atomic_files import write_files
from hfscale.core.untrusted import Unreadable
from hfscale.launch.context import run_of
from hfscale.checkpoints.rollbacks import incident_line, read_rollbacks
from hfscale.launch.recovery.timeline import Timeline, read_timeline
from hfscale.launch.run_dir import CONFIG_COPY, PLAN_FILE
from hfscale.runs.goodput import goodput, lines, timeline_lines
from hfscale.runs.history import (MAX_RANK_LINES, METRICS_FILE, PER_RANK, TRAINER_STATE, ReportError, RunData, rank_stats,
                          read_run)

__all__ = ["ReportError", "RunData", "read_run", "render_html", "write_report"]

MAX_STRAGGLER_ROWS = 50
MAX_TABLE_RANKS = 4096  # rows of the per-rank straggler table
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


# ---- plots ------------------------------------------------------------------------------------

Series = tuple[str, list[float], list[float]]  # (legend label, steps, values)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _relaunched(prev: dict[str, Any], r: dict[str, Any]) -> bool:
    """Whether ``r`` comes from other processes than ``prev`` (launches sharing an output_dir append
    to one file): another job id, or, within a job (torchrun's restarts) and for records written
    without one, the step went back, the world size changed, or a rank's peak memory fell (a peak
    is never reset within a process, so only a new process lowers it)."""
    if "job" in prev and "job" in r and prev["job"] != r["job"]:
        return True
    if r["step"] <= prev["step"] or r.get("world_size") != prev.get("world_size") or r.get("relaunch"):
        return True  # relaunch: a rank's peak fell, seen by run_history while it had every rank's peak
    pairs = zip(prev.get("mem_peak_mb_per_rank") or prev.get("mem_peak_mb_stats") or [],
                r.get("mem_peak_mb_per_rank") or r.get("mem_peak_mb_stats") or [])
    return any(b < a for a, b in ((_num(a), _num(b)) for a, b in pairs) if a is not None and b is not None)


def _series(records: list[dict[str, Any]], value, label: str = "") -> list[Series]:
    """``value(record)`` over the steps (None: no point), one series per launch, all named ``label``."""
    launches: list[list[dict[str, Any]]] = []
    for r in records:
        if not launches or _relaunched(launches[-1][-1], r):
            launches.append([])
        launches[-1].append(r)
    pts = [[(r["step"], v) for r in part if (v := value(r)) is not None] for part in launches]
    return [(label, [p[0] for p in part], [p[1] for p in part]) for part in pts if part]


def _memory_series(metrics: list[dict[str, Any]]) -> list[Series]:
    def rank_value(r: int):
        def value(rec):
            mem = rec.get("mem_peak_mb_per_rank") or []
            return _num(mem[r]) if r < len(mem) else None
        return value

    world = max((len(r.get("mem_peak_mb_per_rank") or []) if "mem_peak_mb_stats" not in r else MAX_RANK_LINES + 1
                 for r in metrics), default=0)
    if world <= MAX_RANK_LINES:
        return [s for r in range(world) for s in _series(metrics, rank_value(r), f"rank {r}")]

    def stat(at: int):  # at: 0 min, 1 median, 2 max (_compact keeps these beyond MAX_RANK_LINES ranks)
        def value(rec):
            st = rec.get("mem_peak_mb_stats") or rank_stats(rec.get("mem_peak_mb_per_rank") or [])
            return _num(st[at]) if st else None
        return value
    return [s for label, at in (("max", 2), ("median", 1), ("min", 0)) for s in _series(metrics, stat(at), label)]


def _svg(series: list[Series], title: str, ylabel: str, uid: str, marks: tuple[int, ...] = ()) -> str:
    """A line plot as inline SVG: no XML prolog, ids prefixed with ``uid`` so that several plots
    in one page never share one (their clip paths and glyphs refer to ids)."""
    from matplotlib import rc_context
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend
    from matplotlib.ticker import MaxNLocator

    with rc_context({"svg.fonttype": "path", "font.size": 9}):  # text as paths: no font needed to view
        fig = Figure(figsize=(6.4, 3.0), layout="constrained")
        ax = fig.add_subplot()
        colors: dict[str, str] = {}
        starts = set()  # where a later launch's line begins
        for n, (label, xs, ys) in enumerate(series):
            first = label not in colors
            colors.setdefault(label, f"C{len(colors) % 10}")
            starts |= set() if first else {xs[0]}
            ax.plot(xs, ys, color=colors[label], marker="." if len(xs) < 40 else None, linewidth=1.2,
                    label=(label or None) if first else None, gid=f"series{n}")  # <g id=...>: each line findable
        for i, x in enumerate(sorted(starts)):
            ax.axvline(x, color="0.6", linestyle=":", linewidth=1, label=None if i else "relaunch")
        for i, x in enumerate(marks):  # the loss guard's alarms (hfscale.checkpoints.rollbacks)
            ax.axvline(x, color="C3", linestyle="--", linewidth=1, label=None if i else "rollback", gid=f"rollback{i}")
        ax.set_xlabel("step")  # the title is the figure's caption in the page
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if any(label for label, _, _ in series) or starts or marks:
            ax.legend(fontsize=7, ncols=2 if len(colors) > 6 else 1)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):].replace("<svg ", f'<svg role="img" aria-label="{_e(title)}" ', 1)
    return re.sub(r'(\bid="|href="#|url\(#)', lambda m: m.group(1) + uid + "-", text)


# ---- page -------------------------------------------------------------------------------------

def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _note(why: str) -> str:
    return f'<p class="note">not recorded: {_e(why)}</p>'


NO_PLOTS = "plot not drawn: matplotlib is not installed (pip install 'hfscale[report]')"


def _plots_drawn() -> bool:
    """Whether matplotlib can be imported (the plots are its; the rest of the page is not)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(key: str, title: str, series: list[Series], ylabel: str, missing: str, marks: tuple[int, ...] = (),
            said: tuple[str, ...] = ()) -> str:
    head = f'<figure id="plot-{key}"><figcaption>{_e(title)}</figcaption>'
    told = "".join(f'<p class="rollback">{_e(line)}</p>' for line in said)
    if not series:
        return head + _note(missing) + told + "</figure>"
    if not _plots_drawn():
        return head + f'<p class="note">{_e(NO_PLOTS)}</p>{told}</figure>'
    return head + _svg(series, title, ylabel, key, marks) + told + "</figure>"


def _rollbacks(d: RunData) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The loss guard's incidents in the output_dir: their steps (marked on the loss curve) and lines."""
    try:
        incidents = read_rollbacks(d.output_dir).incidents
    except Unreadable as e:
        return (), (f"the loss guard's record is unreadable: {e}",)
    return tuple(i.step for i in incidents), tuple(incident_line(i) for i in incidents)


def _plots(d: RunData) -> str:
    hist, m = d.history, d.metrics
    state_where = f"{d.output_dir}/checkpoint-N/{TRAINER_STATE} (none found)"
    metrics_where = (f"no {METRICS_FILE} in {d.output_dir} (hfscale's MetricsCallback writes it)" if not m else "")
    tokens_why = metrics_where or ("the callback was not told the tokens per sample (training.data.block_size, "
                                   "MetricsCallback(seq_len=...), or include_num_input_tokens_seen)")
    mfu_why = metrics_where or ("MFU needs one device's peak FLOP/s: set training.peak_tflops (it is looked up "
                                "for known CUDA GPUs; a CPU has none)")
    figs = [
        ("loss", "Loss", _series(hist, lambda e: _num(e.get("loss"))), "loss", state_where, *_rollbacks(d)),
        ("learning-rate", "Learning rate", _series(hist, lambda e: _num(e.get("learning_rate"))), "learning rate",
         state_where),
        ("grad-norm", "Gradient norm", _series(hist, lambda e: _num(e.get("grad_norm"))), "gradient norm",
         state_where if not hist else "no grad_norm in the Trainer's log_history"),
        ("tokens-per-s", "Tokens per second", _series(m, lambda r: _num(r.get("tokens_per_s"))),
         "tokens/s, all ranks", tokens_why),
        ("mfu", "MFU", _series(m, lambda r: None if (v := _num(r.get("mfu"))) is None else 100 * v),
         "model FLOPs utilisation (%)", mfu_why),
        ("memory", "Peak memory per rank", _memory_series(m), "peak MB (GPU: allocated, CPU: RSS)",
         metrics_where or "no mem_peak_mb_per_rank in the metrics"),
    ]
    return '<div class="plots">' + "".join(_figure(*f) for f in figs) + "</div>"


def _table(head: list[str], rows: list[list[Any]], flagged: list[bool] | None = None) -> str:
    flagged = flagged or [False] * len(rows)
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join(('<tr class="flag">' if f else "<tr>") + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>"
                   for row, f in zip(rows, flagged))
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _f(v: Any, fmt: str = ".3f") -> str:
    x = _num(v)
    return "-" if x is None else format(x, fmt)


def _stragglers(d: RunData) -> str:
    s = d.stragglers
    if not s:
        return _note(f"no straggler reports in {d.output_dir / METRICS_FILE} (hfscale's StragglerCallback writes them)")
    last = s[-1]
    fwd, wall, hosts = (last.get(k) or [] for k in PER_RANK)
    shown_ranks = range(min(len(fwd), MAX_TABLE_RANKS))
    per_rank = _table(["rank", "host", "forward s / step", "wall s / step"],
                      [[r, hosts[r] if r < len(hosts) else "?", _f(fwd[r]), _f(wall[r] if r < len(wall) else None)]
                       for r in shown_ranks], [r == last.get("slowest_rank") for r in shown_ranks])
    if len(fwd) > MAX_TABLE_RANKS:
        per_rank += f"<p>(the first {MAX_TABLE_RANKS} of {len(fwd)} ranks)</p>"
    shown = s[-MAX_STRAGGLER_ROWS:]
    older = f" (the last {len(shown)} of {len(s)})" if len(s) > len(shown) else ""
    flagged = sum(bool(r.get("straggler")) for r in s)
    reports = _table(["step", "slowest rank", "host", "slowest / median forward", "median forward s", "threshold",
                      "straggler"],
                     [[r["step"], r.get("slowest_rank", "?"), r.get("slowest_host", "?"), _f(r.get("ratio"), ".2f"),
                       _f(r.get("median_forward_s")), _f(r.get("threshold"), ".2f"),
                       "yes" if r.get("straggler") else "no"] for r in shown],
                     [bool(r.get("straggler")) for r in shown])
    return (f"<p>{len(s)} report(s), {flagged} over the threshold. Each rank at step {_e(last['step'])} "
            f"(slowest highlighted):</p>{per_rank}<p>Every report{_e(older)}:</p>{reports}")


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px auto;max-width:1240px;color:#222}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:16px;align-items:start}
figure{margin:0;border:1px solid #e4e4e4;border-radius:4px;padding:8px}
figcaption{font-weight:600;margin-bottom:4px}figure svg{width:100%;height:auto;display:block}
.note{color:#8a6d00;background:#fff8e1;padding:6px 10px;border-radius:4px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f4f4f4}tr.flag td{background:#ffe0e0}
pre{background:#f7f7f7;border:1px solid #e4e4e4;padding:10px;overflow-x:auto;font-size:12px;white-space:pre-wrap}
dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px}dt{font-weight:600}dd{margin:0}
"""


def _when(t: Any) -> str | None:
    x = _num(t)
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(x)) if x is not None else None


def _other_launch(r: dict[str, Any], job: Any, t0: float | None, t1: float | None) -> bool:
    """Whether metrics record ``r`` was written by another launch than this run's: by its job id,
    else (written without one) by its time against the run's start and end."""
    if "job" in r and isinstance(job, str):  # a relaunch's attempts are this run's (hfscale.launch.recovery.supervisor)
        return not isinstance(r["job"], str) or run_of(r["job"]) != run_of(job)
    t = _num(r.get("time"))
    return t is not None and ((t0 is not None and t < t0) or (t1 is not None and t > t1))


def _summary(d: RunData) -> str:
    st, last = d.state, d.metrics[-1] if d.metrics else {}
    steps = [e["step"] for e in d.history] + [r["step"] for r in d.metrics]
    t0, t1 = st.started, st.ended
    others = sum(1 for r in d.metrics if _other_launch(r, st.job_id, t0, t1))
    reports = f"{len(d.metrics)}, {others} of them by other launches in this output_dir" if others else len(d.metrics)
    items = [("run directory", d.run_dir), ("training output_dir", d.output_dir),
             ("state", st.state), ("exit code", st.exit_code), ("host", st.host),
             ("started", _when(st.started)), ("ended", _when(st.ended)),
             ("last step recorded", max(steps) if steps else None), ("world size", last.get("world_size")),
             ("metric reports", reports or None)]
    return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in items if v is not None) + "</dl>"


_SEGMENT_COLOURS = {"training": "#2e7d32", "start": "#9e9e9e", "detection": "#ef6c00", "stop": "#c62828",
                    "restart": "#1565c0"}


def _segments(t: Timeline, end: float) -> list[tuple[str, float, float]]:
    """(what, from, to) along the run: start, training, detection (the end of a failed attempt's
    training, from its last step), stop and restart (a relaunch's, or one the ranks made in their
    processes), from the timeline's events."""
    out: list[tuple[str, float, float]] = []
    mark, what = None, "start"
    for e in t.events:
        if e.kind in ("launch", "relaunch"):
            mark, what = (e.at, "start") if e.kind == "launch" else (mark, what)
        elif e.kind == "training" and mark is not None:
            out.append((what, mark, e.at))
            mark, what = e.at, "training"
        elif e.kind == "failure" and mark is not None:
            last = e.at
            if what == "training" and e.step is not None and e.step_time is not None:
                first = next((x for x in t.events if x.kind == "training" and x.attempt == e.attempt), None)
                if first is not None and first.step is not None:
                    last = min(max(first.at + (e.step - first.step) * e.step_time, mark), e.at)
            out += [(what, mark, last), ("detection", last, e.at)]
            mark, what = e.at, "stop"
        elif e.kind == "in_process" and mark is not None and e.at >= mark:  # healed in the ranks' processes
            back = e.at + sum((e.phases or {}).values())
            out += [(what, mark, e.at), ("restart", e.at, back)]
            mark, what = back, "training"
        elif e.kind == "stopped" and mark is not None:
            out.append(("stop", mark, e.at))
            mark, what = e.at, "restart"
        elif e.kind in ("finished", "gave_up") and mark is not None:
            out.append((what, mark, e.at))
            mark = None
    if mark is not None:
        out.append((what, mark, end))
    return [s for s in out if s[2] > s[1]]


def _recovery(d: RunData) -> str:
    """The timeline of a job that recovers (hfscale.launch.recovery.supervisor): a bar of its wall time by
    phase, goodput, and one line per failure and relaunch."""
    try:
        t = read_timeline(d.run_dir)
    except Unreadable as e:
        return _note(f"the timeline is unreadable: {e}")
    g = goodput(t, time.time() if d.state.state == "running" else None)
    if g is None:
        return _note("not a job that recovers (recovery.max_restarts is 0): no timeline")
    t0 = next(e.at for e in t.events if e.kind == "launch")
    segs, width = _segments(t, t0 + g.wall), 900.0
    scale = width / g.wall if g.wall > 0 else 0.0
    rects = "".join(f'<rect x="{(a - t0) * scale:.1f}" y="0" width="{max(0.5, (b - a) * scale):.1f}" height="24" '
                    f'fill="{_SEGMENT_COLOURS[w]}"><title>{_e(w)} {b - a:.1f} s</title></rect>' for w, a, b in segs)
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {_e(w)}' for w, c in _SEGMENT_COLOURS.items())
    bar = f'<svg width="{width:.0f}" height="24" role="img" aria-label="timeline">{rects}</svg><p>{legend}</p>'
    items = "".join(f"<li>{_e(line)}</li>" for line in timeline_lines(t))
    return "".join(f"<p>{_e(line)}</p>" for line in lines(g)) + bar + f"<ul>{items}</ul>"


def render_html(d: RunData) -> str:
    """The page (its plots need matplotlib: without it, a note in their place)."""
    notes = "".join(f'<p class="note">{_e(n)}</p>' for n in d.notes)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{_e(CSP)}">'
        f"<title>hfscale report: {_e(d.name)}</title><style>{STYLE}</style></head><body>\n"
        f"<h1>hfscale report: {_e(d.name)}</h1>{_summary(d)}{notes}\n"
        f'<section id="training"><h2>Training</h2>{_plots(d)}</section>\n'
        f'<section id="recovery"><h2>Recovery</h2>{_recovery(d)}</section>\n'
        f'<section id="stragglers"><h2>Stragglers</h2>{_stragglers(d)}</section>\n'
        f'<section id="config"><h2>Resolved config</h2><p>{_e(d.run_dir / CONFIG_COPY)}</p>'
        f"<pre>{_e(d.config_text)}</pre></section>\n"
        f'<section id="plan"><h2>Launch plan</h2><p>{_e(d.run_dir / PLAN_FILE)}</p>'
        f"<pre>{_e(d.plan_text)}</pre></section>\n"
        f"<footer><p>written by hfscale report at {_e(_when(time.time()))}</p></footer></body></html>\n"
    )


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``<run_dir>/report.html``); the path.

    Raises ReportError when ``run_dir`` is not a run directory or ``out`` cannot be written. Without
    matplotlib (the README's install has none) the page is written with a note where each plot goes:
    the summary, recovery, stragglers, config and plan need nothing more."""
    data = read_run(run_dir)
    dest = Path(out) if out is not None else data.run_dir / "report.html"
    page = render_html(data)
    try:
        (written,) = write_files(dest.parent, {dest.name: page})
    except OSError as e:
        raise ReportError(f"cannot write {dest}: {e.strerror or e}") from None
    return written
