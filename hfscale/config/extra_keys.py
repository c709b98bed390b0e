"""Checking and merging an ``extra`` mapping: keys of a library's own config that hfscale does
not type, merged into the file it generates for that library.

Each key is checked against the library's key tree (hfscale.config.sources.engine): an unknown key gets a
did-you-mean among its siblings only (never a key of another section), a renamed one its new
name, a value the kind, choices and bounds the library declares. A key hfscale sets from a typed
field is refused with that field's name: one value, one place.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

from hfscale.config.sources.engine import KIND_OF, Section

Path = tuple[str | int, ...]
_WORDS = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string", "none": "null",
          "list": "a list", "dict": "a mapping"}
_OPS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b), "le": ("<=", lambda v, b: v <= b),
        "lt": ("<", lambda v, b: v < b)}


def _kind(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return "int"  # 5e8 is a whole number wherever DeepSpeed wants one
    return KIND_OF.get(type(value), type(value).__name__)


def _fits(value: Any, kinds: frozenset[str]) -> bool:
    kind = _kind(value)
    return kind in kinds or (kind == "int" and "float" in kinds)


def check_extra(extra: Mapping[str, Any], keys: Section, owned: Mapping[tuple[str, ...], str],
                here: Path = ()) -> list[tuple[Path, str]]:
    """Problems of ``extra`` (paths relative to it): unknown, renamed, owned keys and bad values."""
    out: list[tuple[Path, str]] = []
    for name, value in extra.items():
        path = here + (name,)
        key = keys.keys.get(name) if isinstance(name, str) else None
        rel = tuple(str(p) for p in path)
        canonical = rel[:-1] + (keys.canonical(name),) if key is not None else rel
        if canonical in owned:
            out.append((path, f"hfscale sets this from {owned[canonical]}; set it there"))
            continue
        if key is None:
            if keys.open or keys.ignores_unknown:
                continue  # ignored_keys() names what the library skips
            close = difflib.get_close_matches(str(name), list(keys.keys), n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            out.append((path, f"unknown key {name!r}{hint}"))
            continue
        if key.unread:
            out.append((path, key.unread))
            continue
        if key.renamed_to:
            new = keys.canonical(name)
            what = "deprecated" if key.deprecated else "another name"
            owner = _owner(owned, rel[:-1] + (new,))
            if rel[:-1] + (new,) in owned or (owner and key.transformed):
                out.append((path, f"{what} for {new!r}, which hfscale sets from {owner}; set it there"))
            elif key.transformed:
                out.append((path, f"{what}; replaced by {new!r}, which takes another value: set that"))
            else:
                out.append((path, f"{what} for {new!r}: write {new!r}"))
            continue
        if key.section is not None and isinstance(value, Mapping):
            sub_owned = {k[len(canonical):]: v for k, v in owned.items() if k[:len(canonical)] == canonical}
            out += [(path + p, m) for p, m in check_extra(value, key.section, sub_owned)]
            continue
        out += [(path, m) for m in _value_problems(value, key.kinds, key.choices, key.bounds, key.section is not None,
                                                   key.any_case)]
    return out


def ignored_keys(extra: Mapping[str, Any], keys: Section, library: str) -> list[tuple[str, str]]:
    """(key, message) for each key of ``extra`` that ``library`` skips without reading it (a section
    that ignores keys it does not know), with a did-you-mean among the keys it reads."""
    if not keys.ignores_unknown:
        return []
    out = []
    for name in extra:
        if isinstance(name, str) and name in keys.keys:
            continue
        close = difflib.get_close_matches(str(name), list(keys.keys), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        out.append((str(name), f"{name!r} is not a key {library} reads: it ignores it{hint}"))
    return out


def _owner(owned: Mapping[tuple[str, ...], str], path: tuple[str, ...]) -> str | None:
    """The hfscale key that sets ``path``, or the section whose keys set what lies below it."""
    if path in owned:
        return owned[path]
    below = sorted(v for k, v in owned.items() if k[:len(path)] == path)
    if not below:
        return None
    common = below[0].split(".")
    for other in below[1:]:
        parts = other.split(".")
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return ".".join(common) or below[0]


def _value_problems(value: Any, kinds, choices, bounds, section: bool, any_case: bool = False) -> list[str]:
    if section and value is not None:
        return [f"must be a mapping, got {_kind(value)}"]
    folded = any_case and isinstance(value, str) and value.lower() in {str(c).lower() for c in choices or ()}
    if choices and value not in choices and not folded:
        return [f"must be one of {', '.join(repr(c) for c in choices)}; got {value!r}"]
    if kinds is not None and not _fits(value, kinds):
        words = sorted(kinds - {"int"} if "float" in kinds else kinds)  # a number covers whole numbers
        want = " or ".join(_WORDS.get(k, k) for k in words)
        return [f"must be {want}, got {_WORDS.get(_kind(value), _kind(value))}"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for op, bound in bounds:
            sign, ok = _OPS[op]
            if not ok(value, bound):
                return [f"must be {sign} {bound:g}, got {value!r}"]
    return []


def merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in: mappings key by key (new dicts: the result shares none
    with ``extra``, so adding to it cannot change the config), anything else replaced."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping):
            out[k] = merge(out[k] if isinstance(out.get(k), dict) else {}, v)
        else:
            out[k] = v
    return out
