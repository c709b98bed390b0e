"""Who is which rank in the next attempt of an in-process restart: pure, no torch.

Every process the launch started has a fixed id, its ``uid``: its global rank in the launch, the
active ranks first (``0 .. world_size - 1``), then the standby ranks of the spare nodes. An attempt's
members are the uids in rank order. After a failure the processes still alive say so (``arrived``);
``assign`` keeps each survivor at its rank, so its data shard and local files stay its own, and gives
each lost rank to a standby, lowest uid first (a spare node's ranks take a lost node's ranks in
order: the uids of one node are consecutive). Too few to fill the world: no attempt, a full relaunch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Members:
    """An attempt's ranks: ``uids[r]`` is the process that is rank ``r``; ``waiting``: the standbys
    left over, in uid order (they wait for the next attempt)."""

    attempt: int
    uids: tuple[int, ...]
    waiting: tuple[int, ...] = ()

    def rank_of(self, uid: int) -> int | None:
        """The rank of ``uid`` in this attempt; None for a standby or a process left out."""
        try:
            return self.uids.index(uid)
        except ValueError:
            return None

    @property
    def world_size(self) -> int:
        return len(self.uids)


@dataclass(frozen=True)
class Replaced:
    """Rank ``rank`` was process ``lost``'s and is now ``by``'s (a standby's)."""

    rank: int
    lost: int
    by: int


@dataclass(frozen=True)
class Assigned:
    members: Members
    replaced: tuple[Replaced, ...]


@dataclass(frozen=True)
class Relaunch:
    """No next attempt in process: why (the launcher stops the job and relaunches every node)."""

    reason: str


def first(world_size: int, standbys: int) -> Members:
    """Attempt 0: uids ``0 .. world_size - 1`` active, the next ``standbys`` uids waiting."""
    if world_size < 1 or standbys < 0:
        raise ValueError(f"world_size {world_size} and standbys {standbys}: need at least 1 and 0")
    return Members(0, tuple(range(world_size)), tuple(range(world_size, world_size + standbys)))


def assign(previous: Members, arrived: frozenset[int], launched: int) -> Assigned | Relaunch:
    """The next attempt's members from ``previous`` and the uids that ``arrived`` for it. ``launched``:
    how many processes the launch started (uids ``0 .. launched - 1``). A process that arrives late for
    an attempt (its members were written without it) is a standby from then on; a uid outside the
    launch is not taken."""
    total = launched
    lost = [(r, u) for r, u in enumerate(previous.uids) if u not in arrived]
    standbys = sorted(u for u in arrived if 0 <= u < total and u not in previous.uids)
    strangers = sorted(u for u in arrived if not 0 <= u < total)
    if len(standbys) < len(lost):
        say = ", ".join(f"rank {r}" for r, _ in lost[:8]) + (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
        return Relaunch(f"{len(lost)} rank(s) lost ({say}) and {len(standbys)} standby rank(s) to take their place"
                        + (f"; {len(strangers)} unknown process(es) ignored" if strangers else ""))
    uids = list(previous.uids)
    replaced = []
    for (rank, was), by in zip(lost, standbys):
        uids[rank] = by
        replaced.append(Replaced(rank, was, by))
    return Assigned(Members(previous.attempt + 1, tuple(uids), tuple(standbys[len(lost):])), tuple(replaced))


def changes(previous: Members, members: Members) -> tuple[Replaced, ...]:
    """The ranks whose process differs between two attempts (what ``assign`` replaced)."""
    return tuple(Replaced(r, was, now) for r, (was, now) in enumerate(zip(previous.uids, members.uids)) if was != now)


def encode(m: Members) -> str:
    """``attempt;uid,uid,...;uid,...`` (members; waiting): what the store holds."""
    return f"{m.attempt};{','.join(map(str, m.uids))};{','.join(map(str, m.waiting))}"


MAX_UIDS = 1 << 20
MAX_TEXT = 8 * MAX_UIDS  # each uid at most 7 digits and a comma


def decode(text: str) -> Members:
    """``encode``'s inverse; ValueError on anything else (the store is read as hostile input)."""
    parts = text.split(";")
    if len(text) > MAX_TEXT or len(parts) != 3:
        raise ValueError("not attempt;members;waiting")

    def uids(s: str) -> tuple[int, ...]:
        out = tuple(int(x) for x in s.split(",")) if s else ()
        if any(u < 0 or u >= MAX_UIDS for u in out) or len(set(out)) != len(out):
            raise ValueError("a uid out of range or repeated")
        return out

    attempt, members, waiting = int(parts[0]), uids(parts[1]), uids(parts[2])
    if attempt < 0 or not members or set(members) & set(waiting):
        raise ValueError("a negative attempt, no member, or a uid both member and waiting")
    return Members(attempt, members, waiting)
