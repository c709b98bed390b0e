"""The shape of the package, read from its source with ast: subpackages in layers (a module imports
only its own layer or lower ones), one module starts processes, the commands that only read configs
import no heavy library, modules stay small, imports form no cycle (type-checking imports counted)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "hfscale"
HEAVY = {"torch", "transformers", "deepspeed", "accelerate", "datasets"}
# what starts a process (or replaces this one with another program)
SPAWNING = {"subprocess", "multiprocessing", "pty"}
SPAWN_CALLS = {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp",
               "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnl"}
MAX_LINES = 400
# the commands that only read configs: check, config, init, schema, import (and launch --dry-run's planning)
CONFIG_ONLY = ["hfscale.cli.commands", "hfscale.rules.config_file", "hfscale.cli.check_summary",
               "hfscale.config.model_config", "hfscale.config.template", "hfscale.render.artifacts",
               "hfscale.core.atomic_files", "hfscale.launch.build", "hfscale.launch.preflight.probes",
               "hfscale.cli.importing.importer", "hfscale.rules.deepspeed", "hfscale.rules.accelerate",
               "hfscale.config.sources.engine", "hfscale.config.sources.accelerate", "hfscale.memory.plan_command",
               "hfscale.memory.estimate", "hfscale.memory.fit", "hfscale.memory.model_shape", "hfscale.runs.registry",
               "hfscale.launch.attempt.console", "hfscale.cli.runs"]
# The layer contract, lowest first: a module of hfscale.<layer> may import its own layer and the ones
# before it, never one after it (every import counts: top level, inside functions, TYPE_CHECKING).
LAYERS = ["core", "config", "checkpoints", "rules", "render", "training", "launch", "runs", "memory", "cli"]
MAX_TOP_LEVEL = 12  # entries directly in hfscale/: __init__.py, __main__.py and the layers
# hfscale.launch in rooms that follow a launch, lowest first: a module of hfscale.launch imports its own
# room and the ones before it, never one after it. "top": what every room reads (the plan value, the
# context, the run directory; netcheck runs alone on the hosts); build takes a config through a runner.
LAUNCH_ROOMS = ["top", "node", "runners", "build", "preflight", "attempt", "recovery"]
LAUNCH_TOP = {"hfscale.launch", "hfscale.launch.spec", "hfscale.launch.context", "hfscale.launch.run_dir",
              "hfscale.launch.netcheck"}
# what a runner may import of runners/: the interface, and the runners' own renderers (no runner borrows
# another runner's module: what two runners share is node/'s)
RUNNER_SHARED = {"hfscale.launch.runners.shared", "hfscale.launch.runners.slurm_step",
                 "hfscale.launch.runners.slurm_script", "hfscale.launch.runners.kubernetes_manifest"}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


MODULES = modules()


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def top_level_imports(module: str, path: Path, type_checking: bool = False) -> set[str]:
    """Modules imported when ``module`` is imported (not inside functions; for type checking too
    when ``type_checking``)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    is_package = path.name == "__init__.py"

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node, is_package)
                for a in node.names:  # `from . import x`: the submodule x; `from .m import name`: m
                    out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
            elif isinstance(node, ast.If) and (type_checking or not _type_checking_only(node)):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(tree.body)
    return out


def all_imports(module: str, path: Path) -> dict[str, int]:
    """Every hfscale module ``module`` imports anywhere (functions and TYPE_CHECKING too), with a line."""
    out: dict[str, int] = {}
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node, is_package)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for n in names:
            if n.split(".")[0] == "hfscale":
                out.setdefault(n, node.lineno)
    return out


GRAPH = {m: {i for i in top_level_imports(m, p) if i in MODULES and i != m} for m, p in MODULES.items()}
# what is needed to import or to type-check a module: the graph the cycle rule reads
TYPED_GRAPH = {m: {i for i in top_level_imports(m, p, type_checking=True) if i in MODULES and i != m}
               for m, p in MODULES.items()}


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_top_level_is_the_layers():
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert entries == {"__init__.py", "__main__.py"} | set(LAYERS)
    assert len(entries) <= MAX_TOP_LEVEL


def test_every_subpackage_says_what_it_owns_and_may_import():
    for module, path in MODULES.items():
        if path.name == "__init__.py" and module != "hfscale":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert "import" in doc and len(doc) > 80, module


def test_a_module_imports_only_its_layer_or_lower_ones():
    offenders = []
    for module, path in MODULES.items():
        if module == "hfscale":  # the public face: names from any layer, loaded on first use (test_public_face.py)
            continue
        mine = layer_of(module)
        for imported, line in all_imports(module, path).items():
            assert imported in MODULES, f"{module}:{line} imports {imported}, which is not a module of hfscale"
            theirs = layer_of(imported)
            if mine is None or theirs is None:  # hfscale itself (the version) and hfscale.__main__
                assert imported in ("hfscale", "hfscale.cli") and module in ("hfscale.__main__", "hfscale.cli.commands"), module
                continue
            if theirs > mine:
                offenders.append(f"{module}:{line} ({LAYERS[mine]}) imports {imported} ({LAYERS[theirs]})")
    assert offenders == []


def test_the_public_face_loads_its_names_on_first_use():
    """``import hfscale`` runs only hfscale.core.moved; the public names' modules (its TYPE_CHECKING
    imports) are loaded by its ``__getattr__``, so the commands that read configs stay light."""
    assert GRAPH["hfscale"] == {"hfscale.core.moved"}
    assert {"hfscale.training.instrument", "hfscale.training.callbacks.reporting"} <= TYPED_GRAPH["hfscale"]


def test_the_package_is_what_this_test_reads():
    assert {"hfscale.cli.commands", "hfscale.launch.attempt.execute", "hfscale.launch.runners.pdsh", "hfscale.training.callbacks.reporting"} <= set(MODULES)


# the programs hfscale runs on a node that start processes there (the launcher's side starts processes in
# execute only): the in-process restarts' node agent, in torchrun's place; the health gate, which runs
# nvidia-smi and the site's check before the node's launcher; the warm launcher, which forks the node's ranks (for
# torch's agent, and for the node agent)
NODE_SPAWNERS = {"hfscale.training.inprocess.node_agent", "hfscale.launch.node.health_gate", "hfscale.training.warm_launcher"}


def test_only_execute_starts_processes():
    offenders = []
    for module, path in MODULES.items():
        if module == "hfscale.launch.attempt.execute" or module in NODE_SPAWNERS:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                offenders += [f"{module}: imports {n}" for n in names if n.split(".")[0] in SPAWNING]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id == "os" and node.func.attr in SPAWN_CALLS:
                    offenders.append(f"{module}:{node.lineno}: os.{node.func.attr}")
    assert offenders == []


def closure(roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += GRAPH.get(m, set())
        parent = m.rsplit(".", 1)[0]
        if parent in MODULES and parent != m:  # importing a submodule runs its package first
            todo.append(parent)
    return seen


def test_the_config_only_commands_import_no_heavy_library():
    reached = closure(CONFIG_ONLY)
    assert "hfscale.config.model" in reached and "hfscale.launch.runners.kubernetes" in reached  # the walk follows imports
    heavy = sorted(f"{m} imports {i}" for m in reached for i in top_level_imports(m, MODULES[m])
                   if i.split(".")[0] in HEAVY)
    assert heavy == []


def test_the_heavy_modules_are_the_training_ones():
    heavy = {m for m in MODULES if any(i.split(".")[0] in HEAVY for i in top_level_imports(m, MODULES[m]))}
    assert heavy == {"hfscale.training.callbacks.collectives", "hfscale.training.callbacks.reporting", "hfscale.training.callbacks.preemption",
                     "hfscale.training.callbacks.checkpoints", "hfscale.training.callbacks.steps",
                     "hfscale.training.callbacks.local_tier", "hfscale.training.callbacks.buddy_stream",
                     "hfscale.training.callbacks.data_state", "hfscale.training.callbacks.loss_guard",
                     "hfscale.training.callbacks.slow_nodes"}


def test_no_module_over_400_lines():
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


def test_no_import_cycles_counting_type_checking_imports():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(TYPED_GRAPH[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def launch_room(module: str) -> str:
    if module in LAUNCH_TOP:
        return "top"
    room = module.split(".")[2]
    assert room in LAUNCH_ROOMS, f"{module} is in no room of hfscale.launch (LAUNCH_ROOMS)"
    return room


def test_launch_rooms_import_only_their_own_or_earlier_ones():
    offenders = []
    for module, path in MODULES.items():
        if not module.startswith("hfscale.launch"):
            continue
        mine = LAUNCH_ROOMS.index(launch_room(module))
        for imported, line in all_imports(module, path).items():
            if not imported.startswith("hfscale.launch") or imported == module:
                continue
            theirs = LAUNCH_ROOMS.index(launch_room(imported))
            if theirs > mine:
                offenders.append(f"{module}:{line} ({LAUNCH_ROOMS[mine]}) imports {imported} ({LAUNCH_ROOMS[theirs]})")
            if launch_room(module) == "attempt" and launch_room(imported) == "preflight":
                offenders.append(f"{module}:{line}: attempt/ runs probes, it does not import preflight/")
            if (launch_room(module) == launch_room(imported) == "runners" and module != "hfscale.launch.runners"
                    and imported not in RUNNER_SHARED):
                offenders.append(f"{module}:{line} borrows from another runner, {imported}")
    assert offenders == []


def test_the_launch_rooms_are_what_this_test_reads():
    rooms = {launch_room(m) for m in MODULES if m.startswith("hfscale.launch")}
    assert rooms == set(LAUNCH_ROOMS)
    for room in LAUNCH_ROOMS[1:]:
        if room != "build":
            assert f"hfscale.launch.{room}" in MODULES, room  # a package, whose __init__ says what it may import
