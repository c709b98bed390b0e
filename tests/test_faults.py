"""Faults told plainly (issue 20): one job per output_dir, a torn metrics line, what resuming
skipped, a full disk. The multi-host parts (a lock across 2 hosts, a node line that starts after
the stop) are in tests/test_faults_cluster.py.

The launches here that only need to hold a lock or print their first lines run a stand-in for
the interpreter (a shell script that sleeps): what is tested is hfscale's launcher, not training.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, job_pids
from hfscale.launch.node.keeper import SELF_STOP_S

MODEL = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "n_positions": 64,
         "bos_token_id": 0, "eos_token_id": 0}


def job_file(tmp: Path, name: str, out: Path, *, python: str | None = None, port: int = 29890, **training) -> Path:
    doc = {"name": name, "cluster": {"nproc_per_node": 1, "master_port": port},
           "runner": {"launcher": "torchrun", "run_dir": str(tmp / "runs"), **({"python": python} if python else {})},
           "distributed": {"backend": "ddp"}, "precision": "no", "batch": {"micro_batch_size": 2},
           "env": {"vars": {"OMP_NUM_THREADS": "1"}},
           "training": {"output_dir": str(out), "max_steps": 4, "save_steps": 2, "logging_steps": 1,
                        "model": {"config": MODEL}, "data": {"block_size": 32}, **training}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def standin(tmp: Path, body: str = "sleep 300 &\nwait\n") -> str:
    """A stand-in for the interpreter the launcher runs (``runner.python``)."""
    path = tmp / "python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def hfscale(*args: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfscale", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def wait_for(predicate, timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# ---- one job per output_dir -----------------------------------------------------------------------

def test_a_second_launch_into_a_used_output_dir_is_refused_and_a_dead_ones_lock_taken_over(tmp_path):
    """Refused while the first launch runs; once its launcher was killed -9 while its job's processes
    train on, the next launch waits for that job to stop itself (Ctrl-C gives up: nothing started);
    taken over (and said) once those are stopped."""
    out = tmp_path / "out"
    job = job_file(tmp_path, "one", out, python=standin(tmp_path))
    first = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(job)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    third = None
    jobs: list[str] = []
    try:
        lock = out / "_hfscale-lock.json"
        wait_for(lambda: lock.exists(), what="the first launch's lock")
        held = json.loads(lock.read_text())
        jobs.append(held["job_id"])
        wait_for(lambda: len(job_pids(held["job_id"])) >= 2, what="the first job's processes")
        t0 = time.monotonic()
        second = hfscale("launch", str(job))
        assert second.returncode == 2, second.stdout + second.stderr
        assert (f"error: training.output_dir {out} is in use by job {held['job_id']} (host {socket.gethostname()}, "
                f"pid {first.pid}, run directory ") in second.stderr, second.stderr
        assert "nothing was started" in second.stderr and "Traceback" not in second.stderr
        runs = sorted((tmp_path / "runs").iterdir())
        assert len(runs) == 1  # the refused launch made no run directory
        print(f"refused in {time.monotonic() - t0:.2f} s")
        dry = hfscale("launch", str(job), "--dry-run")  # the plan says it takes the lock
        assert f"lock: {out}/_hfscale-lock.json (one launch per training.output_dir" in dry.stdout

        first.kill()  # the launcher dies without a word; its job's processes live on
        first.wait(timeout=10)
        assert job_pids(held["job_id"])
        # ... and still train into out: the lock still holds. The same launch waits for the job to stop
        # itself (its keeper hears its line close and confirms: tests/test_keeper.py); Ctrl-C gives up
        again = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(job)], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = again.stdout.readline()
        assert (f"is in use by job {held['job_id']}, whose launcher (host {socket.gethostname()}, pid {first.pid}) is "
                f"gone; its job still runs on local and stops itself within {SELF_STOP_S} s") in line, line
        assert "waiting for it, Ctrl-C to give up" in line
        assert json.loads(lock.read_text())["job_id"] == held["job_id"]  # its job may be stopping itself by now
        again.send_signal(signal.SIGINT)
        rest, _ = again.communicate(timeout=30)
        assert again.returncode == 130 and "hfscale: got SIGINT; gave up waiting, nothing was started" in rest, rest
        assert len(list((tmp_path / "runs").iterdir())) == 1
        stopped = hfscale("stop", held["run_dir"])  # the recorded cleanup of the died run
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        wait_for(lambda: not job_pids(held["job_id"]), 15, "the died job's processes to end")
        third = subprocess.Popen([sys.executable, "-m", "hfscale", "launch", str(job)], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = third.stdout.readline()
        while "took over" not in line and line:
            line = third.stdout.readline()
        assert (f"hfscale: took over the lock of {lock} from job {held['job_id']} (launched on "
                f"{socket.gethostname()}, pid {first.pid}): its launcher is gone (no process with that pid and "
                "start time) and nothing of its job runs here") in line
        now = json.loads(lock.read_text())
        jobs.append(now["job_id"])
        assert now["job_id"] != held["job_id"] and now["pid"] == third.pid
        third.send_signal(signal.SIGTERM)
        assert third.wait(timeout=60) == 143
        assert not lock.exists()  # released at the end
    finally:
        for p in (first, third):
            if p is not None and p.poll() is None:
                p.kill()
        for j in jobs:
            for pid in job_pids(j):
                os.kill(pid, signal.SIGKILL)


def test_the_lock_judges_a_holder_on_another_host_by_its_age_on_the_file_system(tmp_path):
    """A lock whose holder runs on another host: live while touched (by the file system's clock),
    taken over once untouched for the stale time; a lock that cannot be read is judged by age too."""
    from hfscale.launch.attempt import output_lock
    out = tmp_path / "out"
    out.mkdir()
    lock = out / "_hfscale-lock.json"
    lock.write_text(json.dumps({"job_id": "20261125-000001-aaaaaa", "host": "other-host", "pid": 123, "proc_start": 9,
                                "boot_id": None, "run_dir": "/r", "started": time.time()}))
    with pytest.raises(output_lock.LockHeld, match=r"in use by job 20261125-000001-aaaaaa \(host other-host, pid 123"):
        output_lock.acquire(out, "20261125-000002-bbbbbb", "/r2", stale_s=60)
    old = time.time() - 120
    os.utime(lock, (old, old))  # untouched for 2 minutes
    taken = output_lock.acquire(out, "20261125-000002-bbbbbb", "/r2", stale_s=60)
    assert taken.took_over is not None and taken.took_over.host == "other-host" and "not touched for 1" in taken.why
    assert json.loads(lock.read_text())["job_id"] == "20261125-000002-bbbbbb"
    assert output_lock.touch(taken)
    output_lock.release(taken)
    assert not lock.exists()
    lock.write_text("{not json")
    with pytest.raises(output_lock.LockHeld, match="cannot be read"):
        output_lock.acquire(out, "20261125-000003-cccccc", "/r3", stale_s=60)
    os.utime(lock, (old, old))
    assert output_lock.acquire(out, "20261125-000003-cccccc", "/r3", stale_s=60).took_over is None  # unreadable: no record
    assert sorted(p.name for p in out.iterdir()) == ["_hfscale-lock.json"]  # no temporary file left


# ---- a torn metrics line -----------------------------------------------------------------------

def test_a_record_appended_after_a_torn_line_starts_its_own_line_and_the_torn_one_is_counted(tmp_path):
    from hfscale.training.callbacks.collectives import append_jsonl
    from hfscale.core.records import MetricsLine
    from hfscale.core.untrusted import read_json_lines

    path = tmp_path / "hfscale_metrics.jsonl"
    append_jsonl(str(path), {"event": "metrics", "step": 2})
    with open(path, "a") as f:
        f.write('{"event": "metrics", "st')  # a job killed mid-append
    append_jsonl(str(path), {"event": "metrics", "step": 4, "tokens_per_s": 10.0})  # the relaunch's first record
    lines = path.read_text().splitlines()
    assert lines == ['{"event": "metrics", "step": 2}', '{"event": "metrics", "st',
                     '{"event": "metrics", "step": 4, "tokens_per_s": 10.0}']
    got = read_json_lines(path, MetricsLine, 1 << 20, 1 << 20, 1000)
    assert [r.step for r in got.records] == [2, 4] and got.skipped == 1
    assert got.note(path) == f"{path}: 1 unreadable line(s) skipped"


def test_a_line_just_over_the_cap_is_skipped_wherever_the_pieces_split_it(tmp_path):
    """A line a little over line_cap whose start shares a read piece with a newline (the reader
    reads 4 MiB pieces from the end) was returned whole; it is skipped and counted."""
    from hfscale.core.records import MetricsLine
    from hfscale.core.untrusted import CHUNK, read_json_lines

    cap = 1 << 20
    path = tmp_path / "m.jsonl"
    big = '{"event": "metrics", "step": 3, "x": "' + "a" * (cap + 100) + '"}'
    last = '{"event": "metrics", "step": 5}\n'
    for split in (10, len(big) // 2, len(big) - 10):  # where the 4 MiB pieces (from the end) cut the long line
        tail = "c" * (CHUNK - split - len(last) - 1)  # its own line (a bad record)
        path.write_text('{"event": "metrics", "step": 1}\n' + big + "\n" + tail + "\n" + last)
        got = read_json_lines(path, MetricsLine, cap, 64 << 20, 100_000)
        assert [r.step for r in got.records] == [1, 5] and got.skipped == 2, split  # the long line, the c's


# ---- what resuming skipped ---------------------------------------------------------------------

def _checkpoints(out: Path) -> None:
    """checkpoint-35 complete (its marker), checkpoint-40 without rank 1's RNG state."""
    import torch

    from hfscale.checkpoints.resume import write_marker

    for step, ranks in ((35, (0, 1)), (40, (0, 2))):
        d = out / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": 100}))
        for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
            torch.save({}, d / name)
        for r in ranks:
            torch.save({}, d / f"rng_state_{r}.pth")
        if step == 35:
            write_marker(d, step, 2)


def test_resuming_says_what_it_skipped_in_the_plan_and_on_the_terminal(tmp_path):
    out = tmp_path / "out"
    _checkpoints(out)
    job = job_file(tmp_path, "resume", out, python=standin(tmp_path, "exit 0\n"), max_steps=100)
    line = ("checkpoint-40 skipped: no hfscale_complete.json, and by its own files: rng_state_1.pth is missing "
            "(rank 1 did not finish saving); resuming from checkpoint-35")
    dry = hfscale("launch", str(job), "--dry-run")
    assert dry.returncode == 0 and f"resume: {line}" in dry.stdout.splitlines(), dry.stdout
    r = hfscale("launch", str(job))
    assert f"hfscale: {line}" in r.stdout.splitlines(), r.stdout + r.stderr


# ---- a full disk -------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MiB tmpfs: room for the first checkpoints of a tiny model, not for all of them."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true and a tmpfs cannot be mounted: {r.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_is_named_with_the_path_the_space_and_the_checkpoint_a_relaunch_resumes(tmp_path, small_disk):
    out = small_disk / "out"
    job = job_file(tmp_path, "full", out, max_steps=40, save_steps=2, port=29891)
    r = hfscale("launch", str(job), timeout=300)
    text = r.stdout + r.stderr
    assert r.returncode != 0, text[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("hfscale: ")]
    told = [line for line in lines if "disk is full" in line or "free in" in line or "newest complete" in line
            or "was being written" in line]
    print("\n".join(told))
    assert any(line.startswith("hfscale: the disk is full: ") and f" failed writing in {out} (" in line
               for line in told), text[-3000:]
    assert any(line.startswith("hfscale: checkpoint-") and "was being written and is incomplete" in line
               for line in told), told
    free = next(line for line in told if line.endswith(f"free in {out}"))
    assert "KiB" in free or "bytes" in free
    from hfscale.checkpoints.resume import scan_output

    scan = scan_output(str(out), None)
    assert scan.resume is not None
    assert any(line.startswith(f"hfscale: the newest complete checkpoint is {scan.resume}: a relaunch resumes "
                               "there once there is room") for line in told), told


def test_torchs_own_words_for_a_failed_write_count_as_a_full_disk_only_when_the_disk_is_nearly_full(tmp_path,
                                                                                                     small_disk):
    """torch.save says "unexpected pos" or "basic_ios::clear", never "no space": on a nearly full disk
    that is a full disk; with room left (this machine's disk) hfscale does not claim it. A "no
    space" line about another disk is said to be about another disk."""
    from hfscale.launch.attempt.disk_full import LOW, Signs, free_bytes, told

    lines = ["node0: [rank0]: RuntimeError: [enforce fail at inline_container.cc:603] . unexpected pos 4544 vs 4436",
             "node0: [rank0]: RuntimeError: basic_ios::clear: iostream error"]
    signs = Signs()
    for line in lines:
        signs.see("node0", line)
    (small_disk / "fill").write_bytes(b"x" * (1400 << 10))
    said = told(signs, str(small_disk))
    assert said[0] == f"hfscale: the disk is full: node0 failed writing in {small_disk} ({lines[0]})"
    assert said[-1] == "hfscale: no complete checkpoint: a relaunch starts from step 0 once there is room"
    assert (free_bytes(str(tmp_path)) or 0) > LOW, "this test needs 1 GiB free beside the tmpfs"
    assert told(signs, str(tmp_path)) == []  # room left: torch's words alone are not a full disk
    elsewhere = Signs()  # a full /dev/shm or cache while the checkpoints' disk has room: said so, not blamed on it
    elsewhere.see("node3", "RuntimeError: unable to write to file </torch_18692_1>: No space left on device (28)")
    said = told(elsewhere, str(tmp_path))
    assert len(said) == 1 and said[0].startswith("hfscale: a write failed for lack of space on node3 (")
    assert f"free in {tmp_path}: not there (a full /dev/shm, a cache or home directory?)" in said[0]
    named = Signs()  # the line names the output_dir (a quota, say): it is the one
    named.see("node1", f"OSError: [Errno 122] Disk quota exceeded: '{tmp_path}/checkpoint-8/optimizer.pt'")
    assert told(named, str(tmp_path))[0].startswith(f"hfscale: the disk quota is exceeded: node1 failed writing in "
                                                    f"{tmp_path} (")
