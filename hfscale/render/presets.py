"""Generate the ready-made files in accelerate_configs/ and ds_configs/ from examples/presets/.

    python -m hfscale.render.presets          # rewrite the presets
    python -m hfscale.render.presets --check  # exit 1 and name each preset that differs
"""

from __future__ import annotations

import sys
from pathlib import Path

from hfscale.render.artifacts import ACCELERATE_FILE, DEEPSPEED_FILE, HOST_FILE, render_artifacts
from hfscale.rules.config_file import load_text

SOURCES = Path("examples") / "presets"


def render_presets(root: Path) -> dict[str, str]:
    """Relative path -> text for every preset generated from ``root/examples/presets/*.yaml``."""
    out: dict[str, str] = {}
    for src in sorted((root / SOURCES).glob("*.yaml")):
        rel = src.relative_to(root).as_posix()
        job = load_text(src.read_text(encoding="utf-8"), rel, src.parent)
        name = src.stem
        files = render_artifacts(job, f"ds_configs/{name}.json")
        out[f"accelerate_configs/{name}.yaml"] = files[ACCELERATE_FILE]
        if DEEPSPEED_FILE in files:
            out[f"ds_configs/{name}.json"] = files[DEEPSPEED_FILE]
        if HOST_FILE in files:
            out[f"ds_configs/{name}.hostfile"] = files[HOST_FILE]
    return out


def stale_presets(root: Path) -> list[str]:
    """Preset files that are missing or differ from what the generator produces now."""
    want = render_presets(root)
    stale = [p for p, text in want.items() if not (root / p).is_file() or (root / p).read_text() != text]
    generated_dirs = ("accelerate_configs", "ds_configs")
    extra = [
        f.relative_to(root).as_posix()
        for d in generated_dirs
        for f in sorted((root / d).glob("*"))
        if f.is_file() and f.relative_to(root).as_posix() not in want
    ]
    return stale + extra


def main(argv: list[str] | None = None) -> int:
    from hfscale.core.atomic_files import write_files

    argv = sys.argv[1:] if argv is None else argv
    root = Path.cwd()
    if argv == ["--check"]:
        stale = stale_presets(root)
        for p in stale:
            print(f"stale preset: {p} (run: python -m hfscale.render.presets)")
        return 1 if stale else 0
    if argv:
        print(__doc__)
        return 2
    for p in write_files(root, render_presets(root)):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
