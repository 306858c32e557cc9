"""Resolve a spec named on a command line or given to ``recgen.load``: a built-in name or
``path/to/file.py:function`` (the file is imported; the attribute must be a recurrence)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ..errors import CliError
from . import ir


def builtin_specs() -> dict:
    from ..specs import BUILTINS
    return BUILTINS


def _load_module(path: Path):
    name = "recgen_user_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CliError(f"{path}: cannot be loaded as a Python module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def resolve_spec(text: str) -> ir.Recurrence:
    """A built-in name (``gated_delta_net``) or ``path/to/file.py:function`` -> the ``ir.Recurrence``.

    Raises ``CliError`` (unknown name, bad form, wrong type, missing attribute) or
    ``FileNotFoundError``; errors raised while importing the file (``ir.SpecError`` ...) propagate.
    """
    builtins = builtin_specs()
    if text in builtins:
        return builtins[text]
    if ":" not in text:
        if text.endswith(".py"):
            raise CliError(f"{text!r}: name the recurrence too, as {text}:function")
        names = ", ".join(sorted(builtins))
        raise CliError(f"unknown spec {text!r}: not a built-in ({names}) and not of the form path/to/file.py:function")
    path_s, _, attr = text.rpartition(":")
    if not path_s or not attr:
        raise CliError(f"{text!r}: expected path/to/file.py:function")
    path = Path(path_s)
    if not path.is_file():
        raise FileNotFoundError(f"spec file {path_s!r} not found" if not path.exists()
                                else f"spec file {path_s!r} is not a file")
    mod = _load_module(path)
    if not hasattr(mod, attr):
        found = sorted(k for k, v in vars(mod).items() if isinstance(v, ir.Recurrence))
        hint = f"; recurrences in the file: {', '.join(found)}" if found else "; the file defines no recurrence"
        raise CliError(f"{path_s}: no attribute {attr!r}{hint}")
    obj = getattr(mod, attr)
    if not isinstance(obj, ir.Recurrence):
        raise CliError(f"{path_s}:{attr} is a {type(obj).__name__}, not a recurrence "
                       "(decorate the function with @recurrence)")
    return obj
