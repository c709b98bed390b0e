"""The local tier's files and choices (hfscale.checkpoints.local_tier) and the buddy copy's byte stream
(hfscale.training.callbacks.buddy_stream): pure, on tmp folders; no process, no process group."""

from __future__ import annotations

import os
from pathlib import Path

from hfscale.checkpoints import local_tier as tier

LINEAGE = "0123456789abcdef"
WHOLE = {"trainer_state.json": 10, "global_step5/mp_rank_00_model_states.pt": 30,
         "global_step5/zero_pp_rank_0_mp_rank_00_optim_states.pt": 20,
         "global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt": 20, "rng_state_0.pth": 4, "rng_state_1.pth": 4}
NODE0 = ["trainer_state.json", "global_step5/mp_rank_00_model_states.pt",
         "global_step5/zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_state_0.pth"]
NODE1 = ["global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_1.pth"]


def node(root: Path, step: int, own: list[str], buddy: list[str], files=WHOLE, lineage=LINEAGE, world=2,
         holding=True) -> Path:
    for kind, paths in ((tier.OWN, own), (tier.BUDDY, buddy)):
        for rel in paths:
            p = tier.part(root, kind, step) / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x" * files[rel])
    if holding:
        tier.write_holding(root, tier.Holding(step=step, world_size=world, lineage=lineage, files=files, own=own,
                                              buddy=buddy))
    return root


def test_the_newest_step_complete_between_the_nodes_is_chosen(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    node(a, 5, NODE0, NODE1)
    node(b, 5, NODE1, NODE0)
    node(a, 10, NODE0, [], files={**WHOLE})  # step 10: node1's part is nowhere
    choice = tier.choose([tier.scan(a), tier.scan(b)], LINEAGE, 2, newer_than=-1)
    assert choice is not None and choice.step == 5
    assert set(choice.by_node[0]) == set(NODE0 + NODE1)  # node a holds it all (own + buddy copy): b copies nothing
    assert 1 not in choice.by_node


def test_a_lost_node_is_covered_by_its_buddys_copy(tmp_path: Path):
    b = node(tmp_path / "b", 5, NODE1, NODE0)  # node a is gone: b has a's part as buddy
    choice = tier.choose([tier.scan(b)], LINEAGE, 2, newer_than=-1)
    assert choice is not None and set(choice.by_node[0]) == set(WHOLE)
    folders = {Path(f).parent.name for f in choice.by_node[0].values()}
    assert folders == {tier.OWN, tier.BUDDY}


def test_steps_of_another_run_world_size_or_not_newer_are_not_restored(tmp_path: Path):
    a = node(tmp_path / "a", 5, NODE0, NODE1)
    b = node(tmp_path / "b", 5, NODE1, NODE0)
    scans = [tier.scan(a), tier.scan(b)]
    assert tier.choose(scans, "ffffffffffffffff", 2, -1) is None  # another lineage (a --restart)
    assert tier.choose(scans, None, 2, -1) is None
    assert tier.choose(scans, LINEAGE, 3, -1) is None  # saved by 2 ranks, the job now has 3
    assert tier.choose(scans, LINEAGE, 2, 5) is None  # the durable tier has step 5 already


def test_a_file_of_the_wrong_size_a_link_or_a_missing_holding_does_not_count(tmp_path: Path):
    a = node(tmp_path / "a", 5, NODE0, [])
    b = node(tmp_path / "b", 5, NODE1, [])
    (tier.part(b, tier.OWN, 5) / "rng_state_1.pth").write_bytes(b"x")  # torn
    assert tier.choose([tier.scan(a), tier.scan(b)], LINEAGE, 2, -1) is None
    (tier.part(b, tier.OWN, 5) / "rng_state_1.pth").unlink()
    os.symlink("/etc/hostname", tier.part(b, tier.OWN, 5) / "rng_state_1.pth")
    assert tier.choose([tier.scan(a), tier.scan(b)], LINEAGE, 2, -1) is None
    c = node(tmp_path / "c", 5, NODE1, [], holding=False)  # its save was cut short before the holding
    assert tier.choose([tier.scan(a), tier.scan(c)], LINEAGE, 2, -1) is None


def test_a_holding_that_does_not_parse_is_skipped_and_told(tmp_path: Path):
    a = node(tmp_path / "a", 5, NODE0, NODE1)
    (a / "checkpoint-10.json").write_text('{"step": "ten"')
    (a / "checkpoint-11.json").write_text('{"step": 11, "world_size": 2, "lineage": "x", "files": {}, "own": [], '
                                          '"buddy": []}')
    s = tier.scan(a)
    assert [x.holding.step for x in s.held] == [5]
    assert len(s.skipped) == 2 and all(why.startswith("checkpoint-1") for why in s.skipped)


def test_a_holding_naming_a_path_outside_its_folder_gets_nothing(tmp_path: Path):
    files = {"../../../etc/passwd": 5, **WHOLE}
    a = node(tmp_path / "a", 5, NODE0, NODE1, files=WHOLE)
    tier.write_holding(a, tier.Holding(step=6, world_size=2, lineage=LINEAGE, files=files, own=["../../../etc/passwd"],
                                       buddy=[]))
    held = {x.holding.step: x for x in tier.scan(a).held}
    assert held[6].files == {}


def test_rotation_keeps_the_newest_and_drops_parts_left_by_a_cut_save(tmp_path: Path):
    a = tmp_path / "a"
    for step in (5, 10, 15):
        node(a, step, NODE0, NODE1, files={**WHOLE})
    node(a, 3, NODE0, [], holding=False)
    assert tier.rotate(a, 2) == [3, 5]
    assert sorted(x.holding.step for x in tier.scan(a).held) == [10, 15]
    assert not tier.part(a, tier.OWN, 3).exists() and not tier.part(a, tier.OWN, 5).exists()


def test_node_dir_is_per_host_and_per_output_dir():
    one = tier.node_dir("/nvme/{host}", "node1", "/shared/out")
    assert str(one).startswith("/nvme/node1/") and one != tier.node_dir("/nvme/{host}", "node1", "/shared/other")
    assert tier.buddy_of(2, 3) == 0 and tier.buddy_of(0, 3) == 1


def test_the_buddy_stream_rebuilds_every_file_byte_for_byte(tmp_path: Path, monkeypatch):
    from hfscale.training.callbacks import buddy_stream as stream

    monkeypatch.setattr(stream, "CHUNK", 7)  # files cross chunk boundaries
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = {"a.bin": 10, "empty": 0, "d/b.bin": 3, "d/z.bin": 0, "e.bin": 14}
    for rel, size in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(bytes(range(size)))
    writer = stream.Writer(dst, files)
    failed: list[str] = []
    for chunk in stream.chunks(src, files, failed, "node0"):
        assert writer.next_size() == chunk.numel()
        writer.write(chunk.clone())
    assert writer.next_size() == 0
    writer.finish()
    assert tier.listing(dst) == dict(sorted(files.items()))
    assert all((dst / rel).read_bytes() == bytes(range(size)) for rel, size in files.items())


def job_text(tmp: Path, **training) -> "object":
    import yaml

    from hfscale.rules.config_file import load_text

    doc = {"name": "lt", "cluster": {"hosts": [{"host": "node0", "slots": 1}, {"host": "node1", "slots": 1}]},
           "runner": {"type": "pdsh"}, "distributed": {"backend": "deepspeed", "deepspeed": {"stage": 2}},
           "batch": {"micro_batch_size": 1},
           "training": {"output_dir": str(tmp / "out"), "max_steps": 100, "save_steps": 50, **training}}
    return load_text(yaml.safe_dump(doc), str(tmp / "lt.yaml"), tmp)


def test_check_says_what_each_tier_bounds_and_warns_where_the_tier_cannot_help(tmp_path: Path):
    from hfscale.cli.check_summary import summary

    job = job_text(tmp_path, local_checkpoints={"every": 5, "dir": "/nvme/{host}"})
    assert ("checkpoints  durable every 50 steps in " in summary(job) and "local every 5 steps in /nvme/{host}, each "
            "node's part also on the next node: a failure recomputes at most 5 steps (50 when a node and the one after "
            "it are lost together, or when the job restarts at another world size)" in summary(job))
    assert job.warnings == ()
    job = job_text(tmp_path, local_checkpoints={"every": 60, "dir": "/nvme"}, script="train.py")
    said = [str(w) for w in job.warnings]
    assert any("local_checkpoints.every" in w and "60 >= training.save_steps 50" in w for w in said)
    assert any("only if train.py calls hfscale.instrument(trainer)" in w for w in said)


def test_restart_moves_the_lineage_aside_with_the_checkpoints(tmp_path: Path):
    from hfscale.checkpoints.resume import scan_output

    out = tmp_path / "out"
    out.mkdir()
    assert scan_output(out, 2).lineage is False
    (out / tier.LINEAGE_FILE).write_text('{"lineage": "0123456789abcdef"}\n')
    assert scan_output(out, 2).lineage is True
    from hfscale.launch.build import build_plan
    from hfscale.launch.node_command import LaunchContext

    job = job_text(tmp_path, local_checkpoints={"every": 5, "dir": "/nvme"})
    ctx = LaunchContext.of(str(tmp_path), "/usr/bin/python3", "20261126-120000-abcdef", {},
                           output=scan_output(out, 2), restart=True)
    moves = build_plan(job, ctx).moves
    assert [(os.path.basename(a), os.path.basename(b)) for a, b in moves] == [(tier.LINEAGE_FILE, tier.LINEAGE_FILE)]
    assert os.path.basename(os.path.dirname(moves[0][1])) == "restarted-20261126-120000-abcdef"


def test_a_file_that_cannot_be_read_or_written_fails_the_copy_without_a_hang(tmp_path: Path, monkeypatch):
    """A sender whose file vanished sends zeros of its recorded size; a receiver that cannot write (a full
    disk) reads the stream to its end: both say so, neither blocks the other."""
    from hfscale.training.callbacks import buddy_stream as stream

    monkeypatch.setattr(stream, "CHUNK", 4)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "a.bin").write_bytes(b"abcdef")
    files = {"a.bin": 6, "gone.bin": 5}
    failed: list[str] = []
    chunks = list(stream.chunks(src, files, failed, "node0"))
    assert sum(c.numel() for c in chunks) == 11 and len(failed) == 1 and "gone.bin" in failed[0]
    assert failed[0].startswith("node0: ")
    (dst / "a.bin").mkdir(parents=True)  # cannot be opened for writing
    writer = stream.Writer(dst, files)
    for c in chunks:
        writer.write(c)
    writer.finish()
    assert writer.error is not None and writer.next_size() == 0


def _restorable(tmp_path: Path) -> tuple[Path, str, Path]:
    """An output_dir with a lineage and this host's local step 5 (every file its own, one rank)."""
    from hfscale.training.callbacks import local_tier as ranks

    out, template = tmp_path / "out", str(tmp_path / "local" / "{host}")
    out.mkdir()
    (out / tier.LINEAGE_FILE).write_text(f'{{"lineage": "{LINEAGE}"}}\n')
    root = Path(tier.node_dir(template, ranks.host(), str(out)))
    node(root, 5, list(WHOLE), [], world=1)
    return out, template, root


def test_a_restore_cut_short_or_missing_a_file_falls_back_to_the_durable_tier(tmp_path: Path, monkeypatch, capsys):
    """Every rank learns that the restore is not whole (no rank raises while the others wait at a
    barrier): the staging folder goes, the user is told, and training resumes from the durable tier."""
    from hfscale.training.callbacks import local_tier as ranks

    out, template, root = _restorable(tmp_path)
    real = tier.copy_files

    def cut_short(files, dest):  # the copy of one file ends early (the node's disk filled, say)
        real(files, dest)
        (dest / "global_step5/mp_rank_00_model_states.pt").write_bytes(b"x")

    monkeypatch.setattr(tier, "copy_files", cut_short)
    assert ranks.restore(str(out), template, durable=None) is None
    said = capsys.readouterr().out
    assert "the restore of local step 5" in said and "is not whole (1 file(s) missing or short, e.g. " \
        "global_step5/mp_rank_00_model_states.pt)" in said and "resuming from the durable tier's nothing" in said
    assert sorted(p.name for p in out.iterdir()) == [tier.LINEAGE_FILE]  # no checkpoint-5, no staging left

    def vanished(files, dest):  # a local file removed after the scan: copy_files' own OSError
        (Path(files["rng_state_0.pth"]) / "rng_state_0.pth").unlink()
        real(files, dest)

    monkeypatch.setattr(tier, "copy_files", vanished)
    assert ranks.restore(str(out), template, durable=str(out / "checkpoint-2")) is None
    said = capsys.readouterr().out
    assert "No such file or directory" in said and "rng_state_0.pth" in said and "checkpoint-2 instead" in said
    assert sorted(p.name for p in out.iterdir()) == [tier.LINEAGE_FILE]

    monkeypatch.setattr(tier, "copy_files", real)  # whole: restored and marked
    node(root, 5, list(WHOLE), [], world=1)
    assert ranks.restore(str(out), template, durable=None) == str(out / "checkpoint-5")
    assert (out / "checkpoint-5" / "hfscale_complete.json").is_file()


def test_a_buddy_copy_that_raises_keeps_the_own_part_and_says_why():
    """A peer that dies mid-copy makes gloo raise in the copy's thread: the result says the copy is
    not whole, and that this node's own part (listed whole before the copy) stays held."""
    from hfscale.training.callbacks.buddy_stream import Behind

    got = []

    def work():
        raise RuntimeError("Connection reset by peer")

    behind = Behind()
    behind.start(work, got.append)
    behind.join()
    (copied,) = got
    assert copied.read and copied.cut and not copied.received
    assert "RuntimeError: Connection reset by peer" in copied.errors[0]
    assert not behind.running()
