"""The documentation as a user meets it: a short README with its set-up commands and quick starts;
every ``hfscale`` command of a ```bash block in README.md and docs/ run here as written (against a
copy of examples/ and the presets) with the exit code the doc states, or named in NOT_HERE with
why it cannot run here; every YAML shown for an example file is that file; every config shown
checks; every link lands."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from doc_commands import MAIN_JOB, NOT_HERE, blocks, commands, commands_of, pages, run_as_written

README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = ["config-reference", "launch", "engines", "memory", "runs", "recovery", "your-own-script", "import", "slurm",
         "kubernetes", "troubleshooting", "bench"]
SET_UP = ["pip install torch==2.13.0 && pip install -e . && hfscale launch examples/tiny_cpu/config.yaml",
          "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest"]
COPIED = ["examples", "accelerate_configs", "ds_configs"]  # what the commands name, copied into a scratch dir


def test_the_readme_is_short_and_keeps_its_two_set_up_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 10_000
    lines = [line.strip() for line in text.splitlines()]
    assert all(command in lines for command in SET_UP)
    assert '"$PY" -m pytest' in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


def test_the_readme_has_the_quick_starts_the_checklist_and_the_on_ramp():
    text = README.read_text(encoding="utf-8")
    for heading in ("## Quick start: one machine", "## Quick start: two nodes", "## Commands", "## Documentation"):
        assert f"\n{heading}" in text, heading
    two_nodes = text[text.index("## Quick start: two nodes"):text.index("## Already have")]
    for must in ("ssh works without a prompt", "pdsh is installed on the launch host", "same environment",
                 "shared file system", "hfscale preflight", "launch examples/two_nodes/config.yaml --dry-run",
                 "hfscale status", "hfscale report"):
        assert must in two_nodes, must
    assert re.search(r"\nhfscale launch examples/two_nodes/config\.yaml +#", two_nodes)  # the launch itself
    assert "hfscale import accelerate_configs/zero3.yaml --out job.yaml" in text
    assert MAIN_JOB in text


def test_every_page_exists_and_the_readme_links_it():
    text = README.read_text(encoding="utf-8")
    assert sorted(p.stem for p in DOCS.glob("*.md")) == sorted(PAGES)
    assert all(f"(docs/{page}.md)" in text for page in PAGES)
    assert "(CONTRIBUTING.md)" in text and (ROOT / "CONTRIBUTING.md").is_file()


def _anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    in_block = {n for _, start, body in blocks(text) for n in range(start - 1, start + len(body) + 1)}
    return {re.sub(r"[^a-z0-9 _-]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for n, line in enumerate(text.splitlines(), 1) if line.startswith("#") and n not in in_block}


def test_every_link_lands():
    broken = []
    for page in [*pages(), ROOT / "CONTRIBUTING.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_every_command_runs_here_or_says_why_not():
    shown = commands()
    texts = {c.text for c in shown}
    assert len(shown) > 40 and MAIN_JOB in texts
    assert sorted(set(NOT_HERE) - texts) == []  # no reason kept for a command the docs no longer show
    assert {c.page for c in shown} >= {"README.md", "docs/launch.md", "docs/runs.md", "docs/import.md"}
    assert [str(c) for c in shown if c.after_main_job and c.page != "README.md" and c.expect] == []


def test_the_reader_finds_commands_their_exit_codes_and_skips_output(tmp_path, monkeypatch):
    import doc_commands

    page = tmp_path / "docs" / "x.md"
    page.parent.mkdir()
    page.write_text("```bash\npip install x && hfscale check a.yaml   # exit 2: why\n$ hfscale  runs\n```\n"
                    "```text\nhfscale check shown.yaml\n```\n")
    monkeypatch.setattr(doc_commands, "ROOT", tmp_path)
    assert commands_of(page) == [doc_commands.Command("docs/x.md", 2, "hfscale check a.yaml", 2),
                                 doc_commands.Command("docs/x.md", 3, "hfscale runs", 0)]


def _runnable(page: Path):
    return [c for c in commands_of(page) if c.text not in NOT_HERE and c.text != MAIN_JOB and not c.after_main_job]


@pytest.mark.parametrize("page", [p for p in pages() if _runnable(p)], ids=lambda p: p.name)
def test_the_commands_a_page_shows_run_as_written(page, tmp_path):
    """In page order, in one scratch directory per page holding copies of what they name (the
    commands about the README's main job run in tests/test_examples.py, after it trains)."""
    todo = _runnable(page)
    work = tmp_path / "work"
    for name in COPIED:
        shutil.copytree(ROOT / name, work / name)
    failed = []
    for c in todo:
        r = run_as_written(c, work, tmp_path)
        if r.returncode != c.expect:
            failed.append(f"{c} -> exit {r.returncode}, the doc says {c.expect}\n{r.stdout[-1500:]}{r.stderr[-1500:]}")
    assert failed == []


def _yaml_blocks():
    for page in [*pages()]:
        text = page.read_text(encoding="utf-8")
        lines = text.splitlines()
        for lang, start, body in blocks(text):
            if lang == "yaml":
                before = next((line for line in reversed(lines[:start - 2]) if line.strip()), "")
                yield page, start, before, "\n".join(body) + "\n"


def test_the_yaml_shown_for_an_example_file_is_that_file():
    shown = 0
    for page, start, before, body in _yaml_blocks():
        m = re.search(r"\]\((?:\.\./)?(examples/[^)]+\.yaml)\):$", before)
        if m:
            shown += 1
            assert body == (ROOT / m.group(1)).read_text(), f"{page.name}:{start}: differs from {m.group(1)}"
    assert shown >= 2


def test_every_config_shown_checks():
    from hfscale.config.errors import ConfigError
    from hfscale.rules.config_file import load_text

    checked, problems = 0, []
    for page, start, _, body in _yaml_blocks():
        doc = yaml.safe_load(body)
        if isinstance(doc, dict) and "name" in doc:
            checked += 1
            try:
                load_text(body, f"{page.name}:{start}", ROOT)
            except ConfigError as e:
                problems.append(e.render())
    assert checked >= 4 and problems == []
