"""The store the ranks of an in-process restarting job meet on (hfscale.training.inprocess.restart),
hosted for the whole launch by a process of its own beside the launcher: ``python -m
hfscale.training.inprocess.store_host --file <run dir>/inprocess.store``.

It must outlive any rank and any node, so it is neither: hfscale.launch.attempt.execute starts it
before the nodes and ends it after them. A ``torch.distributed.TCPStore`` on a port the kernel
picks, on every interface (the nodes reach the launcher's host as its keepers do); its port is
written to ``--file`` (mode 0600) once it listens, which is what the launch waits for. It ends on
TERM, or when the launcher that started it is gone (its parent changes), so a launcher killed with
-9 leaves no store behind.

Like torchrun's own store, it takes no password: anyone who can reach the port can write keys. What
the ranks read back from it is parsed as hostile (hfscale.training.inprocess.assignment.decode).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

PARENT_CHECK_S = 1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfscale.training.inprocess.store_host")
    p.add_argument("--file", required=True, help="where to write the port once the store listens")
    args = p.parse_args(argv)
    parent = os.getppid()
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C: the launcher ends it after the stop

    import torch.distributed as dist

    from hfscale.core.atomic_files import write_files

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    path = Path(args.file)
    write_files(path.parent, {path.name: f"{store.port}\n"}, mode=0o600)
    print(f"hfscale: the in-process restarts' store listens on port {store.port}", flush=True)
    while not stop and os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
