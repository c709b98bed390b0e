"""The test tiers (CONTRIBUTING.md): the markers are declared and strict, and the modules listed as
unit in conftest.py start no process, use no cluster fixture and join no process group, read from
their source with ast (conftest's guard also fails a unit test that starts a process)."""

from __future__ import annotations

import ast
import re

from conftest import CLUSTER_FIXTURES, ROOT, UNIT_MODULES

TESTS = ROOT / "tests"
# imported modules and used names by which a test starts processes or joins a process group
SPAWNING_MODULES = {"subprocess", "multiprocessing", "pty", "concurrent.futures.process"}
SPAWNING_NAMES = {"run_cli", "Popen", "executable", "fork", "posix_spawn", "system", "init_process_group",
                  "init_distributed"}


def test_the_markers_are_declared_and_strict():
    text = (ROOT / "pyproject.toml").read_text()  # read as text: tomllib is Python 3.11+, hfscale 3.10+
    section = text[text.index("[tool.pytest.ini_options]"):]
    markers = section[section.index("markers = ["):section.index("]", section.index("markers = ["))]
    assert set(re.findall(r'^\s*"(\w+):', markers, re.M)) == {"unit", "integration", "cluster", "slow"}
    assert "--strict-markers" in re.search(r'^addopts = "(.*)"$', section, re.M).group(1).split()


def test_every_unit_module_exists():
    assert {name for name in UNIT_MODULES if not (TESTS / f"{name}.py").is_file()} == set()


def uses(tree: ast.AST) -> set[str]:
    """What in ``tree`` starts a process, needs a cluster or joins a process group."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in SPAWNING_MODULES}
        elif isinstance(node, ast.ImportFrom):
            found |= {node.module} & SPAWNING_MODULES
            found |= {a.name for a in node.names} & (SPAWNING_NAMES | CLUSTER_FIXTURES)
        elif isinstance(node, ast.Name) and node.id in SPAWNING_NAMES | CLUSTER_FIXTURES:
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in SPAWNING_NAMES:
            found.add(node.attr)
        elif isinstance(node, ast.arg) and node.arg in CLUSTER_FIXTURES:
            found.add(node.arg)
    return found


def test_the_reader_sees_what_starts_processes():
    code = ("import subprocess\nfrom conftest import run_cli\nimport sys\n"
            "def test_x(cluster2):\n    subprocess.Popen([sys.executable])\n")
    assert uses(ast.parse(code)) == {"subprocess", "run_cli", "cluster2", "Popen", "executable"}


def test_unit_modules_start_no_process_and_no_cluster():
    found = {name: sorted(uses(ast.parse((TESTS / f"{name}.py").read_text()))) for name in sorted(UNIT_MODULES)}
    assert {name: what for name, what in found.items() if what} == {}
