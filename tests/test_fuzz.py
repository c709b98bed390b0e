"""Random YAML into the loader: a Job or a ConfigError, never any other exception."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hfscale.config.errors import ConfigError
from hfscale.config.model import HfscaleConfig
from hfscale.config.schema_errors import _all_paths
from hfscale.config.template import EXAMPLE
from hfscale.rules.config_file import load_text
from hfscale.rules.resolved import Job

KEYS = sorted({p.rsplit(".", 1)[-1] for p in _all_paths(HfscaleConfig)} | {"host", "slots", "zz", ""})

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["bf16", "fp16", "no", "deepspeed", "fsdp", "ddp", "cpu", "nvme", "none", "local", "pdsh",
                     "node0", "a;b", "$(id)", "3e-4", "5e8", "hosts.txt", "/", "\x00"]),
)
documents = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.sampled_from(KEYS), children, max_size=6),
    ),
    max_leaves=30,
)


def only_config_errors(text: str, base: Path) -> None:
    try:
        result = load_text(text, "fuzz.yaml", base)
    except ConfigError as e:
        assert e.problems, "a ConfigError must carry at least one problem"
        assert all(isinstance(p.message, str) and p.message for p in e.problems)
        e.render()
    else:
        assert isinstance(result, Job)


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(documents)
def test_random_documents(tmp_path_factory, doc):
    only_config_errors(yaml.safe_dump(doc), tmp_path_factory.getbasetemp())


@FUZZ
@given(st.text(max_size=200))
def test_random_text(tmp_path_factory, text):
    only_config_errors(text, tmp_path_factory.getbasetemp())


def _leaves(d, prefix=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaves(v, prefix + (k,))
    yield prefix


def _replace(d, path, value):
    if not path:
        return value
    out = dict(d) if isinstance(d, dict) else {}
    out[path[0]] = _replace(out.get(path[0], {}), path[1:], value)
    return out


VALID = {**EXAMPLE, "cluster": {"hosts": [{"host": "n0", "slots": 2}, {"host": "n1", "slots": 2}]},
         "runner": {"type": "pdsh"}, "batch": {"micro_batch_size": 2, "global_batch_size": 16}}
LEAF_PATHS = sorted(set(_leaves(VALID)) - {()})


@FUZZ
@given(st.sampled_from(LEAF_PATHS), documents)
def test_mutated_valid_config(tmp_path_factory, path, value):
    only_config_errors(yaml.safe_dump(_replace(VALID, path, value)), tmp_path_factory.getbasetemp())


def test_the_unmutated_base_is_valid():
    job = load_text(yaml.safe_dump(VALID), "v.yaml", Path("."))
    assert job.world_size == 4 and job.gradient_accumulation_steps == 2
