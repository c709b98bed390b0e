"""What a real launch of a user script printed on the terminal that belongs in the node logs only:
datasets' progress lines, DeepSpeed's op builds, the Trainer's final dict, a warning's source line
when two ranks' warnings interleave or when the warning was printed behind a progress bar (TRL's
SFT under ZeRO-3 with its tqdm bar), hfscale's own HFSCALE_ markers, and torch's deprecation of
hfscale's own flight recorder variable. Each line is still in the log files."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

from hfscale.launch.attempt.console import Console
from hfscale.launch.build import build_plan
from hfscale.launch.context import LaunchContext

from conftest import job_of, run_cli

# as `hfscale launch` of a 2-rank Trainer script (datasets, DeepSpeed ZeRO-2 on the CPU) printed them
WARN = ("/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: "
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single` "
        "instead.")
SOURCE = "  return func(*args, **kwargs)"
NOISE = [
    "Generating train split: 0 examples [00:00, ? examples/s]",
    "Generating train split: 5 examples [00:00, 427.55 examples/s]",
    "Generating train split: 120000 examples [00:03, 33912.40 examples/s]",
    "Map (num_proc=4): 1500 examples [00:01, 1.23s/examples]",
    "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
    "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
    "Time to load cpu_adam op: 2.714 seconds",
    # the ranks share one pipe: the two lines of each rank's warning interleave
    WARN, WARN, SOURCE, SOURCE,
    "{'train_runtime': '1.282', 'train_samples_per_second': '37.44', 'train_steps_per_second': '4.679', "
    "'train_loss': '5.123', 'epoch': '0.09375'}",
    "[W1126 02:18:42.784923273 Utils.hpp:137] Warning: Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is "
    "deprecated; use TORCH_FR_BUFFER_SIZE instead (function operator())",
]
KEPT = [
    "hfscale: step 6/6 (100%) | loss 4.9962",
    "Traceback (most recent call last):",
    '  File "train.py", line 3, in <module>',
    "    main()",
    "RuntimeError: DeepSpeed op cpu_adam failed to build",
    "loading my own data: 5 files",
]


# TRL's sft.py (tests/scripts/third_party) under ZeRO-3 on 2 CPU ranks, tqdm on, as the node log has
# it: tqdm ends its bar with no newline, so a warning printed while the bar runs continues the bar's
# line, and its source line came to the terminal (3 times in that run, up to 7 in DPO and reward runs)
C10D = "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: "
RS = C10D + "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use `torch.distributed.reduce_scatter_single` instead."
AG = C10D + "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single` instead."
BAR = "\u2588\u2588\u258c"  # tqdm's blocks
TRL_ZERO3 = [
    "Dropping fully masked examples from train dataset:   0%|          | 0/200 [00:00<?, ? examples/s]",
    "",
    "  0%|          | 0/4 [00:00<?, ?it/s]" + RS, SOURCE, RS, SOURCE, AG, SOURCE, AG, SOURCE,
    "",
    f" 25%|{BAR}       | 1/4 [00:00<00:00,  6.11it/s]" + RS, SOURCE, RS, SOURCE, AG, SOURCE, AG, SOURCE,
    "Generating train split: 200 examples [00:00, 88152.67 examples/s]" + AG, SOURCE,  # a bar without a total
    "Writing model shards: 0it [00:00, ?it/s]\x1b[A",  # tqdm moving the cursor up to its outer bar
    "\u2705 Training completed.",  # the script's own lines
    "HFSCALE_TRAIN done step=4 train_loss=5.360700 resumed_from=-",  # hfscale's markers, for the logs and tests
    "node1: HFSCALE_EXIT rc=0",
]


def _shown(lines: list[str], mode: str = "normal", hosts: frozenset[str] | None = None) -> list[str]:
    c = Console(mode, io.StringIO(), tty=False, hosts=hosts)
    return [line for line in lines if c.shown(line)]


def test_the_real_noise_stays_off_the_terminal_and_errors_do_not():
    assert _shown(NOISE + KEPT) == KEPT
    assert _shown([f"node1: {line}" for line in NOISE + KEPT], hosts=frozenset({"node0", "node1"})) == [
        f"node1: {line}" for line in KEPT]
    assert _shown(NOISE, "verbose") == NOISE


def test_a_warnings_source_line_is_dropped_only_as_many_times_as_warnings_came():
    lines = [WARN, WARN, SOURCE, "progress: 3 of 9", SOURCE, "    an indented line of the script's own"]
    assert _shown(lines) == ["progress: 3 of 9", "    an indented line of the script's own"]
    # a warning without a source line (no file to read it from) does not hide an indented line for long
    assert _shown([WARN] + [f"line {i}" for i in range(16)] + ["    indented"])[-1] == "    indented"


def test_a_warning_behind_a_progress_bar_takes_its_source_line_along():
    assert _shown(TRL_ZERO3, hosts=frozenset({"node0", "node1"})) == ["\u2705 Training completed."]
    assert _shown(TRL_ZERO3, "verbose") == TRL_ZERO3
    # the bar alone is noise as before; the line after a bar with no warning is not taken for a source line
    assert _shown(["  0%|          | 0/4 [00:00<?, ?it/s]", "    an indented line of the script's own"]) == [
        "    an indented line of the script's own"]


def test_a_trace_after_a_warning_is_shown_whole():
    lines = [WARN, "Traceback (most recent call last):", '  File "t.py", line 1, in <module>', "ValueError: x"]
    assert _shown(lines) == lines[1:]


def test_a_trace_that_torchs_agent_logs_ends_where_its_exception_line_is():
    """A forked rank killed (runner.warm_start): torch's agent logs the ProcessExitedException's traceback with
    its c10 prefix on every line. The trace is shown to its last line; what the ranks print next is not."""
    c10 = "E1130 07:49:52.101000 2445 site-packages/torch/distributed/elastic/multiprocessing/api.py:836] "
    trace = [c10 + "failed (exitcode: -9) local_rank: 1 (pid: 2490) of fn: forked_rank (start_method: fork)",
             c10 + "Traceback (most recent call last):",
             c10 + '  File "/x/torch/distributed/elastic/multiprocessing/api.py", line 797, in _poll',
             c10 + "    self._pc.join(-1)",
             c10 + "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGKILL"]
    after = ["{'loss': '3.547', 'epoch': '0.02614'}", "HFSCALE_TRAIN done step=60 train_loss=3.546615 resumed_from=-"]
    assert _shown(trace + after) == trace


def test_a_launch_keeps_every_line_in_its_log_and_only_the_rest_on_the_terminal(tmp_path):
    """A real `hfscale launch` of a plain script that prints the lines (accelerate launch, one process)."""
    script = tmp_path / "noisy.py"
    script.write_text("import sys\nlines = " + repr(NOISE + KEPT[-1:]) + "\n"
                      "for line in lines:\n    print(line, file=sys.stderr if 'Warning' in line else sys.stdout, "
                      "flush=True)\n"
                      # a tqdm bar on stderr (no newline), a warning printed behind it, its source line
                      f"sys.stderr.write('\\r  0%|          | 0/4 [00:00<?, ?it/s]'); sys.stderr.flush()\n"
                      f"sys.stderr.write({RS!r} + '\\n' + {SOURCE!r} + '\\n'); sys.stderr.flush()\n"
                      "print('HFSCALE_TRAIN done step=4 train_loss=5.1 resumed_from=-', flush=True)\n")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(textwrap.dedent("""
        name: noisy
        distributed: {backend: ddp}
        precision: "no"
        batch: {micro_batch_size: 1}
        watchdog: {timeout: null}
        training: {script: noisy.py, pass_args: none}
    """))
    r = run_cli("launch", str(cfg), cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    shown = (r.stdout + r.stderr).splitlines()
    assert "loading my own data: 5 files" in shown
    assert not [line for line in shown if any(n in line for n in ("Generating", "built successfully", "Time to load",
                                                                   "train_runtime", "return func", "FutureWarning",
                                                                   "HFSCALE_TRAIN", "it/s]"))]
    (log,) = (tmp_path / "runs").glob("noisy-*/logs/local.log")
    logged = log.read_text().splitlines()
    assert all(line in logged for line in NOISE), logged
    assert "  0%|          | 0/4 [00:00<?, ?it/s]" + RS in logged and logged.count(SOURCE) == 3
    assert "HFSCALE_TRAIN done step=4 train_loss=5.1 resumed_from=-" in logged


# --- the flight recorder variable hfscale sets


PROBE = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
    dist.all_reduce(torch.ones(1))
    import torch._C._distributed_c10d as c10d
    print(len(json.loads(c10d._dump_fr_trace_json()).get("entries", [])))
    dist.destroy_process_group()
""")


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _rank(env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}
    return subprocess.run([sys.executable, "-c", PROBE, _free_port()], env={**clean, **env}, capture_output=True,
                          text=True, timeout=120)


def test_the_ranks_environment_draws_no_deprecation_from_torch_and_keeps_the_flight_recorder(tmp_path):
    """torch prints the deprecation on stderr when a gloo group starts (on the CPU too): with the old
    name it does (so this test can fail), with hfscale's environment it does not, and the flight
    recorder still holds the collective the watchdog's report reads."""
    job = job_of("name: fr\nbatch: {micro_batch_size: 1}\n")
    env = {k: v for k, v in build_plan(job, LaunchContext.of(str(tmp_path), sys.executable, "20261126-000000-aaaaaa",
                                                            {})).main.env if k.startswith("TORCH_")}
    assert set(env) == {"TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"}
    old = _rank({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})
    assert old.returncode == 0 and "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated" in old.stderr, old.stderr
    ours = _rank(env)
    assert ours.returncode == 0, ours.stderr
    assert "deprecated" not in ours.stderr and int(ours.stdout) >= 1
    off = _rank({"TORCH_FR_BUFFER_SIZE": "0"})  # the variable is the one the recorder reads
    assert int(off.stdout) == 0


def test_torch_before_2_8_gets_the_names_it_reads():
    from hfscale.config.envvars import flight_recorder_env

    assert flight_recorder_env("2000", "/r/f/n_", "2.7.1+cu126") == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/r/f/n_"}
    assert flight_recorder_env("2000", "/r/f/n_", "2.13.0+cpu") == flight_recorder_env("2000", "/r/f/n_", None) == {
        "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": "/r/f/n_"}
    # the job's own setting, under either name, is left to it
    assert flight_recorder_env("2000", "/r/f/n_", "2.13.0", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "5"}) == {
        "TORCH_FR_DUMP_TEMP_FILE": "/r/f/n_"}


def test_a_node_with_another_torch_reads_hfscales_values_under_its_own_names():
    """The launching machine's torch picks the names; each rank renames hfscale's own values (not the
    job's) to what the node's torch reads, so neither an old torch loses them nor a new one warns."""
    from hfscale.config.envvars import flight_recorder_on_node

    dump = "/r/flight/nccl_rank_"
    nccl = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump}  # launched with torch 2.7
    fr = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": dump}  # launched with torch 2.8 or later
    assert flight_recorder_on_node(nccl, "2.13.0+cpu", "2000", dump) == {
        "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": None,
        "TORCH_FR_DUMP_TEMP_FILE": dump, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": None}
    assert flight_recorder_on_node(fr, "2.7.1+cu126", "2000", dump) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": None,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump, "TORCH_FR_DUMP_TEMP_FILE": None}
    assert flight_recorder_on_node(fr, "2.13.0", "2000", dump) == flight_recorder_on_node(nccl, "2.6.0", "2000",
                                                                                          dump) == {}
    # the job's own values, and a name the node reads already, are left alone; no torch: nothing to go by
    assert flight_recorder_on_node({"TORCH_NCCL_TRACE_BUFFER_SIZE": "5"}, "2.13.0", "2000", dump) == {}
    assert flight_recorder_on_node({**nccl, "TORCH_FR_BUFFER_SIZE": "7"}, "2.13.0", "2000", dump) == {
        "TORCH_FR_DUMP_TEMP_FILE": dump, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": None}
    assert flight_recorder_on_node(nccl, None, "2000", dump) == {}


def test_a_rank_renames_the_old_names_before_torch_starts(tmp_path):
    """A plain script's rank (hfscale.training.run_script), launched from a machine with torch 2.7: the installed
    torch here reads the new names, draws no deprecation, and its recorder holds the collective."""
    script = tmp_path / "probe.py"
    script.write_text("import os\nprint(sorted(k for k in os.environ if k.startswith(('TORCH_FR', 'TORCH_NCCL'))))\n"
                      + PROBE)
    dump = f"{tmp_path}/flight/nccl_rank_"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}
    env.update(HFSCALE_RUN_DIR=str(tmp_path), TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
               TORCH_NCCL_DEBUG_INFO_TEMP_FILE=dump, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "hfscale.training.run_script", "--plain", str(script), _free_port()], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    names, entries = r.stdout.split("\n")[:2]
    assert names == "['TORCH_FR_BUFFER_SIZE', 'TORCH_FR_DUMP_TEMP_FILE']"
    assert "deprecated" not in r.stderr and int(entries) >= 1
