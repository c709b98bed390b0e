"""The health gate as a node runs it (python -m hfscale.launch.node.health_gate, as the node line calls it),
with nvidia-smi's answers recorded in tests/data/nvidia_smi played by a stand-in nvidia-smi on PATH (no GPU
here: the stand-in is the only part that is not real), and the site's check run for real."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfscale.config.health import HealthCheckConfig
from hfscale.core import exitcodes
from hfscale.launch.node.health_gate import gate_argv

DATA = Path(__file__).parent / "data" / "nvidia_smi"
STAND_IN = """#!/bin/sh
case "$1" in
  --query-gpu=*) cat "$FAKE_GPUS"; exit "${FAKE_GPUS_RC:-0}" ;;
  --query-remapped-rows=*) cat "$FAKE_REMAP"; exit "${FAKE_REMAP_RC:-0}" ;;
esac
exit 2
"""


def gate(tmp: Path, slots: int, command: str | None = None, timeout: int = 60, gpus: str | None = None,
         remap: str = "healthy_8.remap.csv", gpus_rc: int = 0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    path = [p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()]
    if gpus is not None:
        (tmp / "bin").mkdir(exist_ok=True)
        (tmp / "bin" / "nvidia-smi").write_text(STAND_IN)
        (tmp / "bin" / "nvidia-smi").chmod(0o755)
        path.insert(0, str(tmp / "bin"))
        env.update(FAKE_GPUS=str(DATA / gpus), FAKE_REMAP=str(DATA / remap), FAKE_GPUS_RC=str(gpus_rc))
    env["PATH"] = os.pathsep.join(path)
    check = HealthCheckConfig(command=command, timeout=timeout) if command else None
    return subprocess.run(gate_argv(sys.executable, slots, check), env=env, capture_output=True, text=True, timeout=120)


def test_a_healthy_node_passes_silently_and_a_machine_without_gpus_passes(tmp_path):
    for gpus in ("healthy_8.gpus.csv", None):
        r = gate(tmp_path, 8, gpus=gpus)
        assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


@pytest.mark.parametrize("gpus, remap, rc, why", [
    ("ecc_gpu3.gpus.csv", "healthy_8.remap.csv", 0, "GPU 3 (00000000:5D:00.0): 2 uncorrected ECC error(s)"),
    ("healthy_8.gpus.csv", "remap_pending_gpu4.remap.csv", 0, "GPU 4 (00000000:9A:00.0): a row remapping is pending"),
    ("missing_gpu6.gpus.csv", "healthy_8.remap.csv", 0, "8 slots but only 7 GPU(s) answer nvidia-smi"),
    ("fallen_off_bus.out", "healthy_8.remap.csv", 15, "nvidia-smi failed (exit 15): Unable to determine the device "
                                                      "handle for GPU0000:3A:00.0: Unknown Error"),
])
def test_a_sick_gpu_keeps_the_node_out_with_the_reason_in_its_log(tmp_path, gpus, remap, rc, why):
    r = gate(tmp_path, 8, gpus=gpus, remap=remap, gpus_rc=rc)
    assert r.returncode == exitcodes.UNHEALTHY == 69
    assert r.stdout.startswith("hfscale: health gate failed: " + why), r.stdout


def test_the_sites_check_runs_as_written_and_its_output_goes_to_the_log(tmp_path):
    ok = gate(tmp_path, 1, "echo scratch mounted; df -P / >/dev/null")
    assert (ok.returncode, ok.stdout) == (0, "scratch mounted\n")
    bad = gate(tmp_path, 1, "echo 'checking $HOME'; echo 'disk gone' >&2; exit 3")
    assert bad.returncode == 69
    assert bad.stdout == "checking $HOME\ndisk gone\nhfscale: health gate failed: recovery.health_check exited 3: disk gone\n"


def test_a_check_that_hangs_is_killed_with_what_it_started_at_its_timeout(tmp_path):
    mark = tmp_path / "child.pid"
    t = time.monotonic()
    r = gate(tmp_path, 1, f"sleep 300 & echo $! > {mark}; wait", timeout=2)
    assert time.monotonic() - t < 30
    assert r.returncode == 69 and "recovery.health_check still ran after its timeout, 2 s: killed" in r.stdout
    pid = int(mark.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the check's own child outlived it"


def test_a_probe_waits_for_a_site_check_that_takes_longer_than_its_own_timeout(tmp_path):
    """The probe's --timeout (30 s by default, ssh and the facts) is not the site check's bound: a check that
    takes longer, within its own timeout, passes, and is not cut and read as an unreachable host."""
    cfg = tmp_path / "slow-check.yaml"
    cfg.write_text("name: pf\ncluster: {nproc_per_node: 1, master_port: 29557}\nbatch: {micro_batch_size: 1}\n"
                   "recovery: {health_check: {command: 'sleep 3; echo scratch ok', timeout: 30}}\n")
    r = subprocess.run([sys.executable, "-m", "hfscale", "preflight", str(cfg), "--timeout", "1"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "preflight ok: 1 host(s)" in r.stdout, r.stdout + r.stderr
