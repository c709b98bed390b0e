"""Exporting a Trainer checkpoint as one Hugging Face model folder (hfscale.checkpoints.export).

2 CPU processes train a tiny GPT-2 (fp32, dropout 0) for 4 steps through ``hfscale launch`` with an
unchanged HfArgumentParser Trainer script (tests/scripts/export_clm.py), under DeepSpeed ZeRO-1,
ZeRO-2, ZeRO-3 and DDP (a whole model.safetensors); checkpoints at steps 2 and 4. After training
the script runs the model as the Trainer holds it on fixed input ids and saves the logits. The
export of the last checkpoint, loaded with ``AutoModelForCausalLM.from_pretrained`` in fp32,
must give those logits (max abs difference <= 1e-5); the export of step 2 must not (so the
comparison can fail).

FSDP2: not through the Trainer here. On a machine without a GPU accelerate runs the job as
MULTI_CPU and drops the FSDP plugin, so ``distributed.backend: fsdp`` trains with DDP and saves a
whole model (checked by hand: DDP's reducer warning, model.safetensors + optimizer.pt in the
checkpoint). FSDP2 itself works on CPU with gloo, so tests/scripts/fsdp2_checkpoint.py shards the
model with ``fully_shard`` in 2 processes, trains it, and saves it with accelerate's own
``save_fsdp_model`` / ``save_fsdp_optimizer`` (FSDP2 plugin, SHARDED_STATE_DICT) in the Trainer's
checkpoint layout; its reference logits come from the sharded model.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT
from hfscale.checkpoints.export import ExportError, export_model

pytestmark = pytest.mark.slow
MODEL = ("n_layer=2,n_head=2,n_embd=32,vocab_size=256,n_positions=64,bos_token_id=0,eos_token_id=0,"
         "resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0")
ENGINES = {"zero1": ({"backend": "deepspeed", "deepspeed": {"stage": 1}}, 29960),
           "zero2": ({"backend": "deepspeed", "deepspeed": {"stage": 2}}, 29961),
           "zero3": ({"backend": "deepspeed", "deepspeed": {"stage": 3}}, 29962),
           "whole": ({"backend": "ddp"}, 29963)}
FSDP2_PORT = 29964
TOLERANCE = 1e-5


def launch(tmp: Path, engine: str) -> Path:
    """Train with ``engine`` in ``tmp/<engine>``; the folder holds out/ (checkpoints) and ref.pt."""
    distributed, port = ENGINES[engine]
    work = tmp / engine
    work.mkdir()
    doc = {"name": f"export-{engine}", "cluster": {"nproc_per_node": 2, "master_port": port},
           "runner": {"launcher": "torchrun", "run_dir": str(work / "runs"), "workdir": str(work)},
           "distributed": distributed, "precision": "no",
           "batch": {"micro_batch_size": 2, "global_batch_size": 4},
           "env": {"vars": {"OMP_NUM_THREADS": "1"}},
           "training": {"script": str(ROOT / "tests" / "scripts" / "export_clm.py"), "output_dir": "out",
                        "max_steps": 4, "save_steps": 2, "logging_steps": 1, "learning_rate": 1.0e-3, "seed": 3,
                        "script_args": ["--config_overrides", MODEL, "--logits_file", "ref.pt",
                                        "--disable_tqdm", "true"]}}
    (work / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "hfscale", "launch", str(work / "job.yaml")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"{engine}: trained in {time.monotonic() - start:.1f} s")
    return work


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """engine -> its finished run folder (each trained once, when a test first asks for it)."""
    tmp = tmp_path_factory.mktemp("export")
    done: dict[str, Path] = {}

    def get(engine: str) -> Path:
        if engine not in done:
            done[engine] = launch(tmp, engine)
        return done[engine]

    return get


def logits_difference(out: Path, ref: dict) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"]).logits
    return (logits - ref["logits"]).abs().max().item()


def check_folder(out: Path) -> None:
    """The export is a whole model folder: weights, config, the run's generation setting, tokenizer."""
    from transformers import AutoTokenizer, GenerationConfig

    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert GenerationConfig.from_pretrained(out).max_new_tokens == 7  # the script's, not a default
    assert AutoTokenizer.from_pretrained(out)("b1 b2")["input_ids"] == [1, 2]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_export_gives_the_logits_of_the_model_at_training_time(trained, tmp_path, engine):
    work = trained(engine)
    ref = torch.load(work / "ref.pt")
    assert ref["global_step"] == 4
    start = time.monotonic()
    result = export_model(work / "out", tmp_path / "final")
    took = time.monotonic() - start
    assert result.kind == engine and result.checkpoint == str(work / "out" / "checkpoint-4")
    assert result.parameters == 35712  # GPT-2 2x32, vocab 256: the tied lm_head counted once
    assert set(result.files) == {p.name for p in (tmp_path / "final").iterdir()}
    check_folder(tmp_path / "final")
    diff = logits_difference(tmp_path / "final", ref)
    print(f"{engine}: export {took:.2f} s ({result.weights}); max abs logit difference {diff:.3g}")
    assert diff <= TOLERANCE

    # the comparison can fail: the model of step 2 gives other logits
    earlier = export_model(work / "out" / "checkpoint-2", tmp_path / "step2")
    assert logits_difference(tmp_path / "step2", ref) > 1e-3 and earlier.kind == engine


@pytest.mark.parametrize("engine", ["zero1", "zero2"])
def test_zero_1_2_use_the_master_weights_not_the_whole_model_file(trained, tmp_path, engine):
    """ZeRO-1/2 checkpoints also hold a whole model.safetensors; the export reads the fp32 ZeRO
    state (says so) and, trained in fp32, both agree exactly."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "out" / "checkpoint-4"
    shutil.copytree(trained(engine) / "out" / "checkpoint-4", ckpt)
    saved = load_file(ckpt / "model.safetensors")
    # the Trainer's copy blanked (same size, so the completeness marker still holds): were it read,
    # the export would be zeros
    save_file({k: torch.zeros_like(v) for k, v in saved.items()}, ckpt / "model.safetensors", metadata={"format": "pt"})
    result = export_model(ckpt, tmp_path / "final")
    assert result.weights == ("fp32 master weights in global_step4/ (DeepSpeed zero_to_fp32; model.safetensors, "
                              "the Trainer's copy, not read)")
    exported = load_file(tmp_path / "final" / "model.safetensors")
    assert set(exported) == set(saved) - {"lm_head.weight"}  # the Trainer's file keeps the tied twin too
    assert all(torch.equal(exported[k], saved[k]) for k in exported)


def test_a_universal_conversion_beside_the_shards_is_not_read(trained, tmp_path):
    """After a resume at another world size the checkpoint also holds DeepSpeed's universal
    conversion (hfscale.checkpoints.reshard); the export still reads the tag ``latest`` names, and gives the same."""
    out = tmp_path / "out"
    shutil.copytree(trained("zero2") / "out", out)
    ckpt = out / "checkpoint-4"
    r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        str(ckpt / "global_step4"), "--output_folder", str(ckpt / "global_step4_universal"),
                        "--inject_missing_state"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (ckpt / "latest_universal").is_file()
    converted = list((ckpt / "global_step4_universal").rglob("*.pt"))
    assert converted
    for f in converted:  # were the conversion read, the export would fail
        f.write_bytes(b"not a checkpoint")
    result = export_model(out, tmp_path / "final")
    assert result.checkpoint == str(ckpt) and "in global_step4/" in result.weights
    assert logits_difference(tmp_path / "final", torch.load(trained("zero2") / "ref.pt")) <= TOLERANCE


def test_fsdp2_sharded_checkpoint(tmp_path):
    out = tmp_path / "run"
    start = time.monotonic()
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "fsdp2_checkpoint.py"), str(out),
                        "--port", str(FSDP2_PORT)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"fsdp2: trained and saved in {time.monotonic() - start:.1f} s")
    ckpt = out / "checkpoint-4"
    assert (ckpt / "pytorch_model_fsdp_0" / ".metadata").is_file() and not (ckpt / "config.json").exists()
    assert len(list((ckpt / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2  # one file per rank

    with pytest.raises(ExportError) as e:
        export_model(out, tmp_path / "final")
    assert str(e.value) == (f"{ckpt}: no config.json in it or in {out} (the Trainer writes none into a sharded "
                            "FSDP checkpoint); give the model's folder or config.json with config=")
    assert not (tmp_path / "final").exists()

    result = export_model(out, tmp_path / "final", config=out / "model")
    assert result.kind == "fsdp2" and result.checkpoint == str(ckpt) and result.parameters == 35712
    check_folder(tmp_path / "final")
    ref = torch.load(out / "ref.pt")
    diff = logits_difference(tmp_path / "final", ref)
    print(f"fsdp2: max abs logit difference {diff:.3g}")
    assert diff <= TOLERANCE
    assert (ref["initial_logits"] - ref["logits"]).abs().max() > 1e-3  # training moved them: a real comparison

    for name in ("config.json", "generation_config.json"):  # found in the output_dir without config=
        shutil.copy(out / "model" / name, out / name)
    assert export_model(ckpt, tmp_path / "again").kind == "fsdp2"


def test_an_output_dir_gives_its_newest_complete_checkpoint(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained("zero2") / "out", out)
    (out / "checkpoint-4" / "rng_state_1.pth").unlink()  # rank 1 did not finish saving step 4
    assert export_model(out, tmp_path / "final").checkpoint == str(out / "checkpoint-2")

    with pytest.raises(ExportError) as e:
        export_model(out / "checkpoint-4", tmp_path / "other")
    assert str(e.value) == (f"{out / 'checkpoint-4'}: incomplete checkpoint: no hfscale_complete.json, and by its "
                            "own files: DeepSpeed shards of 2 ranks but RNG states of 1: a rank did not finish saving")

    (out / "checkpoint-2" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ExportError) as e:
        export_model(out, tmp_path / "other")
    assert str(e.value).startswith(f"{out}: none of its 2 checkpoint folder(s) is complete (checkpoint-4: ")
    assert "; checkpoint-2: " in str(e.value) and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in str(e.value)
    assert not (tmp_path / "other").exists()


def test_errors_name_the_path_and_leave_nothing_behind(trained, tmp_path):
    ckpt = trained("zero2") / "out" / "checkpoint-4"
    with pytest.raises(ExportError, match=f"^{re.escape(str(tmp_path / 'nope'))}: no such file or directory$"):
        export_model(tmp_path / "nope", tmp_path / "final")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="neither a Trainer checkpoint .* nor an output_dir"):
        export_model(tmp_path / "empty", tmp_path / "final")
    with pytest.raises(ExportError, match="would overwrite or sit inside the checkpoint"):
        export_model(ckpt, ckpt / "export", force=True)
    with pytest.raises(ExportError, match="would overwrite or sit inside the checkpoint"):
        export_model(ckpt, ckpt.parent, force=True)  # the output_dir holding it

    final = tmp_path / "final"
    final.mkdir()
    (final / "old.txt").write_text("keep me")
    with pytest.raises(ExportError) as e:
        export_model(ckpt, final)
    assert str(e.value) == (f"{final}: exists and is a non-empty directory; choose another folder or pass force "
                            "to replace it")
    assert [p.name for p in final.iterdir()] == ["old.txt"]
    result = export_model(ckpt, final, force=True)
    assert "old.txt" not in result.files and sorted(p.name for p in final.iterdir()) == list(result.files)

    # weights that do not fit the config: an error, and neither out nor a staging folder remains
    (tmp_path / "wide").mkdir()
    config = (ckpt / "config.json").read_text().replace('"n_embd": 32', '"n_embd": 64')
    (tmp_path / "wide" / "config.json").write_text(config)
    bad = tmp_path / "sub" / "bad"
    with pytest.raises(ExportError) as e:
        export_model(ckpt, bad, config=tmp_path / "wide")
    assert str(e.value) == (f"{ckpt}: the weights do not fit the model of {tmp_path / 'wide' / 'config.json'}: "
                            "transformer.wte.weight is [256, 32] in the checkpoint, [256, 64] in the model; "
                            "transformer.wpe.weight is [64, 32] in the checkpoint, [64, 64] in the model; "
                            "transformer.h.0.attn.c_attn.weight is [32, 96] in the checkpoint, [64, 192] in the model "
                            "(and 26 more)")
    assert list((tmp_path / "sub").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "final", "sub", "wide"]
