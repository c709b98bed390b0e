"""The in-process restart loop each rank runs around its training function (``run``).

The processes meet on a ``torch.distributed`` TCPStore at ``MASTER_ADDR:MASTER_PORT`` that must outlive
any one rank (hfscale launch runs it beside the launcher: hfscale.training.inprocess.store_host); its keys
are under ``hfscale/inprocess/``. A store that cannot be reached ends the process with ``RELAUNCH_EXIT``.
Attempt ``k``:

- the members (hfscale.training.inprocess.assignment) join a process group of their own over the
  store's prefix ``a{k}/pg``; the standbys wait for the attempt to end;
- any member whose training function raises (a peer's death shows as a collective's error: gloo and
  NCCL see the connection close) leaves its process group, which makes the collectives of the peers
  still in it fail too, writes ``a{k}/over`` (the first reason stays; the standbys wait for it) and
  arrives at ``a{k+1}``;
- the first to arrive leads: it waits until every process of attempt ``k`` has arrived, or enough to
  fill every rank with none new for ``QUIET_S``, or ``join_s`` seconds, then writes ``a{k+1}/members``:
  the survivors at their ranks, a standby in each lost rank's place; with too few, ``relaunch`` and
  the reason: every process then exits with ``RELAUNCH_EXIT``, for the launcher to relaunch the job
  as it would without in-process restarts.

A rank that finds nothing written within its bound exits the same way (a leader lost as it led).
A process its node started again (``HFSCALE_INPROCESS_RESTARTED``: hfscale.training.inprocess.node_agent)
reads the current members (``latest``, written with each attempt's) and waits as a standby for that
attempt to end.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from hfscale.core import exitcodes
from hfscale.training.heartbeat import begin_attempt
from hfscale.training.loss_guard import LossAlarm
from hfscale.training.slow_nodes import SlowNodeStop
from hfscale.training.inprocess.assignment import (Assigned, Members, Relaunch, Replaced, assign, changes, decode,
                                                  encode, first)

PREFIX = "hfscale/inprocess/"
RELAUNCH_EXIT = exitcodes.RELAUNCH  # the in-process restart could not go on; the launcher relaunches the job
POLL_S = 0.2  # how often a waiting process reads a key it waits for (TCPStore.check: one round trip)
QUIET_S = 0.5  # arrivals enough for every rank and none new for this long: the attempt's members are written
ENV_WORLD = "HFSCALE_INPROCESS_WORLD"  # the active world size; the launch's WORLD_SIZE counts the standbys too
ENV_JOIN = "HFSCALE_INPROCESS_JOIN_S"
ENV_RESTARTS = "HFSCALE_INPROCESS_RESTARTS"
ENV_TIMEOUT = "HFSCALE_INPROCESS_TIMEOUT_S"  # a collective that waits longer fails: a frozen or cut-off peer
ENV_RESTARTED = "HFSCALE_INPROCESS_RESTARTED"  # > 0: started again by its node (node_agent): a standby from the start
LATEST = "latest"  # the current attempt's members (encode): where a process started again finds the job
LATE_WAIT_S = 60.0  # a process started again waits this long for LATEST before it gives up (the job is relaunched)


@dataclass(frozen=True)
class Session:
    """What a process knows of the launch, from its environment."""

    uid: int  # its rank in the launch (RANK as torchrun set it): active ranks first, then the standbys
    world_size: int  # the active ranks
    standbys: int
    master_addr: str
    master_port: int
    join_s: float = 3.0
    max_restarts: int = 10
    timeout_s: float | None = None  # the process groups' timeout (None: torch's default, 30 min)
    restarted: int = 0  # how often its node started this process again (ENV_RESTARTED)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Session:
        """ValueError naming the variable that is missing or out of its range."""
        e = os.environ if env is None else env

        def number(name: str, low: float, high: float, default: float | None = None, kind: type = int) -> Any:
            raw = e.get(name)
            if raw is None and default is not None:
                return kind(default)
            try:
                value = kind(raw)
            except (TypeError, ValueError):
                raise ValueError(f"{name}={raw!r}: not {'an integer' if kind is int else 'a number'}") from None
            if not low <= value <= high:
                raise ValueError(f"{name}={raw}: needs {low:g} .. {high:g}")
            return value

        launched = number("WORLD_SIZE", 1, 1 << 20)
        world = number(ENV_WORLD, 1, launched)
        addr = e.get("MASTER_ADDR", "")
        if not addr:
            raise ValueError("MASTER_ADDR is not set")
        return cls(uid=number("RANK", 0, launched - 1), world_size=world, standbys=launched - world, master_addr=addr,
                   master_port=number("MASTER_PORT", 1, 65535), join_s=number(ENV_JOIN, 0, 3600, 3.0, float),
                   max_restarts=number(ENV_RESTARTS, 0, 10_000, 10),
                   timeout_s=number(ENV_TIMEOUT, 1, 86_400, kind=float) if e.get(ENV_TIMEOUT) else None,
                   restarted=number(ENV_RESTARTED, 0, 1 << 20, 0))


@dataclass(frozen=True)
class Attempt:
    """What the training function is told: which attempt, its rank in it, and who was replaced."""

    number: int
    rank: int
    world_size: int
    uid: int
    restarted_at: float | None  # time.time() when the previous attempt ended (None: the first)
    replaced: tuple[Replaced, ...] = ()


def connect(s: Session, timeout_s: float = 60.0) -> Any:
    """A client of the launch's store, its keys under ``PREFIX``."""
    import torch.distributed as dist

    store = dist.TCPStore(s.master_addr, s.master_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(PREFIX, store)


def _get(store: Any, key: str) -> str | None:
    return store.get(key).decode("utf-8", "replace") if store.check([key]) else None


def _wait_for(store: Any, key: str, bound_s: float) -> str | None:
    deadline = time.monotonic() + bound_s
    while True:
        got = _get(store, key)
        if got is not None or time.monotonic() >= deadline:
            return got
        time.sleep(POLL_S)


def declare_over(store: Any, attempt: int, why: str) -> str:
    """Write why attempt ``attempt`` ended unless someone did first; returns the reason that stays."""
    return store.compare_set(f"a{attempt}/over", "", why[:500]).decode("utf-8", "replace")


def join_next(store: Any, s: Session, previous: Members) -> Assigned | Relaunch:
    """Arrive at attempt ``previous.attempt + 1``; lead it if first; return its members (or why not).
    Arrivals are numbered (``a{k}/count``) and each number's uid written (``a{k}/arrival/{n}``), so the
    leader reads them all in one round trip, whatever the job's size."""
    k = previous.attempt + 1
    n = store.add(f"a{k}/count", 1)
    store.set(f"a{k}/arrival/{n}", str(s.uid))
    everyone = len(previous.uids) + len(previous.waiting)
    if store.compare_set(f"a{k}/leader", "", str(s.uid)).decode() == str(s.uid):
        deadline = time.monotonic() + s.join_s
        last, quiet = (n, time.monotonic()), min(QUIET_S, s.join_s)
        while n < everyone and time.monotonic() < deadline:
            if n >= len(previous.uids) and time.monotonic() - last[1] >= quiet:
                break  # enough to fill every rank, and nobody new for QUIET_S: the rest are lost
            time.sleep(POLL_S / 4)
            n = store.add(f"a{k}/count", 0)
            if n != last[0]:
                last = (n, time.monotonic())
        out = assign(previous, _arrived(store, k, n), s.world_size + s.standbys) if k <= s.max_restarts else Relaunch(
            f"{s.max_restarts} in-process restart(s) made, the most recovery.max_restarts allows")
        store.set(f"a{k}/members", encode(out.members) if isinstance(out, Assigned) else f"relaunch;{out.reason}")
        if isinstance(out, Assigned):
            store.set(LATEST, encode(out.members))
        return out
    got = _wait_for(store, f"a{k}/members", s.join_s + 30.0)
    if got is None:
        return Relaunch(f"attempt {k}'s members were not written within {s.join_s + 30.0:.0f} s (its leader lost)")
    if got.startswith("relaunch;"):
        return Relaunch(got.removeprefix("relaunch;"))
    try:
        members = decode(got)
    except ValueError as e:
        return Relaunch(f"attempt {k}'s members record is unreadable: {e}")
    if members.attempt != k or len(members.uids) != len(previous.uids):
        return Relaunch(f"attempt {k}'s members record is of attempt {members.attempt}, {len(members.uids)} ranks")
    return Assigned(members, changes(previous, members))


def _arrived(store: Any, k: int, n: int) -> frozenset[int]:
    """The uids of arrivals 1 .. n (an arrival counted but not yet written is waited for, briefly)."""
    keys = [f"a{k}/arrival/{i}" for i in range(1, n + 1)]
    deadline = time.monotonic() + 5.0
    while not store.check(keys):
        if time.monotonic() >= deadline:  # an arrival that died between its count and its write
            keys = [key for key in keys if store.check([key])]
            break
        time.sleep(0.01)
    uids = set()
    for raw in store.multi_get(keys) if keys else ():
        try:
            uids.add(int(raw))
        except ValueError:  # not a uid: not an arrival
            pass
    return frozenset(uids)


def leave_group(bound_s: float = 10.0) -> None:
    """Leave this attempt's process group, and forget what accelerate, DeepSpeed and transformers
    kept of it, so that the next attempt sets them up anew in this process. Bounded: a group that
    does not close within ``bound_s`` is left to the garbage collector."""
    import torch.distributed as dist

    def close() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    t = threading.Thread(target=close, daemon=True, name="hfscale-leave-group")
    t.start()
    t.join(bound_s)
    forget_singletons()
    while gc.collect():
        pass


# modules whose globals cache process groups (DeepSpeed's data, expert, sequence and pipeline groups):
# loaded again (importlib.reload), so they hold none of the previous attempt's
GROUP_CACHES = ("deepspeed.utils.groups", "deepspeed.runtime.sequence_parallel.parallel_state_sp",
                "deepspeed.runtime.pipe.p2p")


def forget_singletons() -> None:
    """The process-wide state the libraries keep of a process group (each only where imported)."""
    import importlib

    for name in GROUP_CACHES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
    acc = sys.modules.get("accelerate.state")
    if acc is not None:
        acc.AcceleratorState._reset_state(True)  # noqa: SLF001 - accelerate's own reset, used by its tests
        acc.GradientState._reset_state()  # noqa: SLF001
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None:
        ds_comm.cdb = None  # deepspeed.init_distributed starts again
    hf_ds = sys.modules.get("transformers.integrations.deepspeed")
    if hf_ds is not None:
        hf_ds.unset_hf_deepspeed_config()


def _join_group(store: Any, members: Members, rank: int, timeout_s: float | None) -> None:
    """This attempt's process group; with ``timeout_s``, a collective that waits longer raises (a peer
    frozen or cut off never closes its connections: without a bound the survivors wait for ever)."""
    import torch.distributed as dist

    backend = "nccl" if _cuda() else "gloo"
    bound = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if bound:
        _groups_made_later_time_out(bound["timeout"])
    dist.init_process_group(backend, store=dist.PrefixStore(f"a{members.attempt}/pg/", store), rank=rank,
                            world_size=members.world_size, **bound)


def _groups_made_later_time_out(bound: timedelta) -> None:
    """The groups the libraries make after the attempt's (``dist.new_group`` without a timeout: DeepSpeed's
    copy of the world that ZeRO reduces gradients over, deepspeed.utils.groups._clone_world_group) take
    torch's default timeout, 30 min, not the attempt group's: a survivor blocked in ZeRO's all_reduce on a
    peer that left without closing its connections waited half an hour instead of ``bound`` (seen in the
    namespace cluster's in-process test: the stuck survivor was counted lost, and the next fault found no
    standby). torch reads its defaults when a group is made (distributed_c10d._get_default_timeout)."""
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = bound
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = bound


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(fn: Callable[[Attempt], int], say: Callable[[str], None] | None = None, session: Session | None = None) -> int:
    """Run ``fn`` in attempts until one returns; returns its exit code, or ``RELAUNCH_EXIT``.
    A standby waits until an attempt needs it or the job ends (then 0)."""
    s = session or Session.from_env()
    tell = say or (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        return _attempts(fn, s, tell)
    except RuntimeError as e:  # torch's DistStoreError, DistNetworkError: a store operation outside ``fn`` failed
        tell(f"hfscale: no in-process restart: the store at {s.master_addr}:{s.master_port} is lost "
             f"({str(e)[:300]}); the job is relaunched")
        return RELAUNCH_EXIT


def _tell_standbys(store: Any, standbys: int, bound_s: float = 10.0) -> None:
    """The job is done: tell the standbys, and wait (bounded) until each has seen it, so that a store
    hosted with rank 0's node does not end before them (they would take that for a lost store)."""
    try:
        store.set("finished", "1")
        deadline = time.monotonic() + bound_s
        while store.add("finished/seen", 0) < standbys and time.monotonic() < deadline:
            time.sleep(POLL_S / 4)
    except RuntimeError:  # the store is gone: the standbys end with RELAUNCH_EXIT, the job's result stands
        pass


def _attempts(fn: Callable[[Attempt], int], s: Session, tell: Callable[[str], None]) -> int:
    """``run``'s loop; a store operation that fails raises RuntimeError (``fn``'s own errors are caught)."""
    store = connect(s)
    replaced: tuple[Replaced, ...] = ()
    ended: float | None = None
    why = ""  # why the attempt before ended
    if s.restarted:
        found = _late(store, s)
        if found is None:
            return 0  # the job has finished
        if isinstance(found, Relaunch):
            tell(f"hfscale: no in-process restart: {found.reason}; the job is relaunched")
            return RELAUNCH_EXIT
        members, late = found, True
        tell(f"hfscale: uid {s.uid}, started again by its node ({s.restarted}), waits as a standby from attempt "
             f"{members.attempt}")
    else:
        members, late = first(s.world_size, s.standbys), False
        if s.uid == 0:
            store.compare_set(LATEST, "", encode(members))
    while True:
        rank = None if late else members.rank_of(s.uid)
        late = False
        if rank is None:  # a standby: wait for this attempt to end, or for the job to
            while not store.check([f"a{members.attempt}/over"]):
                if store.check(["finished"]):
                    store.add("finished/seen", 1)
                    return 0
                time.sleep(POLL_S)
            ended, why = time.time(), _get(store, f"a{members.attempt}/over") or ""
        else:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(members.world_size))
            if ended is not None:  # this start's parts, marked again (rank 0 of the attempt writes them)
                begin_attempt(ended, members.attempt, why)
            _join_group(store, members, rank, s.timeout_s)
            try:
                rc = fn(Attempt(members.attempt, rank, members.world_size, s.uid, ended, replaced))
            except (KeyboardInterrupt, SystemExit):
                raise
            except LossAlarm:  # every rank stopped at one step, nothing lost: a relaunch rolls back (its record says)
                tell("hfscale: no in-process restart: the loss guard stopped training; the job is relaunched")
                return RELAUNCH_EXIT
            except SlowNodeStop:  # every rank stopped after a checkpoint: the relaunch replaces the slow node
                tell("hfscale: no in-process restart: a slow node is replaced; the job is relaunched")
                return RELAUNCH_EXIT
            except Exception as e:  # noqa: BLE001 - any failure of an attempt is restarted, within max_restarts
                ended = time.time()
                first_line = (str(e).strip().splitlines() or [""])[0]
                mine = f"rank {rank} (uid {s.uid}): {type(e).__name__}: {first_line[:200]}"
                _keep_traceback(s.uid, members.attempt)
                e.__traceback__ = None
                del e
                leave_group()
                why = declare_over(store, members.attempt, mine)
                tell(f"hfscale: attempt {members.attempt} ended ({why}); rank {rank} stays and rejoins")
            else:
                leave_group()
                if rank == 0:
                    _tell_standbys(store, len(members.waiting))
                return rc
        out = join_next(store, s, members)
        if isinstance(out, Relaunch):
            tell(f"hfscale: no in-process restart: {out.reason}; the job is relaunched")
            return RELAUNCH_EXIT
        members, replaced = out.members, out.replaced


def _late(store: Any, s: Session) -> Members | Relaunch | None:
    """Where a process its node started again stands: the current attempt's members, as a standby
    of it (None: the job has finished). It was killed in some attempt; the others may not even have
    noticed yet, and it must not take its old rank in a group that has it: it waits for the attempt
    to end and arrives at the next, where ``assign`` makes it a standby, or gives it its old rank back."""
    deadline = time.monotonic() + LATE_WAIT_S
    while True:
        if store.check(["finished"]):
            store.add("finished/seen", 1)
            return None
        got = _get(store, LATEST)
        if got is not None:
            try:
                return decode(got)
            except ValueError as e:
                return Relaunch(f"the store's current members are unreadable: {e}")
        if time.monotonic() >= deadline:
            return Relaunch(f"started again by its node, it found no attempt in the store within {LATE_WAIT_S:.0f} s")
        time.sleep(POLL_S)


def _keep_traceback(uid: int, attempt: int) -> None:
    """The failed attempt's traceback, for the record but off the terminal (the failure is healed):
    ``<run dir>/logs/_inprocess-<uid>.log`` (hfscale launch sets HFSCALE_RUN_DIR; no host's log begins with
    "_"), else standard error."""
    text = f"--- attempt {attempt} ended in uid {uid}, {time.strftime('%F %T')}\n" + traceback.format_exc()
    run_dir = os.environ.get("HFSCALE_RUN_DIR")
    if run_dir:
        try:
            with open(os.path.join(run_dir, "logs", f"_inprocess-{uid}.log"), "a", encoding="utf-8") as f:
                f.write(text)
            return
        except OSError:
            pass
    sys.stderr.write(text)
