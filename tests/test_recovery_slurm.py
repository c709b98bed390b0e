"""Jobs that heal themselves inside their Slurm allocation (issue 29, items 1 and 3), on a real Slurm
(tests/cluster: slurmctld and munged on node0, one slurmd per namespace node, SlurmdTimeout 10 s):
real sbatch, srun steps, torchrun and DeepSpeed ZeRO-2 on CPU, faults made the way they happen.

- ``test_a_slurm_job_heals_around_a_killed_and_a_slurmd_less_node``: 3 nodes and 1 spare (an
  allocation of 4), one rank each, global batch kept. At steps drawn at random (seeded; the seed is
  printed): node1's ranks SIGKILLed (the spare takes its place), then one training node's slurmd
  stopped: Slurm's "Node failure" names it, it leaves the allocation (--no-kill) and the job, which
  shrinks to 2 nodes (left-out hosts are not probed again here). hfscale's supervisor runs on the
  batch host (node0), each attempt one srun step. It finishes without a person; every step's loss
  equals an uninterrupted run's within 1e-3; squeue is empty and no process of the job is left;
  status shows the attempts and the goodput. (A cut link is
  ``test_a_cut_link_heals_within_90_s_at_slurms_default_timeouts``: at SlurmdTimeout 300, as sites
  run Slurm, hfscale finds the silent node itself.)
- ``test_a_cut_link_heals_within_90_s_at_slurms_default_timeouts``: issue 35, below.
- ``test_a_lost_batch_host_requeues_the_job_which_resumes``: the batch host (where the supervisor
  runs) dies mid-training (its slurmd and every process on it killed); the other nodes' keepers see
  the supervisor's heartbeat stop and requeue the job, which resumes from the newest complete
  checkpoint on other nodes and finishes.

Steps are slowed (0.25 s after each, tests/test_orphans_cluster.py's callback) so that faults land
mid-training and a node whose slurmd stopped, which trains on until Slurm notices (about 30 s),
cannot finish the job first.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cluster import kill_node_at_once, leftover_processes, run_on
from conftest import ROOT
from hfscale.launch.recovery.timeline import read_timeline
from hfscale.launch.runners.slurm_script import BATCH_HOST_LOST_S, REQUEUE_LOG
from test_orphans_cluster import SLOW
from test_recovery_cluster import fault_rng, largest_loss_difference, node_env

pytestmark = pytest.mark.slow
MAX_STEPS = 240  # a node whose slurmd stopped trains on for ~30 s (~100 steps) before Slurm notices
SLURMD_TIMEOUT = 10


def slurm_config(tmp: Path, out: Path, port: int, *, nodes: int = 3, spares: int = 0, extra: list[str] | None = None,
                 max_steps: int = MAX_STEPS, watchdog: int = 120) -> Path:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SLOW)
    slow = tmp / "slow"
    slow.touch()
    doc = {"name": "heal", "cluster": {"num_nodes": nodes, "nproc_per_node": 1, "master_port": port},
           "runner": {"type": "slurm", "launcher": "torchrun", "run_dir": str(tmp / "runs"),
                      "slurm": {"job_name": "hfs-heal", "extra": extra or []}},
           "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}}, "precision": "no",
           "batch": {"micro_batch_size": 2, "global_batch_size": 12},
           "env": {"vars": {**node_env(), "PYTHONPATH": str(site), "SLOW_WHILE": str(slow)}},
           "watchdog": {"timeout": watchdog, "first_step": 400},  # 120: Slurm's Node failure (~30 s) comes first
           "training": {"output_dir": str(out), "max_steps": max_steps, "save_steps": 3, "logging_steps": 1,
                        "learning_rate": 1.0e-3, "lr_scheduler_type": "constant", "seed": 3,
                        "model": {"config": {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32,
                                             "vocab_size": 256, "n_positions": 64, "bos_token_id": 0,
                                             "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                             "attn_pdrop": 0.0}},
                        "data": {"block_size": 32}},
           "recovery": {"max_restarts": 6, "strikes": 2, "min_nodes": 1, "keep_global_batch": True,
                        **({"spares": spares} if spares else {})}}
    path = tmp / "heal.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def submit(slurm, config: Path) -> tuple[str, Path]:
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(config)], cwd=ROOT, env=slurm.env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"hfscale: submitted Slurm job (\d+); output in (\S+)/slurm-\1\.out", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    return m.group(1), Path(m.group(2))


def _step(run: Path) -> int:
    try:
        return json.loads((run / "progress" / "metrics.json").read_text()).get("step") or 0
    except (OSError, ValueError):
        return 0


def _events(run: Path, kind: str):
    try:
        return [e for e in read_timeline(run).events if e.kind == kind]
    except Exception:  # written while read
        return []


def _training_after(run: Path, attempt: int) -> bool:
    """Whether an attempt after ``attempt`` has completed a step (its timeline event)."""
    return any(e.attempt > attempt for e in _events(run, "training"))


def wait_for(what: str, cond, slurm, job: str, timeout: float = 400, run: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        state = slurm.state(job)
        assert state in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING"), \
            f"job {job} is {state} while waiting for {what}"
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; job {job} is {state}\n"
                                 + _diagnosis(slurm, job, run))
        time.sleep(0.3)


def _diagnosis(slurm, job: str, run: Path | None) -> str:
    """What Slurm and the run directory say, for a test that timed out."""
    parts = [slurm.run("scontrol", "show", "job", job, check=False).stdout[-3000:],
             slurm.run("sinfo", "-N", "-o", "%N %T %E", check=False).stdout[-2000:],
             "steps:\n" + slurm.run("squeue", "-s", "-j", job, "-o", "%i %j %T %N", check=False).stdout[-2000:]]
    for log in sorted((slurm.dir / "log").glob("slurm*.log")):  # what the daemons said about this job's steps
        said = [line for line in log.read_text(errors="replace").splitlines()
                if f"JobId={job}" in line or f"StepId={job}." in line or f"job {job}" in line.lower()]
        parts.append(f"--- {log.name} ({len(said)} lines on job {job}, the last 25)\n" + "\n".join(said[-25:]))
    if run is not None:
        requeue = run / REQUEUE_LOG
        parts += [f"{REQUEUE_LOG}: " + (requeue.read_text(errors="replace")[-2000:] if requeue.exists() else "(none)"),
                  output(run, job)[-4000:]]
    return "\n".join(parts)


def output(run: Path, job: str) -> str:
    log = run / f"slurm-{job}.out"
    return log.read_text(errors="replace") if log.exists() else "(no output file)"


def test_a_slurm_job_heals_around_a_killed_and_a_slurmd_less_node(make_slurm, tmp_path, uninterrupted_losses):
    rng = fault_rng()
    slurm = make_slurm(4, slurmd_timeout=SLURMD_TIMEOUT)
    cluster = slurm.cluster
    out = tmp_path / "out"
    config = slurm_config(tmp_path, out, 29971, spares=1)
    doc = yaml.safe_load(config.read_text())
    doc["recovery"]["probe_excluded"] = False  # node1 stays out: the second fault shrinks the job (3 -> 2 nodes)
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    t0 = time.time()
    job, run = submit(slurm, config)
    faults: list[tuple[str, float, int]] = []
    try:
        # 1. node1's ranks SIGKILLed (a GPU fault, the OOM killer)
        wait_for("the first step", lambda: _step(run) >= 1, slurm, job, timeout=600, run=run)
        at = _step(run) + rng.randint(3, 10)
        wait_for(f"step {at}", lambda: _step(run) >= at, slurm, job, run=run)
        run_on(cluster, "node1", "pkill -KILL '^python'", timeout=30)  # its rank (torchrun's process is pt_elastic)
        faults.append(("kill node1's ranks", time.time(), _step(run)))
        wait_for("attempt 1 training", lambda: _training_after(run, 0), slurm, job, run=run)
        # 2. the slurmd of a training node (not the batch host) stopped: Slurm's Node failure
        hosts = _events(run, "relaunch")[-1].hosts
        victim = next(h for h in hosts if h != "node0")
        at = _step(run) + rng.randint(3, 10)
        wait_for(f"step {at}", lambda: _step(run) >= at, slurm, job, run=run)
        slurm.stop_slurmd(victim)
        faults.append((f"stop {victim}'s slurmd", time.time(), _step(run)))
        wait_for(f"{victim}'s loss noticed", lambda: len(_events(run, "failure")) >= 2, slurm, job, run=run)
        last = _events(run, "failure")[-1].attempt
        wait_for("the last attempt training", lambda: _training_after(run, last), slurm, job, run=run)
        (tmp_path / "slow").unlink()  # no fault left to make: the last attempt's steps at full speed
        info = slurm.wait(job, timeout=900)
    finally:
        slurm.run("scancel", job, check=False)
    took = time.time() - t0
    text = output(run, job)
    for what, when, step in faults:
        print(f"{what} at +{when - t0:.1f} s, step {step}")
    assert info["JobState"] == "COMPLETED", text[-6000:]
    events = read_timeline(run).events
    for e in events:
        print(e.model_dump(exclude_none=True))
    failures = [e for e in events if e.kind == "failure"]
    relaunches = [e for e in events if e.kind == "relaunch"]
    assert len(failures) == 2 and len(relaunches) == 2, text[-6000:]
    # the supervisor beat through every gap between attempts (its probes, its decisions): no watch requeued
    assert int(info.get("Restarts", "0")) == 0 and not (run / REQUEUE_LOG).exists(), text[-6000:]
    assert (failures[0].cause, failures[0].host) == ("rank_failed", "node1")
    # the spare (node3, the allocation's last node) in node1's place: the same world size, nothing converted
    assert relaunches[0].hosts == ["node0", "node3", "node2"] and relaunches[0].world_size == 3, relaunches[0]
    assert "ds_to_universal" not in text.split("restart 2 (")[0]
    assert (failures[1].cause, failures[1].host) == ("host_lost", victim)
    # no spare left: 2 nodes, the batch kept (accumulation 2 -> 3), the checkpoint converted
    assert victim not in relaunches[1].hosts and (relaunches[1].world_size, relaunches[1].accumulation) == (2, 3)
    worst = largest_loss_difference(out, MAX_STEPS, uninterrupted_losses)  # every step logged, against the reference
    print(f"healed in {took:.0f} s; largest loss difference over {MAX_STEPS} steps: {worst:.2e}")
    assert worst < 1e-3
    assert slurm.run("squeue", "-h").stdout.strip() == ""
    status = subprocess.run([sys.executable, "-m", "hfscale", "status", str(run)], cwd=ROOT, env=slurm.env(),
                            capture_output=True, text=True, timeout=60)
    print(status.stdout.split("\n---")[0])
    assert status.returncode == 0, status.stderr
    assert f"restarts     {len(relaunches)}" in status.stdout and "goodput      " in status.stdout
    assert "replaced     node3 replaced node1 at +" in status.stdout  # which spare replaced which host, and when
    assert "state        finished (exit code 0)" in status.stdout and "; ended " in status.stdout  # the real end
    # the node whose slurmd was stopped keeps its slurmstepd (what an administrator's stop leaves): not waited for
    assert leftover_processes(cluster, timeout=60, contains=str(tmp_path), but=[victim]) == {}
    assert slurm.job_processes(timeout=60, but=[victim]) == {}


def test_a_slurm_job_restarts_in_process_inside_its_allocation(make_slurm, tmp_path, uninterrupted_losses):
    """recovery.in_process under Slurm (issue 38): 3 nodes and a spare, one srun step over all four (the
    spare's rank a standby, imports done). node1's rank SIGKILLed: the standby takes its rank, the
    other ranks keep their processes, and neither srun nor the supervisor sees a failure (--no-kill):
    one in_process event, no relaunch, every loss the uninterrupted run's."""
    from test_inprocess_cluster import RANK, _marks, _pids

    rng = fault_rng()
    slurm = make_slurm(4, slurmd_timeout=300)  # Slurm's default: the ranks heal it, Slurm need notice nothing
    cluster = slurm.cluster
    out, steps = tmp_path / "out", 60
    config = slurm_config(tmp_path, out, 29972, spares=1, max_steps=steps, watchdog=30)
    doc = yaml.safe_load(config.read_text())
    doc["recovery"]["in_process"] = True
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    job, run = submit(slurm, config)
    try:
        wait_for("the first step", lambda: _step(run) >= 1, slurm, job, timeout=600, run=run)
        at = _step(run) + rng.randint(3, 8)
        wait_for(f"step {at}", lambda: _step(run) >= at, slurm, job, run=run)
        survivors = {node: _pids(cluster, node) for node in ("node0", "node2", "node3")}
        assert sum(map(len, survivors.values())) == 3, survivors  # two training ranks and the standby
        run_on(cluster, "node1", f"pkill -KILL -f {RANK}", timeout=30)
        killed = time.time()
        wait_for("the first step after the kill", lambda: _marks(run).get("first_step", 0.0) > killed, slurm, job,
                 run=run)
        r = _marks(run)["first_step"] - killed
        kept = {node: _pids(cluster, node) & pids for node, pids in survivors.items()}
        (tmp_path / "slow").unlink()
        info = slurm.wait(job, timeout=600)
    finally:
        slurm.run("scancel", job, check=False)
    text = output(run, job)
    print(f"node1's rank killed: back to training in {r:.2f} s")
    assert info["JobState"] == "COMPLETED", text[-6000:]
    assert kept == survivors, (survivors, kept)  # the standby on node3 among them: it took node1's rank
    events = read_timeline(run).events
    assert [e.kind for e in events if e.kind in ("failure", "relaunch", "gave_up")] == [], text[-6000:]
    (healed,) = [e for e in events if e.kind == "in_process"]
    assert healed.in_process == 1 and "first_step" in healed.phases, healed
    assert largest_loss_difference(out, steps, uninterrupted_losses) == 0.0
    assert slurm.run("squeue", "-h").stdout.strip() == ""
    assert leftover_processes(cluster, timeout=60, contains=str(tmp_path)) == {}


def test_a_cut_link_heals_within_90_s_at_slurms_default_timeouts(make_slurm, tmp_path, uninterrupted_losses):
    """Issue 35: Slurm's own SlurmdTimeout (300 s, the default many sites keep) does not notice a node
    whose link is cut for minutes. hfscale's hang watchdog names node1 (its rank cannot answer the stack
    dump); were no rank named, hfscale would probe every node of the attempt itself (an srun step each,
    within its own bound) and find node1 silent. The spare takes node1's place: training again within
    90 s of the cut, every loss equal to the uninterrupted run's."""
    slurm = make_slurm(4, slurmd_timeout=300)
    cluster = slurm.cluster
    out = tmp_path / "out"
    max_steps = 60
    config = slurm_config(tmp_path, out, 29821, spares=1, max_steps=max_steps, watchdog=20)
    t0 = time.time()
    job, run = submit(slurm, config)
    link = f"hfs{cluster.id}v1"  # node1's veth end on the bridge
    try:
        wait_for("the first step", lambda: _step(run) >= 1, slurm, job, timeout=600, run=run)
        at = _step(run) + 5
        wait_for(f"step {at}", lambda: _step(run) >= at, slurm, job, run=run)
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        t_cut, cut_step = time.time(), _step(run)
        wait_for("training again", lambda: _training_after(run, 0), slurm, job, timeout=240, run=run)
        t_back = next(e.at for e in _events(run, "training") if e.attempt > 0)
        subprocess.run(["ip", "link", "set", link, "up"], check=True)  # back; it stays out of the job
        (tmp_path / "slow").unlink()  # no fault left to make
        info = slurm.wait(job, timeout=900)
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        slurm.run("scancel", job, check=False)
    text = output(run, job)
    events = read_timeline(run).events
    for e in events:
        print(e.model_dump(exclude_none=True))
    print(f"node1's link cut at step {cut_step}, +{t_cut - t0:.1f} s; training again {t_back - t_cut:.1f} s later")
    assert info["JobState"] == "COMPLETED", text[-6000:]
    failures = [e for e in events if e.kind == "failure"]
    relaunches = [e for e in events if e.kind == "relaunch"]
    # the watchdog names node1 itself (its rank cannot answer the stack dump: out of reach), or, were no rank
    # named, hfscale's own probe of every node finds node1 silent
    assert [(f.cause, f.host) for f in failures] in ([("hang", "node1")], [("host_lost", "node1")]), text[-6000:]
    assert relaunches[0].hosts == ["node0", "node3", "node2"] and relaunches[0].world_size == 3, relaunches[0]
    assert t_back - t_cut <= 90, text[-6000:]
    worst = largest_loss_difference(out, max_steps, uninterrupted_losses)  # every step logged, against the reference
    print(f"largest loss difference over {max_steps} steps: {worst:.2e}")
    assert worst < 1e-3


def test_a_lost_batch_host_requeues_the_job_which_resumes(make_slurm, tmp_path, uninterrupted_losses):
    slurm = make_slurm(5, slurmd_timeout=SLURMD_TIMEOUT)
    cluster = slurm.cluster
    out = tmp_path / "out"
    max_steps = 120
    config = slurm_config(tmp_path, out, 29981, extra=["--exclude=node0"], max_steps=max_steps)  # node0: slurmctld
    t0 = time.time()
    job, run = submit(slurm, config)
    try:
        wait_for("the first step", lambda: _step(run) >= 1, slurm, job, timeout=600, run=run)
        batch_host = slurm.job(job)["BatchHost"]
        wait_for("a checkpoint", lambda: _step(run) >= 12, slurm, job, run=run)
        killed_at = _step(run)
        # the batch host dies: its slurmd, the batch script, the supervisor, its ranks, all at one instant
        # (kill_node_at_once says why neither one by one nor SIGSTOP first: in two CI runs the batch host's
        # dying sruns cancelled the other nodes' watch steps, and nothing requeued the job)
        assert slurm.run("squeue", "-s", "-j", job, "-h", "-o", "%j").stdout.split().count("hfscale-watch") == 2
        killed = kill_node_at_once(cluster, batch_host)
        t_kill = time.time()
        # the watches notice within BATCH_HOST_LOST_S + 10 s; Slurm starts the job again after its credential
        # lifetime (10 s here) once it has set the batch host DOWN (SlurmdTimeout 10 s)
        wait_for("the requeued job", lambda: "restart 1" in output(run, job), slurm, job,
                 timeout=BATCH_HOST_LOST_S + 240, run=run)
        t_requeued = time.time()
        (tmp_path / "slow").unlink()  # no fault left to make: the requeued job's steps at full speed
        info = slurm.wait(job, timeout=900)
    finally:
        slurm.run("scancel", job, check=False)
    text = output(run, job)
    print(f"batch host {batch_host} killed ({killed} processes) at step {killed_at}, +{t_kill - t0:.0f} s; requeued job started "
          f"{t_requeued - t_kill:.0f} s later; finished +{time.time() - t0:.0f} s")
    assert info["JobState"] == "COMPLETED", text[-6000:]
    assert int(info.get("Restarts", "0")) == 1
    assert "was lost; Slurm requeued job" in text
    events = read_timeline(run).events
    lost = [e for e in events if e.kind == "failure" and e.cause == "host_lost"]
    assert lost and lost[0].host == batch_host, [e.model_dump(exclude_none=True) for e in events]
    worst = largest_loss_difference(out, max_steps, uninterrupted_losses)  # every step logged, against the reference
    print(f"largest loss difference over {max_steps} steps: {worst:.2e}")
    assert worst < 1e-3
    assert slurm.run("squeue", "-h").stdout.strip() == ""
    status = subprocess.run([sys.executable, "-m", "hfscale", "status", str(run)], cwd=ROOT, env=slurm.env(),
                            capture_output=True, text=True, timeout=60)
    print(status.stdout.split("\n---")[0])
    assert f"requeued     its batch host {batch_host} was lost; Slurm requeued job {job} (restart 1)" in status.stdout


def test_hfscale_stop_cancels_a_supervised_job_and_leaves_nothing(make_slurm, tmp_path):
    """A supervised job's run is 'running' on its batch host: ``hfscale stop`` from here writes the
    stop marker and cancels it through Slurm; the supervisor stops the step and lets the lock go."""
    slurm = make_slurm(2, slurmd_timeout=SLURMD_TIMEOUT)
    out = tmp_path / "out"
    config = slurm_config(tmp_path, out, 29991, nodes=2)
    job, run = submit(slurm, config)
    try:
        wait_for("step 4", lambda: _step(run) >= 4, slurm, job, timeout=600, run=run)
        assert (out / "_hfscale-lock.json").is_file()  # held by the supervisor on the batch host
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "hfscale", "stop", str(run)], cwd=ROOT, env=slurm.env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        info = slurm.wait(job, timeout=120)
        took = time.monotonic() - t0
    finally:
        slurm.run("scancel", job, check=False)
    print(f"stopped: {info['JobState']} {took:.1f} s after hfscale stop; {r.stdout.strip()} {r.stderr.strip()}")
    assert info["JobState"] == "CANCELLED"
    assert (run / "stopping").exists()
    assert slurm.run("squeue", "-h").stdout.strip() == ""
    assert slurm.job_processes(timeout=60) == {}
    deadline = time.monotonic() + 30
    while (out / "_hfscale-lock.json").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not (out / "_hfscale-lock.json").exists(), output(run, job)[-3000:]
