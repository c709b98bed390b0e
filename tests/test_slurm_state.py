"""What Slurm says of a submitted job (hfscale.runs.slurm_state) and what ``hfscale status``
prints of it, from REAL output captured on the test Slurm (tests/data/slurm_state/, captured by
capture.py there: Slurm 22.05.8, no accounting): a COMPLETED job, one FAILED by exit 3, one whose
ranks were SIGKILLed (137), one scancel'ed, one requeued; their output files. No process starts:
the commands of ``ask_slurm`` are answered with the captured text."""

from __future__ import annotations

import calendar
import time
from pathlib import Path

import pytest

from hfscale.runs.registry import RunInfo
from hfscale.runs.slurm_state import SlurmJob, parse_output, parse_sacct, parse_scontrol, slurm_time

DATA = Path(__file__).parent / "data" / "slurm_state"


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    """The captures were made in UTC: Slurm prints local time."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def t(text: str) -> float:
    return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%S")))


def captured(name: str) -> str:
    return (DATA / name).read_text()


@pytest.mark.parametrize("name, job, outcome, state, code, sig, start, end, restarts, reason", [
    ("completed", "1", "finished", "COMPLETED", 0, 0, "2026-11-26T23:09:00", "2026-11-26T23:09:00", 0, None),
    ("exit3", "2", "failed", "FAILED", 3, 0, "2026-11-26T23:09:00", "2026-11-26T23:09:00", 0, "NonZeroExitCode"),
    ("killed", "3", "failed", "FAILED", 137, 0, "2026-11-26T23:09:01", "2026-11-26T23:09:03", 0, "NonZeroExitCode"),
    ("cancelled", "4", "cancelled", "CANCELLED", 0, 15, "2026-11-26T23:09:05", "2026-11-26T23:09:07", 0, None),
    ("requeued", "5", "cancelled", "CANCELLED", 0, 15, "2026-11-26T23:09:23", "2026-11-26T23:09:24", 1, None),
    ("requeued-pending", "5", "requeued", "PENDING", 0, 0, "2026-11-26T23:09:22", None, 1, "BeginTime"),
    ("requeued-running", "5", "running", "RUNNING", 0, 0, "2026-11-26T23:09:23", None, 1, None),
    ("running", "4", "running", "RUNNING", 0, 0, "2026-11-26T23:09:05", None, 0, None),
])
def test_scontrol_of_real_jobs(name, job, outcome, state, code, sig, start, end, restarts, reason):
    j = parse_scontrol(captured(f"scontrol-{name}.txt"), job)
    assert j == SlurmJob(job, outcome, state, "scontrol", code, sig, j.submitted, t(start),
                         t(end) if end else None, restarts, reason)
    assert j.submitted is not None and j.submitted <= j.started


def test_scontrol_other_job_unknown_job_and_garbage():
    assert parse_scontrol(captured("scontrol-completed.txt"), "11") is None  # another job's line
    assert parse_scontrol(captured("scontrol-invalid.txt"), "999999") is None  # "Invalid job id specified"
    assert parse_scontrol("", "1") is None
    assert parse_scontrol("\x00" * 10_000_000, "1") is None  # capped, not read whole
    line = captured("scontrol-killed.txt")
    # a job name holding Key=Value words decides nothing (the fields are read after UserId=)
    forged = line.replace("JobName=killed.sh", "JobName=x JobState=COMPLETED ExitCode=0:0")
    assert parse_scontrol(forged, "3").state == "FAILED"
    assert parse_scontrol(line.replace("JobState=FAILED", "JobState=failed;rm"), "3") is None
    odd = parse_scontrol(line.replace("ExitCode=137:0", "ExitCode=x").replace("EndTime=2026-11-26T23:09:03",
                                                                            "EndTime=2026-99-99T99:99:99"), "3")
    assert (odd.outcome, odd.exit_code, odd.ended) == ("failed", None, None)


def test_sacct_without_accounting_and_a_record():
    # the test Slurm has no accounting (AccountingStorageType=accounting_storage/none): sacct says so, exit 1
    assert captured("sacct-disabled.txt") == "Slurm accounting storage is disabled\n"
    assert parse_sacct(captured("sacct-disabled.txt"), "1") is None
    # NOT captured (no accounting here): a record in the documented --parsable2 format of sacct_argv's fields
    text = ("3|FAILED|137:0|2026-11-26T23:08:58|2026-11-26T23:09:01|2026-11-26T23:09:03\n"
            "4|CANCELLED by 0|0:15|2026-11-26T23:09:03|2026-11-26T23:09:05|2026-11-26T23:09:07\n"
            "6|RUNNING|0:0|2026-11-26T23:10:00|2026-11-26T23:10:01|Unknown\nbad|line\n")
    assert parse_sacct(text, "3") == SlurmJob("3", "failed", "FAILED", "sacct", 137, 0, t("2026-11-26T23:08:58"),
                                              t("2026-11-26T23:09:01"), t("2026-11-26T23:09:03"))
    assert parse_sacct(text, "4").outcome == "cancelled" and parse_sacct(text, "4").reason == "by 0"
    assert parse_sacct(text, "6").ended is None and parse_sacct(text, "9") is None


def test_output_files_of_real_jobs():
    # the capture's scripts wrote the exit line without a time; hfscale's sbatch script adds time=
    assert parse_output(captured("out-completed.txt"), "1") == SlurmJob("1", "finished", "", "output file", 0, 0)
    assert parse_output(captured("out-exit3.txt"), "2").outcome == "failed"
    assert parse_output(captured("out-exit3.txt"), "2").exit_code == 3
    assert parse_output(captured("out-killed.txt"), "3").exit_code == 137
    cancelled = parse_output(captured("out-cancelled.txt"), "4")
    assert (cancelled.outcome, cancelled.state, cancelled.ended) == ("cancelled", "CANCELLED", t("2026-11-26T23:09:07"))
    # requeued (slurmstepd: DUE TO JOB REQUEUE), then cancelled: the last word is the cancel
    again = parse_output(captured("out-requeued.txt"), "5")
    assert (again.outcome, again.ended) == ("cancelled", t("2026-11-26T23:09:24"))
    first = captured("out-requeued.txt").split("start 1")[0]
    assert parse_output(first, "5").outcome == "requeued" and parse_output(first, "5").reason == "DUE TO JOB REQUEUE"
    assert parse_output(captured("out-cancelled.txt"), "44") is None  # another job's line


def test_output_file_of_an_hfscale_job():
    head = "hfscale: job 7 on node[0-1], master node0, restart 0\n0: training...\n"
    j = parse_output(head + "HFSCALE_EXIT rc=137 time=1764198543\n", "7")
    assert (j.outcome, j.exit_code, j.ended) == ("failed", 137, 1764198543.0)
    # a run that started again after its exit line, and said nothing more: its end is unknown
    assert parse_output(head + "HFSCALE_EXIT rc=0 time=1\nhfscale: job 7 on node0, master node0, restart 1\n", "7") is None
    # the preemption requeue: the script's exit line after 'requeueing' ends a run, not the job
    j = parse_output(head + "hfscale: requeueing\nHFSCALE_EXIT rc=0 time=5\n", "7")
    assert (j.outcome, j.ended) == ("requeued", None)
    # a rank's line (srun --label prefixes it) is not the script's
    assert parse_output(head + "0: HFSCALE_EXIT rc=0 time=5\n", "7") is None
    assert parse_output("HFSCALE_EXIT rc=99999\n" + "x" * 100_000, "7") is None


def _info(tmp_path: Path) -> RunInfo:
    return RunInfo(tmp_path / "sl-1", "1", "slurm", "submitted", None, None, None, t("2026-11-26T23:08:57"),
                   t("2026-11-26T23:08:58"), 0, 42, "login", slurm_job="3")


def test_status_says_the_real_outcome_exit_code_and_end(tmp_path):
    from hfscale.runs.status import status_text

    (tmp_path / "sl-1").mkdir()
    text = status_text(_info(tmp_path), parse_scontrol(captured("scontrol-killed.txt"), "3"))
    assert "state        failed (exit code 137); Slurm job 3: FAILED (NonZeroExitCode), from scontrol\n" in text
    assert ("started      2026-11-26 23:09:01 (Slurm); submitted 2026-11-26 23:08:58; ended 2026-11-26 23:09:03\n"
            in text)
    text = status_text(_info(tmp_path), parse_scontrol(captured("scontrol-cancelled.txt"), "4"))
    assert "state        cancelled (signal 15); Slurm job 3: CANCELLED, from scontrol\n" in text
    text = status_text(_info(tmp_path), parse_scontrol(captured("scontrol-requeued-pending.txt"), "5"))
    assert "state        requeued; Slurm job 3: PENDING (BeginTime), restart 1, from scontrol\n" in text
    assert "; ended" not in text
    # nothing known: said so, and the time sbatch answered is no end
    text = status_text(_info(tmp_path), "unknown: scontrol: slurm_load_jobs error: Invalid job id specified")
    assert "state        submitted (exit code 0); Slurm job 3: unknown: scontrol: slurm_load_jobs error" in text
    assert "started      2026-11-26 23:08:57; submitted 2026-11-26 23:08:58\n" in text


def test_ask_slurm_asks_scontrol_then_sacct_then_reads_the_output_file(tmp_path, monkeypatch):
    from hfscale.core.shell import Command
    from hfscale.launch.attempt import execute
    from hfscale.runs import status

    run = tmp_path / "sl-1"
    run.mkdir()
    (run / "slurm_job_id").write_text("3\n")
    asked: list[tuple[str, ...]] = []
    answers = {"scontrol": (1, "", captured("scontrol-invalid.txt")), "sacct": (1, "", captured("sacct-disabled.txt"))}

    def fake(cmd: Command, timeout: float):
        asked.append(tuple(cmd.real_argv()))
        return execute.Ran(*answers[cmd.real_argv()[0]])

    monkeypatch.setattr(execute, "run_probe", fake)
    said = status.ask_slurm(_info(tmp_path))
    assert asked == [("scontrol", "show", "job", "--oneliner", "3"),
                     ("sacct", "--noheader", "--parsable2", "--allocations", "--jobs=3",
                      "--format=JobID,State,ExitCode,Submit,Start,End")]
    assert said == ("unknown: scontrol: slurm_load_jobs error: Invalid job id specified; sacct: Slurm accounting "
                    f"storage is disabled; {run / 'slurm-3.out'} is missing")
    (run / "slurm-3.out").write_text(captured("out-killed.txt").replace("rc=137", "rc=137 time=1764198543"))
    said = status.ask_slurm(_info(tmp_path))
    assert (said.outcome, said.exit_code, said.ended, said.source) == ("failed", 137, 1764198543.0, "output file")
    answers["scontrol"] = (0, captured("scontrol-killed.txt"), "")
    assert status.ask_slurm(_info(tmp_path)).source == "scontrol"
    assert slurm_time("Unknown") is None
