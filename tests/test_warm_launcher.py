"""Ranks forked warm (hfscale.training.warm_launcher, runner.warm_start) behave as ranks started as new
interpreters: a real torchrun under the warm launcher, two ranks of a script that reports what it sees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hfscale.core.pid_identity import start_time
from hfscale.training.warm_launcher import PRELOADS, cuda_driver_loaded, preload

PROBE = r'''
import atexit, gc, json, os, signal, sys, threading
import torch
out = os.environ["PROBE_OUT"]


def pdeathsig():
    import ctypes
    sig = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
    return sig.value


rank = os.environ["RANK"]
seen = {"argv": sys.argv, "path0": sys.path[0], "pid": os.getpid(), "ppid": os.getppid(), "name": __name__,
        "preloaded": "accelerate" in sys.modules, "threads": torch.get_num_threads(),
        "pdeathsig": pdeathsig(), "cmdline": open("/proc/self/cmdline", "rb").read().decode().split(chr(0)), "term": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "comm": open("/proc/self/comm").read().strip(),
        "int": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "gc": gc.isenabled(), "frozen": gc.get_freeze_count(), "sid": os.getsid(0)}
atexit.register(lambda: open(f"{out}/atexit-{rank}", "w").write("ran"))


def tell(seen):  # whole or not at all: the test reads the file as soon as it exists
    with open(f"{out}/rank-{rank}.json.part", "w") as f:
        json.dump(seen, f)
    os.replace(f"{out}/rank-{rank}.json.part", f"{out}/rank-{rank}.json")


tell(seen)
mode = sys.argv[1]
if mode == "alone":  # one rank, no OMP_NUM_THREADS: a new interpreter's threads, and a parallel matmul ends
    a = torch.ones(1024, 1024)
    seen["matmul"] = float((a @ a)[0, 0])
    tell(seen)
if mode == "exit":  # hfscale's exit_cleanly ends a rank with os._exit: the agent must not wait for ever
    os._exit(0)
if mode == "code":
    sys.exit(3 if rank == "1" else 0)
if mode == "outlive":  # wait for the test to kill the launcher, then end as a finished rank does
    import time
    while not os.path.exists(f"{out}/release"):
        time.sleep(0.1)
    os._exit(0)
if mode == "sleep":
    import time
    time.sleep(600)
'''


def _run(tmp_path: Path, mode: str, port: int, wait: bool = True, nproc: int = 2
         ) -> subprocess.Popen | subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / mode
    out.mkdir()
    argv = [sys.executable, "-m", "hfscale.training.warm_launcher", "--preload", "accelerate", "torch.distributed.run",
            "--nnodes", "1", "--nproc_per_node", str(nproc), "--master_port", str(port), str(script), mode]
    env = {**os.environ, "PROBE_OUT": str(out), "HFSCALE_RUN_DIR": str(tmp_path / f"run-{mode}"), "HFSCALE_HOST": "node7"}
    env.pop("OMP_NUM_THREADS", None)
    if not wait:
        return subprocess.Popen(argv, cwd="/", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return subprocess.run(argv, cwd="/", env=env, capture_output=True, text=True, timeout=240)


def _seen(tmp_path: Path, mode: str, rank: int) -> dict:
    return json.loads((tmp_path / mode / f"rank-{rank}.json").read_text())


def test_forked_ranks_see_what_new_interpreters_would_and_end_as_they_do(tmp_path):
    r = _run(tmp_path, "exit", 29741)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]  # os._exit(0) of both ranks: done, no hang
    launcher = None
    for rank in (0, 1):
        seen = _seen(tmp_path, "exit", rank)
        assert seen["argv"] == [str(tmp_path / "probe.py"), "exit"] and seen["path0"] == str(tmp_path)
        assert seen["name"] == "__main__" and seen["preloaded"]  # forked after the preload
        assert seen["threads"] == 1  # OMP_NUM_THREADS=1 that torchrun sets for 2 ranks, as a new interpreter reads it
        assert seen["term"] and seen["int"]  # the agent's signal handlers are not the rank's
        # the collector runs, as in a new interpreter; what the launcher imported is frozen: it never walks it
        assert seen["gc"] and seen["frozen"] > 100_000, seen["frozen"]
        assert seen["pdeathsig"] == 0  # torch's SIGINT at the launcher's death undone: a rank outlives it
        # a session of its own, as torch starts a new interpreter (start_new_session): a TERM to the launcher's
        # group is not the rank's too, nor one to the rank's group (its writers) the launcher's
        assert seen["sid"] == seen["pid"], seen
        assert seen["comm"] == Path(sys.executable).name[:15]  # not the agent's pt_elastic: ps and pkill python see it
        # the command torch would have run for it, not the launcher's: ps and pgrep -f see the rank's
        words = [w for w in seen["cmdline"] if w]
        assert words == [sys.executable, "-u", str(tmp_path / "probe.py"), "exit"], seen["cmdline"]
        launcher = launcher or seen["ppid"]
        assert seen["ppid"] == launcher  # both forked from the same launcher process
        assert (tmp_path / "exit" / f"atexit-{rank}").read_text() == "ran"
        note = (tmp_path / "run-exit" / "stacks" / f"pid-node7-{seen['pid']}").read_text().split()
        assert note[0] == str(rank) and int(note[1]) > 0  # the rank and its start time, for the stack dumps

    r = _run(tmp_path, "code", 29742)
    assert r.returncode != 0  # rank 1's exit code 3 fails the launch, as a new interpreter's does
    assert "exitcode  : 3" in r.stdout + r.stderr


def test_a_lone_rank_takes_the_threads_a_new_interpreter_takes(tmp_path):
    fresh = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True,
                           text=True, env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, check=True)
    r = _run(tmp_path, "alone", 29744, nproc=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    seen = _seen(tmp_path, "alone", 0)
    assert seen["threads"] == int(fresh.stdout) and seen["matmul"] == 1024.0


def test_a_term_to_the_launcher_reaches_the_forked_ranks(tmp_path):
    proc = _run(tmp_path, "sleep", 29743, wait=False)
    try:
        pids = _started(tmp_path, "sleep", proc)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        time.sleep(0.5)
        assert [p for p in pids if _running(p)] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_ranks_that_outlive_their_launcher_end_and_leave_its_port_free(tmp_path):
    """A launcher that dies (here SIGKILL; under Slurm a notice its agent does not handle): its ranks go on, as
    new interpreters' do, and when they end they end (torch's forked worker would wait for ever for the dead
    launcher to read its result), and none of them holds the rendezvous store's port."""
    import socket

    proc = _run(tmp_path, "outlive", 29745, wait=False)
    try:
        pids = _started(tmp_path, "outlive", proc)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: its ranks are in its session, left running
        proc.wait(timeout=30)
        time.sleep(1)
        assert all(_running(p) for p in pids)  # they outlived it
        with socket.socket() as s:  # the store's port is free: no rank kept the launcher's listening socket
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", 29745))
            s.listen()
        (tmp_path / "outlive" / "release").touch()
        deadline = time.monotonic() + 30
        while any(_running(p) for p in pids):
            assert time.monotonic() < deadline, [p for p in pids if _running(p)]
            time.sleep(0.2)
        assert all((tmp_path / "outlive" / f"atexit-{r}").read_text() == "ran" for r in (0, 1))
    finally:
        for p in _seen_pids(tmp_path, "outlive"):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _started(tmp_path: Path, mode: str, proc: subprocess.Popen) -> list[int]:
    """The pids of the two ranks, once each has written what it sees (the launcher still running)."""
    deadline = time.monotonic() + 120
    while not all((tmp_path / mode / f"rank-{r}.json").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.2)
    return [_seen(tmp_path, mode, r)["pid"] for r in (0, 1)]


def _running(pid: int) -> bool:
    return start_time(pid) is not None  # None: gone, or ended and not yet reaped


def _seen_pids(tmp_path: Path, mode: str) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in (tmp_path / mode).glob("rank-*.json")]


def test_a_preload_that_does_not_exist_is_skipped_and_one_that_fails_is_told(tmp_path, monkeypatch):
    assert preload(["json", "hfscale_no_such_module.sub", "hfscale.training.no_such"]) == []  # another release: no word
    (tmp_path / "hfscale_broken_probe.py").write_text("import hfscale_needs_this_missing\n")
    (tmp_path / "hfscale_raising_probe.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    failed = preload(["hfscale_broken_probe", "hfscale_raising_probe"])
    assert failed == ["hfscale_broken_probe: ModuleNotFoundError: No module named 'hfscale_needs_this_missing'",
                      "hfscale_raising_probe: RuntimeError: boom"]
    assert set(PRELOADS) == {"accelerate", "trainer", "deepspeed", "builtin"}


def test_a_loaded_cuda_driver_turns_the_forks_off(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1\n")
    assert not cuda_driver_loaded(str(maps))  # NVML (PYTORCH_NVML_BASED_CUDA_CHECK) is not the driver
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05\n")
    assert cuda_driver_loaded(str(maps))
    assert cuda_driver_loaded(str(tmp_path / "absent"))  # cannot tell: not safe
    assert not cuda_driver_loaded()  # this machine: no GPU, nothing loaded it


RANK_OF_AGENT = r'''
import os, sys, time
mode = sys.argv[1]
with open(os.path.join(os.environ["OUT"], mode), "w") as f:
    f.write(" ".join([os.environ.get("ONLY_AGENT", "-"), os.environ["RANK"], sys.argv[0], __name__]))
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise RuntimeError("the rank failed")
if mode == "os-exit":
    os._exit(0)
if mode == "sleep":
    time.sleep(600)
'''

AGENT = r'''
import json, os, sys, time
from hfscale.training.inprocess.node_agent import ForkedRank
from hfscale.training.warm_launcher import fork_rank, warm_up

script, out = sys.argv[1], sys.argv[2]
assert warm_up(["accelerate"])
os.environ["ONLY_AGENT"] = "1"  # in the agent's environment, not in the one the ranks are given
env = {k: v for k, v in os.environ.items() if k != "ONLY_AGENT"}
codes = {}
for n, mode in enumerate(("ok", "exit3", "raise", "os-exit", "sleep")):
    rank = ForkedRank(fork_rank([script, mode], {**env, "OUT": out, "RANK": str(n)}))
    if mode == "sleep":
        while not os.path.exists(os.path.join(out, mode)):
            time.sleep(0.05)
        assert rank.poll() is None
        rank.terminate()
    codes[mode] = rank.wait(120)
print(json.dumps(codes))
'''


def test_the_node_agents_forked_ranks_run_with_their_environment_and_end_with_their_codes(tmp_path):
    """hfscale.training.warm_launcher.fork_rank as the in-process node agent uses it (recovery.in_process with
    runner.warm_start): each rank runs its script as __main__ with the environment it was given (not its agent's),
    and ends with the code a new interpreter would: 0, sys.exit's, 1 after an exception's traceback, a signal's."""
    (tmp_path / "rank.py").write_text(RANK_OF_AGENT)
    (tmp_path / "agent.py").write_text(AGENT)
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, str(tmp_path / "agent.py"), str(tmp_path / "rank.py"), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    codes = json.loads(r.stdout.strip().splitlines()[-1])
    assert codes == {"ok": 0, "exit3": 3, "raise": 1, "os-exit": 0, "sleep": -signal.SIGTERM}, codes
    assert "RuntimeError: the rank failed" in r.stderr  # the traceback an interpreter prints
    for n, mode in enumerate(codes):
        assert (out / mode).read_text() == f"- {n} {tmp_path / 'rank.py'} __main__"


def _agent(tmp_path: Path, preload: str) -> subprocess.Popen:
    """hfscale's in-process node agent for one rank of a script that leaves a file behind if it ever runs."""
    (tmp_path / "store").write_text("29745\n")
    (tmp_path / "rank.py").write_text("import os\nopen(os.environ['RAN'], 'w').write('ran')\n")
    argv = [sys.executable, "-m", "hfscale.training.inprocess.node_agent", "--nproc", "1", "--node-rank", "0",
            "--world", "1", "--launched", "1", "--store-file", str(tmp_path / "store"), "--reach", "local",
            "--preload", preload, "--", str(tmp_path / "rank.py")]
    return subprocess.Popen(argv, env={**os.environ, "RAN": str(tmp_path / "ran")}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_term_while_the_node_agent_imports_starts_no_rank_and_an_unknown_group_is_refused(tmp_path):
    """A stop that lands inside the node agent's imports (a relaunch's stop, a preemption), once its handlers are
    in (torch's library is being mapped): the agent ends with 128 + TERM and never forks its rank."""
    agent = _agent(tmp_path, "trainer,deepspeed")
    deadline = time.monotonic() + 60
    while True:
        try:
            if "libtorch" in Path(f"/proc/{agent.pid}/maps").read_text():
                break
        except OSError:
            pass
        assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[0]
        time.sleep(0.01)
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert not (tmp_path / "ran").exists()

    refused = _agent(tmp_path, "trainer,everything")
    out, _ = refused.communicate(timeout=60)
    assert refused.returncode == 2 and "--preload: unknown everything (known: " in out, out
    assert not (tmp_path / "ran").exists()
