"""Shared test helpers: the repo root, the CLI as a real subprocess, CPU DeepSpeed settings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/cluster/ is importable as "cluster"
pytest_plugins = ["cluster.fixtures"]  # fixtures: cluster2 (session, 2 nodes), make_cluster(n)

ROOT = Path(__file__).resolve().parents[1]

# DeepSpeed on this CPU-only machine: CPU accelerator, and one build of its C++ op per checkout.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Test tiers (markers in pyproject.toml; how to run them: CONTRIBUTING.md). A unit module starts no
# process, no cluster and no process group: test_tiers.py reads these modules for that, and the
# guard below fails a unit test that starts a process anyway. Every other module is integration;
# a test using a cluster fixture (tests/cluster/fixtures.py) is also cluster.
UNIT_MODULES = frozenset({
    "test_accelerate_keys", "test_architecture", "test_checkpoint_files", "test_docs_reference", "test_follow",
    "test_fuzz", "test_kubernetes", "test_launch_summary", "test_lock_follows_job", "test_memory_measured",
    "test_network", "test_node_lines", "test_public_face", "test_render", "test_recovery_config", "test_recovery_policy",
    "test_progress_line", "test_slurm_state",
    "test_supervisor", "test_schedule", "test_slurm_step",
    "test_tiers", "test_validation", "test_spares", "test_local_tier", "test_async_save_unit", "test_healing_trips",
    "test_data_state_unit", "test_inprocess_unit", "test_loss_guard", "test_rollbacks", "test_health_gate", "test_slow_nodes",
})
CLUSTER_FIXTURES = frozenset({"cluster2", "make_cluster", "slurm2", "make_slurm", "podman2"})
SLURM_FIXTURES = frozenset({"slurm2", "make_slurm"})
# The suite runs in three lanes at once (pytest-xdist, one worker each): the tests on namespace
# clusters reached by ssh and pdsh, whose nodes have network stacks of their own; every other test that
# starts processes, one after another on this machine's own ports (many trainings use master_port 29500);
# and the waiting lane: tests that use almost no CPU and mostly wait for a bound (a lost node noticed, a
# keeper's silence, heartbeats counted over a minute) and bind no fixed port, so that their waits
# overlap the two others' work instead of adding to it, and, in turn with them, the tests on Slurm
# (SLURM_FIXTURES: one Slurm at a time on this machine, so all of them in one lane). Unit tests start nothing and run
# wherever a worker is free.
LANE_CLUSTER, LANE_LOCAL, LANE_WAIT = "cluster", "local", "wait"
# (their fixed ports, where they have any, are used by no test of another lane on this machine's own
# network: test_stopping 29631-29633, test_faults 29890-29891, test_hangs 29681-29684). Tests that use
# CPU do not belong here: with test_hostile, test_deepspeed_keys, test_callbacks, test_consumers and the
# orphans test added, every lane slowed (.ci/run 31.5 min and over, against 29.0 min without them).
# Nor do tests that mostly wait but still use some: test_async_save and the in-process cluster test (about
# 0.4 and 0.55 of a core) moved here took the lanes' sums from 1728/1757/551 s to 1313/1675/913 s and the
# run's wall not at all (2018 -> 2015 s: the suite is CPU-bound, 1.8 of 2 cores busy), and slowed the rest
# enough for a 10 s bound of test_hostile_runs to fail.
# The Slurm tests use CPU, but they came from the cluster lane, the longest (its tests of 3 s or more summed
# to 1483 s in a .ci/run of 1546 s, the local lane's to 1162 s, this lane's to 509 s): 523 s of it moved here
# gave 960/1162/1032 s. They take turns with this lane's waiting tests, never run beside them: the load a
# waiting test's bound sees is still the two other lanes'.
WAIT_MODULES = frozenset({"test_keeper", "test_beat_server", "test_stopping", "test_faults", "test_hangs"})
WAIT_TESTS = frozenset({  # cluster tests of a few CPU-seconds each: on a cluster of their own (make_cluster),
    # or on this lane's own session cluster2 (each worker makes its own)
    ("test_launch_cluster", "test_a_lost_node_is_noticed_within_a_minute"),
    ("test_launch_cluster", "test_detached_dead_node_is_noticed_by_its_heartbeat"),
    ("test_launch_cluster", "test_stop_of_a_died_detached_launch_stops_every_node"),
    ("test_launch_cluster", "test_ctrl_c_stops_every_node"),
    ("test_launch_cluster", "test_unrelated_processes_survive_cleanup"),
    ("test_launch_cluster", "test_a_stuck_rank_on_another_host_is_named"),
    ("test_launch_cluster", "test_detached_crash_stops_every_node"),
    ("test_launch_cluster", "test_detached_sigterm_stops_every_node"),
    ("test_faults_cluster", "test_a_node_line_that_starts_after_the_stop_starts_nothing"),
})


# Tests of the local lane that bind no port another test binds (torchrun --standalone: its rendezvous and
# master port are free ports the kernel gives; or a fixed port no other test uses), moved to the lanes with
# room: in a .ci/run of 31.3 min, with the Slurm tests in the waiting lane, the lanes' tests of 3 s or more
# summed to local 1701 s, cluster 1383 s, waiting 1391 s, and the local lane ran alone for its last 6
# minutes (load 1.0-1.5 on 2 cores). The two that compare with trainer_runs.reference() stay together:
# each worker that needs it runs that 2-rank job once (~10 s).
MOVED_TESTS = {
    ("test_async_save", "test_sigkills_during_asynchronous_writes_resume_from_the_newest_complete_checkpoint"): LANE_CLUSTER,
    ("test_async_save", "test_a_rank_killed_mid_write_takes_its_writer_and_the_restart_saves_like_synchronous_saves"):
        LANE_CLUSTER,
    ("test_async_save", None): LANE_WAIT,
    # then the local lane was still the longest (1516 s against 1379 and 1374 s, a 28.1-min run): its in-process
    # fallback (69 s there), on a port of its own (29771) instead of the README job's 29500
    ("test_inprocess", "test_a_rank_that_cannot_rejoin_falls_back_to_a_full_relaunch_that_finishes"): LANE_WAIT,
}


def pytest_itemcollected(item: pytest.Item) -> None:
    """Each test's tier and lane, as it is collected: before any collection_modifyitems hook (-m
    selects by these markers there, and pytest-xdist reads xdist_group there, in an order between
    plugins that pytest does not keep from one release to the next)."""
    fixtures = set(getattr(item, "fixturenames", ()))
    cluster = bool(CLUSTER_FIXTURES & fixtures)
    if cluster:
        item.add_marker(pytest.mark.cluster)
    unit = item.path.stem in UNIT_MODULES
    item.add_marker(pytest.mark.unit if unit else pytest.mark.integration)
    if not unit:  # three lanes under pytest-xdist (pyproject: -n 3 --dist loadgroup); unit tests go where there is room
        module, name = item.path.stem, getattr(item, "originalname", item.name)
        waits = module in WAIT_MODULES or (module, name) in WAIT_TESTS or bool(SLURM_FIXTURES & fixtures)
        lane = LANE_WAIT if waits else LANE_CLUSTER if cluster else LANE_LOCAL
        lane = MOVED_TESTS.get((module, name), MOVED_TESTS.get((module, None), lane))
        item.add_marker(pytest.mark.xdist_group(lane))


def pytest_configure(config: pytest.Config) -> None:
    """In the controller, before any worker starts: the lanes need pytest below 9.2 (below)."""
    version = tuple(int(p) for p in pytest.__version__.split(".")[:2] if p.isdigit())
    if getattr(config.option, "dist", "no") == "loadgroup" and version >= (9, 2):
        raise pytest.UsageError(f"pytest {pytest.__version__}: pytest-xdist's loadgroup sets item._nodeid, which "
                                "pytest 9.2 no longer reads, so the lanes would mix (two Slurm clusters at once, "
                                "trainings on one port); install pytest<9.2 (setup.cfg's test extra), or run with -n 0")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under pytest-xdist's loadgroup a test's group is the ``@<group>`` suffix of its id. pytest-xdist
    3.8 sets it through ``item._nodeid``, which pytest 9.2 no longer reads (setup.cfg keeps pytest below
    9.2): refuse to run with the lanes silently mixed (two Slurm clusters at once, trainings on one port)."""
    if not getattr(session.config.option, "loadgroup", False) or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    mixed = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if mixed:
        raise pytest.UsageError(f"pytest-xdist's loadgroup did not take (e.g. {mixed[0]}): this pytest "
                                f"{pytest.__version__} with pytest-xdist; install pytest<9.2 (setup.cfg's test extra)")


def _no_process(*args, **kwargs):
    raise AssertionError("a unit test started a process: move its module out of UNIT_MODULES (tests/conftest.py)")


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("unit") is not None:
        monkeypatch.setattr(subprocess.Popen, "_execute_child", _no_process)
        monkeypatch.setattr(os, "fork", _no_process)
        monkeypatch.setattr(os, "posix_spawn", _no_process)


def job_of(text: str, name: str = "job.yaml"):
    """The validated Job of an (indented) YAML text, as ``hfscale`` loads a file called ``name``."""
    from hfscale.rules.config_file import load_text

    return load_text(textwrap.dedent(text), name, Path("."))


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def job_pids(job: str) -> list[int]:
    """Processes on this machine whose environment holds ``HFSCALE_JOB_ID=<job>`` (read from /proc
    here, independently of the stop script's own search)."""
    want = f"HFSCALE_JOB_ID={job}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if want in environ.split(b"\0"):
                found.append(int(entry.name))
    return found


REFERENCE_USERS = "uninterrupted_losses"


@pytest.fixture(scope="session")
def uninterrupted_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Each step's loss of the healing tests' job (tests/test_recovery_cluster.py train_config) run
    without a fault on 3 local processes, REFERENCE_STEPS steps (the tests compare their own steps,
    a prefix: the learning rate is constant). Run once per session: see ``reference_losses``."""
    return reference_losses(tmp_path_factory)


def reference_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted run's losses, computed once for all of a session's workers: under pytest-xdist
    the first worker to ask runs it (the others wait on a lock in the session's shared temp folder and
    read its file). Only the cluster lane's tests compare with it: the waiting lane, whose tests use
    little CPU, computes it first (``_reference_in_the_waiting_lane``), off the two longer lanes."""
    from test_recovery_cluster import REFERENCE_STEPS, losses, train_config

    import fcntl
    import json

    import yaml

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    cache = shared / "uninterrupted-losses.json"
    with open(shared / "uninterrupted-losses.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cache.is_file():
            return {int(k): float(v) for k, v in json.loads(cache.read_text()).items()}
        tmp = tmp_path_factory.mktemp("uninterrupted-")
        config = train_config(tmp, "ref", tmp / "out", 29931, None, max_steps=REFERENCE_STEPS)
        doc = yaml.safe_load(config.read_text())
        doc["training"]["save_steps"] = REFERENCE_STEPS  # one save, at the end: a save changes no loss, 140 cost ~30 s
        config.write_text(yaml.safe_dump(doc, sort_keys=False))
        r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=ROOT, capture_output=True,
                           text=True, timeout=1200)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        found = losses(tmp / "out" / f"checkpoint-{REFERENCE_STEPS}")
        cache.write_text(json.dumps(found))
        return found


@pytest.fixture(autouse=True)
def _reference_in_the_waiting_lane(request: pytest.FixtureRequest) -> None:
    """Under pytest-xdist's lanes, the waiting lane's first test computes the uninterrupted run when a
    cluster test of this session will compare with it: the cluster lane then finds it done instead of
    running it itself, and the local lane does not spend its 80 s either (both are longer lanes)."""
    group = request.node.get_closest_marker("xdist_group")
    if not os.environ.get("PYTEST_XDIST_WORKER") or group is None or group.args[:1] != (LANE_WAIT,):
        return
    if getattr(request.session, "_hfscale_reference", False):
        return
    request.session._hfscale_reference = True  # type: ignore[attr-defined]
    if any(REFERENCE_USERS in getattr(item, "fixturenames", ()) for item in request.session.items):
        reference_losses(request.getfixturevalue("tmp_path_factory"))


def same_ninja(bin_dir: Path) -> None:
    """A ``ninja`` in ``bin_dir``, a test's PATH of its own (one without py-spy): the ninja every other
    process of the suite finds (the interpreter's, pip's). DeepSpeed's CPU accelerator loads its shm op
    through torch's JIT build into the suite's one TORCH_EXTENSIONS_DIR; the system's ninja (Debian's
    1.11) hashes the build commands otherwise than pip's (1.13), so each of the two finding the other's
    log rebuilt the op, a minute of two compilers on a loaded machine (5 builds in one .ci/run)."""
    found = shutil.which("ninja", path=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, "no ninja: DeepSpeed's JIT build needs one (pip's ninja, a dependency of deepspeed)"
    (bin_dir / "ninja").symlink_to(os.path.realpath(found))


def read_until(proc: subprocess.Popen, marker: str, count: int, timeout: float = 120) -> list[str]:
    """Read ``proc``'s output until ``count`` lines containing ``marker`` were seen; the lines read."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while sum(marker in line for line in seen) < count:
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, "".join(seen)[-3000:]
        seen.append(line)
    return seen


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m hfscale ARGS`` as users do; capture text output."""
    return subprocess.run(
        [sys.executable, "-m", "hfscale", *args],
        cwd=cwd or ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
