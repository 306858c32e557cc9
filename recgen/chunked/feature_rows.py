r"""The rows of a feature map's expanded space, as the kernel-identity form (``chunked.features``) reads them: each
layout forms the rows of φ(x) for the products over them (or forms them as it reads them) and gives their gradient.

- ``PackedRows``: the spec's own d(d+1)/2 packed rows, formed and differentiated by the generated sympow kernels
  (``recgen.runtime.chunk_kernels.sympow_fn``) where the tuning runs chunk kernels.
- ``FusedRows``: the packed rows read by fragment kernels that form φ as they read it (``Tuning.feature_kernels``).
- ``GatheredRows``: degrees 3 and 4, the packed rows by MLX gathers.
- ``TileRows``: MLX ops on any device (degree 2), blocks of rows that are products x_a x_b (``FeatureTiles``): tile i has the
  rows a ∈ [i·bs, (i+1)·bs), b ∈ [i·bs, d), each a broadcast product of two slices (no gather), weighted 1 where b
  lies in a's own block (both orders present) and 2 beyond (one order for two), so Σ_rows ω φ_row(x) φ_row(y) =
  (xᵀy)²: 2560 rows at d = 64 against the packed d(d+1)/2 = 2080. The state passes in and out in the spec's packed
  layout (``to_tiles``, ``from_tiles``: one gather each).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..codegen.chunk_sources import sympow_supported
from ..runtime import chunk_kernels as ck
from ..spec.features import sympow_pairs, sympow_width
from ..tuning import Tuning
from .terms import sympow_mx


@dataclass(frozen=True)
class FeatureTiles:
    """The expanded space of degree-2 features of width d as tiles of rows (a, b), a in [i·bs, (i+1)·bs), b >= i·bs."""

    d: int
    bs: int

    @property
    def count(self) -> int:
        return self.d // self.bs

    def rows(self, i: int) -> int:
        return self.bs * (self.d - i * self.bs)

    @property
    def total(self) -> int:
        return sum(self.rows(i) for i in range(self.count))

    def start(self, i: int) -> int:
        return sum(self.rows(j) for j in range(i))

    def weight(self, i: int) -> np.ndarray:
        """ω of tile i's rows: 1 inside a's own block (both orders of (a, b) are rows), 2 beyond it (one for two)."""
        w = np.full((self.bs, self.d - i * self.bs), 2.0)
        w[:, :self.bs] = 1.0
        return w.reshape(-1)

    def row(self, a: int, b: int) -> int:
        """The tile row of (a, b) for a <= b."""
        i = a // self.bs
        return self.start(i) + (a - i * self.bs) * (self.d - i * self.bs) + (b - i * self.bs)


@lru_cache(maxsize=None)
def feature_tiles(d: int) -> FeatureTiles:
    """Blocks of bs = the largest divisor of d up to 16: few tiles (4 at d = 64) for 23% more rows than packed."""
    return FeatureTiles(d, max(b for b in range(1, min(d, 16) + 1) if d % b == 0))


@lru_cache(maxsize=None)
def _packing(d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tile row of each packed pair, its coefficient c_ab; packed pair of each tile row, 1/c of it)."""
    ft = feature_tiles(d)
    a, b, c = sympow_pairs(d)
    pack_rows = np.array([ft.row(x, y) for x, y in zip(a, b)], dtype=np.int32)
    index = {(x, y): n for n, (x, y) in enumerate(zip(a, b))}
    tile_pairs, inv = [], []
    for i in range(ft.count):
        for x in range(i * ft.bs, (i + 1) * ft.bs):
            for y in range(i * ft.bs, d):
                n = index[(min(x, y), max(x, y))]
                tile_pairs.append(n)
                inv.append(1.0 / c[n])
    return pack_rows, c, np.array(tile_pairs, dtype=np.int32), np.array(inv)


def to_tiles(S, d: int):
    """A packed state [..., d(d+1)/2, V] -> the tiles' rows [..., R, V] (a symmetric full state's rows)."""
    _, _, pairs, inv = _packing(d)
    return mx.take(S, mx.array(pairs), axis=-2) * mx.array(inv, dtype=S.dtype)[:, None]


def from_tiles(S, d: int):
    """The tiles' rows [..., R, V] -> the packed state [..., d(d+1)/2, V]."""
    rows, c, _, _ = _packing(d)
    return mx.take(S, mx.array(rows), axis=-2) * mx.array(c, dtype=S.dtype)[:, None]


def tile_features(x, ft: FeatureTiles, i: int):
    """Tile i's rows of x [..., d]: x_a x_b as [..., bs, d - i·bs] (unweighted)."""
    lo = i * ft.bs
    return x[..., lo:lo + ft.bs, None] * x[..., None, lo:]


class FormedRows:
    """Rows formed in memory (``features``; ``phi`` hands them to the products), their products MLX matmuls."""

    recordable = True  # no mx.custom_function in its products: a replay (``runtime.replay``) can record them

    def tile(self, S, i: int):
        """Tile i's rows of S [B,H,R,V'] (a state in this layout): S itself where there is one tile."""
        if self.count == 1:
            return S
        start = sum(self.size(j) for j in range(i))
        return S[:, :, start:start + self.size(i)]

    def phi(self, x, i: int):
        """What the products of tile i read for x [B,H,n,C,d]: here φ's rows themselves [B,H,n,C,R_i]."""
        return self.features(x, i)

    def states(self, ph, Y, i: int):
        """φ(x)ᵀ Y per chunk: [B,H,n,R_i,V'] from ``phi``'s value and Y [B,H,n,C,V']."""
        return ph.swapaxes(-1, -2) @ Y

    def weighted(self, S, i: int):
        """ω ⊙ S over tile i's rows (S [..., R_i, V']): the weights ride on the state, never on a token's features."""
        w = self.weight(i)
        return S if w is None else S * mx.array(w, dtype=S.dtype)[:, None]

    def stacked(self, ph, Y, tail, i: int, weighted: bool = False):
        """[B,H,n+1,R_i,V']: ``states`` of each chunk (ω ⊙ them where ``weighted``), then ``tail`` [B,H,R_i,V'] (an
        initial state, or the final state's cotangent), as the entry states' one product over chunks reads them."""
        S = self.states(ph, Y, i)
        return mx.concatenate([self.weighted(S, i) if weighted else S, tail[:, :, None]], axis=2)

    def out(self, ph, S, i: int):
        """φ(x) S per chunk: [B,H,n,C,V'] from ``phi``'s value and S [B,H,m,R_i,V'], m >= n states a sequence (the
        entry states, then the final one: chunk j reads state j)."""
        return ph @ S[:, :, :ph.shape[2]]

    def jac(self, x, S, Y, i: int):
        """dx [B,H,n,C,d] of Σ_t Σ_r (S_r · Y_t) φ_r(x_t) per chunk (S [B,H,m,R_i,V'] as ``out``'s, Y [B,H,n,C,V']):
        the rows' cotangents Y Sᵀ formed, then ``features_vjp``."""
        return self.features_vjp(x, Y @ S[:, :, :x.shape[2]].swapaxes(-1, -2), i)


@dataclass(frozen=True)
class TileRows(FormedRows):
    """The expanded space as ``FeatureTiles`` formed by MLX ops (any device): several tiles, weights ω."""

    ft: FeatureTiles

    count = property(lambda self: self.ft.count)

    def size(self, i: int) -> int:
        return self.ft.rows(i)

    def weight(self, i: int):
        return self.ft.weight(i)

    def features(self, x, i: int):
        """Tile i's rows of x [B,H,n,C,d] -> [B,H,n,C,R_i] (unweighted)."""
        return tile_features(x, self.ft, i).reshape(*x.shape[:-1], -1)

    def features_vjp(self, x, G, i: int):
        """dx of Σ G ⊙ features(x, i): the two sides of each product as batched matrix-vector products."""
        lo, bs = i * self.ft.bs, self.ft.bs
        G = G.reshape(*G.shape[:-1], bs, -1)                      # [..., bs, d - lo]
        da = (G @ x[..., lo:, None])[..., 0]                      # Σ_b G_ab x_b
        db = (x[..., None, lo:lo + bs] @ G)[..., 0, :]            # Σ_a G_ab x_a
        pad = [(0, 0)] * (x.ndim - 1)
        return mx.pad(da, pad + [(lo, self.ft.d - lo - bs)]) + mx.pad(db, pad + [(lo, 0)])

    def to_rows(self, S):
        return to_tiles(S, self.ft.d)

    def from_rows(self, S):
        return from_tiles(S, self.ft.d)


@dataclass(frozen=True)
class PackedRows(FormedRows):
    """φ's own packed rows (the spec's state layout, ω = 1, one tile), formed and differentiated by the generated
    sympow kernels where the tuning runs chunk kernels: φ written contiguous in one pass, its gradient read in
    one (MLX's broadcast products and reductions were most of the tiles' backward on the H100)."""

    t: Tuning
    d: int

    count = 1
    recordable = False  # φ and its gradient are the sympow kernels' mx.custom_function, which MLX cannot record

    def size(self, i: int) -> int:
        return self.d * (self.d + 1) // 2

    def weight(self, i: int):
        return None

    def _phi(self):
        return ck.sympow_fn(self.t, 1, "block")

    def features(self, x, i: int):
        B, H, n, C, d = x.shape
        return self._phi()(x.reshape(B * H, n * C, 1, d)).reshape(B, H, n, C, -1)

    def features_vjp(self, x, G, i: int):
        B, H, n, C, d = x.shape
        flat = x.reshape(B * H, n * C, 1, d)
        return mx.vjp(self._phi(), [flat], [G.reshape(B * H, 1, n * C, -1)])[1][0].reshape(x.shape)

    def to_rows(self, S):
        return S

    def from_rows(self, S):
        return S


@dataclass(frozen=True)
class FusedRows(PackedRows):
    """``PackedRows`` whose products run as fragment kernels that form φ as they read it
    (``chunk_kernels.feature_states``: φ(X)ᵀY; ``feature_out``: φ(X)S; ``feature_jac``: the gradient through them,
    2 M x with M the state's quadratic form), so neither φ(q), φ(k) nor a [T, F] cotangent is ever written."""

    recordable = True  # the fragment kernels are plain kernel calls

    def phi(self, x, i: int):
        return x

    def states(self, ph, Y, i: int):
        return ck.feature_states(ph, Y, self.t)

    def stacked(self, ph, Y, tail, i: int, weighted: bool = False):
        return ck.feature_states(ph, Y, self.t, tail)  # ω = 1: one kernel writes the chunks' states and the tail

    def out(self, ph, S, i: int):
        return ck.feature_out(ph, S, self.t)

    def jac(self, x, S, Y, i: int):
        return ck.feature_jac(x, S, Y, self.t)


@dataclass(frozen=True)
class GatheredRows(FormedRows):
    """φ's packed rows of any degree by MLX gathers and products (``terms.sympow_mx``), its gradient MLX autodiff of
    them: the rows of degrees the tiles and kernels do not cover (3, 4)."""

    d: int
    degree: int

    count = 1

    def size(self, i: int) -> int:
        return sympow_width(self.d, self.degree)

    def weight(self, i: int):
        return None

    def features(self, x, i: int):
        return sympow_mx(x, self.degree)

    def features_vjp(self, x, G, i: int):
        return mx.vjp(lambda a: sympow_mx(a, self.degree), [x], [G])[1][0]

    def to_rows(self, S):
        return S

    def from_rows(self, S):
        return S


def rows_for(t: Tuning, d: int, dtype, C: int, V1: int, degree: int = 2):
    """For chunks of C and V' value columns: the fragment kernels' rows where the tuning asks for them
    (``Tuning.feature_kernels``) and they have a layout, the sympow kernels' packed rows where it runs chunk kernels,
    else MLX's tiles; the kernels' rows in float32 only; degrees but 2 by MLX gathers."""
    if degree != 2:
        return GatheredRows(d, degree)
    if t.chunk_kernels and dtype == mx.float32 and sympow_supported(t.dialect, d):
        return FusedRows(t, d) if ck.features_on_kernels(t, C, d, V1) else PackedRows(t, d)
    return TileRows(feature_tiles(d))
