"""In-process restart for real (hfscale.training.inprocess.restart): processes started as torchrun starts
them (RANK, WORLD_SIZE, MASTER_ADDR/PORT; the store that outlives them hosted here, as node 0's torchrun
agent hosts it), gloo on CPU, the loop of tests/scripts/inprocess_loop.py. A SIGKILLed rank is replaced
by a standby that had done its imports; the survivor keeps its process; the losses are the uninterrupted
run's. The launcher's part (which nodes to start, a lost node 0, the fallback) is not here."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
from test_recovery_cluster import losses

from hfscale.core.pid_identity import start_time
from hfscale.launch.recovery.timeline import read_timeline
from hfscale.training.inprocess.restart import ENV_JOIN, ENV_TIMEOUT, ENV_WORLD, RELAUNCH_EXIT

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "inprocess_loop.py"


STORE_HOST = """
import sys, time, datetime
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
print("ready", flush=True)
time.sleep(3600)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """``world`` active ranks and ``standbys`` more, each a process of its own, and the store. ``args``:
    the loop script's. (The built-in entry point restarting in process: tests/test_inprocess_cluster.py,
    under hfscale launch.)"""

    def __init__(self, out: Path, world: int, standbys: int, args: list[str], join_s: float = 3.0,
                 store_process: bool = False, env: dict[str, str] | None = None) -> None:
        import torch.distributed as dist

        out.mkdir(parents=True, exist_ok=True)
        self.out, port = out, _port()
        if store_process:  # a process of its own, to be killed
            self.store = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port)], stdout=subprocess.PIPE,
                                          text=True)
            assert self.store.stdout.readline().strip() == "ready"
        else:
            self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=60))
        total = world + standbys
        self.logs = [open(out.parent / f"{out.name}.uid{u}.log", "w") for u in range(total)]
        env = {**os.environ, "WORLD_SIZE": str(total), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               ENV_WORLD: str(world), ENV_JOIN: str(join_s), "PYTHONPATH": str(ROOT), **(env or {})}
        cmd = [sys.executable, str(SCRIPT), str(out), *args]
        self.procs = [subprocess.Popen(cmd, stdout=self.logs[u], stderr=subprocess.STDOUT, cwd=out,
                                       env={**env, "RANK": str(u), "LOCAL_RANK": str(u),
                                            "LOCAL_WORLD_SIZE": str(total)},
                                       start_new_session=True) for u in range(total)]

    def steps(self) -> list[dict]:
        path = self.out / "steps.jsonl"
        return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []

    def wait(self, timeout: float = 240) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(max(1.0, deadline - time.monotonic())) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            for f in self.logs:
                f.close()

    def log(self, uid: int) -> str:
        return (self.out.parent / f"{self.out.name}.uid{uid}.log").read_text()

    def until(self, done: Callable[[], bool], timeout: float = 120) -> None:
        """Wait for ``done()`` while uid 0 runs."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline and self.procs[0].poll() is None, self.log(0)[-3000:]
            time.sleep(0.05)

    def at_step(self, step: int) -> None:
        self.until(lambda: any(s["step"] >= step for s in self.steps()))


def _losses(steps: list[dict], rank: int = 0) -> dict[int, float]:
    """step -> loss as rank ``rank`` of the attempt that trained it last recorded it."""
    return {s["step"]: s["loss"] for s in steps if s["rank"] == rank}


LOOP = ["--steps", "24", "--save-every", "4", "--step-sleep", "0.15"]


@pytest.fixture(scope="module")
def loop_losses(tmp_path_factory) -> dict[int, float]:
    """The loop's uninterrupted run: each step's loss."""
    ref = Launch(tmp_path_factory.mktemp("loop-ref") / "ref", 2, 0, LOOP)
    assert ref.wait() == [0, 0], ref.log(0)[-3000:]
    expected = _losses(ref.steps())
    assert sorted(expected) == list(range(1, 25))
    return expected


GROUP_MADE_LATER = """
import sys, time, datetime
import torch, torch.distributed as dist
from hfscale.training.inprocess.assignment import first
from hfscale.training.inprocess.restart import _join_group
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, world_size=2, timeout=datetime.timedelta(seconds=60))
_join_group(store, first(2, 0), rank, 2.0)
group = dist.new_group(ranks=[0, 1])  # made as DeepSpeed makes its copy of the world, without a timeout
if rank == 1:
    print("frozen", flush=True)
    time.sleep(120)  # never enters the collective, never closes its connections: a frozen peer
t = time.monotonic()
try:
    dist.all_reduce(torch.ones(1), group=group)
    print("RESULT completed", flush=True)
except RuntimeError as e:
    print("RESULT failed %.1f %s" % (time.monotonic() - t, str(e).splitlines()[0][:120]), flush=True)
"""


def test_a_group_a_library_makes_after_the_attempts_times_out_with_it(tmp_path):
    """DeepSpeed's ZeRO reduces gradients over a copy of the world it makes with ``dist.new_group`` and no
    timeout (deepspeed.utils.groups._clone_world_group): torch gives such a group its default, 30 min,
    not the attempt group's. A survivor blocked there on a peer that never closed its connections waited
    for half an hour (the namespace cluster's in-process test: counted lost, it left the next fault without
    a standby). Two processes join an attempt bounded at 2 s, make a group, and rank 1 never enters rank
    0's all_reduce on it: rank 0's fails at the bound."""
    port = _port()
    procs = [subprocess.Popen([sys.executable, "-c", GROUP_MADE_LATER, str(r), str(port)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")] or [out[-2000:]]
    assert line.startswith("RESULT failed "), line
    assert float(line.split()[2]) < 10.0, line  # the attempt's 2 s bound, not torch's 30 min


def test_a_killed_rank_is_replaced_by_a_standby_and_the_survivor_keeps_its_process(tmp_path, loop_losses):
    expected, args = loop_losses, LOOP
    job = Launch(tmp_path / "job", 2, 1, args)
    job.at_step(10)
    survivor = job.procs[0].pid
    job.procs[1].send_signal(signal.SIGKILL)  # uid 1: rank 1, its node lost
    killed = time.time()
    rcs = job.wait()
    assert rcs[0] == 0 and rcs[2] == 0 and rcs[1] == -signal.SIGKILL, (rcs, job.log(0)[-3000:], job.log(2)[-3000:])

    steps = job.steps()
    second = [s for s in steps if s["attempt"] == 1]
    assert {(s["rank"], s["uid"]) for s in second} == {(0, 0), (1, 2)}  # the standby took rank 1
    assert {s["pid"] for s in steps if s["uid"] == 0} == {survivor}  # one process throughout
    first = min(second, key=lambda s: s["t"])
    resumed = first["resumed"]
    assert resumed % 4 == 0 and 8 <= resumed <= 12
    assert _losses(steps) == expected  # every step, the retrained ones too (bitwise)
    restart = min(s["t"] for s in second) - killed
    print(f"in-process restart: first step of attempt 1 {restart:.2f} s after the SIGKILL; resumed from step "
          f"{resumed}; the survivor's own restart_s {[s.get('restart_s') for s in second if 'restart_s' in s]}")
    assert "attempt 0 ended" in job.log(0) and "rank 0 stays and rejoins" in job.log(0)


def test_a_frozen_rank_is_replaced_once_its_peers_collective_times_out(tmp_path, loop_losses):
    """A peer stopped (SIGSTOP: a hung driver, a cut link) closes no connection: the survivor's collective
    fails at the groups' timeout (HFSCALE_INPROCESS_TIMEOUT_S, 5 s here), and the standby takes the rank."""
    job = Launch(tmp_path / "job", 2, 1, LOOP, env={ENV_TIMEOUT: "5"})
    job.at_step(6)
    job.procs[1].send_signal(signal.SIGSTOP)
    frozen = time.time()
    try:
        for u in (0, 2):
            assert job.procs[u].wait(180) == 0, (u, job.log(u)[-3000:])
    finally:
        job.procs[1].send_signal(signal.SIGKILL)
        rcs = job.wait()
    assert rcs == [0, -signal.SIGKILL, 0], rcs
    steps = job.steps()
    second = [s for s in steps if s["attempt"] == 1]
    assert {(s["rank"], s["uid"]) for s in second} == {(0, 0), (1, 2)}
    assert _losses(steps) == loop_losses
    back = min(s["t"] for s in second) - frozen
    print(f"frozen rank: first step of attempt 1 {back:.2f} s after the SIGSTOP (timeout 5 s)")
    assert 5.0 <= back <= 5.0 + 10.0, back
    assert re.search(r"attempt 0 ended \(rank 0 \(uid 0\): .*[Tt]imed out", job.log(0)), job.log(0)[-2000:]


def test_a_standby_lost_as_it_takes_its_rank_is_replaced_by_the_next(tmp_path, loop_losses):
    """A fault inside the restart: uid 2, the standby given rank 1, dies as attempt 1 begins (after joining
    its group, before reading the checkpoint). The survivor's next collective fails, and attempt 2 gives
    rank 1 to uid 3; the survivor kept its process through both."""
    job = Launch(tmp_path / "job", 2, 2, [*LOOP, "--die", "2:1"])
    job.at_step(6)
    survivor = job.procs[0].pid
    job.procs[1].send_signal(signal.SIGKILL)
    rcs = job.wait()
    assert rcs == [0, -signal.SIGKILL, -signal.SIGKILL, 0], (rcs, job.log(0)[-3000:])
    steps = job.steps()
    assert {(s["attempt"], s["rank"], s["uid"]) for s in steps if s["attempt"] > 0} == {(2, 0, 0), (2, 1, 3)}
    assert {s["pid"] for s in steps if s["uid"] == 0} == {survivor}
    assert _losses(steps) == loop_losses
    log0 = job.log(0)
    assert "attempt 0 ended" in log0 and "attempt 1 ended" in log0


def test_too_few_standbys_end_every_process_for_a_full_relaunch(tmp_path):
    job = Launch(tmp_path / "job", 2, 0, ["--steps", "40", "--save-every", "4", "--step-sleep", "0.15"], join_s=2.0)
    job.at_step(3)
    job.procs[1].send_signal(signal.SIGKILL)
    rcs = job.wait()
    assert rcs == [RELAUNCH_EXIT, -signal.SIGKILL], (rcs, job.log(0)[-3000:])
    assert ("hfscale: no in-process restart: 1 rank(s) lost (rank 1) and 0 standby rank(s) to take their place; "
            "the job is relaunched") in job.log(0)


def test_a_lost_store_ends_the_standby_for_a_full_relaunch_and_the_training_goes_on(tmp_path):
    job = Launch(tmp_path / "job", 1, 1, ["--steps", "30", "--save-every", "10", "--step-sleep", "0.1"],
                 store_process=True)
    job.at_step(3)
    job.store.kill()
    job.store.wait()
    rcs = job.wait()
    assert rcs == [0, RELAUNCH_EXIT], (rcs, job.log(1)[-3000:])
    assert max(s["step"] for s in job.steps()) == 30  # the training needs no store once its group is formed
    assert re.search(r"hfscale: no in-process restart: the store at 127.0.0.1:\d+ is lost \(.+\); the job is "
                     r"relaunched", job.log(1)), job.log(1)[-2000:]


def _trainer_config(tmp: Path, name: str) -> Path:
    """The README's job (examples/tiny_cpu: GPT-2, ZeRO-2, the built-in entry point), 30 steps, a
    checkpoint every 5, every step's loss logged."""
    import yaml

    doc = yaml.safe_load((ROOT / "examples" / "tiny_cpu" / "config.yaml").read_text())
    doc["name"] = name
    doc["training"].update(max_steps=30, save_steps=5, logging_steps=1, save_total_limit=3,
                           output_dir=str(tmp / name / "out"))
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


CLM = ROOT / "tests" / "scripts" / "hf_clm_inprocess.py"
CLM_MODEL = "n_layer=2,n_head=2,n_embd=32,vocab_size=256,n_positions=64,bos_token_id=0,eos_token_id=0"


def _script_config(tmp: Path, name: str, in_process: bool) -> Path:
    import yaml

    doc = {"name": name, "cluster": {"nproc_per_node": 2, "master_port": 29748},
           "runner": {"type": "local", "launcher": "torchrun", "run_dir": str(tmp / "runs")},
           "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2, "steps_per_print": 100000}},
           "precision": "no", "batch": {"micro_batch_size": 2},
           "env": {"vars": {"OMP_NUM_THREADS": "1"}}, "watchdog": {"timeout": 60},
           "recovery": {"max_restarts": 2, "in_process": in_process},
           "training": {"script": str(CLM), "output_dir": str(tmp / name), "max_steps": 24, "save_steps": 4,
                        "logging_steps": 1, "seed": 3,
                        "script_args": ["--model_type", "gpt2", "--config_overrides", CLM_MODEL, "--block_size", "32",
                                        "--disable_tqdm", "true"]}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_a_user_script_that_opts_in_restarts_in_process_under_hfscale_launch(tmp_path):
    """An HfArgumentParser Trainer script (tests/scripts/hf_clm_inprocess.py) that calls
    hfscale.restart_in_process, launched by ``hfscale launch`` (runner local, 2 ranks, ZeRO-2): rank 1's
    process SIGKILLed after checkpoint 8; its node agent starts it again, it takes its rank back, and
    rank 0 keeps its process. Every step's loss is the same job's without the fault (in-process off)."""
    ref = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(_script_config(tmp_path, "ref", False))],
                         cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    expected = losses(tmp_path / "ref" / "checkpoint-24")
    assert sorted(expected) == list(range(1, 25))
    out = tmp_path / "job"
    job = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(_script_config(tmp_path, "job", True))],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not (out / "checkpoint-8" / "hfscale_complete.json").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-3000:] if job.stdout else ""
        time.sleep(0.2)
    ranks = _ranks_of(str(tmp_path))
    assert sorted(ranks) == [0, 1], ranks
    assert all(_forked_by_its_agent(pid) for pid in ranks.values()), ranks  # runner.warm_start, the default
    os.kill(ranks[1], signal.SIGKILL)
    while not (out / "checkpoint-16" / "hfscale_complete.json").exists():  # past the restart
        assert job.poll() is None and time.monotonic() < deadline + 240, job.stdout.read()[-3000:] if job.stdout else ""
        time.sleep(0.2)
    again = _ranks_of(str(tmp_path))
    assert again[0] == ranks[0]  # rank 0 kept its process
    assert again[1] != ranks[1] and _forked_by_its_agent(again[1])  # the one started again, forked too
    text, _ = job.communicate(timeout=400)
    assert job.returncode == 0, text[-4000:]
    assert losses(out / "checkpoint-24") == expected
    log = next((tmp_path / "runs").glob("job-*/logs/local.log")).read_text()
    assert "rank process 1 ended (signal SIGKILL); started again, as a standby" in log, log[-3000:]
    assert "rank 0 stays and rejoins" in log, log[-3000:]
    # the restart, in the timeline (hfscale.launch.recovery.in_process_events) and in hfscale status
    (run,) = (tmp_path / "runs").glob("job-*")
    (healed,) = [e for e in read_timeline(run).events if e.kind == "in_process"]
    # rank 0 may have reached checkpoint 12 before the kill was seen (checkpoints every 4 steps)
    assert healed.in_process == 1 and healed.resume_step in (8, 12) and healed.failed_step >= healed.resume_step, healed
    assert healed.what.startswith("rank ") and {"engine", "first_step"} <= set(healed.phases), healed
    status = subprocess.run([sys.executable, "-m", "hfscale", "status", str(run)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert "restarts     0 (and 1 in process)" in status.stdout, status.stdout
    assert "last start   attempt 0, restart in process 1 (rank " in status.stdout, status.stdout


def _ranks_of(under: str, module: bytes = b"hfscale.training.run_script") -> dict[int, int]:
    """LOCAL_RANK -> pid of this machine's rank processes (``python -m <module>``, started by an
    in-process node agent) whose run directory is under ``under``: a rank started as a new interpreter
    by its environment, a rank forked warm (its environment is its agent's) by the pid file it wrote
    (``<run>/stacks/pid-<host>-<pid>``: its rank, here its local rank, and its start time)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            env = dict(v.split("=", 1) for v in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in v)
        except OSError:
            continue
        if argv[1:3] == [b"-m", module] and env.get("HFSCALE_RUN_DIR", "").startswith(under) \
                and "HFSCALE_INPROCESS_WORLD" in env:
            found[int(env["LOCAL_RANK"])] = int(entry.name)
    for note in Path(under).glob("**/stacks/pid-*"):
        pid = int(note.name.rsplit("-", 1)[1])
        try:
            rank, started = note.read_text().split()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if argv[1:3] == [b"-m", module] and start_time(pid) == int(started):
            found[int(rank)] = pid
    return found


def _forked_by_its_agent(pid: int) -> bool:
    """Whether rank process ``pid`` was forked by its node agent (warm): its parent is the agent, and its
    /proc environment, the one its process started with, is the agent's (no LOCAL_RANK), not its own."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        agent = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return False
    return agent[1:3] == [b"-m", b"hfscale.training.inprocess.node_agent"] and \
        not any(v.startswith(b"LOCAL_RANK=") for v in env)


NEVER_REJOINS = """\
import os
import time

import hfscale.training.inprocess.restart as restart

_late = restart._late


def _never(store, session):
    # asked when called, not at import: a rank forked warm (runner.warm_start) ran this file in its node
    # agent, which has no HFSCALE_INPROCESS_RESTARTED
    if os.environ.get("HFSCALE_INPROCESS_RESTARTED", "0") != "0":  # a rank its node agent started again
        time.sleep(3600)  # it never finds the attempt in the store: it cannot rejoin
    return _late(store, session)


restart._late = _never
"""


def test_a_rank_that_cannot_rejoin_falls_back_to_a_full_relaunch_that_finishes(tmp_path):
    """Runner local, 2 ranks, no spare: rank 1 SIGKILLed after checkpoint 8; its node agent starts it
    again, but the new process never rejoins (put in from outside: a sitecustomize.py). Rank 0 waits
    the join bound (30 s), finds too few ranks and exits 75; the agent stops the stuck process and ends
    with 75; the launch stops and relaunches the job (recovery.max_restarts), which resumes and finishes."""
    import yaml

    config = _trainer_config(tmp_path, "fallback")
    doc = yaml.safe_load(config.read_text())
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NEVER_REJOINS)
    doc.update(runner={"type": "local", "launcher": "torchrun", "run_dir": str(tmp_path / "runs")},
               recovery={"max_restarts": 2, "in_process": True}, watchdog={"timeout": 60},
               env={"vars": {"PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}})
    doc["cluster"]["master_port"] = 29771  # no other test's: it runs in the waiting lane (tests/conftest.py MOVED_TESTS)
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = tmp_path / "fallback" / "out"
    job = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not (out / "checkpoint-10" / "hfscale_complete.json").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-3000:] if job.stdout else ""
        time.sleep(0.2)
    ranks = _ranks_of(str(tmp_path), b"hfscale.training.train")
    os.kill(ranks[1], signal.SIGKILL)
    text, _ = job.communicate(timeout=600)
    assert job.returncode == 0, text[-4000:]
    assert "hfscale: no in-process restart: 1 rank(s) lost (rank 1) and 0 standby rank(s) to take their place; the " \
           "job is relaunched" in text, text[-4000:]
    assert re.search(r"hfscale: restart 1 \(at most 2\): .*exit code 75", text), text[-4000:]
    (run,) = (tmp_path / "runs").iterdir()
    failure = next(e for e in read_timeline(run).events if e.kind == "failure")
    assert "could not restart in process (exit code 75): the job is relaunched" in failure.what, failure
    assert failure.error == ("no in-process restart: 1 rank(s) lost (rank N) and 0 standby rank(s) to take their "
                             "place"), failure
    assert sorted(losses(out / "checkpoint-30")) == list(range(1, 31))  # every step, the relaunch's included
