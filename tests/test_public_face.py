"""The public face (hfscale/__init__.py): the names a training script imports, where each lives, the
previous release's module paths (hfscale.core.moved), and that the examples and the code the docs
show import nothing else (read with ast; nothing here imports torch or starts a process)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT
from doc_commands import blocks, pages

from hfscale.core.moved import MOVED, MOVED_INTO_PACKAGE

INIT = ast.parse((ROOT / "hfscale" / "__init__.py").read_text())
PUBLIC = ast.literal_eval(next(n.value for n in INIT.body if isinstance(n, ast.Assign)
                               and ast.unparse(n.targets[0]) == "_PUBLIC"))
ALLOWED = set(PUBLIC) | {"__version__"}

# every module of the previous release (git ls-tree ddc25f8^ hfscale/, before "hfscale in ten layered subpackages")
PREVIOUS_RELEASE = """
accelerate_rules accelerate_source artifacts callbacks callbacks.checkpoints callbacks.collectives callbacks.preemption
callbacks.progress callbacks.reporting checkpoint_files cli cli_runs config config_accelerate config_base
config_deepspeed config_runners console deepspeed_rules deepspeed_source disk_full docs_reference engine_source
envvars errors execute exitcodes export extra_keys files fit follow hostfile import_deepspeed import_draft
import_fsdp importer job launch_plan launcher load memory meta_count model_config model_shape netcheck network
output_lock parallelism_rules pid_identity plan preflight presets progress records render_accelerate
render_deepspeed render_kubernetes render_slurm report reshard resume run_history run_script run_stop rundir
runners runners.common runners.kubernetes runners.local runners.pdsh runners.pdsh_docker runners.slurm
runners.stopping runs schedule schema_errors script_rules shell shutdown sizing ssh summary template tensors_only
train trainer_args trainer_hook transformers_source untrusted watchdog yamlsource
""".split() + [f"launch.{m}" for m in """
beats console disk_full execute first_failure follow node_lines output_lock run_output watchdog requeue settle
supervisor timeline network node_command ssh runners.keeper runners.stopping runners.slurm_state preflight recovery
""".split()]  # and hfscale.launch's modules before issue 37 put it in rooms


def module_file(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def test_every_public_name_is_defined_where_the_face_says():
    assert {"instrument", "latest_checkpoint", "exit_cleanly", "step", "MetricsCallback", "StragglerCallback",
            "PreemptionCallback", "CheckpointCompleteCallback", "ProgressCallback"} <= set(PUBLIC)
    for name, module in PUBLIC.items():
        tree = ast.parse(module_file(module).read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert name in defined, f"{name} is not defined in {module}"
    # the imports editors read (under TYPE_CHECKING) say the same
    typed = {a.asname or a.name: n.module for node in INIT.body if isinstance(node, ast.If)
             for n in node.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert typed == PUBLIC


def test_dir_lists_the_public_face_and_nothing_it_imports_to_work():
    import hfscale
    import hfscale.core.untrusted  # noqa: F401  (a subpackage loaded: an attribute of the package, not its face)

    public = [n for n in dir(hfscale) if not n.startswith("__")]
    assert public == sorted(set(PUBLIC)), public
    assert "__version__" in dir(hfscale)


def test_import_hfscale_loads_nothing_but_the_finder_of_moved_modules():
    """At module level the package imports hfscale.core.moved only: every public name loads on first use."""
    top = [n for n in INIT.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(n) for n in top if "hfscale" in ast.unparse(n)] == [
        "from hfscale.core.moved import install as _install_moved"]
    moved = ast.parse((ROOT / "hfscale" / "core" / "moved.py").read_text())
    assert not [n for n in ast.walk(moved) if isinstance(n, (ast.Import, ast.ImportFrom))
                and "hfscale" in ast.unparse(n)]  # core: imports nothing from hfscale


def test_every_module_of_the_previous_release_has_a_new_path():
    old = {f"hfscale.{m}" for m in PREVIOUS_RELEASE}
    assert set(MOVED) | set(MOVED_INTO_PACKAGE) == old
    for name, new in MOVED.items():
        assert module_file(name) is None, f"{name} is a module of its own again: remove it from MOVED"
        assert module_file(new) is not None, f"{name} -> {new}, which does not exist"
    for name, new in MOVED_INTO_PACKAGE.items():
        assert module_file(name).name == "__init__.py" and module_file(new) is not None
        assert "moved_name(__name__, name)" in module_file(name).read_text()  # its __getattr__ serves the old names


# --- the examples and the docs' code import only the public face


def outside_the_face(tree: ast.AST) -> list[str]:
    """Imports of hfscale, and attributes of ``hfscale``, that are not the public face."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [f"import {a.name}" for a in node.names if a.name.startswith("hfscale.")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hfscale":
            if node.module != "hfscale":
                bad.append(f"from {node.module} import ...")
            else:
                bad += [f"from hfscale import {a.name}" for a in node.names if a.name not in ALLOWED]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "hfscale" \
                and node.attr not in ALLOWED:
            bad.append(f"hfscale.{node.attr}")
    return bad


def code_shown() -> dict[str, str]:
    """Every example script, and every ```python block of README.md and docs/*.md."""
    out = {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / "examples").rglob("*.py"))}
    for page in pages():
        for lang, start, body in blocks(page.read_text(encoding="utf-8")):
            if lang in ("python", "py"):
                out[f"{page.relative_to(ROOT).as_posix()}:{start}"] = "\n".join(body)
    return out


def test_the_reader_sees_imports_outside_the_face():
    previous = ("import hfscale.progress\nfrom hfscale.callbacks import MetricsCallback\n"
                "from hfscale import step, Console\nimport hfscale\nhfscale.training.heartbeat.step(1)\n"
                "hfscale.step(1)\n")
    assert outside_the_face(ast.parse(previous)) == [
        "import hfscale.progress", "from hfscale.callbacks import ...", "from hfscale import Console",
        "hfscale.training"]


def test_examples_and_docs_code_import_only_the_public_face():
    shown = code_shown()
    assert "examples/accelerate_loop/train.py" in shown and "docs/your-own-script.md" in " ".join(shown)
    assert any("hfscale.instrument(" in code for code in shown.values())
    bad = {where: found for where, code in shown.items() if (found := outside_the_face(ast.parse(code)))}
    assert bad == {}
