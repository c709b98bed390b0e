"""One rank of tests/test_buddy_copy.py (under torchrun, gloo on CPU): its node's part sent to the
next rank and the previous rank's received, by hfscale's buddy copy in its thread, while this
rank's main thread goes on with collectives on the default group as training does.

argv: <scratch folder> <rank whose part has a file missing, or -1>. Writes <scratch>/result-<rank>.json."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hfscale.training.callbacks import buddy_stream as stream

stream.CHUNK = 1 << 16  # many messages per file, files across message boundaries
scratch, missing = Path(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
group = dist.new_group(backend="gloo")
sizes = {f"r{r}": {"mp_rank_00_model_states.pt": 3_000_001 + r, "global_step5/zero_pp_rank_0.pt": 5_000_000,
                   "trainer_state.json": 0 if r else 17, "latest": 12} for r in range(world)}
own = scratch / f"node{rank}" / "own" / "checkpoint-5"
for rel, size in sizes[f"r{rank}"].items():
    (own / rel).parent.mkdir(parents=True, exist_ok=True)
    (own / rel).write_bytes(os.urandom(size))
if rank == missing:
    (own / "latest").unlink()  # listed, then gone: sent as zeros, and said
prev = (rank - 1) % world
x = stream.Exchange(5, (rank + 1) % world, prev, own, sizes[f"r{rank}"], scratch / f"node{rank}" / "buddy" / "checkpoint-5",
                    sizes[f"r{prev}"])
done: list[stream.Copied] = []
behind = stream.Behind()
behind.start(lambda: stream.exchange(x, group, f"node{rank}"), done.append)
steps, total = 0, torch.zeros(1)
while True:  # "training": an all-reduce per step on the default group, until every rank's copy has ended
    flag = torch.tensor([1.0 if behind.running() else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    t = torch.ones(1000)
    dist.all_reduce(t)
    total += t[0]
    if not flag.item():
        break
    steps += 1
behind.join()
(copied,) = done
json.dump({"rank": rank, "steps_during_copy": steps, "read": copied.read, "received": copied.received,
           "errors": list(copied.errors), "seconds": copied.seconds, "sum": total.item()},
          open(scratch / f"result-{rank}.json", "w"))
dist.destroy_process_group()
