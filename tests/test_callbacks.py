"""hfscale.training.callbacks inside a real HF Trainer on CPU: one process in this interpreter (fast), and the
2-rank DeepSpeed ZeRO-2 job started with torchrun (slow, shared with test_resume.py)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import types

import pytest
from conftest import ROOT
from scripts import trainer_runs

FIELDS = {"event", "step", "epoch", "time", "world_size", "window_steps", "step_time_s", "samples_per_s",
          "tokens_per_s", "eta_s", "mem_peak_mb", "mem_peak_mb_per_rank", "flops_per_token", "mfu"}
STRAGGLER_FIELDS = {"event", "step", "time", "world_size", "window_steps", "forward_s_per_rank", "step_time_s_per_rank",
                    "hosts", "median_forward_s", "slowest_rank", "slowest_host", "ratio", "threshold", "straggler"}
LOG_KEYS = {"hfscale/step_time_s", "hfscale/samples_per_s", "hfscale/tokens_per_s", "hfscale/eta_s",
            "hfscale/mem_peak_mb", "hfscale/mfu"}


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- one process, in this interpreter ------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    """transformers + the tiny model/data of the test script, imported only when these tests run."""
    import transformers
    from scripts import trainer_run

    class Recorder(transformers.TrainerCallback):
        """Stands for a report_to logger: sees exactly what the Trainer's loggers see."""

        def __init__(self):
            self.logs: list[tuple[int, dict]] = []

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append((state.global_step, dict(logs)))

    def make_trainer(out, callbacks=(), **overrides):
        transformers.set_seed(0)
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64))
        kw = {"output_dir": str(out), "use_cpu": True, "per_device_train_batch_size": 4, "max_steps": 7,
              "logging_steps": 2, "save_steps": 100, "learning_rate": 1e-3, "report_to": "none", "disable_tqdm": True}
        args = transformers.TrainingArguments(**{**kw, **overrides})
        data = trainer_run.Blocks(trainer_run.stdlib_blocks(64))
        return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))

    return types.SimpleNamespace(tf=transformers, Recorder=Recorder, make_trainer=make_trainer)


def test_metrics_in_a_real_trainer_reach_loggers_history_and_jsonl(hf, tmp_path, monkeypatch):
    from hfscale.training.callbacks import METRICS_FILE, MetricsCallback

    monkeypatch.setenv("HFSCALE_JOB_ID", "20261124-120000-abcdef")  # as under hfscale launch

    before = hf.Recorder()  # registered first, like the report_to loggers
    trainer = hf.make_trainer(tmp_path / "out", callbacks=[before])
    n_params = sum(p.numel() for p in trainer.model.parameters())
    metrics = MetricsCallback(seq_len=64, peak_flops_per_device=1e12, trainer=trainer)
    trainer.add_callback(metrics)
    trainer.train()

    records = read_jsonl(tmp_path / "out" / METRICS_FILE)
    assert [r["step"] for r in records] == [2, 4, 6]  # every logging_steps, not every step
    for r in records:
        assert set(r) == FIELDS | {"job"} and r["job"] == "20261124-120000-abcdef"
        # the first step (the start-up) is left out: the first window holds step 2 only
        assert r["event"] == "metrics" and r["world_size"] == 1 and r["window_steps"] == (1 if r["step"] == 2 else 2)
        assert r["step_time_s"] > 0 and r["samples_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 64)
        assert r["samples_per_s"] == pytest.approx(4 / r["step_time_s"])
        assert r["eta_s"] == pytest.approx((7 - r["step"]) * r["step_time_s"])
        assert r["mem_peak_mb"] > 50 and r["mem_peak_mb_per_rank"] == [r["mem_peak_mb"]]
        assert r["flops_per_token"] == 6 * n_params
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * 6 * n_params / 1e12)
        assert 0 < r["epoch"] < 1 and r["time"] > 1.7e9

    # The loggers registered before the callback got the metrics, at the steps they were measured.
    seen = {step: logs for step, logs in before.logs if LOG_KEYS & set(logs)}
    assert sorted(seen) == [2, 4, 6]
    assert set(seen[4]) >= LOG_KEYS
    assert seen[4]["hfscale/tokens_per_s"] == records[1]["tokens_per_s"]
    history = [h for h in trainer.state.log_history if "hfscale/tokens_per_s" in h]
    assert [h["step"] for h in history] == [2, 4, 6]
    assert metrics.last == records[-1]


def test_a_starts_first_step_is_in_the_record_and_out_of_the_window(hf, tmp_path):
    """Logged every step: the start's first step has its record (the step is there, with its memory:
    after a relaunch the report's curves do not skip it), with no throughput (its time is the
    start-up's: out of the window); the next steps are measured."""
    from hfscale.training.callbacks import METRICS_FILE, MetricsCallback

    trainer = hf.make_trainer(tmp_path / "out", logging_steps=1, max_steps=3)
    trainer.add_callback(MetricsCallback(seq_len=64, trainer=trainer))
    trainer.train()
    records = read_jsonl(tmp_path / "out" / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3]
    first = records[0]
    assert first["window_steps"] == 0 and first["mem_peak_mb"] > 50
    assert first["step_time_s"] is first["samples_per_s"] is first["tokens_per_s"] is first["eta_s"] is None
    assert all(r["window_steps"] == 1 and r["step_time_s"] > 0 for r in records[1:])


def test_without_trainer_metrics_join_the_trainers_own_log_entry(hf, tmp_path):
    from hfscale.training.callbacks import METRICS_FILE, MetricsCallback

    before, after = hf.Recorder(), hf.Recorder()
    trainer = hf.make_trainer(tmp_path / "out", callbacks=[before])
    trainer.add_callback(MetricsCallback(every=3, seq_len=64))  # no peak FLOPs: no MFU
    trainer.add_callback(after)
    trainer.train()

    records = read_jsonl(tmp_path / "out" / METRICS_FILE)
    assert [r["step"] for r in records] == [3, 6]  # its own cadence: gathered every 3 steps only
    assert all(r["mfu"] is None for r in records)
    # Merged into the Trainer's next log (steps 4 and 6), next to the loss, in one history entry.
    merged = [h for h in trainer.state.log_history if "hfscale/step_time_s" in h]
    assert [h["step"] for h in merged] == [4, 6] and all("loss" in h for h in merged)
    assert not any("hfscale/mfu" in h for h in merged)
    # Callbacks after it see them; loggers before it cannot (why trainer= exists).
    assert [s for s, logs in after.logs if "hfscale/step_time_s" in logs] == [4, 6]
    assert not any("hfscale/step_time_s" in logs for _, logs in before.logs)


def test_straggler_single_process_reports_itself(hf, tmp_path):
    from hfscale.training.callbacks import METRICS_FILE, StragglerCallback

    trainer = hf.make_trainer(tmp_path / "out")
    cb = StragglerCallback(threshold=1.2, trainer=trainer)
    trainer.add_callback(cb)
    trainer.train()
    records = [r for r in read_jsonl(tmp_path / "out" / METRICS_FILE) if r["event"] == "straggler"]
    assert [r["step"] for r in records] == [2, 4, 6]
    for r in records:
        assert set(r) == STRAGGLER_FIELDS
        assert r["hosts"] == [socket.gethostname()] and r["slowest_rank"] == 0
        assert r["ratio"] == 1.0 and r["straggler"] is False
        assert 0 < r["forward_s_per_rank"][0] < r["step_time_s_per_rank"][0]
    assert cb._hooks == []  # forward hooks removed at the end of training


def test_preemption_single_process_saves_complete_checkpoint_and_stops(hf, tmp_path):
    from hfscale.training.callbacks import CheckpointCompleteCallback, PreemptionCallback
    from hfscale.checkpoints.resume import latest_checkpoint

    class SignalAtStep3(hf.tf.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)  # a real signal to this process

    original = signal.getsignal(signal.SIGUSR1)
    trainer = hf.make_trainer(tmp_path / "out", callbacks=[SignalAtStep3()], max_steps=50)
    preempt = PreemptionCallback()
    trainer.add_callback(preempt)
    trainer.add_callback(CheckpointCompleteCallback())
    try:
        out = trainer.train()  # returns normally
        assert out.global_step == 3 and trainer.state.global_step == 3
        assert preempt.preempted and preempt.stop_step == 3 and preempt.received == signal.SIGUSR1
        assert latest_checkpoint(tmp_path / "out") == str(tmp_path / "out" / "checkpoint-3")
        # After a preemption the handler stays: a second copy of the signal must not kill the process.
        assert signal.getsignal(signal.SIGUSR1) == preempt._handler
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(SystemExit) as exc:
            preempt.exit_if_preempted()
        assert exc.value.code == 0
    finally:
        preempt.restore()
    assert signal.getsignal(signal.SIGUSR1) == original


def test_signal_after_the_last_step_boundary_still_counts(hf, tmp_path):
    from hfscale.training.callbacks import PreemptionCallback

    class SignalAfterLastCheck(hf.tf.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == args.max_steps:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = hf.make_trainer(tmp_path / "out", max_steps=3)
    preempt = PreemptionCallback()
    trainer.add_callback(preempt)
    trainer.add_callback(SignalAfterLastCheck())  # after the preemption check of the last step
    try:
        trainer.train()
        assert trainer.state.global_step == 3
        assert preempt.preempted and preempt.stop_step == 3 and preempt.received == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == preempt._handler  # still shielded
    finally:
        preempt.restore()


def test_handlers_restored_after_normal_training(hf, tmp_path):
    from hfscale.training.callbacks import PreemptionCallback

    original = signal.getsignal(signal.SIGTERM)
    trainer = hf.make_trainer(tmp_path / "out", max_steps=2)
    preempt = PreemptionCallback()
    trainer.add_callback(preempt)
    trainer.train()
    assert not preempt.preempted and trainer.state.global_step == 2
    assert signal.getsignal(signal.SIGTERM) == original
    preempt.exit_if_preempted()  # no-op: returns


def test_checkpoint_callback_takes_over_rotation(hf, tmp_path):
    from hfscale.training.callbacks import CheckpointCompleteCallback
    from hfscale.checkpoints.resume import MARKER, checkpoint_problem

    trainer = hf.make_trainer(tmp_path / "out", save_steps=2, save_total_limit=2)
    cb = CheckpointCompleteCallback()
    trainer.add_callback(cb)
    trainer.train()
    out = tmp_path / "out"
    assert cb.marked == [str(out / f"checkpoint-{s}") for s in (2, 4, 6, 7)]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-7"]
    for name in ("checkpoint-6", "checkpoint-7"):
        assert checkpoint_problem(out / name) is None
        marker = json.loads((out / name / MARKER).read_text())
        assert marker["world_size"] == 1 and "model.safetensors" in marker["files"]
    assert trainer.args.save_total_limit == 2  # given back after training


def test_importing_hfscale_resume_does_not_import_torch():
    code = ("import sys, hfscale, hfscale.checkpoints.resume; "
            "print(','.join(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


# ---- 2 ranks, DeepSpeed ZeRO-2, torchrun -----------------------------------------------------------


@pytest.mark.slow
def test_two_rank_deepspeed_metrics_and_straggler(tmp_path_factory):
    ref = trainer_runs.reference(tmp_path_factory)
    res = ref.result
    assert res["world_size"] == 2 and res["global_step"] == 16
    records = read_jsonl(ref.out / "hfscale_metrics.jsonl")
    metrics = [r for r in records if r["event"] == "metrics"]
    stragglers = [r for r in records if r["event"] == "straggler"]
    # Rank 0 alone writes: one record per report, at every 2nd step, in order.
    assert [r["step"] for r in metrics] == list(range(2, 17, 2))
    assert [r["step"] for r in stragglers] == list(range(2, 17, 2))
    for r in metrics:
        assert set(r) == FIELDS
        assert r["world_size"] == 2 and len(r["mem_peak_mb_per_rank"]) == 2
        assert r["mem_peak_mb"] == max(r["mem_peak_mb_per_rank"]) > 50
        assert r["tokens_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 64)
        assert r["samples_per_s"] == pytest.approx(4 * 2 * 2 / (2 * r["step_time_s"]))  # global over both ranks
        assert r["mfu"] is not None and 0 < r["mfu"] < 1
    assert metrics[-1]["eta_s"] == 0 and all(math.isfinite(r["eta_s"]) for r in metrics)
    # Both callbacks gathered on rank 0 exactly once per report: never on the other steps.
    assert res["gathers"] == len(metrics) + len(stragglers)
    # Rank 1 sleeps 100 ms in every forward pass (threshold 1.3; the first window includes warm-up).
    host = socket.gethostname()
    for r in stragglers:
        assert set(r) == STRAGGLER_FIELDS
        assert r["slowest_rank"] == 1 and r["slowest_host"] == host and r["hosts"] == [host, host]
        assert r["forward_s_per_rank"][1] > 0.1 and r["threshold"] == 1.3
        # the median of the ranks other than the slowest: with 2 ranks, the faster one's time
        assert r["median_forward_s"] == pytest.approx(r["forward_s_per_rank"][0])
        assert r["ratio"] == pytest.approx(r["forward_s_per_rank"][1] / r["forward_s_per_rank"][0])
    for r in stragglers[1:]:
        # rank 1 is slower by about its 100 ms sleep; rank 0's own forward time grows on a loaded
        # machine (38.6 ms once, in a CI run sharing its 2 cores), so the gap is what is asserted
        fast, slow = r["forward_s_per_rank"]
        assert r["straggler"] is True and slow - fast > 0.05
    # the warning needs the same rank over the threshold in two reports running (one slow window is in
    # the record only): never at the first report, at every later one here
    running = [r["step"] for before, r in zip(stragglers, stragglers[1:])
               if before["straggler"] and r["straggler"] and before["slowest_rank"] == r["slowest_rank"]]
    assert [int(s) for s in re.findall(r"straggler at step (\d+):", ref.log)] == running
    assert running[0] in (4, 6) and running[1:] == list(range(running[0] + 2, 17, 2))
    assert f"rank 1 on host {host}" in ref.log
    # Wall time per step is the same on both ranks (they wait for each other): why forward time is used.
    assert stragglers[-1]["step_time_s_per_rank"][0] == pytest.approx(stragglers[-1]["step_time_s_per_rank"][1], rel=0.2)
    # log_history (saved in trainer_state.json) holds the metrics, from the same reports.
    state = json.loads((ref.out / "checkpoint-16" / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "hfscale/tokens_per_s" in h]
    assert [h["step"] for h in logged] == list(range(2, 17, 2))
    assert [h["hfscale/tokens_per_s"] for h in logged] == [r["tokens_per_s"] for r in metrics]
    assert all(h["hfscale/slowest_rank"] == 1 for h in state["log_history"] if "hfscale/slowest_rank" in h)


@pytest.mark.slow
def test_two_rank_deepspeed_rotation_keeps_newest_complete(tmp_path_factory):
    from hfscale.checkpoints.resume import checkpoint_problem

    ref = trainer_runs.reference(tmp_path_factory)
    assert ref.result["marked"] == [str(ref.out / f"checkpoint-{s}") for s in (4, 8, 12, 16)]
    assert sorted(p.name for p in ref.out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-16"]
    for name in ("checkpoint-12", "checkpoint-16"):
        assert checkpoint_problem(ref.out / name) is None
    marker = json.loads((ref.out / "checkpoint-16" / "hfscale_complete.json").read_text())
    assert marker["world_size"] == 2 and marker["global_step"] == 16
    assert {"global_step16/zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "global_step16/zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(marker["files"])


_EXIT_SCRIPT = """
import atexit, sys, types
import torch.distributed as dist
from transformers import TrainerControl, TrainerState
import hfscale.training.callbacks as cb

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
# registered first, so it runs last (atexit is LIFO): what is left once every other hook ran
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
callback = getattr(cb, sys.argv[2])()
if sys.argv[3] == "ended":
    args = types.SimpleNamespace(save_total_limit=None, logging_steps=1, output_dir=sys.argv[1] + ".out")
    callback.on_train_begin(args, TrainerState(), TrainerControl())
    callback.on_train_end(args, TrainerState(), TrainerControl())
"""


@pytest.mark.parametrize(
    ("name", "how", "still_initialized"),
    [
        ("MetricsCallback", "ended", False),
        ("StragglerCallback", "ended", False),
        ("PreemptionCallback", "ended", False),
        ("CheckpointCompleteCallback", "ended", False),
        ("MetricsCallback", "raised", True),  # training never ended: the group is left alone
    ],
)
def test_process_group_left_at_exit_after_training_ends(tmp_path, name, how, still_initialized):
    # Gloo groups alive at interpreter finalization can SIGABRT a finished rank (pytorch#190489).
    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "store"), name, how],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == f"initialized at exit: {still_initialized}"


_EXIT_CLEANLY_SCRIPT = """
import atexit, os, sys
import torch.distributed as dist
from hfscale.training.callbacks import exit_cleanly

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
real = dist.destroy_process_group
def spy(*a, **kw):
    real(*a, **kw)
    os.write(1, f"destroyed, still initialized: {dist.is_initialized()}; ".encode())
dist.destroy_process_group = spy
atexit.register(lambda: print("atexit ran", end="; "))  # e.g. wandb finishing its run
print("buffered", end="; ")  # no newline, stdout a pipe: only a flush gets it out
exit_cleanly(3)
"""


def test_exit_cleanly_runs_atexit_hooks_leaves_the_group_and_keeps_the_code(tmp_path):
    out = subprocess.run([sys.executable, "-c", _EXIT_CLEANLY_SCRIPT, str(tmp_path / "store")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr[-3000:]
    assert out.stdout == "buffered; atexit ran; destroyed, still initialized: False; "


_DROPPED_SCRIPT = """
import os
from accelerate import Accelerator
from transformers import TrainerControl, TrainerState
from hfscale.training.callbacks import ProgressCallback

def begin(rank0=True):
    ProgressCallback().on_train_begin(None, TrainerState(is_world_process_zero=rank0), TrainerControl())

begin()  # before any Accelerator: nothing to say
Accelerator()  # what a Trainer makes; on this CPU-only machine accelerate leaves FSDP out
begin()
begin(rank0=False)
del os.environ["ACCELERATE_USE_FSDP"]
begin()
"""


def test_fsdp_dropped_by_accelerate_is_said_once_on_rank_0():
    """accelerate launch sets ACCELERATE_USE_FSDP from an FSDP config, but accelerate builds FSDP on
    GPUs and other accelerators only: on CPU a Trainer trains DDP. Real accelerate here; the rank-0
    warning is what the launch's terminal then shows."""
    env = {**os.environ, "ACCELERATE_USE_FSDP": "true"}
    r = subprocess.run([sys.executable, "-c", _DROPPED_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    said = [line for line in r.stdout.splitlines() if line.startswith("hfscale:")]
    assert said == ["hfscale: warning: distributed.backend is fsdp, but accelerate runs this job as NO (it uses FSDP "
                    "on GPUs and other accelerators only): every rank holds the whole model"], r.stdout


@pytest.mark.parametrize("sharing, data_parallel", [(None, 8), (2, 4), (8, 1)])
def test_metrics_count_each_sample_once_under_tensor_context_or_sequence_parallelism(tmp_path, monkeypatch,
                                                                                       sharing, data_parallel):
    """8 ranks, sp_size (or tp x cp) 2: 4 data-parallel ranks bring samples; the other rank of each
    pair works on the same ones (the Trainer's get_total_train_batch_size counts the same way)."""
    from hfscale.training.callbacks import MetricsCallback
    from hfscale.training.callbacks import collectives

    monkeypatch.setattr(collectives, "all_gather", lambda mine: [[2.0, 2.0, 100.0]] * 8)  # 2 s, 2 steps, 8 ranks
    pc = None if sharing is None else types.SimpleNamespace(non_data_parallel_size=sharing)
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(parallelism_config=pc), log=lambda v: None)
    metrics = MetricsCallback(seq_len=64, peak_flops_per_device=1e12, flops_per_token=1e6, trainer=trainer)
    metrics._window_steps, metrics._flops_per_token = 2, 1e6  # as on_train_begin sets them
    args = types.SimpleNamespace(per_device_train_batch_size=3, gradient_accumulation_steps=5, device=None,
                                 include_num_input_tokens_seen="no", output_dir=str(tmp_path))
    state = types.SimpleNamespace(global_step=2, epoch=0.1, max_steps=10, num_input_tokens_seen=0,
                                  is_world_process_zero=True)
    monkeypatch.setattr(collectives, "peak_memory_mb", lambda device: 100.0)
    metrics._report(args, state)
    r = metrics.last
    assert r["samples_per_s"] == pytest.approx(3 * 5 * data_parallel * 2 / 2)
    assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 64)
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * 1e6 / (8 * 1e12))


def test_the_loss_guard_holds_a_save_inside_a_suspect_run_and_reads_past_skipped_steps(tmp_path):
    """LossGuardCallback on its own (one process, no group): a save due while an outlier is running waits
    for the first ordinary step (a preemption's save does not); a run that reaches the patience stops
    without saving and records the incident; the data positions skip the record's steps."""
    import torch
    from types import SimpleNamespace

    from hfscale.checkpoints.rollbacks import Incident, Rollbacks, read_rollbacks, write_rollbacks
    from hfscale.config.loss_guard import LossGuardConfig
    from hfscale.training.callbacks.loss_guard import LossGuardCallback
    from hfscale.training.loss_guard import LossAlarm

    preempt = SimpleNamespace(stop_step=None, preempted=False)
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[preempt]),
                              training_step=lambda *a: torch.tensor(0.0), state=SimpleNamespace(global_step=0))
    cb = LossGuardCallback(trainer, LossGuardConfig(window=10, warmup=3, patience=2, grad_norm_factor=None))
    args = SimpleNamespace(output_dir=str(tmp_path), fp16=False)

    def step(n: int, loss: float, save: bool = False):
        cb._loss = torch.tensor(loss)  # what the training_step wrapper summed over the step
        control = SimpleNamespace(should_save=save, should_training_stop=False)
        return cb.on_step_end(args, SimpleNamespace(global_step=n), control)

    cb.on_train_begin(args, SimpleNamespace(global_step=0), None)
    for n in range(1, 5):
        assert step(n, 2.0).should_save is False
    assert step(5, 9.0, save=True).should_save is False  # an outlier running: the save waits
    assert step(6, 2.0).should_save is True  # the first ordinary step saves it
    assert step(7, 9.0).should_save is False
    preempt.stop_step, preempt.preempted = 8, True
    assert step(8, 2.0, save=True).should_save is True  # a preemption's save is never held
    step(9, 9.0)
    with pytest.raises(LossAlarm, match="loss spike at step 10"):
        step(10, 9.5, save=True)
    (incident,) = read_rollbacks(tmp_path).incidents
    assert (incident.first_step, incident.action) == (9, "replay")

    write_rollbacks(tmp_path, Rollbacks(incidents=[Incident(n=1, kind="spike", measure="loss", step=5, first_step=4,
                                                            value=9.0, action="skip", skip=(4, 6))]))
    cb.on_train_begin(args, SimpleNamespace(global_step=0), None)
    assert [cb._position(s) for s in (1, 3, 4, 5)] == [1, 3, 7, 8]  # steps 4-6's batches are not trained
