"""The dialect tables: DIALECTS[name]."""
from .cuda import CUDA
from .dialect import Dialect
from .metal import METAL

DIALECTS: dict[str, Dialect] = {"metal": METAL, "cuda": CUDA}


def get(name: str) -> Dialect:
    if name not in DIALECTS:
        raise ValueError(f"unknown target {name!r}: expected one of {sorted(DIALECTS)}")
    return DIALECTS[name]
