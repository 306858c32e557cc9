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

The expanded space's rows come from ``feature_rows``: φ's packed rows by the generated sympow kernels where chunk
kernels run, MLX's tiles of broadcast products elsewhere.

``inter`` (entry states and their readout over the tiles) has a written VJP that recomputes each tile's features
and states rather than keep them from the forward, tile after tile (``mx.depends`` orders them; on GPUs MLX
allocates for all the work it has queued, so there the order bounds memory only loosely, and φ of every token is
formed once a pass). The in-chunk scores are the generated decayed-scores kernels where the tuning runs them
(``chunk_kernels.decayed_scores_fn``, their VJP written), else MLX autodiff; the decay factors between chunks are
MLX autodiff.

Where φ's rows outgrow the sequence (degree 4: 766 480 rows at d = 64), the same sums run as attention
(``attention_form``, ``attends``): the scores of every earlier chunk in place of its state, a given initial state
read through φ(q), the final state a graph of its own.

A decode step (T = 1) can run the generated feature decode kernel instead (``decode_fn``, ``Tuning.feature_decode``):
each state row read and written once, split over blocks of rows.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..codegen.chunk_sources import feature_decode_supported
from ..runtime import chunk_kernels as ck
from ..tuning import Tuning
from .core import exp
from .feature_rows import TileRows, feature_tiles
from .terms import sympow_mx


def workset_per_token(rows, BH: int, d: int, V1: int, C: int) -> int:
    """Bytes a token adds to a training step's working set, about: the widest tile's features and their cotangents
    (three [T, R] arrays), its four state arrays over chunks, the in-chunk scores and the per-token inputs and
    gradients (float32)."""
    R = max(rows.size(i) for i in range(rows.count))
    return 4 * BH * (3 * R + 4 * R * V1 // C + 4 * C + 8 * (d + V1))


# -- decay factors (MLX autodiff) ----------------------------------------------------------------------------

@lru_cache(maxsize=16)
def _lower(C: int, k: int):
    """The [C, C] mask of s <= t + k, made once per size: every call would otherwise upload it from the host."""
    return mx.array(np.tril(np.ones((C, C), dtype=bool), k))


def segment_sums(x):
    """seg[..., t, s] = Σ_{s<l≤t} x_l for s <= t, −∞ above the diagonal: x [..., C] -> [..., C, C]. A sum of the
    spanned log-decays only (no difference of cumulative sums), so it loses nothing to strong decays."""
    C = x.shape[-1]
    rep = mx.where(_lower(C, -1), mx.broadcast_to(x[..., :, None], x.shape + (C,)), 0.0)
    seg = mx.cumsum(rep, axis=-2)
    return mx.where(_lower(C, 0), seg, -mx.inf)


def _power(x, degree: int):
    """x^degree by products, not a power function: exact signs and derivatives at x = 0; by squaring, so a degree
    of 4 is two passes over x, not three."""
    if degree == 1:
        return x
    half = _power(x * x, degree // 2)
    return half * x if degree % 2 else half


def chunk_scores(q, k, gam, pow2: bool = False, degree: int = 2, scores=None):
    """(q_tᵀk_s)^degree e^{Γ_t−Γ_s} for s <= t, 0 above: [B,H,n,C,d] x2, [B,H,n,C] -> [B,H,n,C,C] (``pow2``:
    ``core.exp``'s); ``scores``: a function of (qᵀk, gam) that gives them (the generated kernel,
    ``chunk_kernels.decayed_scores_fn``), else MLX ops over the segment sums."""
    p = q @ k.swapaxes(-1, -2)
    if scores:
        return scores(p, gam)
    return _power(p, degree) * exp(segment_sums(gam), pow2)


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


def decay_factors(gam, pow2: bool = False):
    """(e^{Γ_t} [B,H,n,C], e^{Γ_C−Γ_s} [B,H,n,C], LL = [L | l0] [B,H,n+1,n+1]) of ``chunk_decays``, as
    ``chunk_form`` reads them (``chunk_kernels.decay_factors_fn`` computes the same in two launches)."""
    to_t, to_end, L, l0 = chunk_decays(gam, pow2)
    return to_t, to_end, mx.concatenate([L, l0[..., None]], axis=-1)


# -- the expanded states, tile by tile (written VJP) ---------------------------------------------------------

def _entry_states(X, LL):
    """Ŝ [B,H,n+1,R,V'] (every chunk's entry state, then the final one) from X = [ΔS; S0] [B,H,n+1,R,V'] (the
    chunks' states, then the initial one: ``stacked``): one matmul of [L | l0] with it."""
    B, H, n1, R, V1 = X.shape
    return (LL @ X.reshape(B, H, n1, R * V1)).reshape(X.shape)


def gram_parts(K: int, parts: int) -> int:
    """``_gram``'s slices of a row of K: the largest divisor P of K up to ``parts`` whose slices K / P are a multiple
    of 4 elements (16 bytes of float32), else the largest divisor. cuBLAS takes its slow align-1 kernels for rows not
    16-byte aligned: at K = 2080·65 on the H100 16 slices of 8450 took 0.89 ms a synchronized call, 8 of 16900 0.38."""
    divisors = [p for p in range(max(1, min(parts, K)), 0, -1) if K % p == 0]
    return next((p for p in divisors if (K // p) % 4 == 0), divisors[0])


def _gram(a, b, parts: int):
    """a bᵀ per (b, h): [B,H,M,K] x [B,H,N,K] -> [B,H,M,N] over a long K (R·V'), each row cut in P slices
    (``gram_parts`` of ``parts``, ``Tuning.gram_slices``) read as P rows of their own, a free reshape: one product
    [M·P, K/P] x [K/P, N·P], of which the blocks of equal slices (its diagonal over the P pairs) sum to a bᵀ.
    P times a bᵀ's multiply-adds (few: M, N = n + 1), for parallelism: as one product cuBLAS ran the long sum on one
    threadgroup a (b, h) (1.09 ms on the H100 at B=2, H=8, n = 16, against 0.07 in 16 slices); slices of K as
    batches instead made MLX copy both operands."""
    *lead, M, K = a.shape
    N, P = b.shape[-2], gram_parts(K, parts)
    blocks = a.reshape(*lead, M * P, K // P) @ b.reshape(*lead, N * P, K // P).swapaxes(-1, -2)
    return mx.diagonal(blocks.reshape(*lead, M, P, N, P), axis1=-3, axis2=-1).sum(-1)


def _mix_grad(X, F, LL, gram_slices: int, mix: Tuning | None):
    """(Ŝ = LL X, LLᵀ F, F Xᵀ) for X = [ΔS; S0] and F = [read; dŜ_end] [B,H,n+1,R,V']: the backward's products over
    chunks, by the generated kernel where ``mix`` (the tuning, or None) runs it (``chunk_kernels.mixes``: each state
    read once), else three MLX products (F Xᵀ by ``_gram`` in ``gram_slices``)."""
    if mix is not None and X.dtype == mx.float32 and ck.mixes(mix, LL.shape[-1]):
        return ck.feature_mix_grad(LL, X, F, mix)
    B, H, n1, R, V1 = X.shape
    Ff = F.reshape(B, H, n1, R * V1)
    return (_entry_states(X, LL), (LL.swapaxes(-1, -2) @ Ff).reshape(X.shape),
            _gram(Ff, X.reshape(B, H, n1, R * V1), gram_slices))


def _plus(total, x):
    """total + x, where total may be None (nothing summed yet): no addition of a zero over a whole array."""
    return x if total is None else total + x


@lru_cache(maxsize=None)
def inter_fn(rows, gram_slices: int = 1, mix: Tuning | None = None, keep: bool = False, replay: Tuning | None = None):
    """inter(q, k, Wb, LL, S0) -> (Z [B,H,n,C,V'] = Σ_rows ω φ(q_t) Ŝ_{n(t)}, Ŝ_end [B,H,R,V'] in ``rows``[, X
    of each tile]);
    q, k [B,H,n,C,d], Wb = e^{Γ_C−Γ_s} W [B,H,n,C,V'], LL = [L | l0] [B,H,n+1,n+1] (``chunk_decays``), S0
    [B,H,R,V'] in ``rows``. The products over the rows are ``rows``' (``phi``, ``states``, ``out``, ``jac``), so the
    same algebra runs on formed rows or on kernels that form them; the backward's products over chunks
    ``_mix_grad``'s (``gram_slices``, ``mix``). ``keep``: the chunks' states X = [ΔS; S0] of each tile are outputs too,
    kept for the backward instead of formed again (one φᵀY pass fewer, an expanded state more held between passes).
    ``replay``: the tuning, where both directions are recorded and replayed (``chunk_kernels.replayed``), or None."""
    def forward(q, k, Wb, LL, S0):
        Z, ends, kept, after = None, [], [], []
        for i in range(rows.count):
            qi, ki = mx.depends([q, k], after) if after else (q, k)  # tile after tile
            X = rows.stacked(rows.phi(ki, i), Wb, rows.tile(S0, i), i)
            Sh = _entry_states(X, LL)
            Z = _plus(Z, rows.out(rows.phi(qi, i), rows.weighted(Sh, i), i))  # the first n of Sh's n + 1
            ends.append(Sh[:, :, -1])
            kept.append(X)
            after = [Z]
        return (Z, ends[0] if len(ends) == 1 else mx.concatenate(ends, axis=-2)) + (tuple(kept) if keep else ())

    def backward(q, k, Wb, LL, S0, dZ, dS_end, *kept):
        n = q.shape[2]
        dq, dk, dWb, dLL, dS0, after = None, None, None, None, [], []
        for i in range(rows.count):
            qi, ki = mx.depends([q, k], after) if after else (q, k)
            pk, pq = rows.phi(ki, i), rows.phi(qi, i)
            X = kept[i] if keep else rows.stacked(pk, Wb, rows.tile(S0, i), i)       # [ΔS; S0] [B,H,n+1,R,V']
            read = rows.stacked(pq, dZ, rows.tile(dS_end, i), i, weighted=True)        # [read; dŜ_end]
            Sh, ddS, dLLi = _mix_grad(X, read, LL, gram_slices, mix)  # ddS: dΔS (the first n), then dS0
            dq = _plus(dq, rows.jac(qi, rows.weighted(Sh, i), dZ, i))
            dLL = _plus(dLL, dLLi)
            dS0.append(ddS[:, :, n])
            dWb = _plus(dWb, rows.out(pk, ddS, i))
            dk = _plus(dk, rows.jac(ki, ddS, Wb, i))
            after = [dq, dk, dWb]
        return dq, dk, dWb, dLL, dS0[0] if len(dS0) == 1 else mx.concatenate(dS0, axis=-2)

    def vjp(args, outs, cots):
        return backward(*args, cots[0], cots[1], *outs[2:])

    return ck.piece(forward, vjp, "inter", replay)


def _chunks(x, n: int, C: int):
    """[B,H,T,...] -> [B,H,n,C,...], T padded to n C with tokens that change nothing (zero keys and values,
    log-decay 0)."""
    B, H, T = x.shape[:3]
    if n * C != T:
        x = mx.pad(x, [(0, 0), (0, 0), (0, n * C - T)] + [(0, 0)] * (x.ndim - 3))
    return x.reshape(B, H, n, C, *x.shape[3:])


def chunk_form(q, k, W, gam, S0, c: float, C: int, pow2: bool = False, rows=None, degree: int = 2, scores=None,
               gram_slices: int = 1, mix: Tuning | None = None, keep: bool = False, factors=None,
               replay: Tuning | None = None):
    """Y [B,H,T,V'] and the final state [B,H,R,V'] of the module docstring's form; q, k [B,H,T,d], W [B,H,T,V'],
    gam the log-decays [B,H,T], S0 [B,H,R,V'], both states in ``rows``' layout (default: MLX's tiles, degree 2);
    ``degree`` the feature map's (the scores' power; ``rows`` must be of it); chunks of C
    tokens (T padded with tokens that change nothing: zero keys and values, log-decay 0); ``pow2``: ``core.exp``'s;
    ``scores``: ``chunk_scores``'; ``gram_slices``, ``mix``, ``keep``, ``replay``: ``inter_fn``'s; ``factors``: a
    function of the chunks' log-decays that gives ``decay_factors``' (the generated kernels), else MLX ops."""
    B, H, T, d = q.shape
    n = -(-T // C)
    qc, kc, Wc, gc = (_chunks(x, n, C) for x in (q, k, W, gam))
    to_t, to_end, LL = factors(gc) if factors else decay_factors(gc, pow2)
    rows = rows or TileRows(feature_tiles(d))
    inter = inter_fn(rows, gram_slices, mix, keep, replay if rows.recordable else None)
    Z, S_end = inter(qc, kc, Wc * to_end[..., None], LL, S0)[:2]
    Y = chunk_scores(qc, kc, gc, pow2, degree, scores) @ Wc + to_t[..., None] * Z
    return (c * Y).reshape(B, H, n * C, -1)[:, :, :T], S_end


# -- the attention form: no expanded state --------------------------------------------------------------------

ATTENTION_ARRAYS = 12  # [rows, T] float32 arrays of scores the attention form's training step holds at once, at most
#                        (H100, degree 4: 10.9 GiB at B·H = 16 and T = 4096 in one group, arrays of 1 GiB)


def attention_groups(BH: int, T: int, C: int, budget: int) -> int:
    """Chunks of queries a group of ``cross_fn`` takes at once: as many as keep its [rows, T] arrays of scores within
    ``budget`` bytes (BH heads, T tokens in chunks of C); 0 where not even one chunk's do."""
    return budget // (4 * BH * C * T * ATTENTION_ARRAYS)


def attends(mode: str, degree: int, BH: int, T: int, C: int, R: int, d: int, V1: int, budget: int,
            state: bool = False) -> bool:
    """Whether a feature map of ``degree`` (R expanded rows of d keys, V' value columns, BH heads, T tokens padded to
    whole chunks of C; ``state``: an initial state given) runs as ``attention_form`` (``Tuning.feature_attention``):
    never; where its rows have no kernels (degrees 3 and 4: ``"wide"``) and it takes fewer multiply-adds a token than
    the expanded state (T (d + V'), and R V' to read a given state, against 2 R V': φ(k)ᵀW into the states and φ(q)
    out of them); or always. In each case only if one chunk of queries' scores against the whole sequence fit
    ``budget`` bytes (the segment budget; ``attention_groups``)."""
    cost = T * (d + V1) + (R * V1 if state else 0)
    if mode == "never" or (mode == "wide" and (degree == 2 or cost > 2 * R * V1)):
        return False
    return attention_groups(BH, T, C, budget) >= 1


def _pad_chunks(x, n: int):
    """x [B,H,m,...] zero-padded along its chunks to n (the chunks a group's keys do not reach)."""
    m = x.shape[2]
    return x if m == n else mx.pad(x, [(0, 0), (0, 0), (0, n - m)] + [(0, 0)] * (x.ndim - 3))


@lru_cache(maxsize=None)
def cross_fn(degree: int, group: int, replay: Tuning | None = None):
    """cross(q, k, Wb, L) -> (Z [B,H,n,C,V'],): Z_n = Σ_{m<n} L[n, m] (q_n k_mᵀ)^degree Wb_m, the attention form's
    term between chunks, each earlier chunk read through its scores with the keys where ``inter`` reads its expanded
    state; q, k [B,H,n,C,d], Wb = e^{Γ_C−Γ_s} W [B,H,n,C,V'], L [B,H,n,n] (``chunk_decays``' L over the chunks'
    starts: 0 for m ≥ n). Queries ``group`` chunks at a time (``attention_groups``), each group's against the keys
    up to its last chunk, one group after another (``mx.depends``), so memory holds one group's scores. The decays
    between chunks ride on the values, Wl[n, m] = L[n, m] Wb_m, so no pass over the scores applies them, nor their
    cotangents; the scores' blocks m ≥ n of a group's last chunks are multiplied by zeros. The VJP forms the scores
    again rather than keep them from the forward. ``replay``: as ``inter_fn``'s."""

    def parts(q, k, Wb, L, a, b):
        """The group of query chunks [a, b) against key chunks [0, b): scores P [B,H,(b−a)C, bC], Wl [B,H,b−a,bC,V']."""
        B, H, _, C, d = q.shape
        P = q[:, :, a:b].reshape(B, H, (b - a) * C, d) @ k[:, :, :b].reshape(B, H, b * C, d).swapaxes(-1, -2)
        Wl = (L[:, :, a:b, :b, None, None] * Wb[:, :, None, :b]).reshape(B, H, b - a, b * C, -1)
        return P, Wl

    def groups(n: int):
        return [(a, min(n, a + group)) for a in range(0, n, group)]

    def forward(q, k, Wb, L):
        B, H, n, C, _ = q.shape
        Zs = []
        for a, b in groups(n):
            if Zs:
                q, k = mx.depends([q, k], Zs[-1:])
            P, Wl = parts(q, k, Wb, L, a, b)
            Zs.append(_power(P, degree).reshape(B, H, b - a, C, b * C) @ Wl)
        return (Zs[0] if len(Zs) == 1 else mx.concatenate(Zs, axis=2),)

    def vjp(args, outs, cots):
        q, k, Wb, L = args
        B, H, n, C, d = q.shape
        dq, dk, dWb, dL = [], None, None, []
        for a, b in groups(n):
            if dq:
                q, k = mx.depends([q, k], [dq[-1], dk, dWb])
            P, Wl = parts(q, k, Wb, L, a, b)
            dZ = cots[0][:, :, a:b]
            dWl = (_power(P, degree).reshape(B, H, b - a, C, b * C).swapaxes(-1, -2) @ dZ).reshape(
                B, H, b - a, b, C, -1)
            dWb = _plus(dWb, _pad_chunks((L[:, :, a:b, :b, None, None] * dWl).sum(2), n))
            dL.append(mx.pad((dWl * Wb[:, :, None, :b]).sum((4, 5)), [(0, 0), (0, 0), (0, 0), (0, n - b)]))
            dP = _power(P, degree - 1) * ((degree * dZ) @ Wl.swapaxes(-1, -2)).reshape(P.shape)  # degree ≥ 2
            dq.append((dP @ k[:, :, :b].reshape(B, H, b * C, d)).reshape(B, H, b - a, C, d))
            dk = _plus(dk, _pad_chunks((dP.swapaxes(-1, -2) @ q[:, :, a:b].reshape(B, H, -1, d)).reshape(
                B, H, b, C, d), n))
        cat = lambda xs: xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=2)  # noqa: E731
        return cat(dq), dk, dWb, cat(dL)

    return ck.piece(forward, vjp, "cross", replay)


def attention_form(q, k, W, gam, c: float, C: int, pow2: bool = False, degree: int = 2, scores=None, factors=None,
                   group: int | None = None, replay: Tuning | None = None, S0=None, rows=None, slice_tokens: int = 0):
    """Y [B,H,T,V'] = c (Σ_{s≤t} e^{Γ_t−Γ_s} (q_t·k_s)^degree W_s + e^{Γ_t} φ(q_t)ᵀS0) with no expanded state but the
    initial one (q, k, W, gam as ``chunk_form``'s): inside chunks ``chunk_scores``, between them ``cross_fn``, whose
    decays are ``chunk_form``'s factors (e^{Γ_t}, L, e^{Γ_C−Γ_s}: sums of the log-decays they span), ``group`` chunks
    of queries at a time (default: all). Quadratic in T, where the expanded state is linear in T but R =
    C(d + p − 1, p) rows wide: 766 480 at d = 64, p = 4 (``attends``). ``S0`` [B,H,R,V'] in ``rows``' layout, if
    given, is read ``slice_tokens`` tokens' φ(q) at a time (``initial_read``)."""
    B, H, T, d = q.shape
    n = -(-T // C)
    qc, kc, Wc, gc = (_chunks(x, n, C) for x in (q, k, W, gam))
    Y = chunk_scores(qc, kc, gc, pow2, degree, scores) @ Wc
    if n > 1 or S0 is not None:
        to_t, to_end, LL = factors(gc) if factors else decay_factors(gc, pow2)
    if n > 1:
        Z = cross_fn(degree, min(group or n, n), replay)(qc, kc, Wc * to_end[..., None], LL[:, :, :n, :n])[0]
        Y = Y + to_t[..., None] * Z
    Y = Y.reshape(B, H, n * C, -1)
    if S0 is not None:  # e^{Γ_t} = l0 of t's chunk times the decay within it
        Y = Y + initial_read(qc.reshape(B, H, n * C, d), (to_t * LL[:, :, :n, n, None]).reshape(B, H, n * C), S0,
                             rows, slice_tokens or n * C)
    return (c * Y)[:, :, :T]


def initial_read(q, decay, S0, rows, slice_tokens: int):
    """e^{Γ_t} φ(q_t)ᵀS0 [B,H,T,V'] (q [B,H,T,d], decay = e^{Γ_t} [B,H,T], S0 [B,H,R,V'] in ``rows``' layout): the
    attention form's read of a given initial state, φ(q) of ``slice_tokens`` tokens at a time, one slice after
    another (``mx.depends``), over ``rows``' tiles (their weights ω on the state)."""
    T = q.shape[2]
    parts, after = [], []
    for t0 in range(0, T, slice_tokens):
        x = q[:, :, None, t0:t0 + slice_tokens]                      # [B,H,1,s,d]: one "chunk" of s tokens
        x = mx.depends([x], after)[0] if after else x
        y = None
        for i in range(rows.count):
            y = _plus(y, rows.out(rows.phi(x, i), rows.weighted(rows.tile(S0, i), i)[:, :, None], i))
        parts.append(y[:, :, 0] * decay[:, :, t0:t0 + slice_tokens, None])
        after = [parts[-1]]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def final_state(k, W, gam, rows, C: int, pow2: bool = False, S0=None):
    """e^{Γ_T} S0 + Σ_s e^{Γ_T−Γ_s} φ(k_s) W_sᵀ [B,H,R,V'] in ``rows``' layout (S0 there too, or None: zero): the
    attention form's final state, its own graph, so formed and differentiated only where it is read, one chunk's φ(k)
    at a time (k, W, gam as ``chunk_form``'s)."""
    T = k.shape[2]
    n = -(-T // C)
    kc, Wc, gc = (_chunks(x, n, C) for x in (k, W, gam))
    _, to_end, LL = decay_factors(gc, pow2)
    Wb = Wc * (to_end * LL[:, :, n, :n, None])[..., None]  # e^{Γ_T−Γ_s} W_s
    tiles, after = [], []
    for i in range(rows.count):
        S = None if S0 is None else LL[:, :, n, n, None, None] * rows.tile(S0, i)
        for m in range(n):  # chunk after chunk (``mx.depends``): one chunk's φ(k) alive at a time
            km = kc[:, :, m:m + 1]
            km = mx.depends([km], after)[0] if after else km
            S = _plus(S, rows.states(rows.phi(km, i), Wb[:, :, m:m + 1], i)[:, :, 0])
            after = [S]
        tiles.append(S)
    return tiles[0] if len(tiles) == 1 else mx.concatenate(tiles, axis=-2)


# -- decode (T = 1) ------------------------------------------------------------------------------------------

def decodes(t: Tuning, d: int, V: int, degree: int = 2) -> bool:
    """Whether a decode step runs the generated feature decode kernel (``Tuning.feature_decode``, degree 2, a layout
    for d, V)."""
    return t.feature_decode and degree == 2 and t.dialect is not None and feature_decode_supported(t.dialect, d, V)


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
