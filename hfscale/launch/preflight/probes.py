"""Preflight: what to ask every host before a launch, and what the answers mean (pure, but for
``local_need``, which reads the output_dir's newest checkpoint for its size).

``probes`` builds one ssh command per host (a local shell for one local node); ``evaluate``
turns their outputs into a table and a list of failures naming each host. Running the probes
is ``hfscale.launch.attempt.execute.run_probes``' job.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hfscale.checkpoints.local_room import size_text, step_need
from hfscale.config.base import size_bytes
from hfscale.config.envvars import RDMA_PRESETS
from hfscale.core.shell import Command, Ran, render, words
from hfscale.launch.node.reach import reach_argv
from hfscale.rules.resolved import Job

PACKAGES = ("torch", "transformers", "deepspeed", "accelerate")
MARK = "HFSCALE_PROBE"


def nccl_interface(job: Job) -> str | None:
    """The interface prefix NCCL_SOCKET_IFNAME selects, when it names one (not '^lo,docker0', not a list)."""
    from hfscale.config.envvars import job_env

    value = job_env(job.config, {}).get("NCCL_SOCKET_IFNAME")
    if value and re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", value):
        return value
    return None


# the local tier's folder on the host (training.local_checkpoints.dir): made if missing, a small file written
# and removed there, then the bytes free; ``local=unwritable:<why>`` when the write fails. The ranks' own check
# (hfscale.checkpoints.local_room.short_of_room), spelt in the standard library: it runs before the host is known
# to have hfscale
LOCAL_ROOM = (
    "import os, sys\n"
    "d = sys.argv[1]; f = os.path.join(d, '.hfscale-room.%d' % os.getpid())\n"
    "try:\n"
    "    os.makedirs(d, exist_ok=True)\n"
    "    with open(f, 'wb') as fd: fd.write(bytes(4096)); fd.flush(); os.fsync(fd.fileno())\n"
    "    st = os.statvfs(d); print('local=%d' % (st.f_bavail * st.f_frsize))\n"
    "except OSError as e: print('local=unwritable:' + (e.strerror or str(e)).replace(chr(10), ' '))\n"
    "finally:\n"
    "    try: os.unlink(f)\n"
    "    except OSError: pass\n"
)


def local_folder(job: Job, host: str) -> str | None:
    """``host``'s folder of the local tier (``{host}`` replaced), or None without one."""
    local = job.config.training.local_checkpoints
    return None if local is None else local.dir.replace("{host}", host)


LISTED = ("gpuq", "remap", "health")  # keys said once a line (nvidia-smi's rows, the site check's last lines)
LISTED_MAX = 1024


def _answer_lines(key: str, argv: list[str], timeout: int, last: int = LISTED_MAX) -> str:
    """``o=$(timeout T argv 2>&1); echo key_rc=$?; <its last lines, each as key=line>`` (argv quoted)."""
    from hfscale.launch.node.health_checks import KILL_GRACE_S

    return (f"o=$(timeout -k {KILL_GRACE_S} {timeout} {render(words(argv))} 2>&1); echo {key}_rc=$?; "
            f"printf '%s\\n' \"$o\" | tail -n {last} | sed 's/^/{key}=/'")


def health_lines(job: Job) -> list[str]:
    """The probe's part of the health gate (hfscale.launch.node.health_gate runs the same on each node
    before its ranks start): nvidia-smi's GPU and row-remapping answers, and the site's check."""
    from hfscale.launch.node.health_checks import GPU_QUERY, NVIDIA_SMI_TIMEOUT_S as T, REMAP_QUERY

    gpu = (f"if command -v nvidia-smi >/dev/null 2>&1; then {_answer_lines('gpuq', list(GPU_QUERY), T)}; "
           f"{_answer_lines('remap', list(REMAP_QUERY), T)}; fi")
    check = job.config.recovery.health_check
    return [gpu] + ([_answer_lines("health", ["sh", "-c", check.command], check.timeout, 20)] if check else [])


def bound_s(job: Job, timeout: float) -> float:
    """A probe's bound: ``timeout`` for ssh and the facts, plus what the health checks may take at their
    own bounds (a site check of 60 s must not be cut by a 30 s probe and read as an unreachable host)."""
    from hfscale.launch.node.health_checks import budget_s

    check = job.config.recovery.health_check
    return timeout + budget_s(check.timeout if check else None)


def _script(python: str, port: int | None, interface: str | None = None, local: str | None = None,
            health: tuple[str, ...] = ()) -> str:
    versions = (
        "import importlib.metadata as m, sys\n"
        "print('python=' + sys.version.split()[0])\n"
        f"for p in {PACKAGES!r}:\n"
        "    try: print(p + '=' + m.version(p))\n"
        "    except m.PackageNotFoundError: print(p + '=missing')\n"
    )
    lines = [
        f"echo {MARK}",
        f"{render(words([python, '-c', versions]))} || echo python=missing",
        "if command -v nvidia-smi >/dev/null 2>&1; then echo gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); "
        "echo gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | sort -n | "
        "head -1); else echo gpus=none; fi",
        "echo ib=$(ls /sys/class/infiniband 2>/dev/null | tr '\\n' ',')",
    ]
    if interface is not None:  # validated: letters, digits, '_', '.', '-'
        lines.append(f"echo addr=$(ip -o -4 addr show 2>/dev/null | awk '$2 ~ /^{interface}/ "
                     "{sub(\"/.*\", \"\", $4); print $4; exit}')")
    if local is not None:  # quoted as one argument: the path never reaches the shell as code
        lines.append(f"{render(words([python, '-c', LOCAL_ROOM, local]))} 2>/dev/null || echo local=unknown")
    if port is not None:
        bind = f"import socket; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('', {port}))"
        # without a working interpreter nothing can be said about the port (not "in use")
        lines.append(f"if {render(words([python, '-c', 'pass']))} 2>/dev/null; then "
                     f"{render(words([python, '-c', bind]))} 2>/dev/null && echo port=free || echo port=busy; "
                     "else echo port=unknown; fi")
    return "; ".join(lines + list(health))


def refusal(job: Job) -> str | None:
    """Why preflight cannot check this job's hosts, or None."""
    if job.scheduled:
        return (f"preflight checks hosts over ssh; with runner {job.config.runner.type} the scheduler picks the "
                "nodes (use its own tools, e.g. sinfo or kubectl get nodes)")
    return None


def probes(job: Job, python: str) -> dict[str, Command]:
    """Two probes per host: ``host`` (facts) and ``host/shell`` (a bare ``true``, whose output
    must be empty: a chatty login shell breaks pdsh and scp). The hosts of a Slurm allocation
    (hfscale.launch.runners.slurm_step) are probed by an ``srun`` step on each, not ssh."""
    py = job.config.runner.python or python
    port = job.config.cluster.master_port
    interface = nccl_interface(job)
    health = tuple(health_lines(job))
    if not job.hosts:
        return {"local": Command(("sh", "-c", _script(py, port, interface, local_folder(job, socket.gethostname()),
                                                      health)))}
    out = {}
    for i, h in enumerate(job.hosts):  # a Slurm allocation's hosts: a step on the host, not ssh
        ssh = reach_argv(job, h.host)
        out[h.host] = Command(tuple(ssh + [_script(py, port if i == 0 else None, interface,
                                                   local_folder(job, h.host), health)]))
        out[f"{h.host}/shell"] = Command(tuple(ssh + ["true"]))
    return out


Port = Literal["free", "busy", "unknown"]  # unknown: no interpreter to try it with


@dataclass(frozen=True)
class HostFacts:
    """What one host answered (its probe prints ``key=value`` lines after MARK). None: not said."""

    versions: dict[str, str | None] = field(default_factory=dict)  # python and PACKAGES; None: not installed
    nvidia_smi: bool | None = None  # whether the host has nvidia-smi
    gpus: int | None = None
    gpu_mib: int | None = None  # the smallest GPU's memory
    ib: tuple[str, ...] | None = None  # the InfiniBand devices
    addr: str | None = None  # the address of NCCL_SOCKET_IFNAME's interface
    port: Port | None = None  # the master port, asked on the first host only
    local_free: int | None = None  # bytes free in the local tier's folder (asked with training.local_checkpoints)
    local_unwritable: str | None = None  # why nothing could be written there
    said: dict[str, tuple[str, ...]] = field(default_factory=dict)  # LISTED keys: their lines; "<key>_rc": its code

    @staticmethod
    def read(stdout: str) -> HostFacts | None:
        """The facts in a probe's output, or None when it printed none."""
        said: dict[str, str] = {}
        listed: dict[str, list[str]] = {}
        seen = False
        for line in stdout.splitlines():
            if line.strip() == MARK:
                seen = True
                continue
            if seen and "=" in line:
                k, v = line.split("=", 1)
                if k.strip() in LISTED:
                    if len(listed.setdefault(k.strip(), [])) < LISTED_MAX:
                        listed[k.strip()].append(v.rstrip())
                else:
                    said[k.strip()] = v.strip()
        if not said:
            return None
        number = (lambda v: int(v) if v is not None and v.isdigit() else None)
        port = said.get("port")
        local = said.get("local", "")
        return HostFacts(
            said={**{k: tuple(v) for k, v in listed.items()},
                  **{k: (said[k],) for k in (f"{key}_rc" for key in LISTED) if k in said}},
            local_free=number(local),
            local_unwritable=(local.split(":", 1)[1][:200] or "?") if local.startswith("unwritable:") else None,
            versions={k: (None if said[k] == "missing" else said[k]) for k in ("python", *PACKAGES) if k in said},
            nvidia_smi=None if "gpus" not in said else said["gpus"] != "none",
            gpus=number(said.get("gpus")), gpu_mib=number(said.get("gpu_mib")),
            ib=None if "ib" not in said else tuple(d for d in said["ib"].split(",") if d),
            addr=said.get("addr") or None, port=port if port in ("free", "busy", "unknown") else None)  # type: ignore[arg-type]

    def version(self, key: str) -> str | None:
        """A version as the table shows it: the version, "missing", or None when not said."""
        if key not in self.versions:
            return None
        return self.versions[key] or "missing"

    def cell(self, column: str) -> str:
        """The table cell of ``column`` ("-" where the host said nothing)."""
        if column in ("python", *PACKAGES):
            return self.version(column) or "-"
        if column == "gpus":
            return "none" if self.nvidia_smi is False else "-" if self.gpus is None else str(self.gpus)
        value = {"gpu_mib": self.gpu_mib, "ib": ",".join(self.ib or ()), "port": self.port}[column]
        return str(value) if value not in (None, "") else "-"


@dataclass(frozen=True)
class HostReport:
    host: str
    facts: HostFacts
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()  # said, and the host admitted: a local folder without room


def local_need(job: Job) -> int:
    """About the bytes a local step takes on a node (hfscale.checkpoints.local_tier.step_need, from
    the output_dir's newest complete checkpoint: reads it); 0 without a local tier or a checkpoint."""
    local = job.config.training.local_checkpoints
    if local is None:
        return 0
    from hfscale.checkpoints.resume import latest_checkpoint

    durable = latest_checkpoint(job.config.training.output_dir)
    return step_need(Path(durable) if durable else None, max(1, job.num_nodes), local.buddy)


def local_note(job: Job, host: str, facts: HostFacts, need: int) -> str | None:
    """The note on ``host``'s local tier folder when it cannot be written or has less than ``need``
    bytes free. Such a host is admitted: a full local disk is a reason to skip local steps (the ranks
    say so and resume them when there is room), never to keep a host out or strike it."""
    folder = local_folder(job, host)
    if folder is None:
        return None
    if facts.local_unwritable is not None:
        why = f"cannot be written ({facts.local_unwritable})"
    elif facts.local_free is not None and facts.local_free < need:
        why = f"has {size_text(facts.local_free)} free, a local step needs about {size_text(need)} there"
    else:
        return None
    return (f"local checkpoint folder {folder} {why}: admitted; local steps are skipped while it has no room, "
            "the durable tier carries the job")


def health_problems(job: Job, facts: HostFacts) -> list[str]:
    """The health gate's verdict on a probed host (as hfscale.launch.node.health_gate words it on a node):
    nvidia-smi's answers, where it is present (the GPU count against the slots is ``evaluate``'s), and
    the site's ``recovery.health_check``."""
    from hfscale.launch.node.health_checks import Answer, judge, nvidia_smi_hung, site_problem

    def answer(key: str) -> Answer:
        rc = facts.said.get(f"{key}_rc", ("",))[0]
        return Answer(int(rc), "\n".join(facts.said.get(key, ()))) if rc.isdigit() else Answer(None)

    timed_out = (124, 137)  # coreutils timeout: TERM at the bound, KILL after the grace
    out: list[str] = []
    gpus = answer("gpuq")
    if gpus.rc in timed_out:
        out.append(nvidia_smi_hung())
    elif gpus.rc is not None:
        out += judge(gpus, answer("remap"), 0).problems
    check = job.config.recovery.health_check
    if check is not None:
        site = answer("health")
        if (problem := site_problem(site, check.timeout, site.rc in timed_out)) is not None:
            out.append(problem)
    return out


def evaluate(job: Job, results: dict[str, Ran], local_need: int = 0) -> list[HostReport]:
    """One report per host, each problem phrased so the host and the fix are clear. ``local_need``:
    the bytes a local step takes on a node (``step_need``), 0 when not known: the local folder is then
    only written to."""
    hosts = [h.host for h in job.hosts] or ["local"]
    slots = {h.host: h.slots for h in job.hosts} or {"local": job.procs_per_node}
    reports: list[HostReport] = []
    reference: HostFacts | None = None
    for i, host in enumerate(hosts):
        rc, out, err = results[host]
        problems: list[str] = []
        facts = HostFacts.read(out)
        if rc != 0 or facts is None:
            why = (err.strip().splitlines() or [f"exit code {rc}"])[-1]
            reports.append(HostReport(host, HostFacts(), (f"unreachable: {why}" if rc == 255 or rc == 124 else f"probe failed: {why}",)))
            continue
        shell = results.get(f"{host}/shell")
        if shell is not None:
            src, sout, serr = shell
            if src != 0:
                problems.append(f"'ssh {host} true' failed: {(serr.strip().splitlines() or [str(src)])[-1]}")
            elif sout.strip() or serr.strip():
                text = (sout.strip() or serr.strip()).splitlines()[0][:60]
                problems.append(f"login shell prints output for non-interactive commands ({text!r}); "
                                "silence it in the remote shell's rc files")
        if facts.version("python") == "missing":
            problems.append(f"python interpreter not found: {job.config.runner.python or 'hfscale default'}")
        for p in PACKAGES:
            if facts.version(p) == "missing":
                problems.append(f"{p} is not installed")
        if reference is None:
            reference = facts
        else:
            for k in ("python",) + PACKAGES:
                if facts.version(k) != reference.version(k) and facts.version(k) != "missing":
                    problems.append(f"{k} {facts.version(k)} differs from {hosts[0]}'s {reference.version(k)}")
        gpus = facts.gpus
        if facts.nvidia_smi and gpus is not None and gpus < slots[host]:
            problems.append(f"{slots[host]} slots but only {gpus} GPUs")
        mib = facts.gpu_mib
        want = job.config.cluster.gpu_memory
        if want is not None and mib is not None and mib * 2**20 < size_bytes(want):
            problems.append(f"its smallest GPU has {mib} MiB, less than cluster.gpu_memory {want} (what check and "
                            "plan judge the job against)")
        if job.config.network.preset in RDMA_PRESETS and not facts.ib:
            problems.append(f"no InfiniBand devices in /sys/class/infiniband (network preset {job.config.network.preset})")
        if i == 0 and facts.port == "busy":
            problems.append(f"master port {job.config.cluster.master_port} is already in use")
        problems += health_problems(job, facts)
        note = local_note(job, host, facts, local_need)
        reports.append(HostReport(host, facts, tuple(problems), (note,) if note else ()))
    return reports


def render_table(reports: list[HostReport]) -> str:
    """The per-host table people read before a launch."""
    cols = ["python", *PACKAGES, "gpus", "gpu_mib", "ib", "port"]
    rows = [["host", *cols, "status"]]
    for r in reports:
        status = "ok" if not r.problems else "FAIL"
        rows.append([r.host, *[r.facts.cell(c) for c in cols], status])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for r in reports:
        lines += [f"{r.host}: {p}" for p in r.problems] + [f"{r.host}: note: {n}" for n in r.notes]
    return "\n".join(lines) + "\n"


def gpu_memory_hint(job: Job, reports: list[HostReport]) -> str | None:
    """The smallest GPU memory the hosts reported, as a line suggesting cluster.gpu_memory when unset."""
    sizes = [r.facts.gpu_mib for r in reports if r.facts.gpu_mib is not None]
    if not sizes or job.config.cluster.gpu_memory is not None:
        return None
    return (f"smallest GPU: {min(sizes)} MiB; set cluster.gpu_memory: {min(sizes)}MiB for check's and plan's "
            "verdict on whether the job fits")


def verdict(reports: list[HostReport]) -> tuple[str, bool]:
    """The last line of a preflight, and whether every host passed."""
    failed = [r.host for r in reports if r.problems]
    if failed:
        return f"preflight failed on: {', '.join(failed)}", False
    return f"preflight ok: {len(reports)} host(s)", True
