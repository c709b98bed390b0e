"""hfscale.checkpoints.resume: which checkpoint a restarted job resumes from, and that the resumed job ends
exactly where an uninterrupted one does (preemption by SIGTERM, a damaged newest checkpoint, a rank
killed under torchrun --max-restarts, rotation with save_total_limit=1)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import pytest
from scripts import trainer_runs
from scripts.trainer_runs import COMMON, Job, run

from hfscale.checkpoints.resume import (
    MARKER,
    IncompleteCheckpointWarning,
    checkpoint_problem,
    latest_checkpoint,
    rotate_checkpoints,
    write_marker,
)

# ---- latest_checkpoint on fabricated folders -----------------------------------------------------


def fake_checkpoint(root: Path, step: int, world: int = 2, deepspeed: bool = True, mark: bool = True) -> Path:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (d / "model.safetensors").write_bytes(b"w" * 100)
    if deepspeed:
        tag = d / f"global_step{step}"
        tag.mkdir()
        (d / "latest").write_text(f"global_step{step}")
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"m" * 10)
        for r in range(world):
            (tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"o" * 10)
    if mark:
        write_marker(d, step, world)
    return d


def latest_with_warnings(root) -> tuple[str | None, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = latest_checkpoint(root)
    assert all(issubclass(w.category, IncompleteCheckpointWarning) for w in caught)
    return found, [str(w.message) for w in caught]


def test_fresh_run_has_nothing_to_resume(tmp_path):
    assert latest_with_warnings(tmp_path / "missing") == (None, [])
    assert latest_with_warnings(tmp_path) == (None, [])
    assert latest_checkpoint(None) is None
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "checkpoint-7").write_text("a file, not a folder")
    assert latest_with_warnings(tmp_path) == (None, [])


def test_newest_complete_by_step_number(tmp_path):
    for step in (2, 10, 9):
        fake_checkpoint(tmp_path, step)
    assert latest_with_warnings(tmp_path) == (str(tmp_path / "checkpoint-10"), [])


def test_marker_lists_every_file_with_its_size(tmp_path):
    d = fake_checkpoint(tmp_path, 4)
    doc = json.loads((d / MARKER).read_text())
    assert doc["global_step"] == 4 and doc["world_size"] == 2 and doc["format"] == 1
    assert doc["files"] == {
        "global_step4/mp_rank_00_model_states.pt": 10,
        "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt": 10,
        "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt": 10,
        "latest": len("global_step4"),
        "model.safetensors": 100,
        "trainer_state.json": len(json.dumps({"global_step": 4})),
    }
    assert [p.name for p in d.iterdir() if "tmp" in p.name] == []
    write_marker(d, 4, 2, fsync=True)
    assert checkpoint_problem(d) is None


def damage_unmarked(d: Path) -> str:
    (d / MARKER).unlink()
    return "no hfscale_complete.json"


def damage_cut_short(d: Path) -> str:
    os.truncate(d / "model.safetensors", 40)
    return "model.safetensors has 40 bytes, 100 when saved"


def damage_file_deleted(d: Path) -> str:
    (d / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    return "global_step6/zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"


def damage_shard_not_in_manifest(d: Path) -> str:
    # The marker itself is consistent, but a DeepSpeed rank's shard never arrived.
    (d / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    write_marker(d, 6, 2)
    return "DeepSpeed shard(s) missing in global_step6/: zero_pp_rank_1_mp_rank_00_optim_states.pt"


def damage_latest_tag(d: Path) -> str:
    (d / "latest").write_text("global_step99")
    write_marker(d, 6, 2)
    return "DeepSpeed tag folder 'global_step99' named in 'latest' is missing"


def damage_state_step(d: Path) -> str:
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    write_marker(d, 6, 2)
    return "trainer_state.json says step 5, hfscale_complete.json says 6"


def damage_no_trainer_state(d: Path) -> str:
    (d / "trainer_state.json").unlink()
    write_marker(d, 6, 2)
    return "trainer_state.json is not part of the checkpoint"


def damage_corrupt_marker(d: Path) -> str:
    (d / MARKER).write_text('{"files": ')
    return "unreadable hfscale_complete.json"


def damage_escaping_path(d: Path) -> str:
    doc = json.loads((d / MARKER).read_text())
    doc["files"]["../checkpoint-4/model.safetensors"] = 100
    (d / MARKER).write_text(json.dumps(doc))
    return "a path outside the checkpoint"


def damage_wrong_folder(d: Path) -> str:
    write_marker(d, 5, 2)
    return "hfscale_complete.json is for step 5, the folder name says 6"


@pytest.mark.parametrize("damage", [
    damage_unmarked, damage_cut_short, damage_file_deleted, damage_shard_not_in_manifest, damage_latest_tag,
    damage_state_step, damage_no_trainer_state, damage_corrupt_marker, damage_escaping_path, damage_wrong_folder,
], ids=lambda f: f.__name__.removeprefix("damage_"))
def test_damaged_newest_is_skipped_with_a_warning_naming_it(tmp_path, damage):
    fake_checkpoint(tmp_path, 4)
    why = damage(fake_checkpoint(tmp_path, 6))
    found, warned = latest_with_warnings(tmp_path)
    assert found == str(tmp_path / "checkpoint-4")
    assert len(warned) == 1
    assert f"not resuming from {tmp_path / 'checkpoint-6'}: " in warned[0] and why in warned[0]


def test_no_complete_checkpoint_means_scratch_with_a_warning(tmp_path):
    fake_checkpoint(tmp_path, 4, mark=False)
    fake_checkpoint(tmp_path, 8, mark=False)
    found, warned = latest_with_warnings(tmp_path)
    assert found is None and len(warned) == 3
    assert "training starts from scratch" in warned[-1] and "(2 incomplete)" in warned[-1]


def test_plain_trainer_checkpoint_without_deepspeed(tmp_path):
    fake_checkpoint(tmp_path, 3, world=1, deepspeed=False)
    assert latest_with_warnings(tmp_path) == (str(tmp_path / "checkpoint-3"), [])


def names(root: Path) -> list[str]:
    return sorted((p.name for p in root.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def test_rotation_never_deletes_the_newest_complete(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 6, mark=False)  # a save in progress or cut short: newer than the newest complete
    assert rotate_checkpoints(tmp_path, 1) == [str(tmp_path / "checkpoint-2")]
    assert names(tmp_path) == ["checkpoint-4", "checkpoint-6"]
    assert rotate_checkpoints(tmp_path, 1) == []
    found, warned = latest_with_warnings(tmp_path)
    assert found == str(tmp_path / "checkpoint-4") and "checkpoint-6: no hfscale_complete.json" in warned[0]


def test_rotation_deletes_old_incomplete_and_protects_best(tmp_path):
    fake_checkpoint(tmp_path, 2)  # best model
    fake_checkpoint(tmp_path, 4, mark=False)  # left by a crashed save
    fake_checkpoint(tmp_path, 6)
    fake_checkpoint(tmp_path, 8)
    deleted = rotate_checkpoints(tmp_path, 1, protect=[tmp_path / "checkpoint-2"])
    assert deleted == [str(tmp_path / "checkpoint-4"), str(tmp_path / "checkpoint-6")]
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-8"]


def test_rotation_without_limit_or_complete_checkpoint_deletes_nothing(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    assert rotate_checkpoints(tmp_path, None) == [] and rotate_checkpoints(tmp_path, 0) == []
    other = tmp_path / "other"
    fake_checkpoint(other, 2, mark=False)
    fake_checkpoint(other, 4, mark=False)
    assert rotate_checkpoints(other, 1) == []
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-4"] and names(other) == ["checkpoint-2", "checkpoint-4"]


# ---- real jobs: 2 ranks, DeepSpeed ZeRO-2 on CPU, torchrun ----------------------------------------

STOP_LINE = "preemption: saving checkpoint-{k} and stopping ({why})"


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_on_all_and_resume_is_exact(tmp_path, tmp_path_factory):
    ref = trainer_runs.reference(tmp_path_factory).result
    out = tmp_path / "out"
    job = Job(out, [*COMMON, "--step-sleep", "0.1"])
    job.wait_for(out / "checkpoint-4" / MARKER)
    os.kill(job.pid(1), signal.SIGTERM)  # rank 1 only: rank 0 learns it through the all-reduce
    stopped = job.finish()

    assert stopped.rc == 0, stopped.tail()  # both ranks exited 0, so torchrun did too
    assert stopped.exit_codes() == ["0", "0"]
    res = stopped.result
    k = res["global_step"]
    assert res["preempted"] and 5 <= k <= 14, res
    assert stopped.log.count(STOP_LINE.format(k=k, why="SIGTERM")) == 1
    assert stopped.log.count(STOP_LINE.format(k=k, why="no signal here (another rank got one)")) == 1
    assert latest_checkpoint(out) == str(out / f"checkpoint-{k}")
    assert res["marked"][-1] == str(out / f"checkpoint-{k}")

    resumed = run(out, COMMON)
    assert resumed.rc == 0, resumed.tail()
    res2 = resumed.result
    assert res2["resumed_from"] == str(out / f"checkpoint-{k}")
    assert res2["global_step"] == ref["global_step"] == 16
    assert res2["final_loss"] == ref["final_loss"]  # bitwise: same repr of the float
    assert res2["train_loss"] == ref["train_loss"]


@pytest.mark.slow
def test_damaged_newest_checkpoint_of_a_real_run_is_skipped(tmp_path, tmp_path_factory):
    ref = trainer_runs.reference(tmp_path_factory)
    assert names(ref.out) == ["checkpoint-12", "checkpoint-16"]

    cut = tmp_path / "cut"
    shutil.copytree(ref.out, cut)
    model = cut / "checkpoint-16" / "model.safetensors"
    os.truncate(model, model.stat().st_size // 2)
    with pytest.warns(IncompleteCheckpointWarning, match=r"checkpoint-16: model\.safetensors has \d+ bytes"):
        assert latest_checkpoint(cut) == str(cut / "checkpoint-12")

    out = tmp_path / "out"
    shutil.copytree(ref.out, out)
    (out / "checkpoint-16" / "global_step16" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.warns(IncompleteCheckpointWarning, match=r"checkpoint-16: global_step16/zero_pp_rank_1_mp_rank_00"):
        assert latest_checkpoint(out) == str(out / "checkpoint-12")

    resumed = run(out, COMMON)
    assert resumed.rc == 0, resumed.tail()
    assert f"not resuming from {out / 'checkpoint-16'}" in resumed.log
    res = resumed.result
    assert res["resumed_from"] == str(out / "checkpoint-12") and res["global_step"] == 16
    assert res["final_loss"] == ref.result["final_loss"]
    assert latest_checkpoint(out) == str(out / "checkpoint-16")  # saved again, complete this time


# ---- rotation with save_total_limit=1: the ordering in Trainer._save_checkpoint -------------------

ROTATION = ["--max-steps", "8", "--save-steps", "2", "--save-total-limit", "1", "--logging-steps", "2"]


@pytest.mark.slow
def test_save_total_limit_1_never_leaves_zero_complete_checkpoints(tmp_path):
    # The process dies in on_save of step 6: the Trainer has saved checkpoint-6 and run its own
    # rotation, no marker is written yet.
    crash = ["--crash-on-save-step", "6"]

    plain = tmp_path / "plain"  # the Trainer alone: rotation deleted checkpoint-4 before step 6 was done
    r = run(plain, [*ROTATION, *crash, "--callbacks", "metrics"], nproc=0)
    assert r.rc == 17, r.tail()
    assert names(plain) == ["checkpoint-6"]

    out = tmp_path / "out"  # with CheckpointCompleteCallback
    r = run(out, [*ROTATION, *crash], nproc=0)
    assert r.rc == 17, r.tail()
    assert names(out) == ["checkpoint-4", "checkpoint-6"]
    assert checkpoint_problem(out / "checkpoint-4") is None
    # No marker on checkpoint-6, but this one process wrote all of it before on_save: complete by its files.
    assert not (out / "checkpoint-6" / MARKER).exists() and checkpoint_problem(out / "checkpoint-6") is None
    assert latest_checkpoint(out) == str(out / "checkpoint-6")
    # Had the save of step 6 been cut short, the callback's rotation kept checkpoint-4 to fall back on
    # (the Trainer alone had deleted it).
    os.truncate(out / "checkpoint-6" / "rng_state.pth", 10)
    with pytest.warns(IncompleteCheckpointWarning, match="checkpoint-6: no hfscale_complete.json, and by its own "
                                                         "files: rng_state.pth is cut short"):
        assert latest_checkpoint(out) == str(out / "checkpoint-4")

    r = run(out, ROTATION, nproc=0)
    assert r.rc == 0, r.tail()
    assert r.result["resumed_from"] == str(out / "checkpoint-4") and r.result["global_step"] == 8
    assert names(out) == ["checkpoint-8"] and latest_checkpoint(out) == str(out / "checkpoint-8")
