#!/usr/bin/env python
"""Benchmark: wall time of ``hfscale check CONFIG`` against ``accelerate config default``, and
against the import floor of its own dependencies.

All run as real subprocesses with this interpreter, interleaved (floor, pydantic model, hfscale,
accelerate, floor, ...), each with one untimed warm-up first; medians and minima are shown:

  * the import floor: ``python -c "import yaml, pydantic, click"`` (what any such CLI pays);
  * one pydantic model: the floor plus defining and validating one trivial ``BaseModel``, the
    least any pydantic-based config check can cost (pydantic's model machinery is imported
    lazily, on the first model);
  * ``hfscale check CONFIG``;
  * ``accelerate config default`` (writes a default accelerate config).

Targets (issue 3: at least 10x faster than accelerate; issue 11: at most 1.3x the floor) are
printed, never enforced: the exit code is non-zero only when a command fails (or the import check
cannot run). Bytecode caching is left on (``PYTHONDONTWRITEBYTECODE`` is removed from the
environment), as on a user's machine: else every run would compile hfscale's modules anew.

It also checks that ``hfscale check`` imports none of the heavy libraries:
  * in-process: a subprocess runs ``hfscale.cli.commands.main(['check', CONFIG])`` and reports which of
    torch / transformers / deepspeed / accelerate ended up in ``sys.modules``;
  * as users run it: ``python -X importtime -m hfscale check CONFIG`` and the top-level
    packages it imported.

    python bench/bench_check.py                     # 10 runs each, examples/tiny_cpu/config.yaml
    python bench/bench_check.py --repeat 20 --config examples/presets/zero3.yaml
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "deepspeed", "accelerate")
TARGET_RATIO = 10.0
TARGET_FLOOR = 1.3
FLOOR = [sys.executable, "-c", "import yaml, pydantic, click"]
ONE_MODEL = [sys.executable, "-c", "import yaml, click\nfrom pydantic import BaseModel\n"
             "class A(BaseModel):\n    x: int = 1\nA(x=2)"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # Same settings as the tests/CI: no hub access, DeepSpeed on the CPU accelerator.
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _run(cmd: list[str], label: str) -> float:
    """Run CMD once from the repo root; return wall seconds; raise SystemExit on failure."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"FAILED ({label}, exit {proc.returncode}): {' '.join(cmd)}", file=sys.stderr)
        print(proc.stdout[-2000:], file=sys.stderr)
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(1)
    return dt


def hfscale_cmd(config: str) -> list[str]:
    return [sys.executable, "-m", "hfscale", "check", config]


def accelerate_cmd(out_file: str) -> list[str]:
    # The module form avoids timing a shell shim (pyenv) in front of the console script.
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default",
            "--config_file", out_file]


IMPORT_PROBE = r"""
import json, sys
from hfscale.cli.commands import main
try:
    main(["check", sys.argv[1]], standalone_mode=False)
except SystemExit as e:  # _load exits 2 on a bad config
    if e.code not in (0, None):
        raise
heavy = {name: any(m == name or m.startswith(name + ".") for m in sys.modules) for name in %r}
print("@@IMPORTS@@" + json.dumps({"heavy": heavy, "n_modules": len(sys.modules)}))
""" % (HEAVY,)


def import_check(config: str) -> tuple[dict[str, bool], int, dict[str, bool], int]:
    """(heavy imported in-process, module count, heavy seen by -X importtime, importtime total us)."""
    import json

    proc = subprocess.run([sys.executable, "-c", IMPORT_PROBE, config], cwd=ROOT, env=_env(),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print("FAILED (import check, in-process):", proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(1)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("@@IMPORTS@@"))
    probe = json.loads(line[len("@@IMPORTS@@"):])

    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "hfscale", "check", config],
                          cwd=ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        print("FAILED (import check, -X importtime):", proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(1)
    seen: set[str] = set()
    total_us = 0
    for l in proc.stderr.splitlines():
        # "import time:  self [us] | cumulative | imported package"
        if not l.startswith("import time:") or "imported package" in l:
            continue
        parts = l.split("|")
        name = parts[-1].strip()
        seen.add(name.split(".")[0])
        try:
            total_us += int(parts[0].split(":")[1])
        except ValueError:
            pass
    importtime = {name: name in seen for name in HEAVY}
    return probe["heavy"], probe["n_modules"], importtime, total_us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=10, help="timed runs of each command (default 10)")
    ap.add_argument("--config", default="examples/tiny_cpu/config.yaml",
                    help="hfscale config to check, relative to the repo root")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")

    hf: list[float] = []
    acc: list[float] = []
    floor: list[float] = []
    model: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench_check_") as tmp:
        # A fresh output path each run: accelerate skips the write when the file exists.
        def acc_once(i: int) -> float:
            return _run(accelerate_cmd(os.path.join(tmp, f"accelerate_{i}.yaml")), "accelerate")

        print(f"python {sys.version.split()[0]} ({sys.executable}), {os.cpu_count()} cpus")
        print(f"warm-up, then {args.repeat} interleaved runs each ...", flush=True)
        _run(FLOOR, "floor")
        _run(ONE_MODEL, "one model")
        _run(hfscale_cmd(args.config), "hfscale")
        acc_once(-1)
        for i in range(args.repeat):
            floor.append(_run(FLOOR, "floor"))
            model.append(_run(ONE_MODEL, "one model"))
            hf.append(_run(hfscale_cmd(args.config), "hfscale"))
            acc.append(acc_once(i))

    heavy, n_modules, heavy_it, it_total_us = import_check(args.config)

    med = statistics.median
    w = 52
    print()
    print(f"{'command':<{w}} {'median s':>9} {'min s':>9}")
    print("-" * (w + 20))
    for label, runs in (("import floor: python -c 'import yaml, pydantic, click'", floor),
                        ("floor + one trivial pydantic model", model),
                        ("hfscale check " + args.config, hf),
                        ("accelerate config default", acc)):
        print(f"{label:<{w}} {med(runs):>9.3f} {min(runs):>9.3f}")
    print("-" * (w + 20))
    ratio = med(acc) / med(hf)
    over_floor = med(hf) / med(floor)
    print(f"{'ratio accelerate / hfscale':<{w}} {ratio:>8.1f}x {min(acc) / min(hf):>8.1f}x")
    print(f"{'ratio hfscale / import floor':<{w}} {over_floor:>8.2f}x {min(hf) / min(floor):>8.2f}x")
    print(f"{'ratio one pydantic model / import floor':<{w}} {med(model) / med(floor):>8.2f}x "
          f"{min(model) / min(floor):>8.2f}x")
    print(f"target accelerate/hfscale >= {TARGET_RATIO:.0f}x (medians): {'met' if ratio >= TARGET_RATIO else 'NOT met'}")
    print(f"target hfscale/floor <= {TARGET_FLOOR}x (medians): {'met' if over_floor <= TARGET_FLOOR else 'NOT met'}")
    print()
    print("heavy imports during `hfscale check` (must all be 'no'):")
    print(f"  {'module':<14}{'in-process main()':>18}{'-X importtime -m':>18}")
    for name in HEAVY:
        a = "YES" if heavy[name] else "no"
        b = "YES" if heavy_it[name] else "no"
        print(f"  {name:<14}{a:>18}{b:>18}")
    print(f"  modules loaded in-process: {n_modules}; import time (self, summed): {it_total_us / 1000:.0f} ms")
    bad = [n for n in HEAVY if heavy[n] or heavy_it[n]]
    print("import check: " + (f"FAIL, imported {', '.join(bad)}" if bad else "ok, none imported"))
    # Only a command failure (raised above) makes the exit code non-zero.
    return 0


if __name__ == "__main__":
    sys.exit(main())
