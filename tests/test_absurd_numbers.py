"""A 5,000-digit number (past Python's 4,300-digit limit on int conversion) in every numeric option of
the CLI and every numeric field of the config, the files ``hfscale import`` reads and the host file:
exit 2 with a message naming the option or key, never a traceback."""

from __future__ import annotations

import click
import pytest
import yaml

from conftest import run_cli
from hfscale.cli.commands import Number, main
from hfscale.config.errors import ConfigError
from hfscale.config.yaml_source import dotted
from hfscale.rules.config_file import load_text
from test_hostile import BASES, _leaves, _set

BIG = "9" * 5000
JOB = ("name: small\nbatch: {micro_batch_size: 1}\n"
       "training: {model: {config: {model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 2, vocab_size: 300}}}\n")
# options whose text holds a number, read by the command itself
NUMBER_TEXT = {("plan", "--gpu-memory"): f"{BIG}GiB", ("logs", "--node"): BIG}


def numeric_options() -> set[tuple[str, str]]:
    """(command, option) for every option of a click number type."""
    return {(name, p.opts[0]) for name, cmd in main.commands.items() for p in cmd.params
            if isinstance(p, click.Option) and isinstance(p.type, (click.types._NumberParamTypeBase, Number))}


def test_the_numeric_options_are_found():
    assert {("preflight", "--timeout"), ("preflight", "--seconds"), ("plan", "--seq-len")} <= numeric_options()


@pytest.mark.parametrize("command, option", sorted(numeric_options() | set(NUMBER_TEXT)))
def test_every_numeric_option_refuses_a_5000_digit_number(command, option, tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    run = tmp_path / "runs" / "small-20261126-000000-abcdef"
    (run / "logs").mkdir(parents=True)
    (run / "plan.txt").write_text("")
    (run / "logs" / "node0.log").write_text("hello\n")
    first = {"logs": str(run), "plan": "job.yaml", "preflight": "job.yaml"}[command]
    extra = ["--no-build"] if command == "plan" else []
    r = run_cli(command, first, *extra, option, NUMBER_TEXT.get((command, option), BIG), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and option in r.stderr, r.stderr
    assert len(r.stderr) < 1000  # the value is shortened, not printed whole


def test_nan_and_out_of_range_seconds_are_refused_too(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    for value in ("nan", "inf", "0", "-1", "1e400", "x"):
        r = run_cli("preflight", "job.yaml", "--timeout", value, cwd=tmp_path)
        assert r.returncode == 2 and "Invalid value for '--timeout'" in r.stderr, (value, r.stderr)


NUMERIC_LEAVES = [(name, path) for name, base in BASES.items() for path, value in _leaves(base)
                  if isinstance(value, (int, float)) and not isinstance(value, bool)]


def _text_with(doc: dict, path: tuple, written: str) -> str:
    """The YAML of ``doc`` with the value at ``path`` written as ``written`` (yaml.safe_dump cannot
    write a 5,000-digit int: str() of it raises)."""
    return yaml.safe_dump(_set(doc, path, "NUMBER_HERE"), sort_keys=False).replace("NUMBER_HERE", written)


def test_every_numeric_field_refuses_a_5000_digit_number(tmp_path):
    assert len(NUMERIC_LEAVES) > 60  # every base's numbers: test_hostile checks the bases cover the schema
    (tmp_path / "hosts.txt").write_text("node0 slots=1\nnode1 slots=1\n")
    for name, path in NUMERIC_LEAVES:
        for written in (BIG, "0x" + "f" * 5000, f"-{BIG}"):
            with pytest.raises(ConfigError) as e:
                load_text(_text_with(BASES[name], path, written), "big.yaml", tmp_path)
            said = [str(p) for p in e.value.problems]
            assert any(s.startswith(dotted(path) + " (line") and "5,000 digits" in s for s in said), (path, said)
        with pytest.raises(ConfigError) as e:  # a 5,000-digit float is infinite
            load_text(_text_with(BASES[name], path, BIG + ".5"), "big.yaml", tmp_path)
        assert any(p.path == dotted(path) for p in e.value.problems), (path, e.value.render()[:300])


def test_check_import_and_the_host_file_exit_2_naming_the_key(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB.replace("micro_batch_size: 1", f"micro_batch_size: {BIG}"))
    (tmp_path / "hosts").write_text(f"node0 slots={BIG}\n")
    (tmp_path / "h.yaml").write_text("name: h\nbatch: {micro_batch_size: 1}\nrunner: {type: pdsh}\n"
                                     "cluster: {hostfile: hosts}\n")
    (tmp_path / "acc.yaml").write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config: {{zero_stage: 2}}\n"
                                       f"num_processes: {BIG}\n")
    (tmp_path / "plain.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config: {}\nnum_processes: 2\n")
    (tmp_path / "ds.json").write_text(f'{{"zero_optimization": {{"stage": 2, "reduce_bucket_size": {BIG}}}}}')
    for args, key in ((("check", "job.yaml"), "batch.micro_batch_size (line 2)"),
                      (("check", "h.yaml"), "slots must be a whole number"),
                      (("import", "acc.yaml", "--out", "-"), "num_processes (line 3)"),
                      (("import", "plain.yaml", "--deepspeed", "ds.json", "--out", "-"),
                       "zero_optimization.reduce_bucket_size (line 1)")):
        r = run_cli(*args, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr and key in r.stderr, (args, r.stderr[:500])
        assert len(r.stderr) < 1000


def test_a_sequence_length_in_script_args_is_held_to_plan_seq_lens_bounds(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 64, '
                                                    '"n_head": 2, "vocab_size": 300}')
    for value in ("9" * 4000, "99999999999999999999", "0"):
        (tmp_path / "job.yaml").write_text(f"name: s\nbatch: {{micro_batch_size: 1}}\n"
                                           f"training: {{script: t.py, script_args: [--block_size, '{value}']}}\n")
        r = run_cli("plan", "job.yaml", "--no-build", "--model", "model", cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-500:]
        assert "--block_size" in r.stderr and "not a sequence length from 1 to 10,000,000" in r.stderr
