"""`hfscale launch` with the kubernetes runner: what reaches kubectl, what stays on disk.

No Kubernetes cluster can run here, so `kubectl` is a stand-in script that records its argv and
stdin (the manifests themselves are checked against the Kubeflow SDK in test_kubernetes.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from conftest import ROOT, run_cli

CONFIG = ROOT / "examples" / "kubernetes" / "config.yaml"


def _fake_kubectl(bin_dir: Path, record: Path) -> None:
    bin_dir.mkdir()
    exe = bin_dir / "kubectl"
    exe.write_text(f"#!/bin/sh\n[ \"$1\" = config ] && {{ echo test-context; exit 0; }}\n"
                   f"echo \"$@\" > {record}.argv\ncat > {record}.stdin\necho pytorchjob created\n")
    exe.chmod(0o755)


def _copy_config(tmp_path: Path) -> Path:
    doc = yaml.safe_load(CONFIG.read_text())
    doc["runner"]["run_dir"] = str(tmp_path / "runs")
    path = tmp_path / "k8s.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_launch_applies_real_manifests_on_stdin_and_keeps_a_masked_copy(tmp_path):
    record = tmp_path / "kubectl"
    _fake_kubectl(tmp_path / "bin", record)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "WANDB_API_KEY": "wk-real-secret"}
    r = run_cli("launch", str(_copy_config(tmp_path)), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pytorchjob created" in r.stdout
    assert Path(f"{record}.argv").read_text().split() == ["apply", "-f", "-"]
    applied = list(yaml.safe_load_all(Path(f"{record}.stdin").read_text()))
    assert [m["kind"] for m in applied] == ["ConfigMap", "Secret", "PyTorchJob"]
    assert applied[1]["stringData"] == {"WANDB_API_KEY": "wk-real-secret"}
    (run_dir,) = (tmp_path / "runs").iterdir()
    on_disk = (run_dir / "pytorchjob.yaml").read_text()
    assert "wk-real-secret" not in on_disk and "wk-real-secret" not in r.stdout + r.stderr
    assert list(yaml.safe_load_all(on_disk))[1]["stringData"] == {"WANDB_API_KEY": "***"}
    for f in run_dir.rglob("*"):
        if f.is_file():
            assert "wk-real-secret" not in f.read_text()


def test_without_a_configured_kubectl_the_manifests_are_written_with_instructions(tmp_path):
    # this machine's kubectl (if any) has no context: there is no cluster to talk to
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none")}
    r = run_cli("launch", str(_copy_config(tmp_path)), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert f"kubectl apply -f {run_dir}/pytorchjob.yaml" in r.stdout
    assert (run_dir / "pytorchjob.yaml").is_file()


def test_setup_lines_and_elastic_accelerate_are_refused(tmp_path):
    doc = yaml.safe_load(CONFIG.read_text())
    doc["runner"].update(setup="source /venv/bin/activate", launcher="accelerate")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    r = run_cli("check", str(path))
    assert r.returncode == 2
    assert "runner.setup" in r.stderr and "the kubernetes runner starts no shell" in r.stderr
    assert "runner.kubernetes.elastic" in r.stderr and "needs runner.launcher: torchrun" in r.stderr
