"""A distributed probe for launcher tests: joins the process group, reports, then behaves as told.

    --mode ok        barrier, print PROBE_DONE, exit 0
    --mode crash     rank --rank exits 3 after the group formed; the others block in all_reduce
    --mode hang      every rank loops on all_reduce until it is killed
    --mode stubborn  as hang, but rank --rank ignores SIGTERM, SIGINT and SIGHUP and sleeps outside
                     any collective (stuck, or a preemption handler that never gets to its step
                     boundary): only SIGKILL ends it
    --mode stall     steps (all_reduce, then hfscale.training.heartbeat.step) until step --step, where rank
                     --rank sleeps in stuck_here() for good; the others block in the next all_reduce
    --mode skip      --step + 5 steps, rank --rank skipping the all_reduce of step --step, then a
                     barrier: it ends in the barrier while the others wait in their last all_reduce
Each rank prints ``PROBE_READY {json}`` with its rank, world size, host, argv, $PROBE_VALUE,
whether it runs in a container and whether its interpreter's prefix is writable.
"""

import argparse
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist


def say(line: str) -> None:
    # one write per line: ranks of one node share a pipe, and under PYTHONUNBUFFERED (which hfscale
    # sets) print() writes the text and its newline separately, so two ranks' lines could interleave
    os.write(1, (line + "\n").encode())


ap = argparse.ArgumentParser()
ap.add_argument("--mode", default="ok", choices=["ok", "crash", "hang", "stubborn", "stall", "skip"])
ap.add_argument("--rank", type=int, default=1)
ap.add_argument("--step", type=int, default=3)
args, rest = ap.parse_known_args()
if args.mode == "stubborn" and int(os.environ.get("RANK", "0")) == args.rank:
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
info = {"rank": rank, "world": world, "host": socket.gethostname(), "argv": rest,
        "value": os.environ.get("PROBE_VALUE"), "job": os.environ.get("HFSCALE_JOB_ID"),
        "node_rank": os.environ.get("HFSCALE_NODE_RANK"), "pid": os.getpid(),
        "container": os.path.exists("/run/.containerenv") or os.path.exists("/.dockerenv"),
        "prefix_writable": os.access(sys.prefix, os.W_OK)}  # False on a read-only mount, even for root
say("PROBE_READY " + json.dumps(info, sort_keys=True))
dist.barrier()
if args.mode == "crash" and rank == args.rank:
    say(f"PROBE_CRASH rank={rank}")
    sys.exit(3)
if args.mode == "stubborn" and rank == args.rank:
    while True:  # stuck outside any collective: a peer's death does not end it either
        time.sleep(0.2)


def stuck_here() -> None:
    while True:  # a rank stuck outside any collective (a deadlocked thread, a hung filesystem)
        time.sleep(0.5)


if args.mode in ("stall", "skip"):
    import hfscale.training.heartbeat

    t = torch.zeros(1)
    steps = args.step + 5 if args.mode == "skip" else 10**9
    for i in range(1, steps + 1):
        if i == args.step and rank == args.rank and args.mode == "stall":
            stuck_here()
        if not (i == args.step and rank == args.rank and args.mode == "skip"):
            dist.all_reduce(t)
        hfscale.training.heartbeat.step(i)
        time.sleep(0.1)
    dist.barrier()
if args.mode in ("crash", "hang", "stubborn"):
    t = torch.zeros(1)
    while True:
        dist.all_reduce(t)
        time.sleep(0.2)
dist.barrier()
say(f"PROBE_DONE rank={rank}")
dist.destroy_process_group()
