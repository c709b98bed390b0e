"""A checkpoint without hfscale's marker (an unchanged script saved it) judged complete or not by its
own files. The folders are laid out as the HF Trainer writes them (DeepSpeed ZeRO-2/3, DDP, one
process), with real torch.save and safetensors files, then damaged the ways a killed save leaves them."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hfscale.checkpoints.files import content_problem, safetensors_whole, zip_whole
from hfscale.checkpoints.resume import checkpoint_problem, decide, latest_checkpoint, scan_output


def _pt(path: Path, n: int = 64) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"t": torch.arange(n, dtype=torch.float32)}, path)


def trainer_checkpoint(root: Path, step: int, layout: str = "zero2", ranks: int = 2) -> Path:
    """A checkpoint-<step> folder as the Trainer saves it with ``layout``: zero2, zero3, ddp or single."""
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    save_file({"w": torch.zeros(8, 8)}, str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    if layout in ("zero2", "zero3"):
        tag = d / f"global_step{step}"
        for r in range(ranks):
            _pt(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
            if layout == "zero3":
                _pt(tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        if layout == "zero2":
            _pt(tag / "mp_rank_00_model_states.pt")
        (d / "latest").write_text(f"global_step{step}")
    else:
        _pt(d / "optimizer.pt")
    _pt(d / "scheduler.pt", 4)
    if layout == "single":
        _pt(d / "rng_state.pth", 4)
    else:
        for r in range(ranks):
            _pt(d / f"rng_state_{r}.pth", 4)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": 40, "log_history": []}))
    return d


@pytest.mark.parametrize("layout", ["zero2", "zero3", "ddp", "single"])
def test_a_whole_checkpoint_is_complete_by_its_files(tmp_path, layout):
    d = trainer_checkpoint(tmp_path, 20, layout)
    assert content_problem(d, 20) is None
    assert checkpoint_problem(d) is None
    assert latest_checkpoint(tmp_path) == str(d)


def test_file_checks_on_real_formats(tmp_path):
    _pt(tmp_path / "a.pt", 5000)
    save_file({"w": torch.zeros(100)}, str(tmp_path / "m.safetensors"))
    assert zip_whole(tmp_path / "a.pt") and safetensors_whole(tmp_path / "m.safetensors")
    for name in ("a.pt", "m.safetensors"):
        os.truncate(tmp_path / name, (tmp_path / name).stat().st_size - 10)
    assert not zip_whole(tmp_path / "a.pt") and not safetensors_whole(tmp_path / "m.safetensors")
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 20)
    assert not zip_whole(tmp_path / "empty.pt") and not safetensors_whole(tmp_path / "junk.safetensors")


def _cut(p: Path) -> None:
    os.truncate(p, p.stat().st_size // 2)


DAMAGE = {
    # what a killed save leaves, and the reason given
    "rank 1 never wrote its RNG state": (lambda d: (d / "rng_state_1.pth").unlink(),
                                        "DeepSpeed shards of 2 ranks but RNG states of 1"),
    "rank 0 never wrote trainer_state.json": (lambda d: (d / "trainer_state.json").unlink(),
                                             "trainer_state.json is missing (rank 0 writes it last"),
    "a shard cut short": (lambda d: _cut(d / "global_step20" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                          "global_step20/zero_pp_rank_1_mp_rank_00_optim_states.pt is cut short"),
    "a shard missing": (lambda d: (d / "global_step20" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
                        "DeepSpeed shards of 1 ranks but RNG states of 2"),
    "model cut short": (lambda d: _cut(d / "model.safetensors"), "model.safetensors is cut short"),
    "RNG state cut short": (lambda d: _cut(d / "rng_state_0.pth"), "rng_state_0.pth is cut short"),
    "no latest tag": (lambda d: (d / "latest").unlink(), "DeepSpeed file 'latest' is missing"),
    "save_only_model": (lambda d: [(d / f"rng_state_{r}.pth").unlink() for r in (0, 1)],
                        "no rng_state*.pth"),
    "state of another step": (lambda d: (d / "trainer_state.json").write_text('{"global_step": 19}'),
                              "trainer_state.json says step 19, the folder name says 20"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_skipped_with_the_reason(tmp_path, case):
    damage, why = DAMAGE[case]
    older = trainer_checkpoint(tmp_path, 10)
    d = trainer_checkpoint(tmp_path, 20)
    damage(d)
    assert why in (content_problem(d, 20) or "")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_checkpoint(tmp_path) == str(older)
    assert f"not resuming from {d}: no hfscale_complete.json, and by its own files: " in str(caught[0].message)


def test_ddp_without_optimizer_is_incomplete(tmp_path):
    d = trainer_checkpoint(tmp_path, 5, "ddp")
    (d / "optimizer.pt").unlink()
    assert content_problem(d, 5) == "optimizer.pt is missing"


def test_fsdp_folders_need_their_metadata(tmp_path):
    d = trainer_checkpoint(tmp_path, 5, "ddp")
    (d / "optimizer.pt").unlink()
    (d / "model.safetensors").unlink()
    (d / "pytorch_model_fsdp_0").mkdir()
    (d / "optimizer_0").mkdir()
    assert content_problem(d, 5) == "pytorch_model_fsdp_0/.metadata is missing (the sharded save did not finish)"
    (d / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"x")
    assert content_problem(d, 5) == "optimizer_0/.metadata is missing (the sharded save did not finish)"
    (d / "optimizer_0" / ".metadata").write_bytes(b"x")
    assert content_problem(d, 5) is None


def test_deepspeed_state_of_another_world_size_is_resumed_only_through_a_universal_checkpoint(tmp_path):
    d = trainer_checkpoint(tmp_path, 20, "zero2", ranks=4)
    assert checkpoint_problem(d, world_size=4) is None
    assert checkpoint_problem(d, world_size=2) == (
        "DeepSpeed ZeRO state saved by 4 processes; this job has 2, and DeepSpeed loads ZeRO shards only into as "
        "many processes as wrote them (hfscale launch converts it to a universal checkpoint first)")
    assert checkpoint_problem(d, world_size=2, reshard=True) is None  # the launch converts it
    assert scan_output(tmp_path, 2, reshard=True).saved_world == 4
    uni = d / "global_step20_universal"
    (uni / "zero").mkdir(parents=True)
    (uni / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert checkpoint_problem(d, world_size=2) is not None  # a conversion without latest_universal is unfinished
    (d / "latest_universal").write_text("global_step20_universal")
    assert checkpoint_problem(d, world_size=2) is None
    assert scan_output(tmp_path, 2).universal
    plain = trainer_checkpoint(tmp_path / "ddp", 20, "ddp", ranks=4)
    assert checkpoint_problem(plain, world_size=2) is None  # a whole optimizer loads into any world size


def test_decisions(tmp_path):
    assert decide(scan_output(tmp_path / "none", 2), 40).action == "fresh"
    trainer_checkpoint(tmp_path, 10)
    d = trainer_checkpoint(tmp_path, 20)
    assert decide(scan_output(tmp_path, 2), 40) == decide(scan_output(tmp_path, 2), None)
    assert decide(scan_output(tmp_path, 2), 40).checkpoint == str(d)
    done = decide(scan_output(tmp_path, 2), 20)
    assert (done.action, done.reason) == ("done", f"{d} is at step 20, max_steps is 20")
    for c in (10, 20):
        (tmp_path / f"checkpoint-{c}" / "rng_state_1.pth").unlink()
    refuse = decide(scan_output(tmp_path, 2), 40)
    assert refuse.action == "refuse" and refuse.reason.startswith(f"{tmp_path} holds 2 checkpoint(s) but none is "
                                                                  "complete (checkpoint-20: no hfscale_complete.json")
