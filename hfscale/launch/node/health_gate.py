"""The health gate every node passes before its ranks start: the node line runs it after
``runner.setup`` at each launch and relaunch (hfscale.launch.node.line.prelude, and a Slurm step's
line), so a sick host is kept out however it came in: at the first launch, at a relaunch, or as a
spare that had passed an earlier probe.

It runs the built-in GPU checks (hfscale.launch.node.health_checks: nvidia-smi's answers) and the
site's own ``recovery.health_check`` (``sh -c``, bounded by its timeout, its output into the host's
log). A failing node prints ``hfscale: health gate failed: <why>`` and exits ``UNHEALTHY`` (69) without
starting a rank; the supervisor counts it against the host (cause ``unhealthy``: a spare takes its
place, or it is left out as recovery allows) and status and the timeline say why. Standard library
only, and quick: it runs on every node of every attempt.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from hfscale.core import exitcodes
from hfscale.launch.node.health_checks import (GPU_QUERY, NVIDIA_SMI_TIMEOUT_S, REMAP_QUERY, Answer, judge,
                                               nvidia_smi_hung, site_problem)

if TYPE_CHECKING:
    from hfscale.config.health import HealthCheckConfig

MODULE = "hfscale.launch.node.health_gate"
MARK = "hfscale: health gate failed:"
OUTPUT_MAX = 64 * 1024  # of a site check's output, kept for the log


def gate_argv(python: str, slots: int, check: HealthCheckConfig | None) -> list[str]:
    """The node line's call of the gate (the site's command quoted as one argument, never shell code here)."""
    argv = [python, "-m", MODULE, "--slots", str(slots)]
    return argv + (["--timeout", str(check.timeout), "--", check.command] if check else [])


def gate_verdict(lines: list[str]) -> str | None:
    """Why the gate kept a node out, from its log's lines (the last verdict; None: it said none)."""
    for line in reversed(lines):
        at = line.find(MARK)
        if at >= 0:
            return line[at + len(MARK):].strip()[:1000] or None
    return None


def _run(argv: list[str], timeout: float) -> tuple[Answer, bool]:
    """(its answer, whether it was killed at ``timeout``); its own session, so a timeout kills all it started."""
    try:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    except OSError as e:
        return Answer(127, f"{argv[0]}: {e.strerror or e}"), False
    try:
        out, _ = p.communicate(timeout=timeout)
        return Answer(p.returncode, out[-OUTPUT_MAX:].decode("utf-8", "replace")), False
    except subprocess.TimeoutExpired:
        try:
            # p is this process's own child, not yet reaped, so its pid is not reused; started in a session of
            # its own, that pid is its process group's id: the group is the check and what it started
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = p.communicate()
        return Answer(None, out[-OUTPUT_MAX:].decode("utf-8", "replace")), True


def problems(slots: int, command: str | None, timeout: int) -> list[str]:
    """Why this node must not train (empty: healthy); the site check's output is printed as it came."""
    found: list[str] = []
    if shutil.which("nvidia-smi") is not None:
        gpus, hung = _run(list(GPU_QUERY), NVIDIA_SMI_TIMEOUT_S)
        if hung:
            found.append(nvidia_smi_hung())
        else:
            remap = _run(list(REMAP_QUERY), NVIDIA_SMI_TIMEOUT_S)[0] if gpus.rc == 0 else Answer(None)
            found += judge(gpus, remap, slots).problems
    if command:
        site, hung = _run(["sh", "-c", command], timeout)
        if site.out:
            sys.stdout.write(site.out if site.out.endswith("\n") else site.out + "\n")
        if (problem := site_problem(site, timeout, hung)) is not None:
            found.append(problem)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=MODULE, description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--timeout", type=int, default=60)
    parser.add_argument("command", nargs="?")
    args = parser.parse_args(argv)
    found = problems(args.slots, args.command, args.timeout)
    if found:
        print(f"{MARK} {'; '.join(found)}"[:2000], flush=True)
        return exitcodes.UNHEALTHY
    return 0


if __name__ == "__main__":
    sys.exit(main())
