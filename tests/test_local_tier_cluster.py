"""The local tier of checkpoints on the pdsh namespace cluster (issue 30): real pdsh over real sshd,
torchrun, DeepSpeed ZeRO-2 on CPU, one rank per node; each node's local folder is its own
(``/…/local/{host}``: the namespace nodes share one file system, real nodes have their own disks).

``test_a_killed_node_resumes_from_the_local_tier_and_a_lost_folder_from_its_buddy``: 3 nodes, local
checkpoints every 5 steps, durable ones every 50. At a step drawn at random (seeded; printed) node2's
processes are SIGKILLed: the relaunch resumes at most 5 steps back, from the local tier. Then node1's
local folder is deleted and node1 is SIGKILLed: its part comes from node2's buddy copy, again at most
5 steps back. Every step's loss equals the uninterrupted run's within 1e-3.
"""

from __future__ import annotations

import os
import random
import re
import shutil

import pytest
import yaml

from cluster import leftover_processes, run_on
from hfscale.checkpoints.local_tier import node_dir
from hfscale.launch.timeline import read_timeline
from test_recovery_cluster import _attempt_training, _step, largest_loss_difference, run_dir_of, train_config, launched, wait_for

pytestmark = pytest.mark.slow
MAX_STEPS = 60
EVERY = 5


def test_a_killed_node_resumes_from_the_local_tier_and_a_lost_folder_from_its_buddy(make_cluster, tmp_path,
                                                                                     uninterrupted_losses):
    seed = int(os.environ.get("HFSCALE_FAULT_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    print(f"fault seed {seed} (HFSCALE_FAULT_SEED={seed} repeats these moments)")
    cluster = make_cluster(3)
    out = tmp_path / "out"
    local = tmp_path / "local" / "{host}"
    config = train_config(tmp_path, "tiers", out, 29938, cluster.nodes, {"max_restarts": 4, "strikes": 3},
                          max_steps=MAX_STEPS)
    doc = yaml.safe_load(config.read_text())
    doc["training"].update(save_steps=50, local_checkpoints={"every": EVERY, "dir": str(local), "keep": 2})
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    faults: list[tuple[str, int]] = []
    with launched(config, cluster.env(), tmp_path) as job:
        run = run_dir_of(tmp_path)
        for n, victim in enumerate(("node2", "node1")):
            if n:
                wait_for(f"attempt {n} training", lambda: _attempt_training(run, n), job.proc)
            at = min(_step(run) + rng.randint(7, 14), MAX_STEPS - 8)
            wait_for(f"step {at}", lambda: _step(run) >= at, job.proc)
            run_on(cluster, victim, "pkill -KILL '^python'", timeout=30)
            if victim == "node1":  # its disk is gone with it: its part of the newest local step lives on node2
                gone = node_dir(str(local), "node1", str(out)).parent
                shutil.rmtree(gone, ignore_errors=True)
                assert not gone.exists()
            faults.append((victim, _step(run)))
    output = job.output()
    print(f"faults (node, step seen): {faults}")
    assert job.proc.returncode == 0, output[-6000:]
    events = read_timeline(run_dir_of(tmp_path)).events
    failures = [e for e in events if e.kind == "failure"]
    assert [e.host for e in failures] == ["node2", "node1"], output[-6000:]
    restored = [int(m) for m in re.findall(r"hfscale: restored step (\d+) from the nodes' local checkpoints", output)]
    print(f"restored local steps {restored} after failures at steps {[f.step for f in failures]}")
    assert len(restored) == 2, output[-6000:]
    # the timeline has the step the ranks resumed from (rank 0's word), not the durable tier's planned one:
    # the recompute counted by status and report is the local tier's
    assert [e.resume_step for e in events if e.kind == "training" and e.attempt > 0] == restored
    planned = [e.resume_step for e in events if e.kind == "relaunch"]  # the output_dir's newest when relaunched
    assert planned[0] is None and planned[1] in (None, restored[0])  # (a restored step stays in the output_dir)
    for f, step in zip(failures, restored):
        assert f.step is not None and 0 <= f.step - step <= EVERY, (f.step, step)  # at most 5 steps back
        assert step % EVERY == 0 and step < 50  # a local step: the durable tier had nothing yet
    # a local save leaves out the Trainer's whole model file (the resume reads DeepSpeed's), not the model's config
    parts = {h: sorted(node_dir(str(local), h, str(out)).glob("own/checkpoint-*")) for h in cluster.nodes}
    assert all(parts.values()), parts
    assert not [p for ps in parts.values() for p in ps if (p / "model.safetensors").exists()]
    assert all((p / "config.json").is_file() for p in parts["node0"])  # rank 0's
    worst = largest_loss_difference(out, MAX_STEPS, uninterrupted_losses)  # every step logged, against the reference
    print(f"largest loss difference over {MAX_STEPS} steps: {worst:.2e}")
    assert worst < 1e-3
    assert leftover_processes(cluster, timeout=20, contains=str(tmp_path)) == {}
