"""training.model.config checked against the model type's transformers config class, read from
transformers' own source (no transformers or torch import in `hfscale check`)."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from hfscale.config import model_config
from hfscale.config.errors import ConfigError

from conftest import job_of, run_cli

TINY = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256, "n_positions": 128,
        "bos_token_id": 0, "eos_token_id": 0}


def problems_of(config: dict) -> list[str]:
    text = f"name: m\nbatch: {{micro_batch_size: 1}}\ntraining:\n  model:\n    config: {json.dumps(config)}\n"
    with pytest.raises(ConfigError) as e:
        job_of(text)
    return [str(p) for p in e.value.problems]


@pytest.mark.parametrize("bad,message", [
    ({"n_embd": -1}, "training.model.config.n_embd (line 5): is a size and must be at least 1, got -1"),
    ({"n_embd": "lots"}, "training.model.config.n_embd (line 5): must be a whole number, got 'lots' (a string)"),
    ({"n_embd": [1, 2]}, "training.model.config.n_embd (line 5): must be a whole number, got [1, 2] (a list)"),
    ({"n_layr": 4}, "training.model.config.n_layr (line 5): GPT2Config has no field 'n_layr'; did you mean "
                    "'n_layer'? (an unknown key would be stored and ignored)"),
    ({"n_layer": True}, "training.model.config.n_layer (line 5): must be a whole number, got True (true or false)"),
    ({"layer_norm_epsilon": 1}, "training.model.config.layer_norm_epsilon (line 5): must be a number with a "
                                "decimal point, got 1 (a whole number)"),
    ({"n_embd": 65}, "training.model.config.n_embd (line 5): n_embd 65 must divide by n_head 2 (each head gets "
                     "n_embd / n_head dimensions); the model cannot be built"),
    ({"hidden_size": 0}, "training.model.config.hidden_size (line 5): is a size and must be at least 1, got 0"),
])
def test_the_issues_bad_model_configs_are_errors_with_path_and_line(bad, message):
    assert problems_of({**TINY, **bad}) == [message]


def test_model_type_is_required_and_known():
    assert problems_of({"n_layer": 2}) == ["training.model.config (line 5): needs model_type (e.g. gpt2, llama, "
                                           "mistral): it picks the transformers config class"]
    assert problems_of({"model_typ": "gpt2", "n_layer": 2}) == [
        "training.model.config.model_typ (line 5): unknown key 'model_typ'; did you mean 'model_type'? (it picks the "
        "transformers config class)"]
    assert problems_of({"model_type": "gtp2"}) == [
        "training.model.config.model_type (line 5): transformers has no model_type 'gtp2'; did you mean 'gpt2' "
        "or 'tipsv2'?"]


def test_llama_style_configs():
    ok = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": False}
    assert model_config.check(ok) == ([], [])
    assert model_config.check({**ok, "num_key_value_heads": 3}) == ([(("num_key_value_heads",),
        "num_attention_heads 4 must divide by num_key_value_heads 3 (grouped-query attention shares each "
        "key/value head among a whole group)")], [])
    assert model_config.check({"model_type": "mistral", "sliding_window": 4096, "num_hidden_layer": 2})[0] == [
        (("num_hidden_layer",), "MistralConfig has no field 'num_hidden_layer'; did you mean 'num_hidden_layers'? "
                                "(an unknown key would be stored and ignored)")]


def test_aliases_and_legacy_keywords_are_accepted():
    # attribute_map aliases (GPT-2 calls hidden_size n_embd) and keywords transformers still reads
    assert model_config.check({**TINY, "hidden_size": 64, "num_hidden_layers": 2, "torch_dtype": "float32",
                               "rope_scaling": None, "num_labels": 2}) == ([], [])


def test_an_unreadable_class_is_a_warning_not_a_guess(monkeypatch):
    monkeypatch.setattr(model_config, "schema", lambda mt, bases=True: None)
    assert model_config.check(TINY) == ([], ["the gpt2 config class could not be read from transformers' source: "
                                             "training.model.config is checked when the model is built"])


def test_check_with_a_model_config_imports_neither_transformers_nor_torch(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"name: m\nbatch: {{micro_batch_size: 1}}\ntraining: {{model: {{config: {json.dumps(TINY)}}}}}\n")
    code = textwrap.dedent(f"""
        import sys
        from hfscale.cli.commands import main
        try:
            main(["check", {str(cfg)!r}])
        except SystemExit as e:
            assert e.code in (None, 0), e.code
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "deepspeed", "accelerate"))
        print("HEAVY", heavy)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout


POPULAR = ["gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "phi3", "gpt_neox", "opt", "falcon",
           "bert", "t5"]


def test_the_source_reader_agrees_with_the_real_classes():
    """Differential test against the installed transformers: the same fields for the popular model
    types, and no value the real class accepts is an error here (probe values on every own field)."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    base = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    probes = [1, -1, 1.5, "x", True, None, [1], {"a": 1}]
    false_errors, checked = [], 0
    for mt in POPULAR:
        schema = model_config.schema(mt)
        assert schema is not None, mt
        cls = CONFIG_MAPPING[mt]
        assert set(schema.fields) == {f.name for f in dataclasses.fields(cls)}, mt
        assert schema.aliases == cls.attribute_map, mt
        for name, spec in schema.fields.items():
            if name in base:  # PreTrainedConfig's own fields are not type-checked by transformers
                continue
            for value in probes:
                ours = model_config._value_problem(spec, copy.deepcopy(value))
                try:
                    cls(**{name: copy.deepcopy(value)})
                    theirs = False
                except StrictDataclassFieldValidationError as e:
                    theirs = f"'{name}'" in str(e)
                except Exception:  # a value the class rejects for another reason (its own checks)
                    continue
                checked += 1
                if ours and not theirs and "is a size" not in ours:
                    false_errors.append((mt, name, value, ours))
    assert checked > 1500
    assert false_errors == []


def test_every_model_type_is_read_or_left_to_the_model_build():
    types = model_config.model_types()
    assert len(types) > 300 and "gpt2" in types and "llama" in types
    readable = sum(model_config.schema(mt) is not None for mt in types)
    assert readable / len(types) > 0.95, readable


def test_check_reports_the_model_config_errors_with_exit_2(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("name: m\nbatch: {micro_batch_size: 1}\ntraining:\n  model:\n    config:\n      model_type: gpt2\n"
                   "      n_layr: 4\n      n_embd: -1\n")
    r = run_cli("check", str(cfg))
    assert r.returncode == 2
    assert r.stderr.splitlines()[1:] == [
        "  - training.model.config.n_layr (line 7): GPT2Config has no field 'n_layr'; did you mean 'n_layer'? (an "
        "unknown key would be stored and ignored)",
        "  - training.model.config.n_embd (line 8): is a size and must be at least 1, got -1",
    ]
