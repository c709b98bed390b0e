"""A plain distributed script for the recovery tests: joins the process group, then fails as told.

    --bad-host H   on host H every attempt raises "RuntimeError: uncorrectable ECC error ..." (a
                   host that keeps failing); elsewhere it passes the barrier and ends with exit 0
    --once FILE    on a world of one process, the first attempt that finds FILE absent creates it
                   and raises "OSError: transient NFS read failure" (a one-off fault of another kind)
    --always       every rank raises "ZeroDivisionError: division by zero" before any step (a bug)
Each rank prints ``FLAKY_READY host=<host> world=<world>``.
"""

import argparse
import os
import socket

import torch.distributed as dist

ap = argparse.ArgumentParser()
ap.add_argument("--bad-host")
ap.add_argument("--once")
ap.add_argument("--always", action="store_true")
args = ap.parse_args()

dist.init_process_group("gloo")
host, world = socket.gethostname(), dist.get_world_size()
os.write(1, f"FLAKY_READY host={host} world={world}\n".encode())
if args.always:
    print(1 / 0)
if args.bad_host == host:
    raise RuntimeError(f"uncorrectable ECC error on {host} (device 0)")
if args.once and world == 1 and not os.path.exists(args.once):
    open(args.once, "w").close()
    raise OSError("transient NFS read failure")
dist.barrier()
os.write(1, b"FLAKY_DONE\n")
dist.destroy_process_group()
