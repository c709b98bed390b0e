"""Asynchronous saves (training.async_save), the parts that start nothing: the YAML key, what check
says, the DeepSpeed JSON, the environment and tensors handed to DeepSpeed's decoupled writer, and
when CheckpointCompleteCallback marks a checkpoint whose writes are still pending (a stand-in engine,
one process). The real engine, 2 ranks and SIGKILLs: tests/test_async_save.py."""

from __future__ import annotations

import json
import logging
import types
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from hfscale.checkpoints.resume import MARKER, checkpoint_problem, latest_checkpoint
from hfscale.config.errors import ConfigError
from hfscale.render.deepspeed import deepspeed_config
from hfscale.rules.config_file import load_text
from hfscale.rules.deepspeed import ASYNC_WRITER
from hfscale.training import async_save
from hfscale.training.callbacks import CheckpointCompleteCallback

ROOT = Path(__file__).resolve().parents[1]


def job(training: str = "async_save: true", distributed: str = "{backend: deepspeed, deepspeed: {stage: 2}}"):
    text = f"""\
name: t
cluster: {{nproc_per_node: 2}}
distributed: {distributed}
batch: {{micro_batch_size: 1, gradient_accumulation_steps: 1}}
training: {{max_steps: 10, {training}}}
"""
    return load_text(text, "job.yaml", ROOT)


def problems(**kw) -> list[str]:
    with pytest.raises(ConfigError) as e:
        job(**kw)
    return [f"{p.path}: {p.message}" for p in e.value.problems]


def test_the_deepspeed_json_gets_the_decoupled_writer_only_when_asked():
    assert deepspeed_config(job())["checkpoint"] == {"writer": ASYNC_WRITER}
    assert ASYNC_WRITER == {"type": "python", "decoupled": True, "data_parallel": "replica"}
    assert "checkpoint" not in deepspeed_config(job("async_save: false"))
    assert "checkpoint" not in deepspeed_config(job("save_steps: 5"))  # off by default
    # a universal-checkpoint resume adds its key beside the writer
    assert deepspeed_config(job(), load_universal=True)["checkpoint"] == {"writer": ASYNC_WRITER,
                                                                         "load_universal": True}


def test_check_refuses_async_saves_without_deepspeed_zero():
    assert problems(distributed="{backend: ddp}") == [
        "training.async_save: needs distributed.backend: deepspeed (its decoupled checkpoint writer); with ddp "
        "the Trainer saves synchronously"]
    assert problems(distributed="{backend: deepspeed, deepspeed: {stage: 0}}") == [
        "training.async_save: needs ZeRO (distributed.deepspeed.stage 1, 2 or 3): hfscale tests DeepSpeed's "
        "decoupled checkpoint writer with ZeRO's sharded state only; stage is 0"]
    job(distributed="{backend: deepspeed, deepspeed: {stage: 3}}")  # accepted
    job(distributed="{backend: deepspeed, deepspeed: {stage: 1}}")


def test_the_writer_is_not_set_in_extra():
    found = problems(training="async_save: false",
                     distributed="{backend: deepspeed, deepspeed: {stage: 2, extra: {checkpoint: {writer: "
                                 "{decoupled: true}}}}}")
    assert found == ["distributed.deepspeed.extra.checkpoint.writer: hfscale sets this from training.async_save; "
                     "set it there"]


def test_cross_rank_and_size_come_from_torchrun():
    assert async_save.cross_env({"GROUP_RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "4"}) == {
        "CROSS_RANK": "3", "CROSS_SIZE": "4"}
    assert async_save.cross_env({}) == {"CROSS_RANK": "0", "CROSS_SIZE": "1"}
    assert async_save.cross_env({"CROSS_RANK": "1", "CROSS_SIZE": "2", "GROUP_RANK": "0"}) == {}  # DeepSpeed's launcher's
    assert async_save.cross_env({"WORLD_SIZE": "x", "LOCAL_WORLD_SIZE": "0"}) == {"CROSS_RANK": "0", "CROSS_SIZE": "1"}


def test_the_writer_gets_a_snapshot_in_shared_memory_views_kept_buffers_reused(tmp_path):
    flat = torch.arange(10.0, requires_grad=True) * 1  # ZeRO-1/2's flat fp32 group
    part = flat[:8]  # its partition without padding: a non-leaf view requiring grad (torch.multiprocessing refuses it)
    strided = flat[1::3]
    assert part.requires_grad and not part.is_leaf
    meta = OrderedDict(w=torch.ones(2))
    meta._metadata = {"": {"version": 1}}
    sd = {"optimizer_state_dict": {"single_partition_of_fp32_groups": [part], "step": 3, "pair": (strided, 1)},
          "module": meta, "plain": {"lr": 0.1}}
    pool: dict = {}
    out = async_save.snapshot(sd, pool)
    got = out["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    pair = out["optimizer_state_dict"]["pair"][0]
    assert torch.equal(got, part.detach()) and torch.equal(pair, strided.detach())
    assert not got.requires_grad and got.is_shared() and got.data_ptr() != part.data_ptr()
    # the two views of one storage are views of one copy, at the same offsets and strides
    assert got.untyped_storage().data_ptr() == pair.untyped_storage().data_ptr()
    assert (pair.storage_offset(), pair.stride()) == (1, (3,))
    assert out["optimizer_state_dict"]["step"] == 3 and out["plain"] is sd["plain"]  # no tensor: the same object
    assert type(out["module"]) is OrderedDict and out["module"]._metadata == {"": {"version": 1}}
    assert sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0] is part  # the original is left alone
    with torch.no_grad():
        flat.add_(100.0)  # the next optimizer step changes the live tensors; the snapshot does not change
    assert got[0].item() == 0.0 and pair[0].item() == 1.0
    # torch.save writes from the snapshot what it writes from the live tensors: one storage, two views
    torch.save(out, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    views = back["optimizer_state_dict"]["single_partition_of_fp32_groups"][0], back["optimizer_state_dict"]["pair"][0]
    assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()
    assert torch.equal(views[1], torch.tensor([1.0, 4.0, 7.0]))
    # the next save of the same file reuses the copies: nothing allocated, the new values in them
    again = async_save.snapshot(sd, pool)
    new = again["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    assert new.untyped_storage().data_ptr() == got.untyped_storage().data_ptr() and new[0].item() == 100.0
    assert len(pool) == 2  # the flat group's storage and the module's weight


# ---- CheckpointCompleteCallback with a stand-in for DeepSpeed's engine ------------------------------


class Engine:
    """What the callback reads of a DeepSpeedEngine with a decoupled checkpoint engine; its commit
    (async_save.commit, which needs DeepSpeed's process group) is a stand-in too."""

    def __init__(self) -> None:
        self.checkpoint_engine = types.SimpleNamespace(get_commit_info=lambda: self.info)
        self.info: object | None = None
        self.commits = 0

    def commit(self) -> bool:
        self.info = None
        self.commits += 1
        return True


def checkpoint(root: Path, step: int, world: int = 2, shards: bool = True) -> Path:
    """A Trainer + DeepSpeed checkpoint folder, every file whole (torch.save archives); ``shards``
    False: as it is while the writers are still at work (no shards, no ``latest``)."""
    d = root / f"checkpoint-{step}"
    (d / f"global_step{step}").mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    for r in range(world):
        torch.save({"r": r}, d / f"rng_state_{r}.pth")
    if shards:
        torch.save({}, d / f"global_step{step}" / "mp_rank_00_model_states.pt")
        for r in range(world):
            torch.save({}, d / f"global_step{step}" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        (d / "latest").write_text(f"global_step{step}")
    return d


@pytest.fixture
def engine(monkeypatch):
    e = Engine()
    monkeypatch.setattr(async_save, "_ENGINES", {e})
    monkeypatch.setattr(async_save, "commit", lambda engine, wait: engine.commit())
    return e


def hooks(tmp_path: Path, limit: int | None = None):
    cb = CheckpointCompleteCallback(save_total_limit=limit)
    args = types.SimpleNamespace(output_dir=str(tmp_path), should_save=True, world_size=2, save_total_limit=None)
    state = types.SimpleNamespace(global_step=0, best_model_checkpoint=None)
    cb.on_train_begin(args, state, None)
    return cb, args, state


def test_a_pending_save_is_marked_after_the_commit_not_before(tmp_path, engine):
    cb, args, state = hooks(tmp_path, limit=1)
    old = checkpoint(tmp_path, 4)
    state.global_step = 4
    cb.on_save(args, state, None)
    assert (old / MARKER).exists()

    state.global_step = 8
    new = checkpoint(tmp_path, 8, shards=False)
    engine.info = "global_step8"  # DeepSpeed's save returned, its writers are at work
    cb.on_save(args, state, None)
    assert cb.pending == (str(new), 8) and not (new / MARKER).exists()
    with pytest.warns(UserWarning, match="checkpoint-8: no hfscale_complete.json, and by its own files: DeepSpeed file .latest. is missing"):
        assert latest_checkpoint(tmp_path) == str(old)  # still the previous one, and rotation kept it
    state.global_step = 9
    cb.on_step_end(args, state, None)  # a step whose commit has not happened (gradient accumulation)
    assert not (new / MARKER).exists()

    checkpoint(tmp_path / "x", 8)  # the writers finish; DeepSpeed commits inside step 9's optimizer step
    for f in (tmp_path / "x" / "checkpoint-8").rglob("*"):
        if f.is_file():
            target = new / f.relative_to(tmp_path / "x" / "checkpoint-8")
            target.parent.mkdir(exist_ok=True)
            target.write_bytes(f.read_bytes())
    engine.info = None
    cb.on_step_end(args, state, None)
    assert cb.pending is None and checkpoint_problem(new) is None
    assert json.loads((new / MARKER).read_text())["global_step"] == 8
    assert not old.exists()  # rotated only now (save_total_limit 1)
    assert cb.marked == [str(old), str(new)]


def test_the_last_save_is_committed_at_train_end(tmp_path, engine):
    cb, args, state = hooks(tmp_path)
    state.global_step = 12
    ckpt = checkpoint(tmp_path, 12)
    engine.info = "global_step12"
    cb.on_save(args, state, None)
    assert not (ckpt / MARKER).exists()
    cb.on_train_end(args, state, None)
    assert engine.commits == 1 and checkpoint_problem(ckpt) is None and (ckpt / MARKER).exists()


def test_a_commit_that_left_the_folder_incomplete_is_not_marked(tmp_path, engine, caplog):
    cb, args, state = hooks(tmp_path)
    state.global_step = 12
    ckpt = checkpoint(tmp_path, 12)
    (ckpt / "global_step12" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()  # a writer that died
    engine.info = "global_step12"
    cb.on_save(args, state, None)
    with caplog.at_level(logging.ERROR):
        cb.on_train_end(args, state, None)
    assert not (ckpt / MARKER).exists()
    assert "not marking" in caplog.text and "DeepSpeed shards of 1 ranks but RNG states of 2" in caplog.text


def test_a_synchronous_save_is_marked_at_once(tmp_path, engine):
    cb, args, state = hooks(tmp_path)
    state.global_step = 4
    ckpt = checkpoint(tmp_path, 4)
    cb.on_save(args, state, None)  # no engine has a commit pending
    assert (ckpt / MARKER).exists() and cb.pending is None


def test_a_save_that_begins_before_the_previous_commit_marks_the_previous_first(tmp_path, engine):
    """The writers of step 8 were still at work when step 12 saved: DeepSpeed's save waited for their
    commit (async_save's save_checkpoint), so checkpoint-8 is marked at step 12's save, before
    checkpoint-12 becomes the pending one."""
    cb, args, state = hooks(tmp_path)
    state.global_step = 8
    first = checkpoint(tmp_path, 8)
    engine.info = "global_step8"
    cb.on_save(args, state, None)
    state.global_step = 12
    cb.on_step_end(args, state, None)  # still writing: not committed at any step in between
    assert cb.pending == (str(first), 8) and not (first / MARKER).exists()
    second = checkpoint(tmp_path, 12, shards=False)
    engine.info = "global_step12"  # step 8 committed inside the save, step 12 handed to the writers
    cb.on_save(args, state, None)
    assert (first / MARKER).exists() and json.loads((first / MARKER).read_text())["global_step"] == 8
    assert cb.pending == (str(second), 12) and not (second / MARKER).exists()

