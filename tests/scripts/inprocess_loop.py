"""A plain torch loop under hfscale's in-process restart (hfscale.training.inprocess.restart.run), for
tests/test_inprocess.py: a small MLP, each rank's batch made from (step, rank) alone, gradients averaged
with all_reduce over the attempt's gloo group, a checkpoint every --save-every steps (written whole, then
renamed), each attempt resuming from the newest one. Every step appends a JSON line to
``{out}/steps.jsonl``: attempt, rank, uid, pid, step, loss, time; the first step of an attempt also
its restart time (from the previous attempt's end, on this process's clock).

    python inprocess_loop.py OUT --steps 24 --save-every 4 --step-sleep 0.1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--die", default="", help="UID:ATTEMPT: that process SIGKILLs itself as that attempt begins, "
                    "after joining its group and before reading the checkpoint (a fault inside the restart)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch
    import torch.distributed as dist

    from hfscale.training.inprocess.restart import run

    def newest() -> tuple[int, Path | None]:
        done = [int(p.name.split("-")[1]) for p in out.glob("ckpt-*") if (p / "model.pt").is_file()]
        return (max(done), out / f"ckpt-{max(done)}") if done else (0, None)

    def train(attempt) -> int:
        if a.die == f"{attempt.uid}:{attempt.number}":
            os.kill(os.getpid(), signal.SIGKILL)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        start, ckpt = newest()
        if ckpt is not None:
            state = torch.load(ckpt / "model.pt", weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        first = True
        for step in range(start + 1, a.steps + 1):
            g = torch.Generator().manual_seed(step * 1000 + attempt.rank)
            x = torch.randn(8, 16, generator=g)
            y = x.sum(dim=1, keepdim=True).sin()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= attempt.world_size
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            record = {"attempt": attempt.number, "rank": attempt.rank, "uid": attempt.uid, "pid": os.getpid(),
                      "step": step, "loss": float(mean) / attempt.world_size, "t": time.time()}
            if first and attempt.restarted_at is not None:
                record["restart_s"] = time.time() - attempt.restarted_at
                record["resumed"] = start
            first = False
            with open(out / "steps.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            if step % a.save_every == 0 and attempt.rank == 0 and not (out / f"ckpt-{step}").exists():
                tmp = out / f".tmp-{step}"
                tmp.mkdir(exist_ok=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp / "model.pt")
                os.replace(tmp, out / f"ckpt-{step}")
            if step % a.save_every == 0:
                dist.barrier()  # every rank resumes from the same checkpoint
            time.sleep(a.step_sleep)
        return 0

    return run(train)


if __name__ == "__main__":
    raise SystemExit(main())
