"""Rebinding a function that other modules imported by name (``from .x import f``), or a method of a class,
reversibly.

Such modules hold their own reference to ``f``, so replacing it in its defining module alone reaches
only later imports; every module under a package prefix that holds the original is rebound too. Undoing is
the same call with the two swapped: it reaches each binding that holds the replacement, including those of
modules imported while it was in place (they took it from the defining module).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Rebinding:
    """``module.name`` held ``original`` before it was set to ``replacement``."""

    module: str
    name: str
    original: object
    replacement: object


def rebind(prefix: str, name: str, original, replacement) -> tuple[Rebinding, ...]:
    """Set ``name`` to ``replacement`` in every loaded module under ``prefix`` that binds ``original``."""
    done = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == prefix or mod_name.startswith(prefix + ".")):
            continue
        if getattr(mod, name, None) is original:
            setattr(mod, name, replacement)
            done.append(Rebinding(mod_name, name, original, replacement))
    return tuple(done)


def rebind_attribute(owner, label: str, name: str, original, replacement) -> tuple[Rebinding, ...]:
    """Set the class attribute ``owner.name`` (a method: every instance looks it up through the class) to
    ``replacement`` where it holds ``original``; ``label`` names the owner in the record (``module.Class``)."""
    if owner.__dict__.get(name) is not original:
        return ()
    setattr(owner, name, replacement)
    return (Rebinding(label, name, original, replacement),)
