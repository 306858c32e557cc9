"""A frozen dataclass's hash, computed once: for the values every op call looks up in caches (the tuning, a
kernel launch), where hashing their fields again on each lookup is host work on every call."""
from __future__ import annotations

from dataclasses import fields


def hash_once(self) -> int:
    """``__hash__ = hash_once`` in a frozen dataclass's body: the hash of its fields, kept after the first call
    (a class body's own ``__hash__`` is one ``dataclass`` does not replace)."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(self, f.name) for f in fields(self)))
        object.__setattr__(self, "_hash", h)
    return h
