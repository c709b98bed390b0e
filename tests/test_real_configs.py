"""Real configs from public repositories (tests/data/real_configs, SOURCES.md: repository, path,
commit), unchanged, through ``hfscale import`` -> ``check`` -> ``config``; what comes back is
loaded by DeepSpeed's DeepSpeedConfig and accelerate's own loader and launch code and compared
with the original (tests/real_corpus.py). Also: every key the installed DeepSpeed reads is one
hfscale knows (typed, or accepted in ``extra``)."""

from __future__ import annotations

import os

import pytest

from conftest import ROOT
from real_corpus import CORPUS, rows, survey, table

# the refusals, each with why: a test fails when one more appears or one goes away unnoticed
REFUSED = {
    # DeepSpeed 0.19's CompileConfig forbids these older keys (extra inputs are not permitted)
    "axolotl-ai-cloud__axolotl/zero1_torch_compile.json": "compile.disable: unknown key 'disable'",
    "axolotl-ai-cloud__axolotl/zero2_torch_compile.json": "compile.disable: unknown key 'disable'",
    # DeepSpeed 0.19.6 on refuses warmup_num_steps 0 when the engine builds WarmupLR: the original fails there
    "deepspeedai__DeepSpeed/ds_zero3.json": "scheduler.params.warmup_num_steps: 0: DeepSpeed refuses it when it builds "
                                            "WarmupLR (ValueError: warmup_num_steps must be a positive integer, got 0)",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return survey(tmp_path_factory.mktemp("corpus"))


def test_the_corpus_is_real_configs_with_their_sources():
    all_rows = rows()
    files = {p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*") if p.is_file() and p.name != "SOURCES.md"}
    assert {r.file for r in all_rows} == files  # every file has its source, every source its file
    assert len(files) >= 40 and len({r.repository for r in all_rows}) >= 6
    assert all(len(r.commit) == 40 and int(r.commit, 16) >= 0 for r in all_rows)


def test_every_config_round_trips_or_is_refused_for_its_stated_reason(results):
    artifacts = ROOT / ".cache" / "test-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / "real_configs.md").write_text(table(results) + "\n")
    changed = {r.row.file: r.details for r in results if r.outcome == "changed"}
    assert changed == {}
    refused = {r.row.file: " | ".join(r.details) for r in results if r.outcome == "refused"}
    assert set(refused) == set(REFUSED), refused
    for name, why in REFUSED.items():
        assert why in refused[name]
    assert sum(r.outcome == "faithful" for r in results) == len(results) - len(REFUSED)
    # JSONs for DeepSpeed's own launcher with no zero_optimization: accelerate refuses them, so they are
    # compared as DeepSpeed alone reads them, and the import says what accelerate would do
    raw = {r.row.file: r.notes for r in results if r.accelerate_refuses_original}
    assert set(raw) == {"microsoft__DeepSpeedExamples/ds_config.json",
                        "microsoft__DeepSpeedExamples/deepspeed_bsz24_config.json"}
    assert all(any("accelerate's DeepSpeedPlugin refuses such a file" in n for n in notes) for notes in raw.values())


def test_what_the_import_leaves_out_is_said(results):
    notes = {r.row.file: " ".join(r.notes) for r in results}
    assert "FSDP1 (fsdp_version 1) converted to FSDP2 as `accelerate to-fsdp2` does" in \
        notes["huggingface__alignment-handbook/fsdp.yaml"]
    assert "fsdp_sharding_strategy FULL_SHARD became reshard_after_forward true" in \
        notes["huggingface__alignment-handbook/fsdp.yaml"]
    assert "left out fsdp_backward_prefetch: removed in FSDP2" in notes["huggingface__alignment-handbook/fsdp.yaml"]
    z0 = notes["hiyouga__LLaMA-Factory/ds_z0_config.json"]
    assert "left out zero_optimization.overlap_comm," in z0 and "DeepSpeed does not use them at ZeRO stage 0" in z0
    assert "left out _comment: not a key DeepSpeed reads" in notes["hiyouga__LLaMA-Factory/ds_z2_autotp_config.json"]
    assert "distributed_type MULTI_XPU: accelerate launch starts it as it starts MULTI_GPU" in \
        notes["huggingface__accelerate/multi_xpu.yaml"]


def test_other_repositories_configs_get_what_the_engines_accept(results):
    """Issue 37's shapes, each on real files from repositories the corpus had not seen, each
    faithful (the test above: what accelerate and DeepSpeed run for the original and the import's
    files back is the same) and said."""
    notes = {r.row.file: " ".join(r.notes) for r in results}
    outcome = {r.row.file: r.outcome for r in results}
    # an FSDP1 key accelerate 1.15 has no argument for (the older name of fsdp_backward_prefetch): left out, said
    for f in ("tatsu-lab__alpaca_farm/rlhf_ppo_fsdp_llama_8gpu.yaml", "pacman100__DHS-LLM-Workshop/fsdp_config.yaml",
              "TIGER-AI-Lab__Mantis/accelerate_config_fsdp.yaml"):
        assert outcome[f] == "faithful", f
    for f in ("tatsu-lab__alpaca_farm/rlhf_ppo_fsdp_llama_8gpu.yaml", "pacman100__DHS-LLM-Workshop/fsdp_config.yaml"):
        assert "left out fsdp_config.fsdp_backward_prefetch_policy: not an argument of the installed accelerate's " \
            "launch, so nothing reads it" in notes[f], notes[f]
    # an fsdp_config beside distributed_type NO: accelerate launch sets no FSDP variable
    for f in ("OptimalScale__LMFlow/accelerate_singlegpu_config.yaml", "TIGER-AI-Lab__Mantis/accelerate_config_fsdp.yaml"):
        assert outcome[f] == "faithful" and "left out fsdp_config: distributed_type is NO" in notes[f], notes[f]
    # distributed_type: no unquoted (YAML's false): run as NO, as accelerate runs it
    for f in ("Luodian__Otter/accelerate_config_fsdp.yaml", "TIGER-AI-Lab__Mantis/accelerate_config_fsdp.yaml"):
        assert outcome[f] == "faithful" and "distributed_type false (YAML reads an unquoted no" in notes[f], notes[f]
    # zero_hpz_partition_size above the world size: DeepSpeed clamps it; the import keeps it
    for f in ("LLaVA-VL__LLaVA-NeXT/zero3pp.json", "NVlabs__VILA/zero3pp.json"):
        assert outcome[f] == "faithful", f
    # steps_per_print "auto": accelerate's DeepSpeedPlugin always overwrites it
    f = "huggingface__optimum-habana/llama3_ds_zero3_4k.json"
    assert outcome[f] == "faithful" and "steps_per_print auto left out" in notes[f], notes[f]
    # MULTI_GPU with one process: a process group of one, kept (the accelerate config back says MULTI_GPU)
    for f in ("PKU-YuanGroup__Open-Sora-Plan/ddp_config.yaml", "OptimalScale__LMFlow/accelerate_multigpu_config.yaml"):
        assert outcome[f] == "faithful", f


def test_every_key_deepspeed_reads_is_known(tmp_path):
    """DeepSpeedConfig itself, given a dict that records each top-level key it looks up: every one
    is a key hfscale's DeepSpeed key tree has (typed or accepted in extra), and the keys DeepSpeed
    refuses carry its own message."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    from hfscale.config.sources.deepspeed import deepspeed_keys, deepspeed_removed_keys

    seen: set[str] = set()

    class Recording(dict):
        def get(self, k, d=None):
            seen.add(k)
            return super().get(k, d)

        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

        def __copy__(self):
            return self

    DeepSpeedConfig(Recording({"train_batch_size": 1}))
    keys = deepspeed_keys().keys
    assert len(seen) > 40
    assert sorted(seen - set(keys)) == []
    # and nothing more: the rest are sections other parts of DeepSpeed read (deepspeed.initialize, the
    # engine), or keys read only in other situations (a group of several ranks; the old boolean ZeRO form)
    assert set(keys) - seen - set(deepspeed_removed_keys()) <= {
        "activation_checkpointing", "aio", "autotuning", "flops_profiler", "optimizer", "scheduler",
        "sequence_parallel_size", "data_parallel_size", "allgather_size", "bfloat16"}
    removed = deepspeed_removed_keys()
    assert removed and all(keys[k].unread and removed[k] in keys[k].unread for k in removed)
    for name in removed:  # DeepSpeed refuses each one; so does hfscale, with DeepSpeed's words
        with pytest.raises(Exception, match="removed"):
            DeepSpeedConfig({"train_batch_size": 1, name: {}})
