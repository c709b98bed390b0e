"""The hang watchdog's judgement on given files: when the job counts as hung (timed by the caller's
clock), which rank holds it up (from steps and py-spy / faulthandler stacks), and the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hfscale.launch.attempt.watchdog import LastCollective, Watchdog, analyze, collective, main_stack, read_stacks, report, where
from hfscale.launch.spec import HangWatch
from hfscale.training.heartbeat import Progress, read_progress

PYSPY_WAITING = """Process 11655: python -u probe.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 11655 (idle): "MainThread"
    all_reduce (/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:3252)
    _exception_logger.<locals>.wrapper (/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83)
    train_step (/work/train.py:40)
    <module> (/work/train.py:75)
Thread 11700 (idle): "pt_autograd_0"
    worker (/usr/lib/python3.11/threading.py:100)
"""
PYSPY_STUCK = """Process 11656: python -u probe.py
Thread 11656 (idle): "MainThread"
    stuck_here (/work/train.py:63)
    <module> (/work/train.py:73)
"""
FAULTHANDLER_WAITING = """Thread 0x00007f1 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 622 in run

Current thread 0x00007f2 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5356 in barrier
  File "/work/train.py", line 80 in <module>
"""


def _ranks(*steps: int) -> dict[int, Progress]:
    return {r: Progress(r, s, 100 + r, f"node{r}") for r, s in enumerate(steps)}


def test_stacks_are_read_from_py_spy_and_faulthandler():
    spy = main_stack(PYSPY_WAITING)
    assert [f.func for f in spy] == ["all_reduce", "_exception_logger.<locals>.wrapper", "train_step", "<module>"]
    assert collective(spy) == "all_reduce" and where(spy) == "train_step (train.py:40)"
    fh = main_stack(FAULTHANDLER_WAITING)  # the thread whose outermost frame is the module
    assert [f.func for f in fh] == ["barrier", "<module>"] and collective(fh) == "barrier"
    assert collective(main_stack(PYSPY_STUCK)) is None and where(main_stack(PYSPY_STUCK)) == "stuck_here (train.py:63)"


def test_a_rank_outside_any_collective_at_the_same_step_is_named():
    v = analyze(_ranks(7, 7, 7), {0: PYSPY_WAITING, 1: PYSPY_STUCK, 2: PYSPY_WAITING}, 3)
    assert v.stuck == (1,)
    assert v.line == "rank 1 on node1 stuck at step 7 in stuck_here (train.py:63) while the others wait in all_reduce"


def test_a_rank_ahead_of_ranks_waiting_in_a_collective_skipped_it():
    v = analyze(_ranks(8, 9), {0: PYSPY_WAITING, 1: FAULTHANDLER_WAITING}, 2)
    assert v.stuck == (1,)
    assert v.line == ("rank 1 on node1 at step 9 passed the all_reduce that rank 0 on node0 waits in at step 8: a "
                      "skipped collective")


def test_a_rank_behind_outside_a_collective_is_named():
    v = analyze(_ranks(5, 4), {0: PYSPY_WAITING, 1: PYSPY_STUCK}, 2)
    assert v.stuck == (1,) and v.line.startswith("rank 1 on node1 stuck at step 4 in stuck_here")


def test_a_rank_that_never_reported_is_named():
    assert analyze(_ranks(3), {0: PYSPY_WAITING}, 2).stuck == (1,)


def test_ranks_in_another_collective_than_most():
    v = analyze(_ranks(4, 4, 4), {0: PYSPY_WAITING, 1: FAULTHANDLER_WAITING, 2: PYSPY_WAITING}, 3)
    assert v.stuck == (1,) and v.line == "rank 1 on node1 in barrier while the others wait in all_reduce (step 4)"


def test_every_rank_in_the_same_collective_names_none():
    v = analyze(_ranks(4, 4), {0: PYSPY_WAITING, 1: PYSPY_WAITING}, 2)
    assert v.stuck == () and v.line == "every rank waits in all_reduce at step 4: a lost peer or the network"


def _watch(tmp_path, timeout=60, first_step=None) -> HangWatch:
    return HangWatch(str(tmp_path / "progress"), str(tmp_path / "stacks"), str(tmp_path / "r.txt"), timeout, first_step, 2)


def _write(tmp_path, rank: int, step: int) -> None:
    (tmp_path / "progress").mkdir(exist_ok=True)
    (tmp_path / "progress" / f"rank-{rank}").write_text(f"{step} {100 + rank} node{rank}\n")


def test_hung_once_no_rank_advanced_for_the_timeout(tmp_path):
    dog = Watchdog(_watch(tmp_path), now=0)
    assert dog.poll(1000) is None  # no step yet and no first_step limit: not watched
    _write(tmp_path, 0, 1)
    _write(tmp_path, 1, 1)
    assert dog.poll(1000) is None
    _write(tmp_path, 0, 2)
    assert dog.poll(1030) is None
    assert dog.poll(1089) is None  # 59 s since step 2
    assert dog.poll(1090) == "no rank finished a step for 60 s (the last was step 2)"
    assert dog.changed == {0: 1030, 1: 1000} and dog.ranks[1].step == 1


def test_first_step_limit(tmp_path):
    dog = Watchdog(_watch(tmp_path, first_step=300), now=0)
    assert dog.poll(299) is None
    assert dog.poll(300) == "no rank finished a step in the first 300 s"


def test_progress_files_from_the_rank_side(tmp_path):
    """hfscale.training.heartbeat.step as a rank calls it: the file, and faulthandler's stack file on SIGUSR2."""
    code = ("import os, signal, time, hfscale.training.heartbeat as p\n"
            "p.step(5)\n"
            "os.kill(os.getpid(), signal.SIGUSR2)\n"
            "time.sleep(0.2)\n")
    env = {**os.environ, "HFSCALE_RUN_DIR": str(tmp_path), "RANK": "3"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    p = read_progress(tmp_path / "progress" / "rank-3")
    assert p is not None and p.rank == 3 and p.step == 5 and p.pid > 0
    stacks = read_stacks(str(tmp_path / "stacks"))
    assert "<module>" in stacks[3]  # the stack faulthandler wrote on the signal


def test_outside_hfscale_launch_nothing_is_written(tmp_path, monkeypatch):
    from hfscale.training import heartbeat as progress
    monkeypatch.delenv("HFSCALE_RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    progress.step(1)
    assert list(tmp_path.iterdir()) == []


def test_report_lists_every_rank_and_stack():
    ranks = _ranks(7, 7)
    stacks = {0: PYSPY_WAITING, 1: PYSPY_STUCK}
    v = analyze(ranks, stacks, 2)
    text = report("no rank finished a step for 60 s (the last was step 7)", v, ranks, {0: 10.0, 1: 12.0}, stacks,
                  now=72.0)
    lines = text.splitlines()
    assert lines[0] == "hfscale hang report: no rank finished a step for 60 s (the last was step 7)"
    assert lines[1] == f"verdict: {v.line}"
    assert lines[4].split() == ["0", "node0", "100", "7", "62s", "all_reduce"]
    assert lines[5].split() == ["1", "node1", "101", "7", "60s", "stuck_here", "(train.py:63)"]
    assert "--- rank 1" in lines and PYSPY_STUCK.splitlines()[2] in lines


def test_a_thousand_ranks(tmp_path):
    """Every rank's file is read (the time it takes is in bench/bench_watchdog.py)."""
    for r in range(1000):
        _write(tmp_path, r, 1)
    _write(tmp_path, 999, 2)
    dog = Watchdog(HangWatch(str(tmp_path / "progress"), "", "", 60, None, 1000), now=0)
    assert dog.poll(1) is None
    assert len(dog.ranks) == 1000 and dog.ranks[999].step == 2 and dog.ranks[0].step == 1


def test_flight_recorder_dumps_are_summarised(tmp_path):
    import json

    from hfscale.launch.attempt.watchdog import flight_line, read_flight

    def dump(*entries):
        return json.dumps([{"source": "_dump_fr_trace_json", "entries": [
            {"collective_seq_id": n, "profiling_name": name, "state": "scheduled"} for n, name in entries]}])

    (tmp_path / "rank-0.json").write_text(dump((9, "gloo:all_reduce"), (10, "gloo:all_reduce")))
    (tmp_path / "rank-1.json").write_text(dump((9, "gloo:all_reduce"), (10, "gloo:barrier")))
    (tmp_path / "rank-2.json").write_text("not json")
    flight = read_flight(str(tmp_path))
    assert flight == {0: (10, "gloo:all_reduce", "scheduled"), 1: (10, "gloo:barrier", "scheduled")}
    assert flight_line(flight) == ("flight recorder, each rank's last collective: rank 0: #10 gloo:all_reduce "
                                   "(scheduled), rank 1: #10 gloo:barrier (scheduled)")
    assert flight_line({0: flight[0], 1: flight[0]}) is None  # agreeing ranks: nothing to say


def test_work_between_steps_is_progress(tmp_path):
    """A rank writing beats (evaluation batches, a save) at the same step is not hung."""
    dog = Watchdog(_watch(tmp_path), now=0)
    _write(tmp_path, 0, 5)
    assert dog.poll(0) is None
    for t in (50, 100, 150):
        (tmp_path / "progress" / "rank-0").write_text(f"5 100 node0 {t}\n")
        assert dog.poll(t) is None
    assert dog.poll(209) is None
    assert dog.poll(210) == "no rank finished a step for 60 s (the last was step 5)"


# what an unchanged Trainer script under `python -m hfscale.training.run_script` dumps: hfscale's flight
# recorder thread first, the main thread's outermost frame runpy's, not <module>
FAULTHANDLER_RUNPY = """Thread 0x00007f9 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/work/hfscale/training/heartbeat.py", line 120 in _flight_loop
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner

Current thread 0x00007fa (most recent call first):
  File "/work/user/callbacks.py", line 12 in on_step_end
  File "/venv/lib/python3.11/site-packages/transformers/trainer.py", line 2500 in _inner_training_loop
  File "/work/user/train.py", line 40 in main
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
PYSPY_RUNPY = """Process 200: python -m hfscale.training.run_script train.py
Thread 201 (idle): "Thread-1 (_flight_loop)"
    wait (/usr/lib/python3.11/threading.py:331)
    _flight_loop (/work/hfscale/training/heartbeat.py:120)
Thread 200 (idle): "MainThread"
    all_gather (/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:2800)
    main (/work/user/train.py:40)
    _run_code (<frozen runpy>:88)
    _run_module_as_main (<frozen runpy>:198)
"""


def test_the_main_thread_is_found_under_python_m():
    """Issue 23: the main thread is faulthandler's "Current thread" / py-spy's "MainThread", not
    the first thread listed (hfscale's own _flight_loop)."""
    fh = main_stack(FAULTHANDLER_RUNPY)
    assert fh[0].func == "on_step_end" and collective(fh) is None
    assert where(fh) == "on_step_end (callbacks.py:12)"
    spy = main_stack(PYSPY_RUNPY)
    assert spy[0].func == "all_gather" and collective(spy) == "all_gather"
    v = analyze(_ranks(5, 5), {0: PYSPY_RUNPY, 1: FAULTHANDLER_RUNPY}, 2)
    assert v.stuck == (1,) and "on_step_end (callbacks.py:12)" in v.line and "all_gather" in v.line


def test_flight_recorder_counts_name_the_rank_when_stacks_are_silent():
    """No stacks (none could be taken), but rank 0 issued collective #44 and rank 1 #43: rank 1 is late."""
    flight = {0: LastCollective(44, "nccl:all_gather", "scheduled"), 1: LastCollective(43, "nccl:all_reduce", "completed")}
    v = analyze(_ranks(5, 5), {}, 2, flight)
    assert v.stuck == (1,)
    assert "rank 1 on node1 issued 43 collectives, the others 44 (the last: nccl:all_gather)" in v.line
    same = {0: (44, "nccl:all_gather", "scheduled"), 1: (44, "nccl:all_gather", "scheduled")}
    assert analyze(_ranks(5, 5), {}, 2, same).stuck == ()


@pytest.mark.parametrize("dumper", ["faulthandler", "py-spy"])
def test_a_rank_that_did_not_answer_the_dump_is_named(tmp_path, dumper):
    """node1's rank was SIGSTOPped (a frozen driver): it cannot run faulthandler's handler nor its flight
    recorder's thread, so only an earlier dump's files of it are there (py-spy reads a stopped process,
    so with py-spy its stack is fresh, but that is no answer). Its peers' flight recorders disagree
    among themselves (rank 2 waits in the ring for rank 1's part): once they named rank 2."""
    from hfscale.launch.attempt.dump_files import DumpMarks, answered, await_answers
    from hfscale.launch.attempt.watchdog import judge
    stacks, flight = tmp_path / "stacks", tmp_path / "flight"
    stacks.mkdir()
    flight.mkdir()
    for r in range(3):
        (stacks / f"rank-{r}.fh").write_text(FAULTHANDLER_WAITING)  # an earlier dump
        (flight / f"rank-{r}.json").write_text("[]")
    watch = HangWatch(progress_dir=str(tmp_path / "progress"), stacks_dir=str(stacks), timeout=15,
                      report=str(tmp_path / "hang-report.txt"), first_step=None, world_size=3)
    before = DumpMarks.take(watch, range(3))
    for r in range(3):  # the dump
        if dumper == "py-spy":
            (stacks / f"rank-{r}.txt").write_text(PYSPY_WAITING)
        if r == 1:
            continue
        if dumper == "faulthandler":
            with open(stacks / f"rank-{r}.fh", "a") as f:
                f.write(FAULTHANDLER_WAITING)
        entry = {"collective_seq_id": 128 - r // 2, "profiling_name": "gloo:all_gather", "state": "scheduled"}
        (flight / f"rank-{r}.json").write_text(json.dumps([{"entries": [entry]}]))
    assert {r for r in range(3) if answered(watch, r, before)} == {0, 2}
    want = [0, 1, 2] if dumper == "py-spy" else [0, 2]
    assert sorted(read_stacks(str(stacks), before.stacks)) == want
    assert sorted(read_stacks(str(stacks))) == [0, 1, 2]  # without marks: every file, an earlier dump's too
    clock = iter(range(100))
    waited: list[float] = []
    got = await_answers(watch, range(3), before, wait_s=5, clock=lambda: next(clock), sleep=waited.append)
    assert got == {0, 2} and len(waited) == 4  # read 5 times, for rank 1, until the bound (5 ticks)
    dog = Watchdog(watch, 0.0)
    dog.ranks = _ranks(22, 22, 22)
    verdict, text = judge(dog, "no rank finished a step for 15 s", 100.0, before, got)
    assert verdict.stuck == (1,), verdict.line
    assert verdict.line.startswith("rank 1 on node1 did not answer the stack dump while the others wait in ")
    assert verdict.line.endswith("(step 22): stopped, stuck in the kernel or a driver, or out of reach")
    # without the answers, the flight recorders alone name the wrong rank: what the fix is for
    assert judge(dog, "no rank finished a step for 15 s", 100.0, before)[0].stuck == (2,)
    # more silent ranks than answering ones: the dump itself is in doubt, no one is named for silence
    assert "did not answer" not in analyze(_ranks(22, 22, 22), {}, 3, None, frozenset({0})).line


def test_a_flight_recorder_rewritten_with_the_same_bytes_in_the_same_tick_is_an_answer(tmp_path):
    """A hung rank's flight recorder holds the same collectives at each dump, and heartbeat's atomic replace
    can land in the same mtime tick (a coarse clock on a shared file system): the new inode still tells
    the answer apart from the earlier dump's file; a file left alone, or a link put there, is no answer."""
    import os

    from hfscale.launch.attempt.dump_files import DumpMarks, answered
    stacks, flight = tmp_path / "stacks", tmp_path / "flight"
    stacks.mkdir()
    flight.mkdir()
    for r in range(3):
        (flight / f"rank-{r}.json").write_text('[{"entries": []}]')
    watch = HangWatch(progress_dir=str(tmp_path / "progress"), stacks_dir=str(stacks), timeout=15,
                      report=str(tmp_path / "hang-report.txt"), first_step=None, world_size=3)
    old = (flight / "rank-0.json").stat()
    before = DumpMarks.take(watch, range(3))
    new = flight / "rank-0.json.tmp"  # rank 0 answers: the same bytes, replaced, its time set back
    new.write_text('[{"entries": []}]')
    os.replace(new, flight / "rank-0.json")
    os.utime(flight / "rank-0.json", ns=(old.st_atime_ns, old.st_mtime_ns))
    (flight / "rank-2.json").unlink()  # rank 2: a link to another rank's answer in its place
    (flight / "rank-2.json").symlink_to(flight / "rank-0.json")
    assert [answered(watch, r, before) for r in range(3)] == [True, False, False]
