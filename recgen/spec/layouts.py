"""Sizes of a call, inferred from the input shapes, with errors that name the argument.

Layouts (FLA's): scalar [B,T,H], key [B,T,Hk,Kin], key_gate [B,T,H,K], value [B,T,H,V],
param [H, *signature], initial state [B,H,K,V] (and z [B,H,K] with a normalizer).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..errors import InputError
from . import ir


@dataclass(frozen=True)
class Sizes:
    B: int
    T: int
    H: int
    Hk: int
    Kin: int  # width of the raw key inputs (the feature map's input width)
    K: int    # state rows
    V: int    # state columns

    def key_head(self, h: int, gqa: str) -> int:
        g = self.H // self.Hk
        return h // g if gqa == "block" else h % self.Hk

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        return (self.B, self.H, self.K, self.V)


def _expect(name: str, shape, expected_ndim: int, layout: str):
    if len(shape) != expected_ndim:
        raise InputError(f"argument {name!r}: expected a {expected_ndim}-d array {layout}, got shape {tuple(shape)}")


class _Unifier:
    """Collects each size from every argument that fixes it; the first conflict is an error."""

    def __init__(self):
        self.values: dict[str, tuple[int, str]] = {}

    def put(self, size: str, value: int, who: str):
        if size in self.values and self.values[size][0] != value:
            v0, who0 = self.values[size]
            raise InputError(f"argument {who!r}: size {size}={value} disagrees with {size}={v0} from {who0!r}")
        self.values.setdefault(size, (value, who))

    def get(self, size: str, why: str) -> int:
        if size not in self.values:
            raise InputError(f"cannot infer {size}: {why}")
        return self.values[size][0]


LAYOUT = {"scalar": ("B", "T", "H"), "key": ("B", "T", "Hk", "Kin"), "key_gate": ("B", "T", "H", "K"),
          "value": ("B", "T", "H", "V")}


def input_dims(x: ir.Input) -> tuple[str, ...]:
    """The named axes of input ``x``: ``LAYOUT`` for per-token inputs, [H, K|V...] for a parameter."""
    if x.kind == "param":
        return ("H",) + tuple({"i": "K", "j": "V"}[c] for c in x.index)
    return LAYOUT[x.kind]


def infer_sizes(rec: ir.Recurrence, shapes: dict[str, tuple[int, ...]]) -> Sizes:
    """The sizes of a call; raises InputError naming the first argument that does not fit."""
    return _infer(rec, tuple(sorted((k, tuple(v)) for k, v in shapes.items())))


@lru_cache(maxsize=512)
def _infer(rec: ir.Recurrence, items: tuple) -> Sizes:
    shapes = dict(items)
    missing = [x.name for x in rec.inputs if x.name not in shapes]
    if missing:
        raise InputError(f"{rec.name}: missing argument(s) {missing}")
    extra = set(shapes) - {x.name for x in rec.inputs}
    if extra:
        raise InputError(f"{rec.name}: unexpected argument(s) {sorted(extra)}")
    u = _Unifier()
    for x in rec.inputs:
        shape = tuple(shapes[x.name])
        dims = input_dims(x)
        _expect(x.name, shape, len(dims), "[" + ",".join(dims) + "]")
        for dim, n in zip(dims, shape):
            if n <= 0 and dim not in ("T", "B"):
                raise InputError(f"argument {x.name!r}: size {dim} must be positive, got {n}")
            u.put(dim, n, x.name)
    B = u.get("B", "no per-token input")
    T = u.get("T", "no per-token input")
    H = u.get("H", "no value-head input (scalar, value, key gate or parameter)")
    Hk = u.values.get("Hk", (H, ""))[0]
    if H % Hk:
        raise InputError(f"argument {u.values['Hk'][1]!r}: {Hk} key heads do not divide the {H} value heads "
                         f"of {u.values['H'][1]!r} (GQA needs H % Hk == 0)")
    Kin = u.values.get("Kin", (None, ""))[0]
    if rec.features:
        if Kin is None:
            raise InputError(f"{rec.name}: feature map needs a key input")
        u.put("K", rec.features[0].width(Kin), f"sympow({rec.features[0].source})")
    elif Kin is not None:
        u.put("K", Kin, "key inputs")
    K = u.get("K", "no key-indexed input")
    V = u.get("V", "no value-indexed input")
    return Sizes(B, T, H, Hk, Kin if Kin is not None else K, K, V)


def check_state(rec: ir.Recurrence, sizes: Sizes, state, name: str = "initial_state"):
    """The state is S [B,H,K,V], or the pair (S, z [B,H,K]) with a normalizer."""
    if rec.has_normalizer:
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise InputError(f"argument {name!r}: {rec.name} has a normalizer, pass the pair (S, z)")
        S, z = state
        if tuple(z.shape) != sizes.state_shape[:3]:
            raise InputError(f"argument {name!r}: z must have shape {sizes.state_shape[:3]}, got {tuple(z.shape)}")
    else:
        S = state
    if tuple(S.shape) != sizes.state_shape:
        raise InputError(f"argument {name!r}: expected shape [B,H,K,V] = {sizes.state_shape}, got {tuple(S.shape)}")
