"""The hfscale command as users run it: exit codes, messages, files, and no heavy imports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml

from conftest import ROOT, run_cli

GOOD = textwrap.dedent(
    """\
    name: demo
    cluster:
      hosts: [{host: node0, slots: 8}, {host: node1, slots: 8}]
    runner: {type: pdsh}
    distributed: {backend: deepspeed, deepspeed: {stage: 3, offload_optimizer: {device: cpu}}}
    precision: bf16
    batch: {micro_batch_size: 4, global_batch_size: 256}
    """
)


def write(tmp_path, text, name="job.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_check_prints_summary(tmp_path):
    r = run_cli("check", str(write(tmp_path, GOOD)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1:] == [
        "  job          demo",
        "  nodes        2 (node0, node1) x 8 processes",
        "  world size   16",
        "  engine       deepspeed ZeRO-3 (offload optimizer=cpu)",
        "  precision    bf16",
        "  global batch 256 = micro 4 x accumulation 4 x world 16",
        "  comm buckets ~1.0 GiB per GPU = (reduce 5e8 + prefetch 5e7 elements) x 2 B; gathered parameters up to "
        "1.9 GiB more (stage3_max_live_parameters)",
        "  runner       pdsh (accelerate)",
        "  watchdog     no step for 600 s: every rank's stack, the stuck rank named, the job stopped (exit 4)",
        "  loss guard   every step: NaN/inf; loss > 2x median (+0.5) or grad norm > 10x, 3 steps running; an alarm "
        "stops the job unsaved (recovery.max_restarts 0); a relaunch rolls back and replays",
        "  health       each node before its ranks start, each spare or excluded host before it is admitted: the GPUs "
        "its slots need, no uncorrected ECC error, no row remapping pending (nvidia-smi, where present)",
        "  entry        built-in entry point (python -m hfscale.training.train)",
    ]


BAD_INPUTS = {
    "malformed": ("name: [x\n", "invalid YAML"),
    "empty": ("", "the file is empty"),
    "unknown_key_deep": (GOOD.replace("stage: 3,", "stage: 3, stagee: 1,"), "distributed.deepspeed.stagee (line 5): unknown key"),
    "wrong_type": (GOOD.replace("micro_batch_size: 4", "micro_batch_size: four"), "batch.micro_batch_size (line 7): must be a whole number"),
    "zero_size": (GOOD.replace("slots: 8}, {", "slots: 0}, {"), "cluster.hosts[0].slots (line 3): must be >= 1"),
    "negative_size": (GOOD.replace("micro_batch_size: 4", "micro_batch_size: -4"), "must be >= 1, got -4"),
    "batch_math": (GOOD.replace("global_batch_size: 256", "global_batch_size: 100"), "batch.global_batch_size (line 7): 100 is not a multiple"),
    "duplicate_host": (GOOD.replace("host: node1", "host: node0"), "duplicate host 'node0'"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_config_exits_2_without_traceback(tmp_path, case):
    text, expected = BAD_INPUTS[case]
    r = run_cli("check", str(write(tmp_path, text)))
    assert r.returncode == 2
    assert expected in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stderr.startswith(f"error: {tmp_path / 'job.yaml'}:")


def test_missing_file_and_directory_exit_2(tmp_path):
    r = run_cli("check", str(tmp_path / "nope.yaml"))
    assert (r.returncode, "no such file" in r.stderr, "Traceback" in r.stderr) == (2, True, False)
    r = run_cli("check", str(tmp_path))
    assert (r.returncode, "is a directory" in r.stderr, "Traceback" in r.stderr) == (2, True, False)


def test_usage_error_exits_2():
    r = run_cli("check")
    assert r.returncode == 2 and "Missing argument 'CONFIG'" in r.stderr


def test_config_writes_all_artifacts(tmp_path):
    out = tmp_path / "gen"
    r = run_cli("config", str(write(tmp_path, GOOD)), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["accelerate_config.yaml", "ds_config.json", "hostfile"]
    acc = yaml.safe_load((out / "accelerate_config.yaml").read_text())
    assert acc["deepspeed_config"]["deepspeed_config_file"] == str(out / "ds_config.json")
    assert json.loads((out / "ds_config.json").read_text())["train_batch_size"] == 256
    assert (out / "hostfile").read_text() == "node0 slots=8\nnode1 slots=8\n"
    assert r.stdout.split() == [str(out / n) for n in ("accelerate_config.yaml", "ds_config.json", "hostfile")]


def test_config_with_bad_input_writes_nothing(tmp_path):
    out = tmp_path / "gen"
    r = run_cli("config", str(write(tmp_path, GOOD.replace("256", "100"))), "--out", str(out))
    assert r.returncode == 2 and not out.exists()


def test_init_template_is_valid_and_complete(tmp_path):
    dest = tmp_path / "new.yaml"
    r = run_cli("init", str(dest))
    assert r.returncode == 0, r.stderr
    text = dest.read_text()
    assert run_cli("check", str(dest)).returncode == 0
    # every field of the model appears in the template, with its description as a comment
    from hfscale.config.model import HfscaleConfig

    for name, field in HfscaleConfig.model_fields.items():
        assert f"\n{name}:" in "\n" + text
        assert f"# {field.description}" in text
    assert "  # own default is 0, but choosing DeepSpeed means choosing ZeRO.\n    stage: 2\n" in text
    r = run_cli("init", str(dest))
    assert r.returncode == 2 and "exists" in r.stderr


def test_init_to_stdout_round_trips():
    from pathlib import Path

    from hfscale.rules.config_file import load_text
    from hfscale.config.template import EXAMPLE, render_template

    r = run_cli("init", "-")
    assert r.returncode == 0 and r.stdout == render_template()
    from hfscale.config.model import HfscaleConfig

    assert load_text(r.stdout, "t", Path(".")).config == HfscaleConfig.model_validate(EXAMPLE)


def test_schema_is_json_schema_of_the_model():
    r = run_cli("schema")
    assert r.returncode == 0
    s = json.loads(r.stdout)
    assert s["additionalProperties"] is False
    assert set(s["properties"]) == {"name", "cluster", "runner", "distributed", "precision", "batch",
                                    "gradient_clipping", "network", "env", "accelerate", "watchdog", "recovery", "training"}
    assert s["required"] == ["name", "batch"]
    assert s["$defs"]["DeepSpeedSection"]["properties"]["stage"]["enum"] == [0, 1, 2, 3]
    assert all("description" in p for p in s["$defs"]["BatchConfig"]["properties"].values())


def test_version():
    from hfscale import __version__

    for argv in (["--version"],):
        r = run_cli(*argv)
        assert r.returncode == 0 and r.stdout.strip() == f"hfscale, version {__version__}"


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("hfscale")
    assert exe, "pip install -e . should put the hfscale console script on PATH"
    r = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "hfscale check my-run.yaml" in r.stdout


HEAVY = ("torch", "transformers", "deepspeed", "accelerate", "datasets")


@pytest.mark.parametrize("argv", [["check", "{cfg}"], ["config", "{cfg}", "--out", "{out}"], ["init", "-"], ["schema"]])
def test_config_commands_do_not_import_heavy_libraries(tmp_path, argv):
    cfg = write(tmp_path, GOOD)
    args = [a.format(cfg=cfg, out=tmp_path / "o") for a in argv]
    code = textwrap.dedent(
        f"""
        import sys
        from hfscale.cli.commands import main
        try:
            main({args!r}, standalone_mode=False)
        except SystemExit as e:
            assert not e.code, e.code
        print("HEAVY=" + ",".join(m for m in {HEAVY!r} if m in sys.modules))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "HEAVY="
