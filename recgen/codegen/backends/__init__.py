"""The dialect tables: DIALECTS[name]."""
from .cuda import CUDA
from .dialect import Dialect
from .metal import METAL, METAL_PTX

DIALECTS: dict[str, Dialect] = {"metal": METAL, "cuda": CUDA, "metal_ptx": METAL_PTX}  # metal_ptx: tests only


def get(name: str) -> Dialect:
    if name not in DIALECTS:
        raise ValueError(f"unknown target {name!r}: expected one of {sorted(DIALECTS)}")
    return DIALECTS[name]
