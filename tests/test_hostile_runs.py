"""Run directories, checkpoints and scheduler ids are hostile input (issue 20): the corpus of
tests/hostile_runs.py (every file hfscale reads back, each as a FIFO, /dev/zero, a link out, in a
0777 folder, owned by another uid, 100k-deep JSON, wrong types, NaN, infinities, 1e20, a 5,000-digit
number, 50 MB, invalid UTF-8, empty, cut in half; option-like and shell-like Slurm ids; Kubernetes
objects hfscale never creates; pickles that run a command; pids of real unrelated processes) run
through hfscale runs/status/logs/stop/report/export, in-process (the harness), in three processes.

What must hold over all of it: 0 commands executed (no payload's marker file), 0 unrelated
processes signalled, 0 tracebacks, 0 commands over 10 s (export, which writes the weights: 30 s), peak RSS under 512 MiB per process,
every good run listed, nothing behind a link ever shown or copied; and the controls (a trusted
cleanup, a real Slurm id, the recorded Kubernetes objects, the recorded launcher) do what they
should, so that the assertions can fail. CI is root: files of another uid are made with chown.
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

from conftest import ROOT

sys.path.insert(0, str(Path(__file__).parent))
import hostile_runs as corpus  # noqa: E402

from hfscale.core.untrusted import printable  # noqa: E402

FAMILIES = {"light": "runs,status,logs,follow,stop", "report": "report", "export": "export"}

FAKE_TOOL = """#!{python}
import json, os, sys
rec = {{"tool": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "stdin": sys.stdin.read()}}
with open({log!r}, "a") as f:
    f.write(json.dumps(rec) + "\\n")
if rec["tool"] == "scontrol":  # hfscale status asks scontrol show job --oneliner <id>
    print("JobId=" + sys.argv[-1] + " JobName=x UserId=0(0) GroupId=0(0) JobState=RUNNING Restarts=0")
"""


def _detached(*argv: str) -> int:
    """Start ``argv`` as an orphan (init reaps it, so a signalled one is gone, not a zombie); its pid."""
    out = subprocess.run(["setsid", "sh", "-c", '"$@" </dev/null >/dev/null 2>&1 & echo $!', "sh", *argv],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip())


def _alive(pid: int) -> bool:
    from hfscale.core.pid_identity import start_time

    return start_time(pid) is not None


def _pid_cases(root: Path, template: Path) -> tuple[list[dict], dict[str, int], int]:
    """state.json of a running run naming a real process that is not its launcher: a sleep, one
    whose argv holds "hfscale", a tail -f of a file named hfscale-notes.txt (recorded with another
    start time: the pid was reused), one recorded without a start time (an older state.json), one
    recorded exactly but in a state.json another uid wrote; and the control, recorded with its own
    start time (stop must signal it)."""
    from hfscale.core.pid_identity import boot_id, start_time

    notes = root / "hfscale-notes.txt"
    notes.write_text("x\n")
    decoys = {"sleep": _detached("sleep", "300"),
              "hfscale_argv": _detached(sys.executable, "-c", "import time; time.sleep(300)", "hfscale-notes.txt"),
              "tail_hfscale": _detached("tail", "-f", str(notes)),
              "no_start": _detached("sleep", "301"),
              "untrusted_state": _detached(sys.executable, "-c", "import time; time.sleep(300)", "hfscale", "launch")}
    control = _detached(sys.executable, "-c", "import time; time.sleep(300)", "hfscale", "launch")
    cases = []
    for label, pid in [*decoys.items(), ("control", control)]:
        c = corpus._case(root, f"pid--{label}", "died", template, root / "markers")
        run = Path(c["runs"]) / c["run"]
        start = start_time(pid)
        state = {"job_id": corpus.JOB, "runner": "local", "state": "running", "pid": pid, "host": socket.gethostname(),
                 "boot_id": boot_id(), "started": time.time() - 10}
        if label != "no_start":  # untrusted_state: its true identity, in a state.json someone else wrote
            state["proc_start"] = start if label in ("control", "untrusted_state") else start + 1000
        (run / "state.json").write_text(json.dumps(state))
        if label == "untrusted_state":
            os.chown(run / "state.json", corpus.OTHER_UID, corpus.OTHER_UID)
        (run / "cleanup.json").write_text(json.dumps({"argv": ["true"], "env": {}, "cwd": None}))
        c.update(file="state.json", variant=f"pid_{label}", commands=["status", "stop"])
        cases.append(c)
    return cases, decoys, control


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """The corpus built and run: (cases, results by family, root)."""
    if os.geteuid() != 0:
        pytest.skip("the corpus makes files of another uid and a character device: it needs root (CI is root)")
    root = tmp_path_factory.mktemp("hostile")
    t0 = time.monotonic()
    cases = corpus.build(root)
    pid_cases, decoys, control = _pid_cases(root, root / "template")
    cases += pid_cases
    bin_dir, log = root / "bin", root / "invocations.jsonl"
    bin_dir.mkdir()
    for tool in ("scancel", "scontrol", "sacct", "kubectl"):
        (bin_dir / tool).write_text(FAKE_TOOL.format(python=sys.executable, log=str(log)))
        (bin_dir / tool).chmod(0o755)
    (root / "cases.json").write_text(json.dumps(cases))
    built = time.monotonic() - t0
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}  # this checkout's hfscale, installed or not
    procs = {}
    for family, commands in FAMILIES.items():
        scratch = root / f"scratch-{family}"
        scratch.mkdir()
        procs[family] = subprocess.Popen([sys.executable, str(ROOT / "tests" / "hostile_runs.py"), "run", commands,
                                          str(root / "cases.json"), str(root / f"{family}.json"), str(scratch)],
                                         cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        outputs = {f: p.communicate(timeout=1200)[0] for f, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    results = {}
    for family, p in procs.items():
        assert p.returncode == 0, outputs[family][-5000:]
        results[family] = json.loads((root / f"{family}.json").read_text())
    ran = time.monotonic() - t0 - built
    n = sum(len(r["results"]) for r in results.values())
    print(f"hostile corpus: {len(cases)} cases, {n} commands; built in {built:.1f} s, ran in {ran:.1f} s; peak RSS "
          + ", ".join(f"{f} {r['peak_rss_mb']:.0f} MiB" for f, r in results.items()))
    yield cases, results, root, decoys, control
    for pid in [*decoys.values(), control]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _all(results: dict) -> list[dict]:
    return [r for family in results.values() for r in family["results"]]


def test_the_corpus_covers_every_file_and_variant(hostile):
    cases, results, *_ = hostile
    assert len(cases) >= 150
    files = {c["file"] for c in cases}
    assert set(corpus.RUN_FILES) <= files
    variants = {c["variant"] for c in cases}
    assert set(corpus.VARIANTS) <= variants
    ran = {(r["case"], r["command"]) for r in _all(results)}
    assert ran == {(c["name"], cmd) for c in cases for cmd in c["commands"]}  # every command of every case ran


def test_no_traceback_no_hang_and_only_clean_exit_codes(hostile):
    _, results, *_ = hostile
    bad = [(r["case"], r["command"], r["rc"], r["seconds"], (r["escaped"] or r["output"])[-600:]) for r in _all(results)
           if r["escaped"] or "Traceback" in r["output"] or r["rc"] not in (0, 1, 2, 3) or r["seconds"] >= corpus.bound_s(r["command"])
           or "\x1b" in r["output"] or "\x07" in r["output"]]  # no escape sequence from a name reaches the terminal
    assert bad == []
    slowest = max(_all(results), key=lambda r: r["seconds"])
    print(f"slowest: {slowest['case']} {slowest['command']} {slowest['seconds']:.2f} s")


def test_peak_memory_stays_under_512_mib(hostile):
    _, results, *_ = hostile
    assert {f: r["peak_rss_mb"] < 512 for f, r in results.items()} == dict.fromkeys(results, True), \
        {f: r["peak_rss_mb"] for f, r in results.items()}


def test_nothing_hostile_was_executed_and_the_controls_were(hostile):
    cases, results, root, *_ = hostile
    assert sorted(os.listdir(root / "markers")) == ["cleanup-case"]  # the trusted control cleanup ran, nothing else
    calls = [json.loads(line) for line in (root / "invocations.jsonl").read_text().splitlines()]
    # the id file cut in half still holds a job id ("42"), in a file only this user could write: used
    # as written; every other variant is refused before scancel or scontrol runs (scontrol answers: no sacct)
    assert [(c["tool"], c["argv"]) for c in calls if c["tool"] in ("scancel", "scontrol", "sacct")] == [
        ("scontrol", ["show", "job", "--oneliner", "42"]), ("scancel", ["--", "42"]),
        ("scontrol", ["show", "job", "--oneliner", "4242"]), ("scancel", ["--", "4242"])]
    kubectl = [c for c in calls if c["tool"] == "kubectl"]
    assert [c["argv"] for c in kubectl] == [["delete", "--ignore-not-found", "-f", "-"]]
    import yaml

    objects = list(yaml.safe_load_all(kubectl[0]["stdin"]))
    assert [(o["kind"], o["metadata"]["namespace"]) for o in objects] == [("ConfigMap", "ml"), ("PyTorchJob", "ml")]
    assert all(set(o["metadata"]) == {"name", "namespace"} for o in objects)  # nothing else of the file


def test_no_unrelated_process_was_signalled_and_the_recorded_one_was(hostile):
    cases, results, root, decoys, control = hostile
    assert {label: _alive(pid) for label, pid in decoys.items()} == dict.fromkeys(decoys, True)
    deadline = time.monotonic() + 5
    while _alive(control) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(control)
    stops = {r["case"]: r for r in _all(results) if r["command"] == "stop" and r["case"].startswith("pid--")}
    assert stops["pid--control"]["rc"] == 0 and "SIGTERM to its launcher" in stops["pid--control"]["output"]
    for label in set(decoys) - {"untrusted_state"}:  # died; its (harmless) recorded cleanup ran, no signal
        assert "its launcher (pid" in stops[f"pid--{label}"]["output"] and "died" in stops[f"pid--{label}"]["output"]
    untrusted = stops["pid--untrusted_state"]
    assert untrusted["rc"] == 2 and "belongs to uid 65534" in untrusted["output"] and "nothing was signalled" in \
        untrusted["output"]


def test_every_good_run_is_listed_and_a_bad_one_says_why(hostile):
    cases, results, *_ = hostile
    by_case = {c["name"]: c for c in cases}
    listed = [r for r in results["light"]["results"] if r["command"] == "runs"]
    assert listed
    for r in listed:
        c = by_case[r["case"]]
        assert r["rc"] == 0 and all(g in r["output"] for g in c["good"]), (r["case"], r["output"])
        if c["file"] == "logs/":  # its logs/ is a link out: not a run directory hfscale made, not listed
            assert printable(c["run"]) not in r["output"]
            continue
        line = next(line for line in r["output"].splitlines() if line.startswith(printable(c["run"])))
        assert "unreadable: " in line or line.split()[2] in ("finished", "died", "submitted", "running"), line
    fifo = next(r for r in listed if r["case"] == "state.json--fifo")
    assert "unreadable: is not a regular file (a FIFO)" in fifo["output"]


def test_nothing_behind_a_link_is_shown_or_copied(hostile):
    cases, results, root, *_ = hostile
    assert not any(corpus.SECRET in r["output"] for r in _all(results))
    leaked = [p for d in root.glob("scratch-*") for p in d.rglob("*") if p.is_file() and corpus.SECRET.encode()
              in p.read_bytes()]
    assert leaked == []
    export = next(r for r in results["export"]["results"] if r["case"] == "checkpoint-4_tokenizer_config.json--link_out")
    assert export["rc"] == 0 and "left out: tokenizer_config.json (is a symbolic link" in export["output"]


def test_a_crafted_pickle_is_refused_not_run(hostile):
    _, results, *_ = hostile
    got = {r["case"]: r for r in results["export"]["results"] if r["case"].startswith("checkpoint--")}
    for case in ("checkpoint--zero_pickle", "checkpoint--bin_pickle"):
        assert got[case]["rc"] == 2 and "refused: it holds a pickled posix.system" in got[case]["output"], got[case]
    dcp = got["checkpoint--dcp_other_uid"]
    assert dcp["rc"] == 2 and "belongs to uid 65534" in dcp["output"] and "unpickles this file" in dcp["output"]


def test_runs_lists_5000_runs_when_one_is_bad(tmp_path):
    """hfscale runs over 5,000 run directories with one FIFO state.json: every run listed, the bad one
    as unreadable, in a few seconds."""
    runs = tmp_path / "runs"
    state = json.dumps({"job_id": "20261125-000001-aaaaaa", "runner": "local", "state": "finished", "exit_code": 0,
                        "started": time.time()})
    for i in range(5000):
        run = runs / f"r{i:04d}-20261125-000001-{i:06x}"
        (run / "logs").mkdir(parents=True)
        (run / "plan.txt").write_text("plan\n")
        (run / "state.json").write_text(state)
    bad = runs / "r0042-20261125-000001-00002a" / "state.json"
    bad.unlink()
    os.mkfifo(bad)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "hfscale", "runs", str(runs)], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()[1:]
    assert len(rows) == 5000 and sum("finished" in row for row in rows) == 4999
    assert [row for row in rows if "unreadable" in row] == [
        next(row for row in rows if row.startswith("r0042-"))]
    assert "unreadable: is not a regular file (a FIFO)" in next(row for row in rows if row.startswith("r0042-"))
    print(f"hfscale runs over 5,000 runs: {took:.2f} s")
    assert took < 10


@pytest.mark.parametrize("variant", sorted(corpus.VARIANTS))
def test_what_a_launch_reads_back_is_read_as_safely(tmp_path, variant):
    """The files a running launch reads (the output_dir lock, the ranks' progress, stack dumps and
    flight recorder dumps, the nodes' heartbeats and logs) in every hostile form: no hang, no
    exception, nothing followed."""
    if os.geteuid() != 0 and variant in ("devzero", "other_uid"):
        pytest.skip("needs root (mknod, chown); CI is root")
    from hfscale.launch.attempt import beats, output_lock
    from hfscale.launch.attempt.follow import Follower, LogTail
    from hfscale.launch.spec import Follow, HangWatch
    from hfscale.launch.attempt.watchdog import Watchdog, read_flight, read_stacks

    run, out = tmp_path / "run", tmp_path / "out"
    for d in ("progress", "stacks", "flight", "alive", "logs", "orphaned"):
        (run / d).mkdir(parents=True)
    out.mkdir()
    good = {out / "_hfscale-lock.json": json.dumps({"job_id": corpus.JOB, "host": "elsewhere", "pid": 5,
                                                   "proc_start": 1, "run_dir": "/r", "started": time.time()}),
            run / "progress" / "rank-0": "4 123 node0 9\n", run / "stacks" / "rank-0.txt": "Thread 1\n",
            run / "flight" / "rank-0.json": json.dumps([{"entries": [{"collective_seq_id": 3}]}]),
            run / "alive" / "node0": "7\n", run / "logs" / "node0.log": "a line\n",
            run / "launcher.beat": "00000000000000000003\n", run / "orphaned" / "node0": "1764180000\n"}
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for path, text in good.items():
        path.write_text(text)
        if variant == "link_out":
            corpus._link_out(path, text.encode(), secrets)
        elif variant == "half":
            path.write_text(text[: len(text) // 2])
        else:
            corpus.VARIANTS[variant](path, text.encode())
    t0 = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, 10)
    try:
        try:
            taken = output_lock.acquire(out, "20261125-000009-dddddd", str(run), stale_s=60)
            output_lock.release(taken)
        except output_lock.LockHeld as e:
            assert "in use by job" in str(e) or "cannot be read" in str(e)
        dog = Watchdog(HangWatch(str(run / "progress"), str(run / "stacks"), str(run / "r.txt"), 5, None, 1), 0.0)
        dog.poll(1.0)
        from hfscale.core.records import TEXT_CAP

        stacks = read_stacks(str(run / "stacks"))  # a stack is text: whatever it holds, at most its newest 4 MiB
        assert set(stacks) <= {0} and all(len(v) <= TEXT_CAP for v in stacks.values())
        assert read_flight(str(run / "flight")) in ({}, {0: (3, "?", "?")})
        follow = Follower(Follow(("node0",), str(run / "logs"), str(run / "alive"), 10, 40), 0.0)
        follow.lines()
        follow.silent(100.0, set())
        LogTail({"x": run / "logs" / "node0.log"}).lines()
        seen = beats.observe(run, 0.3)  # what a later launch and status read of a died job's heartbeats
        assert seen is not None and not seen.launcher_beats and seen.running == ()
        assert beats.orphan(run, time.time()) is None or beats.orphan(run, time.time()).running in ((), ("node0",))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    assert time.monotonic() - t0 < 10
    assert not any(corpus.SECRET in str(v) for v in (read_stacks(str(run / "stacks")), read_flight(str(run / "flight"))))


def test_crafted_checkpoint_files_give_a_reason_not_a_crash(tmp_path, monkeypatch):
    """Names, headers and sizes a checkpoint's files can be crafted with: each is a reason, found
    in well under a second, never an exception or a huge allocation."""
    import struct

    from hfscale.checkpoints import files as checkpoint_files
    from hfscale.core import records
    from hfscale.checkpoints.files import safetensors_whole, saved_step
    from hfscale.checkpoints.resume import checkpoint_problem, write_marker

    ckpt = tmp_path / "checkpoint-4"
    corpus._tiny_checkpoint(ckpt)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../outside.safetensors"}}))
    write_marker(ckpt, 4, 1)  # a marker does not make what an index names safe
    assert checkpoint_problem(ckpt) == ("model.safetensors.index.json names a file outside the checkpoint: "
                                        "'../../outside.safetensors'")
    (ckpt / "hfscale_complete.json").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "sub/x.safetensors"}}))
    assert "names a file outside the checkpoint: 'sub/x.safetensors'" in checkpoint_problem(ckpt)
    (ckpt / "model.safetensors.index.json").unlink()
    header = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, Infinity]}}'
    (tmp_path / "inf.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert safetensors_whole(tmp_path / "inf.safetensors") is False
    t0 = time.monotonic()
    (ckpt / "rng_state.pth").rename(ckpt / "rng_state_0.pth")
    (ckpt / "rng_state_999999.pth").write_bytes((ckpt / "rng_state_0.pth").read_bytes())
    (ckpt / "rng_state_99999999999.pth").write_bytes(b"x")  # not a rank this check counts to
    assert "rng_state_1.pth is missing" in checkpoint_problem(ckpt)
    assert time.monotonic() - t0 < 1
    big = tmp_path / "trainer_state.json"  # a long run's state, over the cap: its step is still read
    big.write_text(json.dumps({"global_step": 140000, "log_history": [{"step": i, "loss": 1.0} for i in range(400)]},
                              indent=2, sort_keys=True))
    monkeypatch.setattr(records, "TRAINER_STATE_CAP", 1000)
    assert saved_step(big) == 140000
    big.write_text("{" + " " * 2000 + "}")
    with pytest.raises(checkpoint_files.Unreadable, match="names no global_step"):
        saved_step(big)


def test_export_refuses_a_checkpoint_holding_a_link_or_fifo_and_follows_links_in_a_folder_you_name(tmp_path):
    from hfscale.checkpoints.export import ExportError, export_model

    ckpt = tmp_path / "out" / "checkpoint-4"
    corpus._tiny_checkpoint(ckpt)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"max_new_tokens": 99, "secret": corpus.SECRET}))
    (ckpt / "generation_config.json").unlink()
    (ckpt / "hfscale_complete.json").unlink()  # judged by its own files, which say nothing of this one
    (ckpt / "generation_config.json").symlink_to(elsewhere / "generation_config.json")
    with pytest.raises(ExportError, match="'generation_config.json' is a link, not a regular file"):
        export_model(ckpt, tmp_path / "e1")
    (ckpt / "generation_config.json").unlink()
    from hfscale.checkpoints.resume import write_marker

    write_marker(ckpt, 4, 1)
    os.mkfifo(ckpt / "zzz_model_states.pt")  # added after the marker was written: a read would wait for ever
    t0 = time.monotonic()
    with pytest.raises(ExportError, match="'zzz_model_states.pt' is a FIFO"):
        export_model(ckpt, tmp_path / "e2")
    assert time.monotonic() - t0 < 5
    (ckpt / "zzz_model_states.pt").unlink()
    # --config naming a folder of links (a Hugging Face cache snapshot): the user's own, followed
    snapshot, blobs = tmp_path / "hub" / "snapshots" / "abc", tmp_path / "hub" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (blobs / name).write_bytes((ckpt / name).read_bytes())
        (snapshot / name).symlink_to(blobs / name)
    (ckpt / "tokenizer_config.json").unlink()
    write_marker(ckpt, 4, 1)
    r = export_model(ckpt, tmp_path / "e3", config=snapshot)
    assert "tokenizer_config.json" in r.files and r.left_out == ()


def test_a_pid_is_checkable_only_in_its_own_boot_and_pid_namespace():
    from hfscale.core.pid_identity import ProcessIdentity, liveness, this_process

    me = this_process()
    assert liveness(me) == "alive"
    assert liveness(ProcessIdentity(me.pid, me.start, me.boot_id, me.host, (me.pid_ns or 0) + 1)) == "elsewhere"
    assert liveness(ProcessIdentity(me.pid, me.start, None, me.host, me.pid_ns)) == "unknown"  # no boot id: no proof
    assert liveness(ProcessIdentity(me.pid, me.start + 1, me.boot_id, me.host, me.pid_ns)) == "gone"


def test_one_failed_read_of_the_lock_does_not_stop_its_heartbeat(tmp_path, monkeypatch):
    from hfscale.launch.attempt import output_lock
    from hfscale.core.untrusted import Unreadable

    taken = output_lock.acquire(tmp_path, "20261125-000001-aaaaaa", "/r")
    real = output_lock.read_bytes
    fail = iter([True])

    def flaky(*a, **k):
        if next(fail, False):
            raise Unreadable(taken.path, "Stale file handle")
        return real(*a, **k)

    monkeypatch.setattr(output_lock, "read_bytes", flaky)
    assert output_lock.touch(taken) is True  # an NFS hiccup is not a takeover
    assert output_lock.touch(taken) is True
    doc = json.loads(Path(taken.path).read_text())
    Path(taken.path).write_text(json.dumps({**doc, "job_id": "20261125-000002-bbbbbb"}))
    assert output_lock.touch(taken) is False  # another job's record: taken over
