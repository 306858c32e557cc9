"""The dialect tables: DIALECTS[name]."""
from .cuda import CUDA
from .dialect import Dialect
from .metal import METAL

DIALECTS: dict[str, Dialect] = {"metal": METAL, "cuda": CUDA}


def machine_dialect() -> str | None:
    """The dialect of this machine's GPU as MLX sees it (Metal first, then CUDA), or None without one."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


def get(name: str) -> Dialect:
    if name not in DIALECTS:
        raise ValueError(f"unknown target {name!r}: expected one of {sorted(DIALECTS)}")
    return DIALECTS[name]
