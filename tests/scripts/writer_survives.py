"""DeepSpeed 0.19.8's real DecoupledCheckpointEngine, its writer process and hfscale's patches
(hfscale.training.async_save), one process group of one (gloo): a write that fails (a file that is a
link to /dev/full: ENOSPC) costs that file, not the writer; a writer that is SIGKILLed is replaced at
the next commit. Prints one JSON line of what it saw (tests/test_async_save_unit.py asserts on it)."""

from __future__ import annotations

import json
import os
import signal
import sys
import types

import torch
import torch.distributed as tdist

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed  # noqa: E402
from deepspeed.runtime.checkpoint_engine import decoupled_checkpoint_engine as dce  # noqa: E402
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo  # noqa: E402
from deepspeed.runtime.model_checkpointing import constants as k  # noqa: E402
from deepspeed.runtime.model_checkpointing.data_parallel_writer_factory import DataParallelWriterConfig  # noqa: E402

from hfscale.training import async_save  # noqa: E402

if __name__ == "__main__":
    tdist.init_process_group("gloo", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    async_save.install()
    root = sys.argv[1]
    writer = {k.CHECKPOINT_WRITER_TYPE: k.CheckpointWriterType.PYTHON, k.CHECKPOINT_IO_BUFFER_SIZE: 1 << 20,
              k.CHECKPOINT_IO_BUFFER_DOUBLE: False, k.CHECKPOINT_IO_MULTIPLIER: 1, k.CHECKPOINT_IO_STATISTICS: False}
    params = types.SimpleNamespace(checkpoint_config={k.CHECKPOINT_SERIALIZATION: True, k.CHECKPOINT_WRITER: writer},
                                   aio_config={})
    ce = dce.DecoupledCheckpointEngine(params, DataParallelWriterConfig(1, 0, 0, 0, True), False)
    engine = types.SimpleNamespace(checkpoint_engine=ce, global_rank=0)
    seen: dict[str, object] = {}

    def save(tag: str, name: str, target: str | None = None) -> str:
        os.makedirs(os.path.join(root, tag), exist_ok=True)
        path = os.path.join(root, tag, name)
        if target is not None:
            os.symlink(target, path)
        ce.create(CheckpointCommitInfo(tag=tag, save_dir=root, save_latest=False))
        ce.save({"x": torch.arange(1 << 16, dtype=torch.float32)}, path)
        return path

    first = ce.ckpt_process.pid
    good = save("t1", "a.pt")
    async_save.commit(engine, wait=True)
    seen["written"] = torch.load(good, weights_only=True)["x"].shape[0]
    seen["unwritten_after_good"] = async_save.unwritten(root)

    full = save("t2", "a.pt", target="/dev/full")  # ENOSPC inside torch.save, in the writer
    async_save.commit(engine, wait=True)
    seen["unwritten_after_full"] = async_save.unwritten(root) == [full]
    seen["link_removed"] = not os.path.lexists(full)
    seen["dev_full_kept"] = os.path.exists("/dev/full")
    seen["writer_alive_after_full"] = ce.ckpt_process.is_alive() and ce.ckpt_process.pid == first

    after = save("t3", "a.pt")  # the same writer writes the next save
    async_save.commit(engine, wait=True)
    seen["written_after_full"] = os.path.isfile(after)

    os.kill(ce.ckpt_process.pid, signal.SIGKILL)
    ce.ckpt_process.join(10)
    lost = save("t4", "a.pt")  # DeepSpeed's save drops it: its writer is dead
    committed = async_save.commit(engine, wait=False)  # a dead writer has ended: committed, and replaced
    seen["committed_with_dead_writer"] = committed
    seen["unwritten_after_kill"] = async_save.unwritten(root) == [lost]
    seen["replaced"] = ce.ckpt_process.is_alive() and ce.ckpt_process.pid != first
    last = save("t5", "a.pt")
    async_save.commit(engine, wait=True)
    seen["written_by_new_writer"] = torch.load(last, weights_only=True)["x"].shape[0]
    ce.cleanup()
    print("RESULT " + json.dumps(seen), flush=True)
