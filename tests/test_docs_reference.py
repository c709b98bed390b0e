"""docs/config-reference.md is generated from the config model's field descriptions (the ones
``hfscale init`` writes) by ``python -m hfscale.config.docs_reference``; it must match them."""

from __future__ import annotations

from typing import Literal

from hfscale.config.docs_reference import PAGE, anchor, main, render_reference, type_text
from hfscale.config.model import HfscaleConfig
from hfscale.config.template import render_template

from conftest import ROOT
from test_architecture import HEAVY, MODULES, closure, top_level_imports


def test_the_page_is_up_to_date():
    page = (ROOT / PAGE).read_text(encoding="utf-8")
    assert page == render_reference(), "stale: run python -m hfscale.config.docs_reference"


def test_check_says_when_the_page_is_stale(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--check"]) == 1
    assert "stale: docs/config-reference.md (run: python -m hfscale.config.docs_reference)" in capsys.readouterr().out
    assert main([]) == 0 and main(["--check"]) == 0


def _fields(model, path=""):
    for name, field in model.model_fields.items():
        yield f"{path}{name}", field
        for sub in (field.annotation, *getattr(field.annotation, "__args__", ())):
            for leaf in (sub, *getattr(sub, "__args__", ())):
                if isinstance(leaf, type) and hasattr(leaf, "model_fields"):
                    yield from _fields(leaf, f"{path}{name}.")


def test_every_field_and_its_description_is_on_the_page():
    page = render_reference()
    template = render_template()
    fields = list(_fields(HfscaleConfig))
    assert len(fields) > 150
    for path, field in fields:
        assert field.description, path  # the descriptions init writes are the page's
        assert f"| `{path.rsplit('.', 1)[-1]}` |" in page and field.description.replace("|", "\\|") in page, path
    assert fields[0][1].description in template


def test_types_read_as_a_user_writes_them():
    assert type_text(Literal["a", "b"]) == "`a`, `b`"
    assert type_text(HfscaleConfig.model_fields["gradient_clipping"].annotation,
                     HfscaleConfig.model_fields["gradient_clipping"].metadata) == "number > 0, <= 1000000, or null"
    assert anchor("distributed.deepspeed.offload_param") == "distributeddeepspeedoffload_param"
    assert anchor("cluster.hosts[]") == "clusterhosts"


def test_every_link_on_the_page_has_its_heading():
    page = render_reference()
    headings = {anchor(line.lstrip("#").strip()) for line in page.splitlines() if line.startswith("#")}
    links = {part.split(")")[0] for part in page.split("](#")[1:]}
    assert links and links <= headings


def test_the_generator_imports_no_heavy_library():
    reached = closure(["hfscale.config.docs_reference"])
    assert "hfscale.config.model" in reached
    assert sorted(f"{m}: {i}" for m in reached for i in top_level_imports(m, MODULES[m]) if i.split(".")[0] in HEAVY) == []
