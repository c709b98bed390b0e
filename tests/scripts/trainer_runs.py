"""Start ``trainer_run.py`` the way users do (torchrun as ``hfscale launch`` starts it, its ranks forked warm by
hfscale.training.warm_launcher; or plain python), watch it, read its result.

Shared by tests/test_callbacks.py and tests/test_resume.py. ``reference()`` runs the uninterrupted
2-rank DeepSpeed ZeRO-2 job once per pytest session; the other runs compare against it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).with_name("trainer_run.py")
RESULT_PREFIX = "HFSCALE_RESULT "

# The uninterrupted job every resumed job must match exactly (same seed, steps, schedule).
# Rank 1 sleeps 100 ms in each forward pass: a straggler on purpose (does not change the numbers); 100 ms, not
# 30: on a loaded CI machine rank 0's own forward took 38.6 ms once, and the ratio must stay above 1.3.
COMMON = ["--max-steps", "16", "--save-steps", "4", "--logging-steps", "2", "--deepspeed", "2", "--seed", "1234"]
REFERENCE_ARGS = [*COMMON, "--save-total-limit", "2", "--slow-rank", "1", "--slow-seconds", "0.1",
                  "--straggler-threshold", "1.3"]


@dataclass
class Run:
    rc: int
    log: str
    out: Path
    pid_dir: Path
    seconds: float

    @property
    def result(self) -> dict:
        lines = [ln for ln in self.log.splitlines() if ln.startswith(RESULT_PREFIX)]
        assert len(lines) == 1, f"expected one result line (rank 0 only), got {len(lines)}:\n{self.tail()}"
        return json.loads(lines[0][len(RESULT_PREFIX):])

    def exit_codes(self, world: int = 2) -> list[str]:
        return [(self.pid_dir / f"rank{r}.exit").read_text() for r in range(world)]

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])


class Job:
    """A started job in its own session (process group), with its output going to a log file."""

    def __init__(self, out: Path, args: list[str], nproc: int = 2, max_restarts: int = 0,
                 env: dict[str, str] | None = None) -> None:
        self.out = Path(out)
        self.pid_dir = self.out.parent / (self.out.name + ".pids")
        self.log_path = self.out.parent / (self.out.name + ".log")
        script = [str(SCRIPT), "--output-dir", str(self.out), "--pid-dir", str(self.pid_dir), *args]
        if nproc:
            cmd = [sys.executable, "-m", "hfscale.training.warm_launcher", "--preload", "trainer,deepspeed",
                   "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   "--max-restarts", str(max_restarts), *script]
        else:
            cmd = [sys.executable, *script]
        self.t0 = time.monotonic()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for(self, path: Path, timeout: float = 120) -> None:
        """Wait until ``path`` exists (the job must still be running)."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended (rc {self.proc.returncode}) before {path} appeared:\n"
                                     + self.log_path.read_text()[-6000:])
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{path} did not appear in {timeout} s")
            time.sleep(0.02)

    def pid(self, rank: int) -> int:
        return int((self.pid_dir / f"rank{rank}.pid").read_text())

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def finish(self, timeout: float = 240) -> Run:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not end in {timeout} s:\n" + self.log_path.read_text()[-6000:]) from None
        finally:
            if self.proc.poll() is None:
                self.kill()
        return Run(rc, self.log_path.read_text(), self.out, self.pid_dir, time.monotonic() - self.t0)


def run(out: Path, args: list[str], nproc: int = 2, **kw) -> Run:
    return Job(out, args, nproc=nproc, **kw).finish()


_MEMO: dict[str, Run] = {}


def reference(tmp_path_factory) -> Run:
    """The uninterrupted 2-rank ZeRO-2 run, once per session."""
    if "reference" not in _MEMO:
        r = run(tmp_path_factory.mktemp("reference") / "out", REFERENCE_ARGS)
        assert r.rc == 0, r.tail()
        _MEMO["reference"] = r
    return _MEMO["reference"]
