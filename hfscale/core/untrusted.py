"""The one reader for files hfscale reads back and did not just write: run directories, checkpoints,
id files, the output_dir lock, and the configs people give it.

Any of them may have been written or damaged by another process of the user, a job that crashed
mid-write, or another user of a shared file system. So every read:

- opens regular files only: ``O_NONBLOCK`` (a FIFO does not wait for a writer) and ``O_NOFOLLOW``
  (a symbolic link is not followed), then ``fstat``: a FIFO, socket or device (``/dev/zero``) is
  refused, and so is a file whose directory resolves outside the ``root`` being read;
- takes at most a cap of bytes per kind of file (longer ones are refused, or read from the tail);
- parses JSON from UTF-8 at most ``MAX_DEPTH`` levels deep, and validates records with typed
  models (pydantic, hfscale.core.records);
- reads JSON lines one record at a time, skipping and counting the bad ones.

:func:`read_trusted` adds the one trust rule for what hfscale executes or hands to a scheduler:
the file, and every directory from it up to the root, belong to this user and are writable by
no one else. Failures are :class:`Unreadable` (a ValueError) naming the file and the reason.
Standard library only; pydantic is imported by the models passed in.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

KiB, MiB = 1 << 10, 1 << 20
MAX_DEPTH = 64  # JSON nesting: hfscale's own files use 4; a 100k-deep one would exhaust the stack
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
M = TypeVar("M")
T = TypeVar("T")


def printable(text: str, limit: int = 300) -> str:
    """``text`` safe to print on a terminal: control characters (escape sequences, newlines) as ``?``,
    at most ``limit`` characters. For names and values read from files others may have written."""
    out = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return out + "..." if len(text) > limit else out


class Unreadable(ValueError):
    """A file that cannot be used: the message names it and says why."""

    def __init__(self, path: str | os.PathLike[str], reason: str):
        self.path, self.reason = str(path), reason
        sep = " " if reason.startswith("is ") else ": "  # "x.json is a FIFO, not ..." / "x.json: not valid JSON"
        super().__init__(f"{printable(str(path), 1000)}{sep}{printable(reason, 1000)}")


class Missing(Unreadable):
    """The file does not exist (often normal: a run that has not written it yet)."""


def real_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory itself, not a link to one (links out are never followed)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def real_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file itself, not a link, FIFO or device."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def tag_name(text: str) -> bool:
    """Whether ``text`` (read from a file such as DeepSpeed's ``latest``) can name a folder beside
    it: one path component, not ``.`` or ``..``, printable."""
    return bool(text) and text not in (".", "..") and "/" not in text and text.isprintable() and len(text) <= 255


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return f"is not a regular file ({name})"
    return "is not a regular file"


def _inside(path: Path, root: str | os.PathLike[str] | None) -> None:
    """Refuse ``path`` when its directory resolves outside ``root`` (a symlinked folder on the way)."""
    if root is None:
        return
    base, parent = os.path.realpath(root), os.path.realpath(path.parent)
    if parent != base and not parent.startswith(base.rstrip("/") + "/"):
        raise Unreadable(path, f"is in {parent}, outside {base} (a symbolic link is not followed)")


def open_regular(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None, *,
                 follow_links: bool = False) -> tuple[int, os.stat_result]:
    """(fd, its stat) of the regular file ``path``; the caller closes the fd. Raises Unreadable.
    ``follow_links``: for a file the user named (a config), not one read back."""
    p = Path(path)
    _inside(p, root)
    try:
        fd = os.open(p, _FLAGS & ~os.O_NOFOLLOW if follow_links else _FLAGS)
    except FileNotFoundError:
        raise Missing(p, "is missing") from None
    except ValueError:  # a NUL byte in the name
        raise Unreadable(p, "the name holds a NUL byte") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Unreadable(p, "is a symbolic link (hfscale does not follow links in the files it reads back)"
                             ) from None
        raise Unreadable(p, e.strerror or str(e)) from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise Unreadable(p, e.strerror or str(e)) from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Unreadable(p, _kind(st.st_mode))
    return fd, st


def _read_fd(fd: int, path: Path, st: os.stat_result, cap: int, tail: bool) -> bytes:
    if st.st_size > cap and not tail:
        raise Unreadable(path, f"is {st.st_size:,} bytes, over the {cap:,}-byte limit for this file")
    try:
        if tail and st.st_size > cap:
            os.lseek(fd, st.st_size - cap, os.SEEK_SET)
        # one read of the size fstat gave (one buffer: pieces joined would need the memory twice),
        # then what the file grew by meanwhile, up to one byte over the cap
        data = os.read(fd, min(st.st_size, cap) + 1)
        while len(data) <= cap:
            more = os.read(fd, cap + 1 - len(data))
            if not more:
                break
            data += more
    except OSError as e:
        raise Unreadable(path, e.strerror or str(e)) from None
    if len(data) > cap:  # it grew while being read
        if not tail:
            raise Unreadable(path, f"is over the {cap:,}-byte limit for this file")
        data = data[-cap:]
    return data


def _read(path: str | os.PathLike[str], cap: int, root: str | os.PathLike[str] | None, tail: bool,
          follow_links: bool = False) -> tuple[bytes, int]:
    p = Path(path)
    fd, st = open_regular(p, root, follow_links=follow_links)
    try:
        return _read_fd(fd, p, st, cap, tail), st.st_size
    finally:
        os.close(fd)


def read_bytes(path: str | os.PathLike[str], cap: int, root: str | os.PathLike[str] | None = None, *,
               tail: bool = False) -> bytes:
    """The bytes of a regular file of at most ``cap`` bytes (``tail``: its last ``cap`` bytes)."""
    return _read(path, cap, root, tail)[0]


def decode(data: bytes, path: str | os.PathLike[str]) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Unreadable(path, f"is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def read_text(path: str | os.PathLike[str], cap: int, root: str | os.PathLike[str] | None = None, *,
              follow_links: bool = False) -> str:
    """A UTF-8 text file of at most ``cap`` bytes."""
    return decode(_read(path, cap, root, False, follow_links)[0], path)


def _depth_ok(doc: Any) -> bool:
    stack = [(doc, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > MAX_DEPTH:
                return False
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True


def parse_json(text: str | bytes, path: str | os.PathLike[str]) -> Any:
    """JSON text at most MAX_DEPTH levels deep (NaN and Infinity parse; the models decide)."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise Unreadable(path, f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, TypeError) as e:  # also a number of over 4,300 digits
        raise Unreadable(path, f"not valid JSON: {str(e)[:200]}") from None
    if not _depth_ok(doc):
        raise Unreadable(path, f"JSON nested deeper than {MAX_DEPTH} levels")
    return doc


def read_json(path: str | os.PathLike[str], cap: int, root: str | os.PathLike[str] | None = None) -> Any:
    return parse_json(read_text(path, cap, root), path)


def validation_reason(e: Exception) -> str:
    """The first problem of a pydantic ValidationError, as ``key: message``."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            first = errors(include_url=False, include_input=False)[0]
        except (TypeError, IndexError):
            first = None
        if first:
            where = ".".join(str(p) for p in first.get("loc", ())) or "the record"
            more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""  # type: ignore[attr-defined]
            msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
            return f"{where}: {msg}{more}"
    return str(e)[:200]


def as_record(doc: Any, model: type[M], path: str | os.PathLike[str]) -> M:
    """``doc`` validated by the pydantic ``model``."""
    from pydantic import ValidationError

    try:
        return model.model_validate(doc)  # type: ignore[attr-defined,no-any-return]
    except ValidationError as e:
        raise Unreadable(path, validation_reason(e)) from None


def parse_record(data: bytes, model: type[M], path: str | os.PathLike[str]) -> M:
    """JSON bytes (of the file ``path``) validated by the pydantic ``model``, parsed by pydantic
    (what the model ignores is never built into Python objects; nesting is bounded by its parser)."""
    from pydantic import ValidationError

    try:
        return model.model_validate_json(data)  # type: ignore[attr-defined,no-any-return]
    except ValidationError as e:
        raise Unreadable(path, validation_reason(e)) from None


def read_record(path: str | os.PathLike[str], model: type[M], cap: int,
                root: str | os.PathLike[str] | None = None) -> M:
    """A JSON file validated by the pydantic ``model`` (:func:`parse_record`)."""
    return parse_record(read_bytes(path, cap, root), model, path)


@dataclass(frozen=True)
class Lines(Generic[T]):
    """The records of a JSON-lines file; ``skipped``: lines that were not records (torn by a crash,
    too long, wrong types); ``cut``: older lines were not read (the file is over its size limit)."""

    records: list[T]
    skipped: int = 0
    cut: bool = False

    def note(self, path: str | os.PathLike[str], what: str = "line(s)") -> str | None:
        """``"<path>: 3 unreadable line(s) skipped"`` (None when none were)."""
        parts = [f"{self.skipped} unreadable {what} skipped"] if self.skipped else []
        if self.cut:
            parts.append("only its newest part was read (over the size or line limit)")
        return f"{printable(str(path), 1000)}: {'; '.join(parts)}" if parts else None


CHUNK = 4 * MiB  # JSON lines are read from the end in pieces of this size


def _newest_first(fd: int, size: int, total_cap: int, max_lines: int, line_cap: int, state: dict):
    """The lines of an open file from its end (bytes; None for one over ``line_cap``), at most
    ``max_lines`` of them (blank ones included) from its newest ``total_cap`` bytes; memory stays
    one piece plus one line. ``state["cut"]``: older lines were left unread."""
    pos, stop, carry, over, n = size, max(0, size - total_cap), b"", False, 0
    while pos > stop and n < max_lines:
        take = min(CHUNK, pos - stop)
        pos -= take
        os.lseek(fd, pos, os.SEEK_SET)
        chunk = os.read(fd, take)
        if pos + take == size and chunk.endswith(b"\n"):
            chunk = chunk[:-1]  # the last line's end: no empty line after it
        parts = chunk.rsplit(b"\n", max_lines - n)  # at most that many lines split off: C speed
        if len(parts) == 1:  # inside one line
            carry, over = (b"", True) if over or len(chunk) + len(carry) > line_cap else (chunk + carry, False)
            continue
        yield None if over or len(parts[-1]) + len(carry) > line_cap else parts[-1] + carry
        n += 1
        for piece in reversed(parts[1:-1]):
            yield None if len(piece) > line_cap else piece
            n += 1
        carry, over = (b"", True) if len(parts[0]) > line_cap else (parts[0], False)
    if pos == 0 and n < max_lines:
        if over or carry:
            yield None if over else carry  # the file's first line
    elif pos > 0 or n >= max_lines:
        state["cut"] = True


def read_json_lines(path: str | os.PathLike[str], model: type[M], line_cap: int, total_cap: int, max_lines: int,
                    root: str | os.PathLike[str] | None = None, keep: Callable[[M], T | None] | None = None
                    ) -> Lines[T]:
    """The lines of a JSON-lines file that ``model`` accepts (pydantic, parsed from the bytes), in
    file order. At most the newest ``total_cap`` bytes and ``max_lines`` lines are looked at, read
    from the end in pieces (memory grows with what ``keep`` keeps, not with the file); a line over
    ``line_cap`` bytes, or one that is not a record, is skipped and counted; blank lines are
    ignored. ``keep`` is applied newest first (None: drop the record), so a caller can keep the
    newest records whole and older ones reduced."""
    from pydantic import ValidationError

    p = Path(path)
    fd, st = open_regular(p, root)
    validate = model.model_validate_json  # type: ignore[attr-defined]
    kept: list[Any] = []
    skipped, state = 0, {"cut": False}
    try:
        for line in _newest_first(fd, st.st_size, total_cap, max_lines, line_cap, state):
            line = line.strip() if line is not None else None
            if line == b"":
                continue
            if line is None or line[:1] != b"{":
                skipped += 1
                continue
            try:
                record = validate(line)
            except (ValidationError, ValueError, RecursionError):
                skipped += 1
                continue
            out = keep(record) if keep is not None else record
            if out is not None:
                kept.append(out)
    except OSError as e:
        raise Unreadable(p, e.strerror or str(e)) from None
    finally:
        os.close(fd)
    kept.reverse()
    return Lines(kept, skipped, state["cut"])


class Untrusted(Unreadable):
    """A file hfscale would execute or hand to a scheduler that someone else could have written."""


def _owner_problem(st: os.stat_result, what: str) -> str | None:
    if st.st_uid != os.geteuid():
        return f"{what} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        who = {0o022: "group and others", 0o020: "its group"}.get(st.st_mode & 0o022, "others")
        return f"{what} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def read_trusted(path: str | os.PathLike[str], root: str | os.PathLike[str], cap: int) -> bytes:
    """The bytes of a file hfscale will execute or hand to a scheduler: a regular file (no link
    followed) that belongs to this user and is writable by no one else, in folders up to ``root``
    (included) that are the same. Anyone else who could write one of them could have swapped the
    file. Raises Untrusted naming the file and the reason."""
    p = Path(path)
    # the folders checked are the ones the file is opened in: both resolved (a "link/.." in the
    # path the user typed must not check one folder and open another)
    base = Path(os.path.realpath(root))
    here = Path(os.path.realpath(p.parent))
    if here != base and base not in here.parents:
        raise Untrusted(p, f"is in {here}, not inside {base}")
    try:
        fd, st = open_regular(here / p.name)
    except Unreadable as e:
        raise (Missing if isinstance(e, Missing) else Untrusted)(p, e.reason) from None
    try:
        why = _owner_problem(st, "the file")
        folder = here
        while why is None:
            try:
                dst = os.lstat(folder)
            except OSError as e:
                why = f"its folder {folder}: {e.strerror or e}"
                break
            if stat.S_ISLNK(dst.st_mode):
                why = f"its folder {folder} is a symbolic link"
                break
            why = _owner_problem(dst, f"its folder {folder}")
            if folder == base:
                break
            folder = folder.parent
        if why is not None:
            raise Untrusted(p, f"{why}; hfscale runs or submits only what you alone could have written")
        return _read_fd(fd, p, st, cap, tail=False)
    finally:
        os.close(fd)
