"""The health gate's checks, judged (pure: the node's gate and the probes run the commands,
hfscale.launch.node.health_gate and hfscale.launch.preflight.probes, and both word a verdict here).

The built-in GPU checks, as nvidia-smi answers them:

A host is unhealthy when fewer GPUs answer than its slots promise, when nvidia-smi itself fails (a
GPU fallen off the bus answers "Unable to determine the device handle for GPU ...: Unknown Error",
a lost driver "couldn't communicate with the NVIDIA driver"), when a GPU counts uncorrected ECC
errors since the driver loaded, or when a row remapping is pending (the GPU needs a reset) or failed
(it needs replacing). Where the driver does not report a value ("[N/A]", "[Not Supported]", or the
remapped-rows query refused), that check says so and passes. Without nvidia-smi there is no GPU to
check: the checks say so and pass.

The site's own check (recovery.health_check) fails on any exit but 0, or when it still runs at its
timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

GPU_QUERY = ("nvidia-smi", "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total",
             "--format=csv,noheader,nounits")
REMAP_QUERY = ("nvidia-smi", "--query-remapped-rows=gpu_bus_id,remapped_rows.pending,remapped_rows.failure",
               "--format=csv,noheader,nounits")
NVIDIA_SMI_TIMEOUT_S = 30  # each query; a GPU that hangs nvidia-smi is a sick GPU
KILL_GRACE_S = 5  # after a bound, before KILL (the probe's `timeout -k`)
MAX_GPUS = 1024  # rows read at most (a node has 8 or 16)
_NOT_SAID = ("[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]", "")


@dataclass(frozen=True)
class Answer:
    """What one nvidia-smi command printed and how it ended (``rc`` None: not run, no nvidia-smi)."""

    rc: int | None
    out: str = ""


@dataclass(frozen=True)
class GpuHealth:
    gpus: int | None  # the GPUs that answered; None: no nvidia-smi
    problems: tuple[str, ...]  # each one reason to keep the host out
    notes: tuple[str, ...] = ()  # what could not be checked, said and passed


def _rows(text: str) -> list[list[str]]:
    rows = [[cell.strip() for cell in line.split(",")] for line in text.splitlines()[:MAX_GPUS] if line.strip()]
    return [r for r in rows if len(r) >= 3]


def _last(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _flag(value: str) -> bool | None:
    v = value.strip().lower()
    if v in ("yes", "true", "1"):
        return True
    if v in ("no", "false", "0"):
        return False
    return None  # not reported


def budget_s(check_timeout: int | None) -> int:
    """The most the checks take on a host: both nvidia-smi queries and the site's check, each at its bound."""
    site = 0 if check_timeout is None else check_timeout + KILL_GRACE_S
    return 2 * (NVIDIA_SMI_TIMEOUT_S + KILL_GRACE_S) + site


def nvidia_smi_hung() -> str:
    return f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT_S} s"


def site_problem(site: Answer, timeout: int, timed_out: bool) -> str | None:
    """The site check's verdict (None: healthy): its exit code and its output's last line."""
    if timed_out:
        return f"recovery.health_check still ran after its timeout, {timeout} s: killed"
    if site.rc is None:
        return "recovery.health_check said nothing (the probe ended before it)"
    if site.rc != 0:
        last = _last(site.out)
        return f"recovery.health_check exited {site.rc}" + (f": {last}" if last else "")
    return None


def judge(gpus: Answer, remap: Answer, slots: int) -> GpuHealth:
    """The problems in nvidia-smi's answers to ``GPU_QUERY`` and ``REMAP_QUERY`` on a host of ``slots`` ranks."""
    if gpus.rc is None:
        return GpuHealth(None, (), ("no nvidia-smi: no GPU checked",))
    if gpus.rc != 0:
        return GpuHealth(0, (f"nvidia-smi failed (exit {gpus.rc}): {_last(gpus.out) or 'no output'}",))
    rows = _rows(gpus.out)
    problems: list[str] = []
    notes: list[str] = []
    if len(rows) < slots:
        problems.append(f"{slots} slots but only {len(rows)} GPU(s) answer nvidia-smi")
    unreported = 0
    for index, bus, ecc in (r[:3] for r in rows):
        if ecc.lower() in _NOT_SAID:
            unreported += 1
        elif not ecc.isdigit():
            problems.append(f"GPU {index} ({bus}): nvidia-smi says {ecc[:60]!r} for its uncorrected ECC errors")
        elif int(ecc) > 0:
            problems.append(f"GPU {index} ({bus}): {int(ecc)} uncorrected ECC error(s) since the driver loaded; "
                            "drain the host and reset the GPU")
    if unreported:
        notes.append(f"{unreported} GPU(s) report no ECC counts (ECC off or not supported)")
    index_of = {r[1].lower().removeprefix("0000"): r[0] for r in rows}
    if remap.rc is None or remap.rc != 0:
        notes.append("row remapping not reported by this driver or GPU")
    else:
        for bus, pending, failed in (r[:3] for r in _rows(remap.out)):
            name = f"GPU {index_of.get(bus.lower().removeprefix('0000'), '?')} ({bus})"
            if _flag(failed):
                problems.append(f"{name}: a row remapping failed; the GPU needs replacing")
            elif _flag(pending):
                problems.append(f"{name}: a row remapping is pending; reset the GPU (nvidia-smi -r) before it trains")
    return GpuHealth(len(rows), tuple(problems), tuple(notes))
