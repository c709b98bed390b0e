"""The settle probe (hfscale.launch.recovery.settle) run for real on this machine, as the supervisor runs it
between two attempts of a local job: it waits for the stopped attempt's processes (found by the job
id they were started with, never by name) and for the master port, each within its bound, and never
waits for itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from hfscale.launch.attempt.execute import run_probes
from hfscale.launch.recovery import settle
from hfscale.rules.config_file import load_text

JOB = "20261128-130000-abcdef-r2"
PORT = 29811


def local_job(tmp_path):
    text = (f"name: settle\ncluster: {{nproc_per_node: 1, master_port: {PORT}}}\n"
            f"runner: {{type: local, run_dir: {tmp_path / 'runs'}}}\n"
            "distributed: {backend: ddp}\nprecision: \"no\"\nbatch: {micro_batch_size: 1}\n"
            f"training: {{output_dir: {tmp_path / 'out'}, max_steps: 2}}\nrecovery: {{max_restarts: 2}}\n")
    return load_text(text, "settle.yaml", tmp_path)


def settle_here(tmp_path, grace: int) -> tuple[settle.Settled | None, float]:
    cmds = settle.probes(local_job(tmp_path), (), JOB, grace, sys.executable)
    t0 = time.monotonic()
    ran = run_probes(cmds, {k: settle.bound_s(grace, True) for k in cmds})
    return settle.Settled.read(ran[settle.LOCAL]), time.monotonic() - t0


def test_settle_waits_for_the_stopped_attempts_processes_not_for_itself(tmp_path, monkeypatch):
    # the probe's own environment carries the job id (a supervisor inside a job's shell): it must not wait on itself
    monkeypatch.setenv("HFSCALE_JOB_ID", JOB)
    alone, took = settle_here(tmp_path, grace=10)
    assert alone == settle.Settled(0, "free") and took < 5, (alone, took)
    lingering = subprocess.Popen(["sleep", "2"], env={**os.environ, "HFSCALE_JOB_ID": JOB})  # a rank shutting down
    other = subprocess.Popen(["sleep", "30"], env={**os.environ, "HFSCALE_JOB_ID": JOB + "0"})  # another job's
    try:
        waited, took = settle_here(tmp_path, grace=10)
        assert waited == settle.Settled(0, "free") and 1.5 < took < 10, (waited, took)
        stuck = subprocess.Popen(["sleep", "30"], env={**os.environ, "HFSCALE_JOB_ID": JOB})  # outlives the wait
        try:
            left, took = settle_here(tmp_path, grace=0)
            assert left == settle.Settled(1, "free") and settle.LEFT_AFTER_S <= took < settle.bound_s(0, True), took
        finally:
            stuck.kill()
    finally:
        lingering.kill()
        other.kill()


def test_settle_waits_for_the_master_port_within_its_bound(tmp_path, monkeypatch):
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("", PORT))
    holder.listen()
    threading.Timer(2.0, holder.close).start()  # the previous attempt's store, gone 2 s later
    freed, took = settle_here(tmp_path, grace=0)
    assert freed == settle.Settled(0, "free") and 1.5 < took < 10, (freed, took)
    monkeypatch.setattr(settle, "PORT_WAIT_S", 1)
    with socket.socket() as held:  # held for good (another program): said busy after the wait
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("", PORT))
        held.listen()
        busy, took = settle_here(tmp_path, grace=0)
    assert busy == settle.Settled(0, "busy") and took < 8, (busy, took)
