"""The stream's saved position (hfscale.training.callbacks.data_state), its pure parts: the file read
back as hostile input, which checkpoint a resume means, and where the callback goes in a Trainer's
list. The runs: tests/test_data_state.py."""

from __future__ import annotations

import json
import os
import types

import pytest

from hfscale.training.callbacks.data_state import (MAX_BYTES, STATE_FILE, DataStateCallback, _resolve, _step_of,
                                                   attach, read_positions, write_positions)

POSITION = {"examples_iterable": {"shard_idx": 0, "shard_example_idx": 160, "type": "ArrowExamplesIterable"},
            "epoch": 0}


def test_positions_written_are_read_back(tmp_path):
    write_positions(str(tmp_path), 20, [POSITION, None], 40, 0)
    assert read_positions(str(tmp_path), 20, 2) == ([POSITION, None], "")
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


@pytest.mark.parametrize("case, why", [
    ("missing", "checkpoint-20 has no hfscale_data_state.json"),
    ("link", "is a symbolic link"),
    ("folder", "is a directory, not a file"),
    ("fifo", "is not a regular file (a FIFO)"),
    ("huge", f"over the {MAX_BYTES:,}-byte limit"),
    ("not json", "not valid JSON"),
    ("too deep", "JSON nested deeper than"),
    ("a list", "not a version 1 data state"),
    ("version 2", "not a version 1 data state"),
    ("another step", "is of step 19, the checkpoint of step 20"),
    ("another world", "saved at world size 4, resumed at 2"),
    ("second pass", "the stream was past its first pass"),
    ("short states", "'states' is not one position (or null) a rank"),
    ("states of strings", "'states' is not one position (or null) a rank"),
])
def test_a_bad_file_means_replay_and_says_why(tmp_path, case, why):
    ckpt = tmp_path / "checkpoint-20"
    ckpt.mkdir()
    path = ckpt / STATE_FILE
    good = {"version": 1, "step": 20, "world_size": 2, "pass": 0, "batches": 40, "states": [POSITION, None]}
    if case == "link":
        (tmp_path / "elsewhere.json").write_text(json.dumps(good))
        path.symlink_to(tmp_path / "elsewhere.json")
    elif case == "folder":
        path.mkdir()
    elif case == "fifo":
        os.mkfifo(path)  # never opened for a blocking read: the reader would wait for a writer for ever
    elif case == "too deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "huge":
        path.write_text(" " * (MAX_BYTES + 1))
    elif case == "not json":
        path.write_text("{")
    elif case == "a list":
        path.write_text("[]")
    elif case != "missing":
        changed = {"version 2": {"version": 2}, "another step": {"step": 19}, "another world": {"world_size": 4},
                   "second pass": {"pass": 1}, "short states": {"states": [POSITION]},
                   "states of strings": {"states": ["a", "b"]}}[case]
        path.write_text(json.dumps({**good, **changed}))
    states, reason = read_positions(str(ckpt), 20, 2)
    assert states is None and why in reason, reason


def test_which_checkpoint_a_resume_means(tmp_path):
    out = tmp_path / "out"
    assert _resolve(None, str(out)) is None and _resolve(False, str(out)) is None
    assert _resolve(True, str(out)) is None  # no output_dir yet: the Trainer itself says so
    for step in (5, 20, 10):
        (out / f"checkpoint-{step}").mkdir(parents=True)
    assert _resolve(True, str(out)) == str(out / "checkpoint-20")  # transformers' get_last_checkpoint
    assert _resolve(str(out / "checkpoint-5"), str(out)) == str(out / "checkpoint-5")
    assert _step_of(str(out / "checkpoint-20") + os.sep) == 20
    assert _step_of("best-model") is None and _step_of("checkpoint-x1") is None and _step_of("checkpoint-" + "9" * 40) is None


class _Trainer:
    """What attach uses of a Trainer: its callback list, add_callback, train and the loader's getter."""

    def __init__(self, *names):
        self.callback_handler = types.SimpleNamespace(callbacks=[type(n, (), {})() for n in names])
        self.args = types.SimpleNamespace(output_dir="out", ignore_data_skip=False)

    def add_callback(self, cb):
        self.callback_handler.callbacks.append(cb)

    def train(self, resume_from_checkpoint=None):
        return resume_from_checkpoint, self.args.ignore_data_skip

    def get_train_dataloader(self):
        return "a map-style loader"


def test_it_goes_before_the_marker_once_and_wraps_only_that_trainer():
    t = _Trainer("DefaultFlowCallback", "CheckpointCompleteCallback", "ProgressCallback")
    cb = attach(t)
    assert [type(c).__name__ for c in t.callback_handler.callbacks] == [
        "DefaultFlowCallback", "DataStateCallback", "CheckpointCompleteCallback", "ProgressCallback"]
    assert attach(t) is None and len(t.callback_handler.callbacks) == 4
    # the instance's methods are wrapped, not the class's
    assert {"train", "get_train_dataloader"} <= set(vars(t))
    assert vars(_Trainer)["train"].__qualname__ == "_Trainer.train" and "train" not in vars(_Trainer())
    # nothing changes for a dataset that is not a stream
    assert t.train("out/checkpoint-3") == ("out/checkpoint-3", False)
    assert t.get_train_dataloader() == "a map-style loader" and cb.resumed_at is None
    alone = _Trainer("DefaultFlowCallback")
    attach(alone)
    assert isinstance(alone.callback_handler.callbacks[-1], DataStateCallback)


def test_the_position_kept_is_the_one_after_the_last_batch_trained(tmp_path):
    """The loader reads ahead: after 3 optimizer steps of 2 micro-batches it has read 7 batches. The
    position saved is the one after the 6th, and a dataset given it goes on with example 24."""
    from datasets import Dataset

    def stream():
        return Dataset.from_dict({"i": list(range(100))}).to_iterable_dataset(num_shards=2)

    t = _Trainer()
    t.train_dataset = stream()
    t.args.gradient_accumulation_steps, t.args.should_save = 2, True
    cb = DataStateCallback(t)
    loader = types.SimpleNamespace(collate_fn=lambda batch: batch, dataset=t.train_dataset)
    cb._dataset = t.train_dataset
    cb._mark_batches(loader, t.train_dataset)
    cb.on_epoch_begin(t.args, types.SimpleNamespace(global_step=0), None)
    examples = iter(t.train_dataset)
    for _ in range(3 * 2 + 1):  # what the loader reads: 3 steps' batches and one ahead
        loader.collate_fn([next(examples) for _ in range(4)])
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    cb.save_position(str(ckpt), 3, t.args)
    states, why = read_positions(str(ckpt), 3, 1)
    assert states is not None, why
    resumed = stream()
    resumed.load_state_dict(states[0])
    assert next(iter(resumed))["i"] == 3 * 2 * 4
    # a pass past the first is not kept: the file of that step goes
    cb.on_epoch_begin(t.args, types.SimpleNamespace(global_step=3), None)
    cb.save_position(str(ckpt), 3, t.args)
    assert not (ckpt / STATE_FILE).exists()


def test_a_position_of_another_pipeline_does_not_fit():
    """A script changed between the save and the resume (a map added, another source): the saved
    position is refused before datasets would fail on it mid-training (or read the wrong example)."""
    from datasets import Dataset

    from hfscale.training.callbacks.data_state import misfit

    def source(n=100):
        return Dataset.from_dict({"i": list(range(n))}).to_iterable_dataset(num_shards=2)

    mapped = source().map(lambda ex: {"j": ex["i"] * 2})
    it = iter(mapped)
    for _ in range(10):
        next(it)
    saved = mapped.state_dict()
    again = source().map(lambda ex: {"j": ex["i"] * 2})
    before = again.state_dict()
    assert misfit(again, saved) is None and again.state_dict() == before  # nothing read, nothing changed
    assert misfit(source(), saved) == "the saved position does not fit this dataset's pipeline (changed since the save?)"
    assert misfit(source().map(lambda ex: ex).map(lambda ex: ex), saved) is not None
    wrong = json.loads(json.dumps(saved).replace('"shard_example_idx": ', '"shard_example_idx": "x", "y": '))
    assert misfit(again, wrong) is not None


def test_a_position_that_cannot_be_written_leaves_no_part_of_it(tmp_path):
    """The write fails at its last move (a folder where the file goes): nothing half-written is left in
    the checkpoint for its marker to list."""
    (tmp_path / STATE_FILE).mkdir()
    with pytest.raises(OSError):
        write_positions(str(tmp_path), 20, [POSITION], 8, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]
