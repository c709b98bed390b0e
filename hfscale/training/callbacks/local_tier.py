"""The local tier of checkpoints on the ranks' side (``training.local_checkpoints``; the files and the
choices: hfscale.checkpoints.local_tier).

``LocalCheckpointCallback`` saves a checkpoint every ``every`` optimizer steps (not on the durable
tier's steps) into each node's own disk, right after the Trainer logged the step, with the
Trainer's own save (``Trainer._save_checkpoint``, the output_dir pointed at the node's folder for
that call): DeepSpeed's shards, the optimizer, the
scheduler, the RNG states, the trainer state, each written by the rank that writes it in a
durable save. Then the nodes exchange their listings (one ``all_gather_object``), each node's
first rank sends its node's part to the next node's first rank over a gloo group of its own
(chunks of ``CHUNK`` bytes; NCCL carries only GPU tensors), and each node writes its holding. A rank
killed during any of this leaves no holding for that step: the previous local step stays the
newest.

``restore`` runs on every rank before ``trainer.train``: the nodes exchange what they hold, choose
the newest step complete between them (own and buddy copies) that is newer than the durable
tier's newest and saved at this world size, copy its files (each from one node) into
``<output_dir>/checkpoint-<step>``, and rank 0 marks it complete (hfscale_complete.json): the
resume then reads it from the shared file system as any checkpoint.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hfscale.checkpoints import local_tier as tier
from hfscale.checkpoints.resume import saved_state, write_marker
from hfscale.core.untrusted import Unreadable, read_json
from hfscale.training import async_save as async_saves
from hfscale.training.callbacks.collectives import logger, rank_world

CHUNK = 64 << 20  # bytes per message of the buddy copy


def host() -> str:
    return os.environ.get("HFSCALE_HOST") or socket.gethostname()


@dataclass(frozen=True)
class Nodes:
    """The nodes in order (by their lowest rank): this rank's node, whether this rank is its node's
    first (the one that lists, sends and receives its node's part), and each node's first rank."""

    node: int
    first: bool
    leaders: tuple[int, ...]


def _nodes() -> Nodes:
    """One collective: every rank's host."""
    rank, _ = rank_world()
    me = host()
    hosts = _all_gather(me)
    order = list(dict.fromkeys(hosts))
    return Nodes(order.index(me), hosts.index(me) == rank, tuple(hosts.index(h) for h in order))


def _all_gather(obj: Any) -> list[Any]:
    _, world = rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def read_lineage(output_dir: str) -> str | None:
    try:
        doc = read_json(Path(output_dir) / tier.LINEAGE_FILE, 4096, output_dir)
    except Unreadable:
        return None
    value = doc.get("lineage") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and value.isalnum() and len(value) <= 64 else None


def start_lineage(output_dir: str, fresh: bool) -> str:
    """The run's lineage, the same on every rank: rank 0 starts a new one at a fresh start (step 0:
    the local steps of an earlier run are not this one's), else keeps the output_dir's."""
    rank, world = rank_world()
    value = None
    if rank == 0:
        value = None if fresh else read_lineage(output_dir)
        if value is None:
            value = secrets.token_hex(8)
            os.makedirs(output_dir, exist_ok=True)
            tmp = Path(output_dir) / f".{tier.LINEAGE_FILE}.tmp{os.getpid()}"
            tmp.write_text(f'{{"lineage": "{value}"}}\n')
            os.replace(tmp, Path(output_dir) / tier.LINEAGE_FILE)
    if world > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return str(value)


def restore(output_dir: str, template: str, durable: str | None) -> str | None:
    """Every rank: the local tier's newest step complete across the nodes, restored into
    ``output_dir``, when it is newer than ``durable`` (the durable tier's checkpoint to resume
    from) and was saved at this world size; None otherwise."""
    rank, world = rank_world()
    durable_step = _step_of(durable)
    nodes = _nodes()
    root = tier.node_dir(template, host(), output_dir)
    mine = tier.scan(root) if nodes.first else None
    scans = [s for s in _all_gather(mine) if s is not None]  # node order
    for s in scans:
        for why in s.skipped:
            logger.warning("local checkpoints: skipped %s", why)
    choice = tier.choose(scans, read_lineage(output_dir), world, durable_step)
    if choice is None:
        return None
    dest = Path(output_dir) / f"checkpoint-{choice.step}"
    staging = Path(output_dir) / f".restoring-checkpoint-{choice.step}"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    failed = None
    if nodes.first:
        try:
            tier.copy_files(choice.by_node.get(nodes.node, {}), staging)
        except OSError as e:  # a disk that filled, a file that went away: told, and the durable tier instead
            failed = f"{host()}: {e.strerror or e} ({e.filename or staging})"
    problems = [p for p in _all_gather(failed) if p]  # every rank learns it: none waits on one that gave up
    if not problems:
        got = tier.listing(staging) if rank == 0 else {}
        short = [rel for rel, size in choice.files.items() if got.get(rel) != size] if rank == 0 else []
        problems = [p for p in _all_gather(f"{len(short)} file(s) missing or short, e.g. {short[0]}" if short else None)
                    if p]
    if problems:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            print(f"hfscale: warning: the restore of local step {choice.step} into {staging} is not whole "
                  f"({'; '.join(problems[:4])}); resuming from the durable tier's {durable or 'nothing'} instead",
                  flush=True)
        _barrier()
        return None
    if rank == 0:
        if dest.exists():  # a durable save of that step cut short: never complete, else it would be the newest
            shutil.rmtree(dest)
        os.replace(staging, dest)
        write_marker(dest, choice.step, world)
        print(f"hfscale: restored step {choice.step} from the nodes' local checkpoints into {dest} "
              f"(the durable tier's newest: {durable or 'none'})", flush=True)
    _barrier()
    return str(dest)


def _step_of(ckpt: str | None) -> int:
    if ckpt is None:
        return -1
    state = saved_state(ckpt)
    return state.global_step if state is not None else int(Path(ckpt).name.rsplit("-", 1)[-1])


def _barrier() -> None:
    if rank_world()[1] > 1:
        dist.barrier()


class LocalCheckpointCallback(TrainerCallback):
    """Saves every ``every`` steps into ``template`` (``{host}``: this node's name) and copies each
    node's part to the next node (``buddy``); keeps the ``keep`` newest local steps."""

    def __init__(self, trainer: Any, every: int, template: str, keep: int = 2, buddy: bool = True,
                 lineage: str = "") -> None:
        self.trainer, self.every, self.template, self.keep, self.buddy = trainer, every, template, keep, buddy
        self.lineage = lineage
        self.group = None
        self.pending: int | None = None
        self._wrapped = False
        self.pauses: list[float] = []  # seconds each local save held training

    def on_train_begin(self, args, state, control, **kwargs):
        if rank_world()[1] > 1 and self.buddy and self.group is None:
            self.group = dist.new_group(backend="gloo")  # every rank takes part in making a group
        if not self._wrapped:
            self._wrap()

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step % self.every or control.should_save or step >= state.max_steps:
            return  # the durable tier saves this step
        self.pending = step  # saved once the Trainer has logged this step (its log_history is saved)

    def _wrap(self) -> None:
        """Save after the Trainer's own log-and-save of the step (``_maybe_log_save_evaluate``, right
        after ``on_step_end``), as a durable save is: the step's logged loss is then in the saved
        trainer state, and nothing of the next step has run."""
        original = self.trainer._maybe_log_save_evaluate

        def log_save_evaluate(*a: Any, **kw: Any) -> Any:
            out = original(*a, **kw)
            if self.pending is not None:
                step, self.pending = self.pending, None
                t0 = time.perf_counter()
                size = self.save(step, self.trainer.args)
                self.pauses.append(time.perf_counter() - t0)
                if rank_world()[0] == 0:  # the node log's record (HFSCALE_ lines stay off the terminal)
                    print(f"HFSCALE_LOCAL_SAVE step={step} seconds={self.pauses[-1]:.3f} bytes={size}", flush=True)
            return out

        self.trainer._maybe_log_save_evaluate = log_save_evaluate
        self._wrapped = True

    def save(self, step: int, args: Any) -> int:
        """Save ``step`` locally (every rank); the checkpoint's bytes, every node's part."""
        _, world = rank_world()
        nodes = _nodes()
        first = nodes.first
        root = tier.node_dir(self.template, host(), args.output_dir)
        own = tier.part(root, tier.OWN, step)
        if first:
            shutil.rmtree(own, ignore_errors=True)
            own.parent.mkdir(parents=True, exist_ok=True)
        _barrier()
        output_dir = args.output_dir
        args.output_dir = str(own.parent)  # the Trainer saves into <root>/own/checkpoint-<step>
        error = None
        try:
            self.trainer._save_checkpoint(self.trainer.model_wrapped, trial=None)
        except OSError as e:  # a full or failed local disk costs this local step, not the training
            error = f"{host()}: {e}"
        finally:
            args.output_dir = output_dir
        # training.async_save: DeepSpeed's writers may still hold the shards; the listing and the buddy copy
        # need them on disk, so a local save waits for its writes (a barrier inside: all ranks or none)
        if all(_all_gather(bool(async_saves.pending()))):
            async_saves.commit_pending()
        _barrier()  # every rank of every node has written its files (or failed to)
        listed = None
        if first:
            try:
                listed = tier.listing(own)
            except OSError as e:
                error = error or f"{host()}: {e}"
        gathered = _all_gather((error, listed))
        errors = [e for e, _ in gathered if e]
        parts = [p for _, p in gathered if p is not None]  # node order
        files = {rel: size for p in parts for rel, size in p.items()}
        received: list[str] = []
        if not errors and self.buddy and len(parts) > 1:
            failed = None
            if first:
                received, failed = self._exchange(parts, nodes, tier.part(root, tier.BUDDY, step), own)
            errors = [e for e in _all_gather(failed) if e]
        if errors:
            if first:
                for kind in (tier.OWN, tier.BUDDY):
                    shutil.rmtree(tier.part(root, kind, step), ignore_errors=True)
            if rank_world()[0] == 0:
                print(f"hfscale: warning: local checkpoint of step {step} not kept: {errors[0][:500]}"
                      + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
                      + "; training goes on, the previous local step and the durable tier stay", flush=True)
            return 0
        if first:
            tier.write_holding(root, tier.Holding(step=step, world_size=world, lineage=self.lineage, files=files,
                                                  own=sorted(parts[nodes.node]), buddy=received))
            for gone in tier.rotate(root, self.keep):
                logger.info("local checkpoints: removed step %s", gone)
        return sum(files.values())

    def _exchange(self, parts: list[dict[str, int]], nodes: Nodes, into: Path, own: Path
                  ) -> tuple[list[str], str | None]:
        """Send this node's part to the next node, receive the previous node's (the first ranks of
        the nodes only: point to point, no collective): the paths received, and what failed (a file
        that could not be read or written: the stream goes on to its end, so neither side hangs)."""
        n, node = len(parts), nodes.node
        send_to, recv_from = nodes.leaders[tier.buddy_of(node, n)], nodes.leaders[(node - 1) % n]
        out_files, in_files = parts[node], parts[(node - 1) % n]
        shutil.rmtree(into, ignore_errors=True)
        failed: list[str] = []
        try:
            into.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            failed.append(f"{host()}: {e}")
        outgoing = _chunks(own, out_files, failed)
        incoming = _Writer(into, in_files)
        while True:
            chunk = next(outgoing, None)
            req = dist.isend(chunk, dst=send_to, group=self.group) if chunk is not None else None
            size = incoming.next_size()
            if size:
                buf = torch.empty(size, dtype=torch.uint8)
                dist.recv(buf, src=recv_from, group=self.group)
                incoming.write(buf)
            if req is not None:
                req.wait()
            if chunk is None and not size:
                break
        incoming.finish()
        if incoming.error:
            failed.append(f"{host()}: {incoming.error}")
        return sorted(in_files), (failed[0] if failed else None)


def _chunks(folder: Path, files: dict[str, int], failed: list[str]):
    """The bytes of ``files`` (sorted by path) in CHUNK-sized uint8 tensors; a file that cannot be
    read is sent as zeros of its recorded size (the receiver expects that many bytes), and said in
    ``failed``."""
    pending = bytearray()

    def blocks(rel: str, size: int):
        sent = 0
        try:
            with open(folder / rel, "rb") as f:
                while sent < size and (block := f.read(min(CHUNK, size - sent))):
                    sent += len(block)
                    yield block
        except OSError as e:
            failed.append(f"{host()}: {e}")
        if sent < size:
            if not failed:
                failed.append(f"{host()}: {folder / rel} shrank while it was copied")
            while sent < size:
                n = min(CHUNK, size - sent)
                sent += n
                yield bytes(n)

    for rel in sorted(files):
        for block in blocks(rel, files[rel]):
            while block:
                take = CHUNK - len(pending)
                pending += block[:take]
                block = block[take:]
                if len(pending) == CHUNK:
                    yield torch.frombuffer(pending, dtype=torch.uint8).clone()
                    pending = bytearray()
    if pending:
        yield torch.frombuffer(pending, dtype=torch.uint8).clone()


class _Writer:
    """Writes the received stream into the files it is made of (sizes known from the listings); a
    write that fails (a full disk) is kept in ``error`` and the rest of the stream is read all the same."""

    def __init__(self, folder: Path, files: dict[str, int]) -> None:
        self.folder, self.order = folder, sorted(files)
        self.sizes = files
        self.total = sum(files.values())
        self.done = 0
        self.index, self.offset = 0, 0
        self.handle: Any = None
        self.error: str | None = None

    def next_size(self) -> int:
        return min(CHUNK, self.total - self.done)

    def finish(self) -> None:
        """The empty files after the last byte."""
        self.write(torch.empty(0, dtype=torch.uint8))
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def write(self, buf: torch.Tensor) -> None:
        data = buf.numpy().tobytes()
        self.done += len(data)
        while data or (self.index < len(self.order) and self.sizes[self.order[self.index]] == 0):
            rel = self.order[self.index]
            take = min(len(data), self.sizes[rel] - self.offset)
            if self.error is None:
                try:
                    if self.handle is None:
                        target = self.folder / rel
                        target.parent.mkdir(parents=True, exist_ok=True)
                        self.handle = open(target, "wb")
                    self.handle.write(data[:take])
                except OSError as e:
                    self.error = str(e)
            data, self.offset = data[take:], self.offset + take
            if self.offset == self.sizes[rel]:
                if self.handle is not None:
                    try:
                        self.handle.close()
                    except OSError as e:
                        self.error = self.error or str(e)
                self.handle, self.index, self.offset = None, self.index + 1, 0
