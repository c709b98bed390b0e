"""hfscale.runs.report: the HTML page of a run directory.

Fast tests build a run directory and a training output_dir by hand (plan.txt, config.yaml,
state.json, hfscale_metrics.jsonl, checkpoint-N/trainer_state.json) and read the page's HTML. The
slow test launches a real 2-process job, writes its report and renders it in headless Chromium,
keeping the screenshot in .cache/test-artifacts/report.png."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from hfscale.runs.report import ReportError, read_run, write_report


TITLES = {"loss": "Loss", "learning-rate": "Learning rate", "grad-norm": "Gradient norm",
          "tokens-per-s": "Tokens per second", "mfu": "MFU", "memory": "Peak memory per rank"}
ARTIFACT = ROOT / ".cache" / "test-artifacts" / "report.png"


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "action", "poster", "srcset") and value:
                self.found.append(value)
            if name == "style" and value and "url(" in value:
                self.found += re.findall(r"url\(([^)]*)\)", value)


def external_links(page: str) -> list[str]:
    """Every src/href (and style url()) of the page's elements that points outside it."""
    parser = _Links()
    parser.feed(page)
    links = parser.found + re.findall(r"url\(([^)]*)\)", "".join(re.findall(r"<style>(.*?)</style>", page, re.S)))
    return [v for v in links if re.match(r"""\s*["']?\s*(?:[a-z][a-z0-9+.-]*:|//)""", v, re.I)]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


try:
    import matplotlib  # noqa: F401
except ImportError:  # the test extras install it: missing in CI is a broken install, not a reason to skip
    if in_ci():
        raise
    pytest.skip("the report's plots need matplotlib (pip install -e '.[test]')", allow_module_level=True)


def metrics(step: int, world: int = 2, mfu: float | None = 0.31, tokens: float | None = 9000.0) -> dict:
    return {"event": "metrics", "step": step, "epoch": step / 100, "time": 1.7e9 + step, "world_size": world,
            "window_steps": 2, "step_time_s": 0.05, "samples_per_s": 160.0, "tokens_per_s": tokens,
            "eta_s": 1.0, "mem_peak_mb": 900.0 + step, "mem_peak_mb_per_rank": [800.0 + step + r for r in range(world)],
            "flops_per_token": 2e5, "mfu": mfu}


def straggler(step: int, ratio: float) -> dict:
    return {"event": "straggler", "step": step, "time": 1.7e9 + step, "world_size": 2,
            "forward_s_per_rank": [0.01, 0.01 * ratio], "step_time_s_per_rank": [0.05, 0.05],
            "hosts": ["node-a", "<b>node-b</b>"], "median_forward_s": 0.01 * (1 + ratio) / 2, "slowest_rank": 1,
            "slowest_host": "<b>node-b</b>", "ratio": ratio, "threshold": 1.2, "straggler": ratio > 1.2}


def history(last: int) -> list[dict]:
    out = []
    for s in range(2, last + 1, 2):  # the Trainer's loss entry, then hfscale's own entry at the same step
        out += [{"epoch": s / 100, "grad_norm": 1.5, "learning_rate": 1e-3 * (1 - s / 40), "loss": 5 - s / 20, "step": s},
                {"epoch": s / 100, "hfscale/tokens_per_s": 9000.0, "step": s}]
    return out


def make_run(tmp: Path, *, name: str = "demo", events: list[dict] | None = None, ckpts: tuple[int, ...] = (10, 20),
             state: dict | None = None, output: str = "out") -> Path:
    """tmp/runs/demo-1 as hfscale launch leaves it (launched from tmp), the output in tmp/<output>; ``name``
    in the config copy only (a real job name is letters, digits, '.', '-', '_')."""
    run = tmp / "runs" / "demo-1"
    run.mkdir(parents=True)
    cfg = {"name": name, "runner": {"type": "local", "workdir": None, "run_dir": "runs"},
           "env": {"vars": {"NOTE": "<script>alert('cfg')</script>"}}, "training": {"output_dir": output}}
    (run / "config.yaml").write_text("# Resolved from job.yaml by hfscale\n" + yaml.safe_dump(cfg))
    (run / "plan.txt").write_text(f"# hfscale launch plan: job 1, runner local\nrun directory: {run}\n"
                                  "run:\n  cd /x && echo '<img src=http://evil.example/x.png>'\n")
    if state is not None:
        (run / "state.json").write_text(json.dumps(state))
    out = tmp / output
    for step in ckpts:
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(
            json.dumps({"global_step": step, "log_history": history(step)}))
    if events is not None:
        out.mkdir(exist_ok=True)
        (out / "hfscale_metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def figure(page: str, key: str) -> str:
    m = re.search(rf'<figure id="plot-{key}">(.*?)</figure>', page, re.S)
    assert m, key
    return m.group(1)


def test_the_page_has_every_plot_the_tables_config_and_plan(tmp_path, monkeypatch):
    events = [metrics(2), straggler(2, 1.0), metrics(4), straggler(4, 1.6)]
    run = make_run(tmp_path, name="<script>x</script>", events=events)
    with (tmp_path / "out" / "hfscale_metrics.jsonl").open("a") as f:
        f.write('{"event": "metrics", "st')  # the half line a killed writer leaves
    monkeypatch.chdir(ROOT)  # not the launch directory: the output_dir is found from the run directory's path
    path = write_report(run)
    assert path == run / "report.html"
    page = path.read_text()
    for key, title in TITLES.items():
        fig = figure(page, key)
        assert fig.startswith(f"<figcaption>{title}</figcaption><svg ") and f'<g id="{key}-series0">' in fig, key
    assert page.count("<svg ") == len(TITLES)
    assert f"training output_dir</dt><dd>{tmp_path / 'out'}</dd>" in page
    assert "2 report(s), 1 over the threshold. Each rank at step 4 (slowest highlighted):" in page
    assert '<tr class="flag"><td>1</td><td>&lt;b&gt;node-b&lt;/b&gt;</td><td>0.016</td><td>0.050</td></tr>' in page
    assert "<td>4</td><td>1</td><td>&lt;b&gt;node-b&lt;/b&gt;</td><td>1.60</td><td>0.013</td><td>1.20</td><td>yes</td>" in page
    assert "unreadable line(s) skipped" in page and "hfscale_metrics.jsonl: 1 unreadable" in page
    assert '<section id="config"><h2>Resolved config</h2>' in page and "NOTE: &lt;script&gt;alert(&#x27;cfg&#x27;)" in page
    assert "# hfscale launch plan: job 1, runner local" in page
    # every text is escaped; nothing is fetched
    assert "<script" not in page and "<img" not in page and "<b>" not in page
    assert "<title>hfscale report: &lt;script&gt;x&lt;/script&gt;</title>" in page
    assert external_links(page) == [] and "<use xlink:href=\"#" in page  # the SVGs' own references only
    assert "Content-Security-Policy" in page and "default-src &#x27;none&#x27;" in page
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))  # several inline SVGs, no id twice


def test_history_is_the_newest_checkpoints_merged_with_the_root_state(tmp_path):
    run = make_run(tmp_path, ckpts=(10, 20))
    root = {"global_step": 24, "log_history": history(24)[-4:]}  # steps 22 and 24
    (tmp_path / "out" / "trainer_state.json").write_text(json.dumps(root))
    (tmp_path / "out" / "checkpoint-30").mkdir()
    (tmp_path / "out" / "checkpoint-30" / "trainer_state.json").write_text("{not json")  # cut short
    d = read_run(run)
    assert [e["step"] for e in d.history] == list(range(2, 25, 2))
    assert any("checkpoint-30/trainer_state.json: unreadable" in n for n in d.notes)


def test_relaunches_sharing_the_output_dir_are_plotted_as_launches(tmp_path):
    # the first launch reached step 6, the second (this run directory's) resumed from checkpoint-2 and
    # went on to 8 with 4 processes
    events = [metrics(s) for s in (2, 4, 6)] + [{**metrics(s, world=4), "time": 1.7e9 + 100 + s} for s in (4, 6, 8)]
    run = make_run(tmp_path, events=events, state={"cwd": str(tmp_path), "started": 1.7e9 + 50, "ended": 1.7e9 + 200})
    page = write_report(run, tmp_path / "elsewhere" / "r.html").read_text()
    from hfscale.runs.report import _memory_series, _series

    d = read_run(run)
    assert [(s[0], s[1]) for s in _series(d.metrics, lambda r: r["tokens_per_s"])] == [("", [2, 4, 6]), ("", [4, 6, 8])]
    assert [s[:2] for s in _memory_series(d.metrics)] == \
        [("rank 0", [2, 4, 6]), ("rank 0", [4, 6, 8]), ("rank 1", [2, 4, 6]), ("rank 1", [4, 6, 8]),
         ("rank 2", [4, 6, 8]), ("rank 3", [4, 6, 8])]
    # a launch that went on where the previous one stopped: new processes, so a lower peak memory
    went_on = [metrics(2), metrics(4), {**metrics(6), "mem_peak_mb_per_rank": [700.0, 900.0]},
               {**metrics(8), "mem_peak_mb_per_rank": [701.0, 901.0]}]
    assert [s[1] for s in _series(went_on, lambda r: r["step"])] == [[2, 4], [6, 8]]
    # records with job ids: a launch that went on with a higher peak, which only the id tells apart;
    # within one job (a torchrun restart) the step going back still splits
    a, b = {"job": "20261124-1-aaaaaa"}, {"job": "20261124-2-bbbbbb"}
    ids = [{**metrics(2), **a}, {**metrics(4), **a}, {**metrics(6), **b}, {**metrics(8), **b}, {**metrics(6), **b}]
    assert [s[1] for s in _series(ids, lambda r: r["step"])] == [[2, 4], [6, 8], [6]]
    assert [s[1] for s in _series([{**r, **a} for r in ids[:4]], lambda r: r["step"])] == [[2, 4, 6, 8]]
    assert page.count("<svg ") == len(TITLES)
    assert "<dt>metric reports</dt><dd>6, 3 of them by other launches in this output_dir</dd>" in page
    assert "<dt>world size</dt><dd>4</dd>" in page
    # with job ids the count goes by them, not by time: here every record falls inside this run's
    # start and end, and 2 are another job's
    by_id = [{**metrics(s), "job": "other"} for s in (2, 4)] + [{**metrics(s), "job": "this"} for s in (6, 8, 10)]
    run2 = make_run(tmp_path / "ids", events=by_id, state={"cwd": str(tmp_path / "ids"), "job_id": "this",
                                                           "started": 1.7e9, "ended": 1.7e9 + 200})
    page2 = write_report(run2, tmp_path / "ids" / "r.html").read_text()
    assert "<dt>metric reports</dt><dd>5, 2 of them by other launches in this output_dir</dd>" in page2


def test_the_output_dir_is_found_as_the_ranks_saw_it(tmp_path, monkeypatch):
    from hfscale.runs.report import _memory_series
    from hfscale.runs.registry import output_dir_of

    run = tmp_path / "launch" / "var" / "runs" / "j-1"

    def cfg(out: str, workdir: str | None = None, run_dir: str = "var/runs") -> dict:
        return {"training": {"output_dir": out}, "runner": {"workdir": workdir, "run_dir": run_dir}}

    monkeypatch.chdir(tmp_path)
    assert output_dir_of(run, cfg("/data/out", "/w")) == Path("/data/out")
    assert output_dir_of(run, cfg("out", "/w")) == Path("/w/out")
    assert output_dir_of(run, cfg("out", "sub")) == tmp_path / "launch" / "sub" / "out"  # from the run dir's path
    assert output_dir_of(run, cfg("out"), launch_cwd="/recorded") == Path("/recorded/out")  # state.json's cwd
    (tmp_path / "out").mkdir()  # the recorded directory has none, this process's has one: the one that exists
    assert output_dir_of(run, cfg("out"), launch_cwd="/recorded") == tmp_path / "out"
    assert output_dir_of(run, cfg("o", run_dir="/abs/runs")) == tmp_path / "o"  # nothing to infer from
    (tmp_path / "rec").mkdir()  # the recorded directory is there, without an out yet: its out, not this process's
    assert output_dir_of(run, cfg("out"), launch_cwd=str(tmp_path / "rec")) == tmp_path / "rec" / "out"

    many = [{"step": 2, "mem_peak_mb_per_rank": [float(r) for r in range(64)]}]
    assert _memory_series(many) == [("max", [2], [63.0]), ("median", [2], [32.0]), ("min", [2], [0.0])]


def test_missing_pieces_are_notes_not_errors(tmp_path):
    cpu = [metrics(s, mfu=None) for s in (2, 4)]  # no peak FLOP/s on a CPU; no straggler callback
    page = write_report(make_run(tmp_path, events=cpu)).read_text()
    assert figure(page, "mfu") == ('<figcaption>MFU</figcaption><p class="note">not recorded: MFU needs one device&#x27;s '
                                   "peak FLOP/s: set training.peak_tflops (it is looked up for known CUDA GPUs; a CPU has "
                                   "none)</p>")
    assert ('<section id="stragglers"><h2>Stragglers</h2><p class="note">not recorded: no straggler reports in '
            f"{tmp_path / 'out' / 'hfscale_metrics.jsonl'} (hfscale&#x27;s StragglerCallback writes them)</p>") in page
    assert page.count("<svg ") == 5

    nothing = make_run(tmp_path / "b", ckpts=(), output="never-written")
    page = write_report(nothing).read_text()
    assert "<svg" not in page
    for key in TITLES:
        assert '<p class="note">not recorded: ' in figure(page, key)
    assert (f"not recorded: no hfscale_metrics.jsonl in {tmp_path / 'b' / 'never-written'} (hfscale&#x27;s "
            "MetricsCallback writes it)") in figure(page, "tokens-per-s")


def test_what_is_not_a_run_directory_is_a_report_error(tmp_path):
    with pytest.raises(ReportError, match=re.escape(f"{tmp_path / 'nope'}: no such run directory")):
        write_report(tmp_path / "nope")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "plan.txt").write_text("x")
    with pytest.raises(ReportError) as e:
        write_report(tmp_path / "plain")
    assert str(e.value) == (f"{tmp_path / 'plain'} is not an hfscale run directory: config.yaml missing "
                            "(hfscale launch writes both)")
    (tmp_path / "plain" / "config.yaml").write_text("- a list\n")
    with pytest.raises(ReportError, match="config.yaml: not a YAML mapping"):
        write_report(tmp_path / "plain")
    assert issubclass(ReportError, ValueError)  # the CLI's exit 2


def test_without_matplotlib_the_page_is_written_with_a_note_for_each_plot(tmp_path, monkeypatch):
    """The first run's summary prints ``hfscale report <run>``; on the README's install (no matplotlib)
    it works: every part but the plots, and a note in each plot's place saying what to install."""
    run = make_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    page = write_report(run).read_text()
    assert page.count("plot not drawn: matplotlib is not installed (pip install &#x27;hfscale[report]&#x27;)") >= 3
    assert "<svg role=\"img\"" not in page  # no plot
    for section in ("training", "recovery", "stragglers", "config", "plan"):
        assert f'<section id="{section}">' in page


def test_matplotlib_is_imported_only_when_a_report_is_written():
    from test_architecture import CONFIG_ONLY, MODULES, closure, top_level_imports

    assert not any(i.split(".")[0] == "matplotlib" for i in top_level_imports("hfscale.runs.report", MODULES["hfscale.runs.report"]))
    assert "hfscale.runs.report" not in closure(CONFIG_ONLY)
    assert len((ROOT / "hfscale" / "runs" / "report.py").read_text().splitlines()) < 400


# ---- a real run, rendered by a real browser ---------------------------------------------------

def chromium() -> str:
    exe = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    if exe is None:
        why = "chromium is not installed (apt-get install -y chromium)"
        if in_ci():
            pytest.fail(f"CI=true and {why}", pytrace=False)
        pytest.skip(why)
    return exe


def browse(exe: str, page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    # its own profile: another Chromium (a second test session) must not share the lock
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           f"--user-data-dir={profile}", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_a_real_run_renders_in_chromium(tmp_path):
    exe = chromium()
    model = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "n_positions": 64,
             "bos_token_id": 0, "eos_token_id": 0}
    doc = {"name": "rep", "cluster": {"nproc_per_node": 2, "master_port": 29911},
           "runner": {"launcher": "torchrun", "run_dir": "runs"}, "distributed": {"backend": "ddp"},
           "precision": "no", "batch": {"micro_batch_size": 2, "global_batch_size": 8},
           "env": {"vars": {"OMP_NUM_THREADS": "1", "REPORT_NOTE": "<script>alert(1)</script>"}},
           "training": {"output_dir": "out", "max_steps": 20, "save_steps": 10, "logging_steps": 2,
                        "learning_rate": 1.0e-3, "warmup_steps": 4, "seed": 3, "model": {"config": model},
                        "data": {"block_size": 32}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", "job.yaml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    (run,) = (tmp_path / "runs").iterdir()

    page = write_report(run)  # from the repo root, not the launch directory
    d = read_run(run)
    assert d.output_dir == tmp_path / "out"
    assert [e["step"] for e in d.history] == list(range(2, 21, 2))
    assert [m["step"] for m in d.metrics] == list(range(2, 21, 2))

    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    ARTIFACT.unlink(missing_ok=True)
    shot = browse(exe, page, tmp_path / "profile-shot", f"--screenshot={ARTIFACT}", "--window-size=1280,4000")
    assert shot.returncode == 0 and ARTIFACT.is_file(), shot.stderr[-3000:]
    png = ARTIFACT.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000
    from PIL import Image  # matplotlib's own dependency

    with Image.open(ARTIFACT) as im:
        assert im.size == (1280, 4000)
        inked = sum(n for level, n in enumerate(im.convert("L").histogram()) if level < 200)
        assert inked > 0.01 * 1280 * 4000  # lines, text and tables, not a blank page

    dom = browse(exe, page, tmp_path / "profile-dom", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    html = dom.stdout
    svgs = re.findall(r"<svg\b.*?</svg>", html, re.S)
    plotted = [s for s in svgs if re.search(r'<g id="[\w-]+-series0">', s)]
    assert len(plotted) == 5  # all but MFU: no peak FLOP/s on a CPU
    for key, title in TITLES.items():
        assert f'<figure id="plot-{key}"><figcaption>{title}</figcaption>' in html
    assert "not recorded: MFU needs one device's peak FLOP/s" in html
    stragglers = html[html.index('<section id="stragglers">'):html.index('<section id="config">')]
    assert "10 report(s)" in stragglers and stragglers.count("<tr") == 1 + 2 + 1 + 10  # per-rank + every report
    assert "master_port: 29911" in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "# hfscale launch plan: job " in html and "--master_port 29911" in html
    assert "<script" not in html and external_links(html) == []
    print(f"screenshot: {ARTIFACT} ({len(png)} bytes)")


def test_a_restart_is_told_apart_beyond_16_ranks_by_any_ranks_peak(tmp_path):
    """With 32 ranks the page keeps min/median/max per record, yet a torchrun restart (same job id)
    where one rank's peak fell is still drawn as a new line: run_history decides it while reading,
    with every rank's peak at hand."""
    world = 32
    peaks = [1000.0 + r for r in range(world)]
    fell = list(peaks)
    fell[5] -= 2.0  # rank 5 alone: min, median and max unchanged
    events = [{**metrics(2, world=world), "job": "20261125-1-aaaaaa", "mem_peak_mb_per_rank": peaks},
              {**metrics(4, world=world), "job": "20261125-1-aaaaaa", "mem_peak_mb_per_rank": peaks},
              {**metrics(6, world=world), "job": "20261125-1-aaaaaa", "mem_peak_mb_per_rank": fell}]
    run = make_run(tmp_path, events=events)
    from hfscale.runs.report import _series

    d = read_run(run)
    assert "mem_peak_mb_per_rank" not in d.metrics[0] and d.metrics[0]["mem_peak_mb_stats"] == (1000.0, 1016.0, 1031.0)
    assert [s[1] for s in _series(d.metrics, lambda r: r["step"])] == [[2, 4], [6]]


def test_the_loss_guards_rollbacks_are_marked_on_the_loss_curve_and_listed_under_it(tmp_path, monkeypatch):
    from hfscale.checkpoints import rollbacks as rb

    run = make_run(tmp_path, events=[metrics(2)])
    kw = dict(patience=3, skip_margin=2, max_rollbacks=3, resumed_from=None, at=1.0, rollback_to=10)
    record = rb.judge(rb.Rollbacks(), rb.Alarm("spike", "loss", 14, 12, 9.5, 2.4), **kw)
    rb.write_rollbacks(tmp_path / "out", rb.judge(record, rb.Alarm("spike", "loss", 14, 12, 9.5, 2.4), **kw))
    monkeypatch.chdir(ROOT)
    loss = figure(write_report(run).read_text(), "loss")
    assert '<g id="loss-rollback0">' in loss and '<g id="loss-rollback1">' in loss  # a dashed line at each alarm
    assert ('<p class="rollback">rollback 2: step 14 loss 9.5 vs median 2.4 (x4.0), since step 12; back to '
            "checkpoint-10; the replay spiked again; skipped steps 12-16&#x27;s batches</p>") in loss
    (tmp_path / "out" / rb.ROLLBACKS_FILE).write_text("[")
    assert "the loss guard&#x27;s record is unreadable" in figure(write_report(run).read_text(), "loss")
