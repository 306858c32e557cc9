r"""The chunked form of a feature-map spec through the kernel identity (power retention's): inside a chunk the
scores come from the raw keys, φ(q)ᵀφ(k) = (qᵀk)², and the expanded space is touched only at chunk boundaries, one
tile of it at a time.

For a spec with a scalar decay e^{γ_t}, readout r_t = c·φ(q_t) (c a constant), update φ(k_t) w_tᵀ and no
transition (a normalizer with the same decay and update rides along as the value column W = [w, 1]), per (b, h)
and chunk n of C tokens with in-chunk cumulative log-decays Γ_t and entry state Ŝ_n:

    Y_t     = c·( e^{Γ_t} φ(q_t)ᵀ Ŝ_n + Σ_{s≤t} e^{Γ_t−Γ_s} (q_tᵀk_s)² W_s )       (``chunk_scores``, ``inter``)
    Ŝ_{n'}  = Σ_{m<n'} L[n', m] ΔS_m + l0[n'] Ŝ_0,   ΔS_m = Σ_{s∈m} φ(k_s) (e^{Γ_C−Γ_s} W_s)ᵀ

with L[n', m] the decay from chunk m's end to chunk n''s start and l0 that from the sequence's start: every entry
state is one matmul over chunks, no sequential scan. Every decay factor is an exponential of a sum of the log-decays
it spans (segment sums), never a difference of cumulative sums, so strong decays lose nothing and a decay of 0
(log −∞) is a reset.

The expanded space is held in blocks of rows that are products x_a x_b (``FeatureTiles``): tile i has the rows
a ∈ [i·bs, (i+1)·bs), b ∈ [i·bs, d), each a broadcast product of two slices (no gather), weighted 1 where b lies in
a's own block (both orders present) and 2 beyond (one order for two), so Σ_rows ω φ_row(x) φ_row(y) = (xᵀy)²:
bs·(d+bs)·d/(2bs) rows, 2560 at d = 64 against the packed d(d+1)/2 = 2080. The state passes in and out in the
spec's packed layout (``to_tiles``, ``from_tiles``: one gather each).

``inter`` (entry states and their readout over the tiles) has a written VJP that recomputes each tile's features
and states, one tile at a time (``mx.depends`` orders them), so neither pass keeps φ(q), φ(k) of every token:
the working set is one tile's. The in-chunk scores and the decay factors are MLX autodiff.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..codegen.chunk_sources import feature_decode_supported, sympow_supported
from ..runtime import chunk_kernels as ck
from ..spec.features import sympow_pairs
from ..tuning import Tuning
from .core import exp
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


def workset_per_token(BH: int, d: int, V1: int, C: int) -> int:
    """Bytes a token adds to a training step's working set, about: one tile's features and their cotangents
    (three [T, bs·d] arrays), its four state arrays over chunks, the in-chunk scores and the per-token inputs and
    gradients (float32)."""
    ft = feature_tiles(d)
    R0 = ft.rows(0)
    return 4 * BH * (3 * R0 + 4 * R0 * V1 // C + 4 * C + 8 * (d + V1))


# -- decay factors (MLX autodiff) ----------------------------------------------------------------------------

def segment_sums(x):
    """seg[..., t, s] = Σ_{s<l≤t} x_l for s <= t, −∞ above the diagonal: x [..., C] -> [..., C, C]. A sum of the
    spanned log-decays only (no difference of cumulative sums), so it loses nothing to strong decays."""
    C = x.shape[-1]
    below = mx.array(np.tril(np.ones((C, C), dtype=bool), -1))
    rep = mx.where(below, mx.broadcast_to(x[..., :, None], x.shape + (C,)), 0.0)
    seg = mx.cumsum(rep, axis=-2)
    return mx.where(mx.array(np.tril(np.ones((C, C), dtype=bool))), seg, -mx.inf)


def chunk_scores(q, k, gam, pow2: bool = False):
    """(q_tᵀk_s)² e^{Γ_t−Γ_s} for s <= t, 0 above: [B,H,n,C,d] x2, [B,H,n,C] -> [B,H,n,C,C] (``pow2``:
    ``core.exp``'s)."""
    p = q @ k.swapaxes(-1, -2)
    return p * p * exp(segment_sums(gam), pow2)


def chunk_decays(gam, pow2: bool = False):
    """From the chunks' log-decays [B,H,n,C]: (e^{Γ_t} [B,H,n,C], e^{Γ_C−Γ_s} [B,H,n,C], L [B,H,n+1,n],
    l0 [B,H,n+1]): the in-chunk factors to the readout and to the chunk's end, and between chunks the decay from
    chunk m's end to chunk n''s start (L[n', m], m < n') and from the start to chunk n' (l0)."""
    to_t = exp(mx.cumsum(gam, axis=-1), pow2)
    to_end = exp(mx.cumsum(gam, axis=-1, reverse=True, inclusive=False), pow2)
    tot = gam.sum(-1)                                              # [B,H,n]
    n = tot.shape[-1]
    seg = segment_sums(tot)                                        # [B,H,n,n]: Σ_{m<l≤n'} for m ≤ n'
    L = mx.concatenate([mx.zeros(seg.shape[:-2] + (1, n), seg.dtype), exp(seg, pow2)], axis=-2)  # row n'+1: start of n'+1
    l0 = exp(mx.concatenate([mx.zeros(tot.shape[:-1] + (1,), tot.dtype), mx.cumsum(tot, axis=-1)], axis=-1), pow2)
    return to_t, to_end, L, l0


# -- the rows of the expanded space -------------------------------------------------------------------------

@dataclass(frozen=True)
class TileRows:
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
class PackedRows:
    """φ's own packed rows (the spec's state layout, ω = 1, one tile), formed and differentiated by the generated
    sympow kernels where the tuning runs chunk kernels: φ written contiguous in one pass, its gradient read in
    one (MLX's broadcast products and reductions were most of the tiles' backward on the H100)."""

    t: Tuning

    count = 1

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


def rows_for(t: Tuning, d: int, dtype):
    """The generated sympow kernels' packed rows where the tuning runs chunk kernels and they have a layout for d
    (float32), else MLX's tiles."""
    if t.chunk_kernels and dtype == mx.float32 and sympow_supported(t.dialect, d):
        return PackedRows(t)
    return TileRows(feature_tiles(d))


# -- the expanded states, tile by tile (written VJP) ---------------------------------------------------------

def _tile_states(rows, k, Wb, L, l0, S0_i, i):
    """(φ_i(k) [B,H,n,C,R_i], ΔS [B,H,n,R_i,V'], Ŝ [B,H,n+1,R_i,V']) of tile i."""
    B, H, n, C, _ = k.shape
    pk = rows.features(k, i)
    dS = pk.swapaxes(-1, -2) @ Wb
    R, V1 = dS.shape[-2:]
    Sh = (L @ dS.reshape(B, H, n, R * V1)).reshape(B, H, n + 1, R, V1) + l0[..., None, None] * S0_i[:, :, None]
    return pk, dS, Sh


def _weighted(rows, i, S):
    """ω ⊙ S over tile i's rows (S [..., R_i, V']): the weights ride on the state, never on a token's features."""
    w = rows.weight(i)
    return S if w is None else S * mx.array(w, dtype=S.dtype)[:, None]


@lru_cache(maxsize=None)
def inter_fn(rows):
    """inter(q, k, Wb, L, l0, S0) -> (Z [B,H,n,C,V'] = Σ_rows ω φ(q_t) Ŝ_{n(t)}, Ŝ_end [B,H,R,V'] in ``rows``);
    q, k [B,H,n,C,d], Wb = e^{Γ_C−Γ_s} W [B,H,n,C,V'], S0 [B,H,R,V'] in ``rows``."""
    bounds = np.cumsum([0] + [rows.size(i) for i in range(rows.count)]) if rows.count > 1 else None

    def tile(S, i):
        return S if bounds is None else S[:, :, int(bounds[i]):int(bounds[i + 1])]

    @mx.custom_function
    def inter(q, k, Wb, L, l0, S0):
        Z, ends, after = None, [], []
        for i in range(rows.count):
            qi, ki = mx.depends([q, k], after) if after else (q, k)  # one tile's features alive at a time
            _, _, Sh = _tile_states(rows, ki, Wb, L, l0, tile(S0, i), i)
            part = rows.features(qi, i) @ _weighted(rows, i, Sh[:, :, :-1])
            Z = part if Z is None else Z + part
            ends.append(Sh[:, :, -1])
            after = [Z]
        return Z, ends[0] if len(ends) == 1 else mx.concatenate(ends, axis=-2)

    @inter.vjp
    def inter_vjp(primals, cotangents, outputs):
        q, k, Wb, L, l0, S0 = primals
        dZ, dS_end = (mx.zeros_like(o) if c is None else c for c, o in zip(cotangents, outputs))
        B, H, n, C, _ = q.shape
        dq, dk, dWb, dL, dl0, dS0, after = 0.0, 0.0, 0.0, 0.0, 0.0, [], []
        for i in range(rows.count):
            qi, ki = mx.depends([q, k], after) if after else (q, k)
            pk, dS, Sh = _tile_states(rows, ki, Wb, L, l0, tile(S0, i), i)
            R, V1 = dS.shape[-2:]
            read = _weighted(rows, i, rows.features(qi, i).swapaxes(-1, -2) @ dZ)                   # [B,H,n,R,V']
            dSh = mx.concatenate([read, tile(dS_end, i)[:, :, None]], axis=2)                     # [B,H,n+1,R,V']
            dq = dq + rows.features_vjp(qi, dZ @ _weighted(rows, i, Sh[:, :, :-1]).swapaxes(-1, -2), i)
            flat = dSh.reshape(B, H, n + 1, R * V1)
            dL = dL + flat @ dS.reshape(B, H, n, R * V1).swapaxes(-1, -2)
            S0_i = tile(S0, i)
            dl0 = dl0 + (dSh * S0_i[:, :, None]).sum((-2, -1))
            dS0.append((l0[:, :, None] @ flat).reshape(B, H, R, V1))
            ddS = (L.swapaxes(-1, -2) @ flat).reshape(B, H, n, R, V1)                              # [B,H,n,R,V']
            dWb = dWb + pk @ ddS
            dk = dk + rows.features_vjp(ki, Wb @ ddS.swapaxes(-1, -2), i)
            after = [dq, dk, dWb]
        return dq, dk, dWb, dL, dl0, dS0[0] if len(dS0) == 1 else mx.concatenate(dS0, axis=-2)

    return inter


def chunk_form(q, k, W, gam, S0, c: float, C: int, pow2: bool = False, rows=None):
    """Y [B,H,T,V'] and the final state [B,H,R,V'] of the module docstring's form; q, k [B,H,T,d], W [B,H,T,V'],
    gam the log-decays [B,H,T], S0 [B,H,R,V'], both states in ``rows``' layout (default: MLX's tiles); chunks of C
    tokens (T padded with tokens that change nothing: zero keys and values, log-decay 0); ``pow2``: ``core.exp``'s."""
    B, H, T, d = q.shape
    n = -(-T // C)

    def chunks(x):
        if n * C != T:
            x = mx.pad(x, [(0, 0), (0, 0), (0, n * C - T)] + [(0, 0)] * (x.ndim - 3))
        return x.reshape(B, H, n, C, *x.shape[3:])

    qc, kc, Wc, gc = (chunks(x) for x in (q, k, W, gam))
    to_t, to_end, L, l0 = chunk_decays(gc, pow2)
    Z, S_end = inter_fn(rows or TileRows(feature_tiles(d)))(qc, kc, Wc * to_end[..., None], L, l0, S0)
    Y = chunk_scores(qc, kc, gc, pow2) @ Wc + to_t[..., None] * Z
    return (c * Y).reshape(B, H, n * C, -1)[:, :, :T], S_end


# -- decode (T = 1) ------------------------------------------------------------------------------------------

def decodes(t: Tuning, d: int, V: int) -> bool:
    """Whether a decode step runs the generated feature decode kernel (``Tuning.feature_decode``, a layout for d, V)."""
    return t.feature_decode and t.dialect is not None and feature_decode_supported(t.dialect, d, V)


def decode_step(q, k, w, decay, S, z=None):
    """One step in MLX ops (the decode kernel's definition and VJP): q, k [BH, d], w [BH, V], decay [BH],
    S [BH, F, V] in φ's packed rows, z [BH, F] or None -> (S', y = φ(q)ᵀS'[, z', n = φ(q)ᵀz'])."""
    pq, pk = sympow_mx(q), sympow_mx(k)
    S1 = decay[:, None, None] * S + pk[:, :, None] * w[:, None, :]
    y = (pq[:, None, :] @ S1)[:, 0]
    if z is None:
        return S1, y
    z1 = decay[:, None] * z + pk
    return S1, y, z1, (pq * z1).sum(-1)


@lru_cache(maxsize=16)
def decode_fn(t: Tuning, has_z: bool):
    """``decode_step`` by the generated kernel (``chunk_kernels.feature_decode``: each state row read and written
    once, split over blocks of rows), its VJP that of ``decode_step`` (decode rarely needs one)."""

    @mx.custom_function
    def step(q, k, w, decay, S, *z):
        S1, z1, y, n = ck.feature_decode(q, k, w, decay, S, z[0] if has_z else None, t)
        return (S1, y, z1, n) if has_z else (S1, y)

    @step.vjp
    def step_vjp(primals, cotangents, outputs):
        cots = [mx.zeros_like(o) if c is None else c for c, o in zip(cotangents, outputs)]
        return tuple(mx.vjp(decode_step, list(primals), cots)[1])

    return step
