"""What the drop-ins share: metadata checks of their array arguments, and the call of a recgen op on inputs whose
[B,T,H,D] layout is the caller's contract."""
from __future__ import annotations

import warnings

from ..spec.layouts import InputError


def shape_error(name: str, shape, expected: str) -> InputError:
    return InputError(f"argument {name!r}: expected {expected}, got shape {tuple(shape)}")


def check_floating_arrays(named: dict) -> None:
    """Each value an mx.array of a floating dtype (metadata only: no host sync), else an error naming it."""
    import mlx.core as mx

    for name, x in named.items():
        if not isinstance(x, mx.array):
            raise InputError(f"argument {name!r}: expected an mx.array, got {type(x).__name__}")
        if not mx.issubdtype(x.dtype, mx.floating):
            raise InputError(f"argument {name!r}: expected a floating dtype, got {x.dtype}")


def call_in_layout(op, T: int, H: int, *args, **kwargs):
    """``op(*args, **kwargs)`` without its head-first layout warning: the caller's [B,T,H,D] layout is a contract,
    so a short prompt (1 < T < H, where the op warns) is not head-first. The warnings context is entered only
    then: it costs host time on every decode step."""
    if not 1 < T < H:
        return op(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*layout mismatch", category=UserWarning)
        return op(*args, **kwargs)
