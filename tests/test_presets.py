"""The committed presets are exactly what the generator makes from examples/presets/ now."""

from __future__ import annotations

import subprocess
import sys

from hfscale.render.presets import render_presets, stale_presets

REQUIRED = {"zero1", "zero2", "zero3", "zero3_offload", "fsdp", "ddp", "pdsh_2node"}


def test_required_presets_exist(repo_root):
    names = {p.stem for p in (repo_root / "accelerate_configs").glob("*.yaml")}
    assert REQUIRED <= names
    assert {p.stem for p in (repo_root / "ds_configs").glob("*.json")} == {
        "zero1", "zero2", "zero3", "zero3_offload", "pdsh_2node"}
    assert (repo_root / "ds_configs" / "pdsh_2node.hostfile").read_text() == "node0 slots=8\nnode1 slots=8\n"


def test_committed_presets_are_current(repo_root):
    assert stale_presets(repo_root) == []


def test_a_changed_source_makes_a_preset_stale(repo_root, tmp_path):
    # copy the tree the generator reads, change one source, and the check must notice
    for d in ("examples/presets", "accelerate_configs", "ds_configs"):
        (tmp_path / d).mkdir(parents=True)
        for f in (repo_root / d).iterdir():
            (tmp_path / d / f.name).write_text(f.read_text())
    src = tmp_path / "examples/presets/zero2.yaml"
    src.write_text(src.read_text().replace("stage: 2", "stage: 1"))
    (tmp_path / "ds_configs/stray.json").write_text("{}")
    assert stale_presets(tmp_path) == ["ds_configs/zero2.json", "ds_configs/stray.json"]
    r = subprocess.run([sys.executable, "-m", "hfscale.render.presets", "--check"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 1 and "stale preset: ds_configs/zero2.json" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hfscale.render.presets"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and (tmp_path / "ds_configs/zero2.json").read_text() == render_presets(tmp_path)[
        "ds_configs/zero2.json"]


def test_preset_accelerate_yaml_points_at_its_json(repo_root):
    import yaml

    for name in ("zero1", "zero2", "zero3", "zero3_offload", "pdsh_2node"):
        acc = yaml.safe_load((repo_root / "accelerate_configs" / f"{name}.yaml").read_text())
        path = acc["deepspeed_config"]["deepspeed_config_file"]
        assert path == f"ds_configs/{name}.json" and (repo_root / path).is_file()
