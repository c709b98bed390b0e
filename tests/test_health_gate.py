"""The health gate's judgement (pure): nvidia-smi's answers as recorded in tests/data/nvidia_smi (no GPU
here), the probe's reading of them and of the site's check, the policy's answer to a host that failed
it, and where the node line runs it. The gate as a process on a node: tests/test_health_gate_node.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hfscale.launch.node.health_checks import Answer, judge
from hfscale.launch.preflight.probes import MARK, HostFacts, health_problems
from hfscale.launch.recovery.policy import Fault, History, Policy, Replacement, decide, last_error

DATA = Path(__file__).parent / "data" / "nvidia_smi"


def said(name: str, rc: int = 0) -> Answer:
    return Answer(rc, (DATA / name).read_text())


HEALTHY = said("healthy_8.remap.csv")


def test_a_healthy_node_passes_and_says_nothing():
    h = judge(said("healthy_8.gpus.csv"), HEALTHY, 8)
    assert h.gpus == 8 and h.problems == () and h.notes == ()


@pytest.mark.parametrize("gpus, remap, rc, slots, problem", [
    ("ecc_gpu3.gpus.csv", "healthy_8.remap.csv", 0, 8,
     "GPU 3 (00000000:5D:00.0): 2 uncorrected ECC error(s) since the driver loaded; drain the host and reset the GPU"),
    ("healthy_8.gpus.csv", "remap_pending_gpu4.remap.csv", 0, 8,
     "GPU 4 (00000000:9A:00.0): a row remapping is pending; reset the GPU (nvidia-smi -r) before it trains"),
    ("healthy_8.gpus.csv", "remap_failed_gpu7.remap.csv", 0, 8,
     "GPU 7 (00000000:DB:00.0): a row remapping failed; the GPU needs replacing"),
    ("missing_gpu6.gpus.csv", "healthy_8.remap.csv", 0, 8, "8 slots but only 7 GPU(s) answer nvidia-smi"),
    ("fallen_off_bus.out", "healthy_8.remap.csv", 15, 8,
     "nvidia-smi failed (exit 15): Unable to determine the device handle for GPU0000:3A:00.0: Unknown Error"),
    ("no_driver.out", "healthy_8.remap.csv", 9, 8, "nvidia-smi failed (exit 9): NVIDIA-SMI has failed because it "
     "couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."),
])
def test_a_sick_gpu_is_named_with_what_to_do(gpus, remap, rc, slots, problem):
    h = judge(said(gpus, rc), said(remap), slots)
    assert h.problems == (problem,)


def test_what_the_driver_does_not_report_is_said_and_passes():
    h = judge(said("consumer_1.gpus.csv"), said("remap_unsupported.out", 2), 1)
    assert h.problems == () and h.notes == ("1 GPU(s) report no ECC counts (ECC off or not supported)",
                                            "row remapping not reported by this driver or GPU")
    none = judge(Answer(None), Answer(None), 8)  # no nvidia-smi: no GPU here
    assert none.gpus is None and none.problems == () and none.notes == ("no nvidia-smi: no GPU checked",)


def test_fewer_slots_than_gpus_is_fine_and_garbage_is_not_a_count():
    assert judge(said("healthy_8.gpus.csv"), HEALTHY, 4).problems == ()
    h = judge(Answer(0, "0, 00000000:18:00.0, lots\nnot a row\n"), HEALTHY, 1)
    assert h.problems == ("GPU 0 (00000000:18:00.0): nvidia-smi says 'lots' for its uncorrected ECC errors",)


def job(check: str | None = "exit 0", timeout: int = 60) -> SimpleNamespace:
    hc = SimpleNamespace(command=check, timeout=timeout) if check else None
    return SimpleNamespace(config=SimpleNamespace(recovery=SimpleNamespace(health_check=hc)))


def probed(*lines: str) -> HostFacts:
    facts = HostFacts.read("\n".join([MARK, "python=3.11.7", *lines]))
    assert facts is not None
    return facts


def test_the_probe_reads_the_gate_as_the_node_words_it():
    sick = (DATA / "ecc_gpu3.gpus.csv").read_text().splitlines()
    facts = probed("gpuq_rc=0", *(f"gpuq={r}" for r in sick), "remap_rc=0",
                   *(f"remap={r}" for r in (DATA / "healthy_8.remap.csv").read_text().splitlines()),
                   "health_rc=3", "health=checking /scratch", "health=disk gone")
    assert health_problems(job(), facts) == [
        "GPU 3 (00000000:5D:00.0): 2 uncorrected ECC error(s) since the driver loaded; drain the host and reset the GPU",
        "recovery.health_check exited 3: disk gone"]
    assert health_problems(job(), probed("health_rc=0", "health=ok")) == []
    assert health_problems(job(timeout=7), probed("health_rc=124")) == [
        "recovery.health_check still ran after its timeout, 7 s: killed"]
    assert health_problems(job(), probed()) == ["recovery.health_check said nothing (the probe ended before it)"]
    assert health_problems(job(None), probed()) == []  # no site check, no nvidia-smi: nothing to say
    hostile = probed("gpuq_rc=0", *(["gpuq=0, x, 0"] * 5000), "health_rc=0")
    assert len(hostile.said["gpuq"]) == 1024  # lines kept at most


def policy(min_nodes=None, spares=("node3",)) -> Policy:
    return Policy.of(SimpleNamespace(max_restarts=5, window=None, strikes=2, min_nodes=min_nodes),
                     ("node0", "node1", "node2"), spares)


def sick(host: str) -> Fault:
    return Fault("unhealthy", host, 69, f"{host} failed its health gate (exit code 69): not admitted",
                 "health gate failed: recovery.health_check exited 3: disk gone", 1.0, False)


def test_a_host_that_fails_its_gate_is_replaced_by_a_spare_or_left_out_at_once():
    out = decide(policy(), History(), sick("node1"), frozenset({"node3"}), 2.0)
    assert out.hosts == ("node0", "node3", "node2") and out.replaced == (Replacement("node1", "node3"),)
    out = decide(policy(min_nodes=2, spares=()), History(), sick("node2"), frozenset(), 2.0)
    assert out.hosts == ("node0", "node1") and "node2 failed its health gate: excluded" in out.reason
    out = decide(policy(spares=()), History(), sick("node2"), frozenset(), 2.0)  # may not shrink: retried, struck
    assert out.hosts == ("node0", "node1", "node2") and "strike 1 of 2 against node2" in out.reason


def test_the_gates_line_is_the_nodes_error():
    log = ["node1: recovery check: /scratch", "node1: hfscale: health gate failed: recovery.health_check exited 3: "
           "disk gone"]
    assert last_error(log) == "health gate failed: recovery.health_check exited 3: disk gone"
