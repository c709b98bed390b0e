"""A corpus of hostile run directories and checkpoints, and the harness that runs hfscale's run
commands over it (tests/test_hostile_runs.py drives both).

Every file hfscale reads back from a run directory or a training output_dir is replaced, one at a
time, by each hostile variant: a FIFO, /dev/zero (a character device), a link out of the directory
to a 0600 file, the file in a 0777 folder, the file owned by another uid, 100,000-deep JSON, wrong
types, NaN, infinities, 1e20, 50 MB, invalid UTF-8, empty and cut in half. Id files get option-like
and shell-like values, the Kubernetes manifest objects hfscale never creates, checkpoints a pickle
that runs a command, and state.json the pid of a real unrelated process (one with "hfscale" in its
argv). Payloads that would run something touch a file in ``markers/``.

The harness (``python hostile_runs.py run FAMILY CASES OUT``) runs the CLI in-process (click's
runner) so that 300 cases take seconds, not the interpreter starts: each command under a 10 s
alarm, its exit code, output and time recorded, and the process's peak RSS at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import sys
import time
import traceback
from pathlib import Path

import yaml

JOB = "20261125-000003-cccccc"
GOOD_JOBS = ("20261125-000001-aaaaaa", "20261125-000002-bbbbbb")
OTHER_UID = 65534  # nobody
BIG = 50 * 2**20
TIMEOUT_S = 10
# export writes a checkpoint's whole weights: CPU work a loaded 2-core machine slows several times (an export
# of the good checkpoint took 10.004 s in one .ci/run); a hostile file that hangs it is still caught at 30 s
EXPORT_TIMEOUT_S = 30


def bound_s(command: str) -> int:
    """The seconds a command of the corpus may take: more is a hang."""
    return EXPORT_TIMEOUT_S if command == "export" else TIMEOUT_S

# file -> (where: run | out | ckpt, its base state, the commands that read it)
RUN_FILES = {
    "state.json": ("run", "finished", ("runs", "status", "logs", "follow", "stop", "report", "export")),
    "progress/metrics.json": ("run", "finished", ("runs", "status")),
    "progress/rank-0": ("run", "finished-nostep", ("runs", "status")),
    "cleanup.json": ("run", "died", ("runs", "status", "stop")),
    "slurm_job_id": ("run", "slurm", ("runs", "status", "stop")),
    "pytorchjob.yaml": ("run", "kubernetes", ("runs", "status", "stop")),
    "logs/local.log": ("run", "finished", ("runs", "status", "logs", "follow")),
    "plan.txt": ("run", "finished", ("runs", "report")),
    "config.yaml": ("run", "finished", ("runs", "report", "export")),
    "hfscale_metrics.jsonl": ("out", "finished", ("report",)),
    "trainer_state.json": ("out", "finished", ("report",)),
    "checkpoint-4/trainer_state.json": ("out", "finished", ("report", "export")),
    "checkpoint-4/hfscale_complete.json": ("out", "finished", ("export",)),
    "checkpoint-4/latest": ("out", "finished", ("export",)),
    "checkpoint-4/config.json": ("out", "finished", ("export",)),
    "checkpoint-4/tokenizer_config.json": ("out", "finished", ("export",)),
    "checkpoint-4/rng_state.pth": ("out", "finished", ("export",)),
    "checkpoint-4/model.safetensors": ("out", "finished", ("export",)),
    "checkpoint-4/model.safetensors.index.json": ("out", "finished", ("export",)),
    "hfscale_rollbacks.json": ("out", "finished", ("report", "export")),  # the loss guard's record
}
WRONG = {"pid": "1", "proc_start": [], "state": 7, "started": "yesterday", "ended": {}, "job_id": 5, "runner": 1,
         "host": ["h"], "step": "4", "max_steps": True, "loss": "low", "event": 1, "global_step": "4",
         "files": ["a"], "argv": "touch x", "env": [], "cwd": 3, "world_size": "2", "weight_map": [1],
         "log_history": {"a": 1}, "time": "now", "exit_code": "0", "model_type": 5}
NUMBERS = ("pid", "proc_start", "started", "ended", "step", "max_steps", "loss", "global_step", "time", "world_size",
           "exit_code", "n_embd", "model_max_length")


def _numbers(value: str) -> str:
    return "{" + ", ".join(f'"{k}": {value}' for k in NUMBERS) + ', "event": "metrics", "state": "running"}'


# variant -> what it does to the file at path p (given its good bytes)
def _fifo(p: Path, good: bytes) -> None:
    p.unlink()
    os.mkfifo(p)


def _devzero(p: Path, good: bytes) -> None:
    p.unlink()
    os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 5))


SECRET = "TOPSECRET-7f3a"  # in every file a link points to: it must never appear in any output


def _link_out(p: Path, good: bytes, secrets: Path) -> None:
    secret = secrets / f"secret-{len(list(secrets.iterdir()))}"
    try:
        doc = json.loads(good)
        data = json.dumps({**doc, "secret": SECRET}).encode() if isinstance(doc, dict) else good + SECRET.encode()
    except ValueError:
        data = good + f"\n{SECRET}\n".encode()
    secret.write_bytes(data)
    secret.chmod(0o600)
    p.unlink()
    p.symlink_to(secret)


def _dir_0777(p: Path, good: bytes) -> None:
    p.parent.chmod(0o777)


def _other_uid(p: Path, good: bytes) -> None:
    os.chown(p, OTHER_UID, OTHER_UID)


def _write(data: bytes):
    def variant(p: Path, good: bytes) -> None:
        p.write_bytes(data)
    return variant


def _big(p: Path, good: bytes) -> None:
    with open(p, "wb") as f:
        f.write(good)
        f.truncate(BIG)  # sparse: 50 MB the reader must not take in


VARIANTS = {
    "fifo": _fifo, "devzero": _devzero, "link_out": None, "dir_0777": _dir_0777, "other_uid": _other_uid,
    "deep_json": _write(b"[" * 100_000), "wrong_types": _write(json.dumps(WRONG).encode()),
    "nan": _write(_numbers("NaN").encode()), "inf": _write(_numbers("Infinity").encode()),
    "-inf": _write(_numbers("-Infinity").encode()),
    "1e20": _write(_numbers("1e20").encode()), "big_int": _write(_numbers("1" + "0" * 5000).encode()),
    "50mb": _big, "bad_utf8": _write(b'{"state": "\xff\xfe running"}\n\xc3\x28'), "empty": _write(b""),
    "half": None,
}


def _tiny_checkpoint(ckpt: Path) -> None:
    """A whole-model Trainer checkpoint of a tiny GPT-2 (safetensors, marker, RNG, optimizer)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from hfscale.checkpoints.resume import write_marker

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32))
    model.save_pretrained(ckpt, safe_serialization=True)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32}))
    state = {"global_step": 4, "max_steps": 4, "num_train_epochs": 1.0,
             "log_history": [{"step": s, "loss": 3.0 - s / 4, "learning_rate": 1e-3, "grad_norm": 1.0} for s in (2, 4)]}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    for name in ("rng_state.pth", "optimizer.pt", "scheduler.pt"):
        torch.save({"x": torch.zeros(2)}, ckpt / name)
    write_marker(ckpt, 4, 1)


def _index(ckpt: Path) -> None:
    """A sharded-model index beside the safetensors file (the checks read it first)."""
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"lm_head.weight": "model.safetensors"}}))


def _run_dir(runs: Path, name: str, job: str, base: str, out: Path, markers: Path, now: float) -> Path:
    run = runs / f"{name}-{job}"
    (run / "logs").mkdir(parents=True)
    (run / "progress").mkdir()
    (run / "plan.txt").write_text(f"# hfscale launch plan: job {job}, runner local\n")
    runner = {"slurm": "slurm", "kubernetes": "kubernetes"}.get(base, "local")
    (run / "config.yaml").write_text(yaml.safe_dump({"name": name, "runner": {"type": runner, "run_dir": str(runs)},
                                                     "training": {"output_dir": str(out)}}))
    (run / "logs" / "local.log").write_text("step 1\nHFSCALE_TRAIN done step=4\n")
    host = socket.gethostname()
    state: dict = {"job_id": job, "runner": runner, "pid": 4_000_000, "proc_start": 1, "host": host, "cwd": str(runs),
                   "started": now - 100, "state": "finished", "ended": now - 50, "exit_code": 0}
    if base == "died":  # a launcher gone: stop runs the recorded cleanup
        state.update(state="running", ended=None, exit_code=None)
    elif base == "elsewhere":
        state.update(state="running", host="login-node-7", ended=None, exit_code=None)
    elif base in ("slurm", "kubernetes"):
        state.update(state="submitted", ended=None)
    (run / "state.json").write_text(json.dumps({k: v for k, v in state.items() if v is not None}))
    if base != "finished-nostep":
        (run / "progress" / "metrics.json").write_text(json.dumps({"step": 4, "max_steps": 4, "loss": 1.5, "time": now}))
    (run / "progress" / "rank-0").write_text(f"4 4000000 {host} 7\n")
    (run / "cleanup.json").write_text(json.dumps({"argv": ["touch", str(markers / f"cleanup-{name}")], "env": {},
                                                  "cwd": None}))
    (run / "cleanup.json").chmod(0o600)
    if base == "slurm":
        (run / "slurm_job_id").write_text("4242\n")
    if base == "kubernetes":
        meta = {"namespace": "ml", "labels": {"hfscale.job": job}}
        docs = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"hfscale-{job}", **meta}},
                {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": f"{name}-{job[-6:]}", **meta},
                 "spec": {"pytorchReplicaSpecs": {}}}]
        (run / "pytorchjob.yaml").write_text(yaml.safe_dump_all(docs))
    return run


def _metrics(out: Path, now: float) -> None:
    lines = [{"event": "metrics", "step": s, "time": now - 60 + s, "world_size": 2, "step_time_s": 0.1,
              "tokens_per_s": 1000.0 + s, "mem_peak_mb_per_rank": [100.0, 101.0], "job": JOB} for s in (2, 4)]
    lines.append({"event": "straggler", "step": 4, "time": now - 55, "world_size": 2, "forward_s_per_rank": [0.1, 0.2],
                  "step_time_s_per_rank": [0.3, 0.3], "hosts": ["a", "b"], "slowest_rank": 1, "slowest_host": "b",
                  "ratio": 2.0, "median_forward_s": 0.1, "threshold": 1.2, "straggler": True, "job": JOB})
    (out / "hfscale_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (out / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": [{"step": 4, "loss": 2.0}]}))


def _case(root: Path, name: str, base: str, template: Path, markers: Path) -> dict:
    """A runs directory with two good runs and the case's run, and the case's output_dir."""
    import shutil

    case = root / name
    runs, out = case / "runs", case / "out"
    runs.mkdir(parents=True)
    shutil.copytree(template, out)
    now = time.time()
    _metrics(out, now)
    for good, job, kind in (("good-a", GOOD_JOBS[0], "finished"), ("good-b", GOOD_JOBS[1], "elsewhere")):
        _run_dir(runs, good, job, kind, out, markers, now)
    run = _run_dir(runs, "case", JOB, base, out, markers, now)
    return {"name": name, "runs": str(runs), "run": run.name, "out": str(out), "good": [f"good-a-{GOOD_JOBS[0]}",
            f"good-b-{GOOD_JOBS[1]}"], "commands": []}


def build(root: Path) -> list[dict]:
    """Make every case under ``root``; the cases as data (what the harness runs)."""
    markers, secrets, template = root / "markers", root / "secrets", root / "template"
    for d in (markers, secrets):
        d.mkdir(parents=True)
    _tiny_checkpoint(template / "checkpoint-4")
    cases = []
    for rel, (where, base, commands) in RUN_FILES.items():
        for vname, variant in VARIANTS.items():
            c = _case(root, f"{rel.replace('/', '_')}--{vname}", base, template, markers)
            if rel == "checkpoint-4/model.safetensors.index.json":
                _index(Path(c["out"]) / "checkpoint-4")
            p = (Path(c["runs"]) / c["run"] if where == "run" else Path(c["out"])) / rel
            if rel == "checkpoint-4/latest":
                p.write_text("global_step4\n")  # a DeepSpeed checkpoint's tag file, then made hostile
            if rel == "hfscale_rollbacks.json":  # a replay that was clean, then made hostile
                p.write_text(json.dumps({"format": 1, "incidents": [
                    {"n": 1, "kind": "nan", "measure": "loss", "step": 3, "first_step": 3, "value": None,
                     "action": "replay", "outcome": "clean", "hosts": ["node1"], "at": 1.7e9}]}))
            if where == "out" and rel.startswith("checkpoint-4/") and rel != "checkpoint-4/hfscale_complete.json":
                (p.parent / "hfscale_complete.json").unlink()  # judged by its own files: every reader runs
            good = p.read_bytes() if p.exists() else b"{}"
            if vname == "link_out":
                _link_out(p, good, secrets)
            elif vname == "half":
                p.write_bytes(good[: len(good) // 2])
            else:
                variant(p, good)
            c["file"], c["variant"] = rel, vname
            c["commands"] = list(commands)
            cases.append(c)
    cases += _id_cases(root, template, markers)
    cases += _pickle_cases(root, template, markers)
    return cases


SLURM_IDS = {"option": "--me", "option2": "-u root", "shell": "1; touch {m}", "subst": "$(touch {m})",
             "space": "1 2", "empty": "", "hex": "0x1f", "newline": "4242\n--me", "huge": "9" * 40}
MANIFESTS = {
    "namespace": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml", "namespace": "ml",
                                                                          "labels": {"hfscale.job": JOB}}}],
    "other_label": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "theirs", "namespace": "ml",
                                                                            "labels": {"hfscale.job": "someone-else"}}}],
    "bad_name": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "$(touch {m})", "namespace": "ml",
                                                                         "labels": {"hfscale.job": JOB}}}],
    "option_name": [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "--all", "namespace": "ml",
                                                                         "labels": {"hfscale.job": JOB}}}],
    "list_kind": [{"apiVersion": ["v1"], "kind": {"a": 1}, "metadata": {"name": "x", "namespace": "ml",
                                                                         "labels": {"hfscale.job": JOB}}}],
    "all_namespaces": [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x", "namespace": "--all-namespaces",
                                                                           "labels": {"hfscale.job": JOB}}}],
}


def _id_cases(root: Path, template: Path, markers: Path) -> list[dict]:
    cases = []
    for label, value in SLURM_IDS.items():
        c = _case(root, f"slurm_job_id--id_{label}", "slurm", template, markers)
        (Path(c["runs"]) / c["run"] / "slurm_job_id").write_text(value.format(m=markers / f"slurm-{label}"))
        c.update(file="slurm_job_id", variant=label, commands=["runs", "status", "stop"])
        cases.append(c)
    control = _case(root, "slurm_job_id--control", "slurm", template, markers)
    control.update(file="slurm_job_id", variant="control", commands=["status", "stop"])
    cases.append(control)
    for label, docs in MANIFESTS.items():
        c = _case(root, f"pytorchjob.yaml--objects_{label}", "kubernetes", template, markers)
        text = yaml.safe_dump_all(docs).replace("{m}", str(markers / f"k8s-{label}"))
        (Path(c["runs"]) / c["run"] / "pytorchjob.yaml").write_text(text)
        c.update(file="pytorchjob.yaml", variant=label, commands=["stop"])
        cases.append(c)
    alias_bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{k}: &{k} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, k in zip("abcdefgh", "bcdefghi"))
    c = _case(root, "pytorchjob.yaml--alias_bomb", "kubernetes", template, markers)
    (Path(c["runs"]) / c["run"] / "pytorchjob.yaml").write_text(alias_bomb)
    c.update(file="pytorchjob.yaml", variant="alias_bomb", commands=["stop"])
    cases.append(c)
    control = _case(root, "pytorchjob.yaml--control", "kubernetes", template, markers)
    control.update(file="pytorchjob.yaml", variant="control", commands=["stop"])
    cases.append(control)
    nul = json.dumps({"argv": ["touch\u0000", str(markers / "nul")], "env": {"A": "x\u0000"}, "cwd": None})
    for label, how in (("mode_0666", lambda p: p.chmod(0o666)), ("dir_other_uid", lambda p: os.chown(p.parent, OTHER_UID, -1)),
                       ("runs_dir_0777", lambda p: p.parent.parent.chmod(0o777)), ("nul", lambda p: p.write_text(nul))):
        c = _case(root, f"cleanup.json--{label}", "died", template, markers)
        how(Path(c["runs"]) / c["run"] / "cleanup.json")
        c.update(file="cleanup.json", variant=label, commands=["stop"])
        cases.append(c)
    control = _case(root, "cleanup.json--control", "died", template, markers)
    control.update(file="cleanup.json", variant="control", commands=["stop"])
    cases.append(control)
    cases += _dir_cases(root, template, markers)
    return cases


ESCAPE = "\x1b]0;pwned\x07\x1b[31mEVIL"  # sets a terminal's title, turns its text red


def _dir_cases(root: Path, template: Path, markers: Path) -> list[dict]:
    """A run directory whose name holds terminal escape sequences, and ones whose logs/ and
    progress/ are links to a folder outside (holding what must not be shown)."""
    cases = []
    c = _case(root, "name--escape", "finished", template, markers)
    run = Path(c["runs"]) / c["run"]
    named = run.with_name(f"{ESCAPE}-{JOB}")
    run.rename(named)
    c.update(run=named.name, file="<run directory name>", variant="escape", commands=["runs", "status", "logs", "stop"])
    cases.append(c)
    for folder, inside in (("logs", "local.log"), ("progress", "rank-0")):
        c = _case(root, f"{folder}--dir_link", "finished-nostep", template, markers)
        run = Path(c["runs"]) / c["run"]
        outside = root / "secrets" / f"dir-{folder}"
        outside.mkdir()
        (outside / inside).write_text(f"9 1 host 1 {SECRET}\n" if folder == "progress" else f"{SECRET}\n")
        for f in (run / folder).iterdir():
            f.unlink()
        (run / folder).rmdir()
        (run / folder).symlink_to(outside)
        c.update(file=f"{folder}/", variant="dir_link", commands=["runs", "status", "logs", "follow"])
        cases.append(c)
    return cases


class _Evil:
    """Unpickling this runs a command (what a crafted checkpoint does to a torch.load that is not
    weights_only)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickle_cases(root: Path, template: Path, markers: Path) -> list[dict]:
    """Checkpoints whose pickles run a command when loaded unsafely: a DeepSpeed ZeRO-shaped one, a
    pytorch_model.bin, and an FSDP (DCP) folder owned by another uid."""
    import pickle

    import torch

    def unmarked(name: str, file: str, variant: str) -> tuple[dict, Path]:
        """A case whose checkpoint is judged by its own files (no marker), and that checkpoint."""
        c = _case(root, f"checkpoint--{name}", "finished", template, markers)
        c.update(file=file, variant=variant, commands=["export"])
        ckpt = Path(c["out"]) / "checkpoint-4"
        (ckpt / "hfscale_complete.json").unlink()
        return c, ckpt

    zero, ckpt = unmarked("zero_pickle", "checkpoint/global_step4", "pickle_runs_code")
    (ckpt / "global_step4").mkdir()
    (ckpt / "latest").write_text("global_step4")
    evil = _Evil(str(markers / "zero_pickle"))
    torch.save({"ds_config": {"zero_optimization": {"stage": evil}}, "module": {}},
               ckpt / "global_step4" / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": evil}, ckpt / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    whole, ckpt = unmarked("bin_pickle", "checkpoint/pytorch_model.bin", "pickle_runs_code")
    (ckpt / "model.safetensors").unlink()
    torch.save({"lm_head.weight": _Evil(str(markers / "bin_pickle"))}, ckpt / "pytorch_model.bin")
    dcp, ckpt = unmarked("dcp_other_uid", "checkpoint/pytorch_model_fsdp_0/.metadata", "pickle_other_uid")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model_fsdp_0").mkdir()
    (ckpt / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(_Evil(str(markers / "dcp_pickle"))))
    (ckpt / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"\0" * 16)
    os.chown(ckpt / "pytorch_model_fsdp_0" / ".metadata", OTHER_UID, OTHER_UID)
    return [zero, whole, dcp]


# ---- the harness ------------------------------------------------------------------------------

def argv_of(command: str, c: dict, scratch: Path) -> list[str]:
    ref = ["--runs-dir", c["runs"]]
    return {"runs": ["runs", c["runs"]], "status": ["status", c["run"], *ref], "logs": ["logs", c["run"], *ref],
            "follow": ["logs", c["run"], *ref, "--follow"], "stop": ["stop", c["run"], *ref],
            "report": ["report", c["run"], *ref, "--out", str(scratch / f"{c['name']}.html")],
            "export": ["export", c["run"], *ref, "--out", str(scratch / f"export-{c['name']}")]}[command]


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout("over its bound")


def run_family(family: list[str], cases: list[dict], scratch: Path) -> dict:
    """Run the commands of ``family`` on every case; per command: exit code, seconds, output tail,
    an exception that escaped (a traceback), and the peak RSS so far."""
    from click.testing import CliRunner

    from hfscale.cli.commands import main

    # what the commands import, imported before the clock starts: the bound is for what a hostile file can do,
    # not for importing torch or matplotlib (several seconds on a loaded machine: the first report, of
    # the corpus's first case, took 10.07 s in one .ci/run, the next ones 1-4 s)
    import hfscale.runs.registry  # noqa: F401
    import hfscale.runs.status  # noqa: F401
    import hfscale.runs.stop  # noqa: F401
    if "report" in family:
        import matplotlib.figure  # noqa: F401
        import matplotlib.ticker  # noqa: F401

        import hfscale.runs.report  # noqa: F401
    if "export" in family:
        import deepspeed.utils.zero_to_fp32  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
        import transformers  # noqa: F401

        import hfscale.checkpoints.export  # noqa: F401
    signal.signal(signal.SIGALRM, _alarm)
    runner = CliRunner()
    results = []
    for c in cases:
        for command in c["commands"]:
            if command not in family:
                continue
            argv = argv_of(command, c, scratch)
            t0 = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, bound_s(command))
            try:
                r = runner.invoke(main, argv, catch_exceptions=True)
                rc, out = r.exit_code, r.output
                escaped = None if r.exception is None or isinstance(r.exception, SystemExit) else \
                    "".join(traceback.format_exception(r.exception))[-2000:]
            except _Timeout as e:  # raised outside the command's own handlers
                rc, out, escaped = -1, "", f"timeout: {e}"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            took = time.monotonic() - t0
            if escaped and "_Timeout" in escaped:
                escaped = f"timeout: over {bound_s(command)} s"
            results.append({"case": c["name"], "command": command, "rc": rc, "seconds": round(took, 3),
                            "output": out[-3000:], "escaped": escaped, "rss_mb": peak_rss_mb()})
    return {"results": results, "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: ru_maxrss would carry the parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


if __name__ == "__main__":  # run FAMILY(comma-separated) CASES_JSON OUT_JSON SCRATCH
    _, verb, family, cases_file, out_file, scratch = sys.argv
    assert verb == "run"
    res = run_family(family.split(","), json.loads(Path(cases_file).read_text()), Path(scratch))
    Path(out_file).write_text(json.dumps(res))
