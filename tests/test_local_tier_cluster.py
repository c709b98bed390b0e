"""The local tier of checkpoints on the pdsh namespace cluster (issue 30): real pdsh over real sshd,
torchrun, DeepSpeed ZeRO-2 on CPU, one rank per node; each node's local folder is its own
(``/…/local/{host}``: the namespace nodes share one file system, real nodes have their own disks).

``test_a_killed_node_resumes_from_the_local_tier_and_a_lost_folder_from_its_buddy``: 3 nodes, local
checkpoints every 5 steps, a durable one at the end (every 100). At a step drawn at random (seeded;
printed) node1's local folder is deleted and node1 is SIGKILLed: the relaunch resumes at most 5 steps
back, from the local tier, node1's part from node2's buddy copy. Then rot (issue 36): node2 is frozen,
4 KiB of its own optimizer shard flipped in every local step it holds (size and times kept), and it is
killed: the restore finds the shard does not match its checksum and takes node0's buddy copy, and
says so. Last, node1's shard is flipped in every
step it holds and node2's buddy copy of it in the newest one too: no copy of that step matches, the
restore falls back to the older local step (its shard from node2's copy). Every step's loss equals
the uninterrupted run's within 1e-3.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from cluster import leftover_processes, run_on
from hfscale.checkpoints.local_tier import node_dir
from hfscale.launch.recovery.timeline import read_timeline
from test_local_tier import flip
from test_recovery_cluster import fault_rng, _attempt_training, _step, largest_loss_difference, run_dir_of, train_config, launched, wait_for

pytestmark = pytest.mark.slow
MAX_STEPS = 90
EVERY = 5
SHARD = "optim_states.pt"  # a rank's optimizer shard: the biggest file of a node's part


def rot(local, host: str, out, kind: str, steps: str = "all") -> list[str]:
    """Flip 4 KiB in the middle of ``host``'s ``kind`` (own or buddy) optimizer shards, in every local
    step it holds (``steps`` "all") or in the newest holding one (``"newest"``); the files flipped."""
    root = node_dir(str(local), host, str(out))
    held = sorted((int(p.stem.split("-")[1]), json.loads(p.read_text())) for p in root.glob("checkpoint-*.json"))
    held = [(step, h) for step, h in held if any(r.endswith(SHARD) for r in h[kind])]
    flipped = []
    for step, h in held[-1:] if steps == "newest" else held:
        for rel in (r for r in h[kind] if r.endswith(SHARD)):
            path = root / kind / f"checkpoint-{step}" / rel
            flip(path, max(0, path.stat().st_size // 2 - 2048))
            flipped.append(f"{kind}/checkpoint-{step}/{rel}")
    return flipped


def test_a_killed_node_resumes_from_the_local_tier_and_a_lost_folder_from_its_buddy(make_cluster, tmp_path,
                                                                                     uninterrupted_losses):
    rng = fault_rng()
    cluster = make_cluster(3)
    out = tmp_path / "out"
    local = tmp_path / "local" / "{host}"
    config = train_config(tmp_path, "tiers", out, 29938, cluster.nodes, {"max_restarts": 4, "strikes": 3},
                          max_steps=MAX_STEPS)
    doc = yaml.safe_load(config.read_text())
    # the durable tier saves only at the end: every relaunch resumes from the local tier
    doc["training"].update(save_steps=100, local_checkpoints={"every": EVERY, "dir": str(local), "keep": 2})
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    faults: list[tuple[str, int]] = []
    flipped: list[list[str]] = []
    with launched(config, cluster.env(), tmp_path) as job:
        run = run_dir_of(tmp_path)
        for n, victim in enumerate(("node1", "node2", "node1")):
            if n:
                wait_for(f"attempt {n} training", lambda: _attempt_training(run, n), job.proc)
            at = min(_step(run) + rng.randint(7, 14), MAX_STEPS - 8)
            wait_for(f"step {at}", lambda: _step(run) >= at, job.proc)
            if n >= 1:  # rot: frozen first, so that no newer local step is made while its files are flipped
                run_on(cluster, victim, "pkill -STOP '^python'", timeout=30)
                flipped.append(rot(local, victim, out, "own"))
                if n == 2:  # the buddy's copy of the newest step rotted too
                    flipped[-1] += rot(local, "node2", out, "buddy", "newest")
                assert flipped[-1], f"{victim} holds no local step"
            run_on(cluster, victim, "pkill -KILL '^python'", timeout=30)
            if n == 0:  # its disk is gone with it: its part of the newest local step lives on node2
                gone = node_dir(str(local), "node1", str(out)).parent
                shutil.rmtree(gone, ignore_errors=True)
                assert not gone.exists()
            faults.append((victim, _step(run)))
    output = job.output()
    print(f"faults (node, step seen): {faults}")
    assert job.proc.returncode == 0, output[-6000:]
    events = read_timeline(run_dir_of(tmp_path)).events
    failures = [e for e in events if e.kind == "failure"]
    assert [e.host for e in failures] == ["node1", "node2", "node1"], output[-6000:]
    restored = [int(m) for m in re.findall(r"hfscale: restored step (\d+) from the nodes' local checkpoints", output)]
    print(f"restored local steps {restored} after failures at steps {[f.step for f in failures]}; flipped {flipped}")
    assert len(restored) == 3, output[-6000:]
    said = [line for line in output.splitlines() if "does not match its checksum" in line]
    print("\n".join(said))
    # node2's rotten shard: node0's buddy copy instead, for the step restored
    assert any(f"local step {restored[1]}: " in line and "of node2's own part does not match its checksum (crc32 " in line
               and line.endswith("; taken from node0's buddy copy") for line in said), said
    # node1's rotten shard with node2's copy of the newest step rotten too: an older step, its shard from node2
    newest = max(int(f.split("/")[1].split("-")[1]) for f in flipped[1] if f.startswith("buddy/"))
    assert any(f"local step {newest}: " in line and "of node2's buddy copy does not match its checksum" in line
               and line.endswith("no other copy matches: an older step") for line in said), said
    assert restored[2] < newest and any(f"local step {restored[2]}: " in line and "of node1's own part does not match"
                                        in line and line.endswith("taken from node2's buddy copy") for line in said)
    # the timeline has the step the ranks resumed from (rank 0's word), not the durable tier's planned one:
    # the recompute counted by status and report is the local tier's
    assert [e.resume_step for e in events if e.kind == "training" and e.attempt > 0] == restored
    planned = [e.resume_step for e in events if e.kind == "relaunch"]  # the output_dir's newest when relaunched
    assert planned[0] is None and planned[1] in (None, restored[0])  # (a restored step stays in the output_dir)
    for n, (f, step) in enumerate(zip(failures, restored)):
        back = 2 * EVERY if n == 2 else EVERY  # the newest local step unusable: the one before it
        assert f.step is not None and 0 <= f.step - step <= back, (n, f.step, step)
        assert step % EVERY == 0 and step < MAX_STEPS  # a local step: the durable tier saves only at the end
    # a local save leaves out the Trainer's whole model file (the resume reads DeepSpeed's), not the model's config
    parts = {h: sorted(node_dir(str(local), h, str(out)).glob("own/checkpoint-*")) for h in cluster.nodes}
    assert all(parts.values()), parts
    assert not [p for ps in parts.values() for p in ps if (p / "model.safetensors").exists()]
    assert all((p / "config.json").is_file() for p in parts["node0"])  # rank 0's
    worst = largest_loss_difference(out, MAX_STEPS, uninterrupted_losses)  # every step logged, against the reference
    print(f"largest loss difference over {MAX_STEPS} steps: {worst:.2e}")
    assert worst < 1e-3
    assert leftover_processes(cluster, timeout=20, contains=str(tmp_path)) == {}
