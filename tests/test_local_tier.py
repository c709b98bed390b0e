"""The local tier's files and choices (hfscale.checkpoints.local_tier) and the buddy copy's byte stream
(hfscale.training.callbacks.buddy_stream): pure, on tmp folders; no process, no process group."""

from __future__ import annotations

import os
import zlib
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
         holding=True, sums=True) -> Path:
    for kind, paths in ((tier.OWN, own), (tier.BUDDY, buddy)):
        for rel in paths:
            p = tier.part(root, kind, step) / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x" * files[rel])
    if holding:  # each file's CRC-32 as the save (own) or the copy (buddy) records it
        crcs = {rel: f"{zlib.crc32(b'x' * files[rel]):08x}" for rel in own + buddy} if sums else {}
        tier.write_holding(root, tier.Holding(step=step, world_size=world, lineage=lineage, files=files, own=own,
                                              buddy=buddy, sums=crcs))
    return root


def test_the_newest_step_complete_between_the_nodes_is_chosen(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    node(a, 5, NODE0, NODE1)
    node(b, 5, NODE1, NODE0)
    node(a, 10, NODE0, [], files={**WHOLE})  # step 10: node1's part is nowhere
    choice = tier.choose([tier.scan(a), tier.scan(b)], LINEAGE, 2, newer_than=-1)
    assert choice is not None and choice.step == 5
    # each node copies its own part (the copies spread over the nodes): a's buddy copy of b's part is not needed
    assert set(choice.by_node[0]) == set(NODE0) and set(choice.by_node[1]) == set(NODE1)
    assert {x.kind for files in choice.by_node.values() for x in files.values()} == {tier.OWN}


def test_a_lost_node_is_covered_by_its_buddys_copy(tmp_path: Path):
    b = node(tmp_path / "b", 5, NODE1, NODE0)  # node a is gone: b has a's part as buddy
    choice = tier.choose([tier.scan(b)], LINEAGE, 2, newer_than=-1)
    assert choice is not None and set(choice.by_node[0]) == set(WHOLE)
    assert {Path(f.folder).parent.name for f in choice.by_node[0].values()} == {tier.OWN, tier.BUDDY}
    assert {f.kind for f in choice.by_node[0].values()} == {tier.OWN, tier.BUDDY}


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
    from hfscale.launch.context import LaunchContext

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
    from hfscale.training.callbacks.collectives import host

    out, template = tmp_path / "out", str(tmp_path / "local" / "{host}")
    out.mkdir()
    (out / tier.LINEAGE_FILE).write_text(f'{{"lineage": "{LINEAGE}"}}\n')
    root = Path(tier.node_dir(template, host(), str(out)))
    node(root, 5, list(WHOLE), [], world=1)
    return out, template, root


def flip(path: Path, at: int = 0, n: int = 4096) -> None:
    """Rot: ``n`` bytes flipped from ``at`` (at most to the end), the size and the times kept."""
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    for i in range(at, min(len(data), at + n)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_restore_cut_short_or_missing_a_file_falls_back_to_the_durable_tier(tmp_path: Path, monkeypatch, capsys):
    """Every rank learns that the restore is not whole (no rank raises while the others wait at a
    barrier): the staging folder goes, the user is told, and training resumes from the durable tier."""
    from hfscale.training.callbacks.local_restore import restore

    out, template, root = _restorable(tmp_path)
    real = tier.copy_checked

    def cut_short(rel, source, dest):  # the copy of one file ends early after it was checked
        got = real(rel, source, dest)
        if rel == "global_step5/mp_rank_00_model_states.pt":
            (dest / rel).write_bytes(b"x")
        return got

    monkeypatch.setattr(tier, "copy_checked", cut_short)
    assert restore(str(out), template, durable=None) is None
    said = capsys.readouterr().out
    assert "the restore of local step 5" in said and "is not whole (1 file(s) missing or short, e.g. " \
        "global_step5/mp_rank_00_model_states.pt)" in said and "resuming from the durable tier instead" in said
    assert sorted(p.name for p in out.iterdir()) == [tier.LINEAGE_FILE]  # no checkpoint-5, no staging left

    def vanished(rel, source, dest):  # a local file removed after the scan: its copy cannot read it
        if rel == "rng_state_0.pth":
            (Path(source.folder) / rel).unlink(missing_ok=True)
        return real(rel, source, dest)

    monkeypatch.setattr(tier, "copy_checked", vanished)
    assert restore(str(out), template, durable=str(out / "checkpoint-2")) is None
    said = capsys.readouterr().out
    assert "local step 5: rng_state_0.pth of " in said and "does not match its checksum (crc32 unreadable" in said
    assert "no other copy matches: an older step" in said and "durable tier's " + str(out / "checkpoint-2") in said
    assert sorted(p.name for p in out.iterdir()) == [tier.LINEAGE_FILE]

    monkeypatch.setattr(tier, "copy_checked", real)
    node(root, 5, list(WHOLE), [], world=1)  # whole: restored and marked
    assert restore(str(out), template, durable=None) == str(out / "checkpoint-5")
    assert (out / "checkpoint-5" / "hfscale_complete.json").is_file()
    assert "every file matching its checksum (6 file(s)" in capsys.readouterr().out


def test_a_rotten_file_is_never_restored_an_older_step_is(tmp_path: Path, capsys):
    """Issue 36: bytes flipped in the newest local step at the same size and time (the sizes and
    torch.load do not notice): that step is not restored, the older one is, and the user is told which
    file, where, and both checksums. A holding without checksums (an older hfscale's) offers nothing."""
    from hfscale.training.callbacks.local_restore import restore

    out, template, root = _restorable(tmp_path)
    node(root, 10, list(WHOLE), [], world=1, files=WHOLE)
    shard = tier.part(root, tier.OWN, 10) / "global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip(shard, 5, 10)
    assert restore(str(out), template, durable=None) == str(out / "checkpoint-5")
    said = capsys.readouterr().out
    crc = f"{zlib.crc32(shard.read_bytes()):08x}"
    assert "local step 10: global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt of " in said
    assert f"'s own part does not match its checksum (crc32 {crc}, saved {zlib.crc32(b'x' * 20):08x}); " \
        "no other copy matches: an older step" in said
    assert "restored step 5 from the nodes' local checkpoints" in said and not (out / "checkpoint-10").exists()
    node(root, 15, list(WHOLE), [], world=1, sums=False)  # written before checksums: not verifiable, not offered
    assert tier.choose([tier.scan(root)], LINEAGE, 1, newer_than=10) is None


def test_a_copy_that_does_not_match_is_taken_from_its_other_holder(tmp_path: Path):
    """What the ranks do across nodes (the restore's rounds), on the pure parts: node a's own file does
    not match; without that copy the choice takes node b's buddy copy of it; with b's copy rotten too,
    the step is not whole and an older one is chosen."""
    a = node(tmp_path / "a", 5, NODE0, NODE1)
    b = node(tmp_path / "b", 5, NODE1, NODE0)
    node(a, 3, NODE0, NODE1)
    node(b, 3, NODE1, NODE0)
    flip(tier.part(a, tier.OWN, 5) / "rng_state_0.pth")
    scans = [tier.scan(a, "a"), tier.scan(b, "b")]
    first = tier.choose(scans, LINEAGE, 2, -1)
    assert first is not None and first.step == 5 and first.by_node[0]["rng_state_0.pth"].kind == tier.OWN
    staging = tmp_path / "staging"
    src = first.by_node[0]["rng_state_0.pth"]
    assert tier.copy_checked("rng_state_0.pth", src, staging) == f"{zlib.crc32(bytes(b ^ 0xFF for b in b'xxxx')):08x}"
    assert not (staging / "rng_state_0.pth").exists()  # a copy that does not match is not kept
    again = tier.choose(scans, LINEAGE, 2, 4, frozenset({(0, "rng_state_0.pth")}), older_than=6)
    assert again is not None and again.step == 5
    assert again.by_node[1]["rng_state_0.pth"].kind == tier.BUDDY  # b's copy of a's part
    assert tier.copy_checked("rng_state_0.pth", again.by_node[1]["rng_state_0.pth"], staging) is None
    assert (staging / "rng_state_0.pth").read_bytes() == b"xxxx"
    both = frozenset({(0, "rng_state_0.pth"), (1, "rng_state_0.pth")})
    assert tier.choose(scans, LINEAGE, 2, 4, both, older_than=6) is None  # no copy of it matches: not step 5
    assert tier.choose(scans, LINEAGE, 2, -1, older_than=5).step == 3  # the next older step


def test_a_copy_that_cannot_be_written_is_not_blamed_on_its_source(tmp_path: Path):
    a = node(tmp_path / "a", 5, NODE0, NODE1)
    (choice,) = [tier.choose([tier.scan(a)], LINEAGE, 2, -1)]
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "rng_state_0.pth").mkdir()  # cannot be opened for writing (as a full disk cannot be written)
    try:
        tier.copy_checked("rng_state_0.pth", choice.by_node[0]["rng_state_0.pth"], staging)
    except tier.WriteFailed as e:
        assert e.filename == str(staging / "rng_state_0.pth")
    else:
        raise AssertionError("WriteFailed expected")


def test_the_buddy_stream_checks_both_ends_against_the_checksums(tmp_path: Path, monkeypatch):
    """A sender whose own file rotted since its checksum was taken says so (its own step is then
    dropped); a receiver keeps a copy only when every file it wrote matches what the sender sent."""
    from hfscale.training.callbacks import buddy_stream as stream

    monkeypatch.setattr(stream, "CHUNK", 1000)  # files cross chunk boundaries
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = {"a.bin": 5000, "b.bin": 7, "empty": 0}
    for rel, size in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(bytes(i % 251 for i in range(size)))
    sums = tier.sums_all(src, files)
    assert sums == tier.sums_of(src, files) and sums["empty"] == "00000000"
    flip(src / "a.bin", 100, 8)  # rot after the checksums were taken
    failed: list[str] = []
    sent: dict[str, str] = {}
    writer = stream.Writer(dst, files)
    for chunk in stream.chunks(src, files, failed, "node0", sums, sent):
        writer.write(chunk.clone())
    writer.finish()
    assert len(failed) == 1 and "a.bin does not match its checksum (crc32 " in failed[0] and failed[0].startswith("node0: ")
    assert writer.crcs == sent and writer.error is None  # the bytes arrived as they were sent
    writer.check({**sent, "b.bin": "00000000"})  # a file that did not arrive as sent
    assert writer.error is not None and "b.bin as received does not match its checksum" in writer.error


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


def test_a_folder_without_room_or_that_cannot_be_written_is_short(tmp_path: Path):
    from hfscale.checkpoints.local_room import short_of_room

    folder = tmp_path / "nvme" / "node1" / "key"
    assert short_of_room(folder, 0, "node1") is None and folder.is_dir()  # made, written to, room
    assert not [p for p in folder.iterdir()]  # the probe file is gone
    short = short_of_room(folder, 1 << 62, "node1")
    assert short is not None and short.free is not None and short.need == 1 << 62
    assert short.line().startswith(f"node1's local folder {folder} has ") and "free, a local step needs" in short.line()
    blocked = tmp_path / "file"
    blocked.write_text("x")  # a file where the folder should be: nothing can be written there
    short = short_of_room(blocked / "key", 0, "node2")
    assert short is not None and short.free is None
    assert short.line() == f"node2's local folder {blocked / 'key'} cannot be written (Not a directory)"


def test_a_local_steps_size_is_estimated_from_the_durable_checkpoints_deepspeed_files(tmp_path: Path):
    from hfscale.checkpoints.local_room import step_need

    ckpt = tmp_path / "checkpoint-10"
    (ckpt / "global_step10").mkdir(parents=True)
    (ckpt / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 3000)
    (ckpt / "global_step10" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
    (ckpt / "model.safetensors").write_bytes(b"x" * 100_000)  # a local step leaves the whole model file out
    (ckpt / "global_step10" / "link").symlink_to(ckpt / "model.safetensors")  # a link is no file of it
    assert step_need(ckpt, 2, buddy=True) == 4000  # its half, and the buddy's copy of another half
    assert step_need(ckpt, 2, buddy=False) == 2000
    assert step_need(ckpt, 1, buddy=True) == 4000  # one node has no buddy
    assert step_need(None, 2, buddy=True) == 0 and step_need(tmp_path / "gone", 2, buddy=True) == 0
