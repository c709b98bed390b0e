"""The local tier's restore on the ranks (``training.local_checkpoints``; the files and the choices:
hfscale.checkpoints.local_tier; the saves: hfscale.training.callbacks.local_tier).

``restore`` runs on every rank before ``trainer.train``. The nodes exchange what they hold and
choose the newest step complete between them (own parts and buddy copies) that is newer than the
durable tier's newest and saved at this world size. Each node's first rank copies the files
assigned to it into ``<output_dir>/.restoring-checkpoint-<step>``, computing each file's CRC-32 on
the way; a file whose bytes do not match the checksum recorded when it was saved or received (rot:
4 KiB flipped at the same size and time, which neither the sizes nor ``torch.load`` notice) is not
kept, and the nodes choose again for the files still missing, without that copy:

1. the same file from its other holder (the buddy's copy, or the own part when the buddy's rotted);
2. when no copy of a file matches, the next older local step, chosen the same way;
3. when none is left, the durable tier's checkpoint (``durable``).

Each fallback is said on rank 0 with the file, the node and the checksums. Once every file is there
and matched, rank 0 checks the sizes again, moves the staging folder to ``checkpoint-<step>`` and
marks it complete (hfscale_complete.json): the resume then reads it as any checkpoint. Every rank
learns every node's outcome (one gather per round), so none waits on one that gave up.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from hfscale.checkpoints import local_tier as tier
from hfscale.checkpoints.lineage import read_lineage
from hfscale.checkpoints.resume import rollback_bound, saved_state, write_marker
from hfscale.training.callbacks.collectives import barrier, gather_objects, host, logger, nodes, rank_world

SAID = 8  # fallbacks named on the terminal; the rest are counted


@dataclass
class Verifying:
    """What the restore has learnt so far (the same on every rank): by step, the copies that did not
    match (node, path), and what to say of them."""

    bad: dict[int, set[tuple[int, str]]] = field(default_factory=dict)
    said: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0  # the copies' time (each round's slowest node), checksums included
    failed: bool = False  # a copy could not be written: the durable tier, no older local step


def restore(output_dir: str, template: str, durable: str | None) -> str | None:
    """Every rank: the local tier's newest step complete and verified across the nodes, restored into
    ``output_dir``, when it is newer than ``durable`` (the durable tier's checkpoint to resume from)
    and was saved at this world size; None otherwise (the durable tier then)."""
    rank, world = rank_world()
    durable_step = _step_of(durable)
    me = nodes()
    root = tier.node_dir(template, host(), output_dir)
    mine = tier.scan(root, host()) if me.first else None
    scans = [s for s in gather_objects(mine) if s is not None]  # node order
    for s in scans:
        for why in s.skipped:
            logger.warning("local checkpoints: skipped %s", why)
    lineage, v = read_lineage(output_dir), Verifying()
    older: int | None = rollback_bound(output_dir)[0]  # the loss guard's: only steps saved before its spike began
    while (choice := tier.choose(scans, lineage, world, durable_step, older_than=older)) is not None:
        done = _take(choice, scans, lineage, output_dir, me.node, me.first, v)
        if done is not None or v.failed:
            _tell(v)
            if done is not None and rank == 0:  # after the fallbacks that led here
                print(f"hfscale: restored step {choice.step} from the nodes' local checkpoints into {done}, every "
                      f"file matching its checksum ({v.files_checked} file(s), {v.bytes_checked / 2**20:.1f} MiB "
                      f"checked in {v.seconds:.2f} s)", flush=True)
            return done
        older = choice.step  # some file of this step matched nowhere: the next older step
    _tell(v)
    if v.said and not v.failed and rank == 0:
        print(f"hfscale: warning: no local step newer than the durable tier's could be restored with every file "
              f"matching its checksum; resuming from the durable tier's {durable or 'nothing'}", flush=True)
    return None


def _take(choice: tier.Restore, scans: list[tier.Scan], lineage: str | None, output_dir: str, node: int,
          first: bool, v: Verifying) -> str | None:
    """Restore ``choice.step`` (every rank): rounds of copies, each node its files, until every file is
    there and matched (the step's folder then), or a file matches nowhere (None: try an older step).
    A copy that cannot be written (the output_dir's disk) gives up the local tier (``v.failed``)."""
    rank, world = rank_world()
    step = choice.step
    dest = Path(output_dir) / f"checkpoint-{step}"
    staging = Path(output_dir) / f".restoring-checkpoint-{step}"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    assigned: tier.Restore | None = choice
    while assigned is not None:
        result = _copy(assigned.by_node.get(node, {}), staging) if first else None
        gathered = [r for r in gather_objects(result) if r is not None]  # node order: each node's first rank
        failed = [f for r in gathered for f in r.failed]
        if failed:
            v.failed = True
            return _give_up(staging, f"the restore of local step {step} into {staging} failed ({'; '.join(failed[:4])})")
        v.files_checked += sum(r.files for r in gathered)
        v.bytes_checked += sum(r.bytes for r in gathered)
        v.seconds += max((r.seconds for r in gathered), default=0.0)
        wrong = [(n, rel, crc) for n, r in enumerate(gathered) for rel, crc in sorted(r.wrong.items())]
        if not wrong:
            break
        bad = v.bad.setdefault(step, set())
        bad.update((n, rel) for n, rel, _ in wrong)
        missing = {rel for _, rel, _ in wrong}
        again = tier.choose(scans, lineage, world, step - 1, frozenset(bad), older_than=step + 1)
        for n, rel, crc in wrong:
            src = assigned.by_node[n][rel]
            instead = next(((m, x) for m, files in (again.by_node.items() if again else ()) for r, x in files.items()
                            if r == rel), None)
            v.said.append(f"local step {step}: {rel} of {_holder(scans, n, src)} does not match its checksum (crc32 "
                          f"{crc}, saved {src.crc}); " + (f"taken from {_holder(scans, *instead)}" if instead else
                                                          "no other copy matches: an older step"))
        if again is None:
            return _give_up(staging, None)
        assigned = tier.Restore(step, world, again.files, {n: {rel: x for rel, x in files.items() if rel in missing}
                                                           for n, files in again.by_node.items()})
    short: list[str] = []
    if rank == 0:
        got = tier.listing(staging)
        short = [rel for rel, size in choice.files.items() if got.get(rel) != size]
    problems = [p for p in gather_objects(f"{len(short)} file(s) missing or short, e.g. {short[0]}" if short else None)
                if p]
    if problems:
        return _give_up(staging, f"the restore of local step {step} into {staging} is not whole ({problems[0]})")
    if rank == 0:
        if dest.exists():  # a durable save of that step cut short: never complete, else it would be the newest
            shutil.rmtree(dest)
        os.replace(staging, dest)
        write_marker(dest, step, world)
    barrier()
    return str(dest)


def _holder(scans: list[tier.Scan], n: int, source: tier.Source) -> str:
    """``node1's own part`` / ``node2's buddy copy``."""
    return f"{scans[n].host or f'node {n}'}'s {source.kind} {'part' if source.kind == tier.OWN else 'copy'}"


def _give_up(staging: Path, why: str | None) -> None:
    """Every rank: the staging folder removed (rank 0), ``why`` said (when the durable tier is next,
    not an older local step), all ranks past it together. None: this step is not restored."""
    if rank_world()[0] == 0:
        shutil.rmtree(staging, ignore_errors=True)
        if why:
            print(f"hfscale: warning: {why}; resuming from the durable tier instead", flush=True)
    barrier()
    return None


@dataclass(frozen=True)
class Round:
    """One node's round of copies: the files whose bytes did not match (path -> their CRC-32 now, or
    "unreadable"), the copies that could not be written (said), and what was checked."""

    wrong: dict[str, str]
    failed: tuple[str, ...]
    files: int
    bytes: int
    seconds: float


def _copy(files: dict[str, tier.Source], staging: Path) -> Round:
    """This node's files of one round, each copied and checked, several at once
    (tier.copy_all_checked). A file that cannot be read counts as not matching (another holder may
    have it); one that cannot be written (the output_dir's disk full) fails the restore."""
    t0 = time.perf_counter()
    try:
        got = tier.copy_all_checked(files, staging)
    except tier.WriteFailed as e:
        return Round({}, (f"{host()}: {e.strerror or e} ({e.filename})",), len(files), 0, time.perf_counter() - t0)
    wrong = {rel: crc for rel, crc in got.items() if crc is not None}
    size = sum(source_size(staging / rel) for rel, crc in got.items() if crc is None)
    return Round(wrong, (), len(files), size, time.perf_counter() - t0)


def source_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tell(v: Verifying) -> None:
    if rank_world()[0] != 0:
        return
    for line in v.said[:SAID]:
        print(f"hfscale: {line}", flush=True)
    if len(v.said) > SAID:
        print(f"hfscale: ... and {len(v.said) - SAID} more file(s) that did not match their checksums", flush=True)


def _step_of(ckpt: str | None) -> int:
    if ckpt is None:
        return -1
    state = saved_state(ckpt)
    return state.global_step if state is not None else int(Path(ckpt).name.rsplit("-", 1)[-1])
