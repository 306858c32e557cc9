r"""Chunked (matmul) forms of one chunk, in MLX ops; every formula is exact, none divides by a
cumulative product of decays.

Per (b, h), a chunk of C tokens t = 0..C-1 enters with state S (K×V). With per-token log-decay
l_t (scalar or key-vector) and its in-chunk inclusive cumulative sum G_t, write
Γ(t, s) = exp(G_t − G_s) (the decay applied between token s and token t, s ≤ t), formed only
for s ≤ t after masking, so it is ≤ 1 for decays ≤ 1 and never overflows.

General rank-1 transition Q = P + a (bᵀP), P = D ⊙ S (``chunks_rank1``: this algebra written for MLX autodiff,
the tests' independent check of ``rank1``'s core, which runs it with a written VJP; the delta rules, a = ρ u, use
the ``parallel`` core). Unrolling, S_t = Λ(t,0) S + Σ_{s≤t} Λ(t,s) (a_s x_sᵀ + u_s w_sᵀ)
with x_t = (Λ_t S_{t-1})ᵀ b_t (the decayed "prediction"), which solves the unit lower-triangular
system (WY/UT form)
    x_t − Σ_{s<t} L[t,s] x_s = (b_t ⊙ e^{G_t})ᵀ S + Σ_{s<t} [Σ_i b_ti u_si Γ_i(t,s)] w_s,
    L[t,s] = Σ_i b_ti a_si Γ_i(t,s)   (s < t),
so X = (I − L)^{-1} RHS, then
    y_t   = (r_t ⊙ e^{G_t})ᵀ S + Σ_{s≤t} [r_t·Γ(t,s)·a_s] x_s + Σ_{s≤t} [r_t·Γ(t,s)·u_s] w_s
    S_new = e^{G_C} ⊙ S + Σ_s (a_s ⊙ Γ(C,s)) x_sᵀ + Σ_s (u_s ⊙ Γ(C,s)) w_sᵀ.
(I − L)^{-1} comes from the recursive 2×2 block inverse (``unit_lower_inv``); no matrix power series.

A transition before the decay (Q = P + a (bᵀ S_{t-1}), RWKV-7 / FLA's DPLR) has x_t = S_{t-1}ᵀ b_t, so b_t pairs
with the decay up to token t−1: L[t,s] = Σ_i b_ti a_si Γ_i(t−1,s) and the RHS takes (b_t ⊙ e^{G_{t−1}}) and
Γ(t−1,s). Those are the non-strict pair matrices of b shifted one token earlier, read one row later (row 0 is
zero): the same levels, no division by a decay (b/d would divide, and d may be 0 or underflow).

Key-vector decays never form a [C, C, K] pairwise tensor (nor the split q·e^{G}, k·e^{−G}, which
overflows): ``decay_levels`` builds every decay product from one exp per token by a hierarchy of
multiplications. Full (i, j) decays (selective scan, ``scan_full``) have no matmul form: every (i, j)
is its own scalar recurrence, run as a two-level scan (about 2√T sequential elementwise steps).
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..runtime.pieces import Piece


LOG2E = 1.4426950408889634


def exp(x, pow2: bool = False):
    """e^x; with ``pow2`` (``Tuning.pow2_exp``: the CPU) computed as 2^(x·log2 e) by ``mx.power``. MLX's CPU
    ``exp`` costs 12-17 ns an element on x86-64, its ``power`` 5, and both round alike: MLX's exp is itself a
    base-2 polynomial of x·log2 e, and the two agree bitwise on 93% of [-80, 0] and within 1 ulp elsewhere
    (measured). GPUs have a hardware exp."""
    return mx.power(2.0, x * LOG2E) if pow2 else mx.exp(x)


def row_major(x):
    """``x`` row-major: a copy where it is a view that is not (transposed, broadcast), else itself, as
    ``mx.contiguous`` makes it, but in primitives MLX can record (``runtime.replay``; it serializes no
    ``Contiguous``): flattening copies exactly where the view is not row-major, and the reshape back is a view."""
    return x.reshape(-1).reshape(x.shape)


def tr(x, copy: bool = False):
    """xᵀ over the last two axes, for the right operand of a matmul; with ``copy`` (``Tuning.copy_transposes``:
    the reference BLAS, which runs a product whose right operand is a transposed view as dot products, 2.6x
    slower than on a contiguous copy) materialised."""
    x = x.swapaxes(-1, -2)
    return row_major(x) if copy else x


def pow2_ceil(n: int) -> int:
    """The least power of two >= n."""
    c = 1
    while c < n:
        c *= 2
    return c


def diag_blocks(M, m: int):
    """The m×m diagonal blocks of M [..., C, C] (C a multiple of m): [..., C/m, m, m]."""
    C = M.shape[-1]
    nb = C // m
    x = M.reshape(*M.shape[:-2], nb, m, nb, m)
    return mx.moveaxis(mx.diagonal(x, 0, x.ndim - 4, x.ndim - 2), -1, -3)


def offdiag_blocks(M, m: int):
    """The (right-half rows, left-half columns) m×m block of every 2m×2m diagonal block of
    M [..., C, C] (C a multiple of 2m): [..., C/2m, m, m]."""
    return diag_blocks(M, 2 * m)[..., m:, :m]


@lru_cache(maxsize=32)
def _level_masks(C: int) -> tuple:
    """For m = 1, 2, 4, .. < C: the 0/1 mask of the entries (t, s) in the lower-left m×m block of
    every 2m×2m diagonal block (t in the right half, s in the left half)."""
    t = np.arange(C)
    masks, m = [], 1
    while m < C:
        same = (t[:, None] // (2 * m)) == (t[None, :] // (2 * m))
        lower = ((t[:, None] // m) % 2 == 1) & ((t[None, :] // m) % 2 == 0)
        masks.append((same & lower).astype(np.float32))
        m *= 2
    return tuple(masks)


_MASKS: dict = {}


def _device_masks(C: int, dtype) -> list:
    """The level masks as device arrays, made once per (C, dtype, device): an upload per call costs
    a host-device copy each time."""
    key = (C, dtype, str(mx.default_device()))
    if key not in _MASKS:
        _MASKS[key] = [mx.array(m, dtype=dtype) for m in _level_masks(C)]
        mx.eval(_MASKS[key])
    return _MASKS[key]


def unit_lower_inv(L, base: int = 1):
    """(I − L)^{-1} for strictly lower-triangular L [..., C, C]: recursive 2×2 block inversion on
    the diagonal blocks only.

    With T_L, T_R the inverses of the two m×m diagonal blocks of a 2m×2m diagonal block of I − L
    and L_RL its lower-left block,
        T_2m = [[T_L, 0], [T_R L_RL T_L, T_R]],
    all 2m-blocks of a level at once (batched m×m products), up to m = C. This is forward
    substitution reorganised into log2(C) levels (LAPACK's recursive triangular inverse), not a
    matrix power series (whose terms overflow float32 for correlated keys). Level m touches C·m
    numbers per chunk, so all levels together cost about two passes over a C×C matrix.

    The levels start from the inverses of the ``base``×``base`` diagonal blocks, made by
    ``unit_lower_inv_full`` (few large ops instead of many small ones: ``base`` = C is that form
    alone, ``base`` = 1 this one alone; GPUs and the CPU differ in which pays, see
    ``parallel.inverse_base``)."""
    C = L.shape[-1]
    Cp = pow2_ceil(C)
    if Cp != C:
        L = mx.pad(L, [(0, 0)] * (L.ndim - 2) + [(0, Cp - C), (0, Cp - C)])
    lead = L.shape[:-2]
    m = min(pow2_ceil(base), Cp)
    Tb = unit_lower_inv_full(diag_blocks(L, m)) if m > 1 else mx.ones((*lead, Cp, 1, 1), dtype=L.dtype)
    while m < Cp:
        pairs = Tb.reshape(*lead, Cp // (2 * m), 2, m, m)
        TL, TR = pairs[..., 0, :, :], pairs[..., 1, :, :]
        X = offdiag_blocks(L, m)                         # L_RL of every 2m-block: [.., C/2m, m, m]
        if m > 1:
            X = TR @ X @ TL
        Tb = _join_lower(TL, X, TR)
        m *= 2
    T = Tb[..., 0, :, :]
    return T[..., :C, :C] if Cp != C else T


def unit_lower_inv_full(L):
    """The same inverse written on the full C×C matrix, T_2m = T_m + T_m (L ⊙ mask_m) T_m: two
    C×C×C products a level but only ~2 ops a level, which pays for small C where launches cost more
    than flops (``unit_lower_inv``'s base blocks on GPUs)."""
    C = L.shape[-1]
    Cp = pow2_ceil(C)
    if Cp != C:
        L = mx.pad(L, [(0, 0)] * (L.ndim - 2) + [(0, Cp - C), (0, Cp - C)])
    masks = _device_masks(Cp, L.dtype)
    T = mx.eye(Cp, dtype=L.dtype) + (L * masks[0] if masks else mx.zeros_like(L))
    for mask in masks[1:]:
        T = T + T @ (L * mask) @ T
    return T[..., :C, :C] if Cp != C else T


def _position_major(x, n: int, c: int):
    """[B,H,T,...] (T = n·c) -> [c,B,H,n,...], contiguous, so each step of a loop over the c positions reads
    whole slabs (strided broadcasts measured ~3x slower on the CPU)."""
    return row_major(mx.moveaxis(x.reshape(*x.shape[:2], n, c, *x.shape[3:]), 3, 0))


def states_two_level(S0, D, a, b):
    """Every state of S_t = D_t ⊙ S_{t-1} + a_t b_tᵀ (t = 0..T-1, S_{-1} = S0) in about 2√T sequential
    elementwise steps: (S_all [B,H,T,K,V], S_end).

    The T tokens are cut into n chunks of c ≈ √T. A loop over the c positions runs every chunk at once from
    a zero state (local states L and cumulative decays P_k = Π_{τ≤k} D_τ, both [c,B,H,n,K,V]); a scan over
    the n chunk ends gives each chunk's entry state E; then S = L + P ⊙ E. No division by a decay product;
    P ≤ 1 for decays ≤ 1. S0 [B,H,K,V]; D [B,H,T,K|1,V]; a [B,H,T,K]; b [B,H,T,V]."""
    B, H, T, K = a.shape
    c = max(1, int(round(T ** 0.5)))
    n = -(-T // c)
    pad = n * c - T
    if pad:  # identity tokens: decay 1, no update
        a, b = (mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (a, b))
        D = mx.pad(D, [(0, 0), (0, 0), (0, pad), (0, 0), (0, 0)], constant_values=1.0)
    a, b, D = (_position_major(x, n, c) for x in (a, b, D))
    L = mx.zeros((B, H, n, K, b.shape[-1]), dtype=S0.dtype)
    P = None
    Ls, Ps = [], []
    for k in range(c):
        L = D[k] * L + a[k][..., None] * b[k][..., None, :]
        P = D[k] if P is None else D[k] * P
        Ls.append(L)
        Ps.append(P)
    entry, E = [], S0
    for j in range(n):
        entry.append(E)
        E = P[:, :, j] * E + L[:, :, j]
    S = mx.stack(Ls, axis=0) + mx.stack(Ps, axis=0) * mx.stack(entry, axis=2)       # [c,B,H,n,K,V]
    return mx.moveaxis(S, 0, 3).reshape(B, H, n * c, *S.shape[-2:])[:, :, :T], E


def _sum_to(x, shape):
    """x summed over the axes where ``shape`` broadcasts (size 1), keeping them."""
    axes = [i for i, (m, k) in enumerate(zip(x.shape, shape)) if k == 1 and m != 1]
    return x.sum(axes, keepdims=True) if axes else x


@lru_cache(maxsize=2)
def _scan_full(pow2: bool):
    """The custom function of ``scan_full`` (``pow2``: see ``exp``)."""
    @mx.custom_function
    def scan(S, r, u, w, ld):
        D = exp(ld, pow2)
        S_all, S_end = states_two_level(S, D, u, w)
        return (r[..., None] * S_all).sum(-2), S_end, S_all, D

    scan.vjp(_scan_full_vjp)
    return scan


def _scan_full_vjp(primals, cotangents, outputs):
    """The reverse recurrence, by the same two-level scan with time reversed:
        dS_t = D_{t+1} ⊙ dS_{t+1} + r_t dy_tᵀ  (dS_{T-1} = r dyᵀ + dS_end),
        dr_t = S_t dy_t,  du_t = dS_t w_t,  dw_t = dS_tᵀ u_t,  dl_t = D_t ⊙ dS_t ⊙ S_{t-1},  dS0 = D_0 ⊙ dS_0.
    (MLX autodiff of the forward loop cost 4x the forward, here ~1.5x; checked against it and the float64
    reference in the tests.)"""
    S, r, u, w, ld = primals
    y, S_end, S_all, D = outputs
    dy, dS_end = [mx.zeros_like(o) if ct is None else ct for ct, o in zip(cotangents[:2], (y, S_end))]
    # reversed time j = T-1-t carries decay D_{T-j}: 1 for j = 0 (dS_end enters dS_{T-1} undecayed)
    D_rev = mx.concatenate([mx.ones_like(D[:, :, :1]), D[:, :, ::-1][:, :, :-1]], axis=2)
    dS_rev, _ = states_two_level(dS_end, D_rev, r[:, :, ::-1], dy[:, :, ::-1])
    dS_all = dS_rev[:, :, ::-1]
    S_prev = mx.concatenate([S[:, :, None], S_all[:, :, :-1]], axis=2)
    dr = (S_all * dy[..., None, :]).sum(-1)
    du = (dS_all * w[..., None, :]).sum(-1)
    dw = (dS_all * u[..., None]).sum(-2)
    dl = _sum_to(D * dS_all * S_prev, ld.shape)
    dS0 = _sum_to(D[:, :, 0] * dS_all[:, :, 0], S.shape)
    return dS0, dr, du, dw, dl


def scan_full(S, r, u, w, ld, pow2: bool = False):
    """A full (i, j) or value-indexed decay, S_t = D_t ⊙ S_{t-1} + u_t w_tᵀ, y_t = S_tᵀ r_t (D = e^{ld}), over a
    stretch of T tokens by ``states_two_level``, with a hand-derived VJP (``_scan_full_vjp``).
    S [B,H,K,V]; r, u [B,H,T,K]; w [B,H,T,V]; ld [B,H,T,K|1,V]. Returns (y [B,H,T,V], S_end).
    Memory is O(T·K·V): every state (and D) is kept for the backward, bounded by the caller's segments."""
    return _scan_full(pow2)(S, r, u, w, ld)[:2]


def _split_last(x):
    """(x[..., :-1], x[..., -1]): a normalizer's column riding along the values, split off again (``split_last``)."""
    return x[..., :-1], x[..., -1]


def _split_last_vjp(args, outs, cots):
    """The two cotangents joined by one concatenation: MLX's own VJP of the slices would fill a zero array of x's
    shape for each, write its cotangent into it and add the two (five launches over x, every eager training step)."""
    a, b = cots
    return (mx.concatenate([a, b[..., None].astype(a.dtype)], axis=-1),)


split_last = Piece(_split_last, _split_last_vjp, name="split_last")


# -- chunk-parallel forms (all chunks at once; only the state scan is sequential) -------------------
#
# Shapes: [B, H, n, C, F] with n chunks of C = 2^L tokens (time padded with identity tokens:
# decay 1, every other role 0). F = K for key-vector decays, 1 for scalar ones.
#
# Products of decays come from one exp per token (d = e^{l}) and a hierarchy of multiplications,
# never a division and never a pairwise exp: at level m (blocks of m tokens paired as (L, R)
# inside blocks of 2m) P_t = Π d over R's start..t (= Γ(t, end of L) for t in R) and
# Q_s = Π d over s+1..end of L (= Γ(end of L, s) for s in L). Both are ≤ 1 for decays ≤ 1, so
# the off-diagonal block (X_R ⊙ P_R)(Y_L ⊙ Q_L)ᵀ = Σ_i X_ti Y_si Γ_i(t, s) is exact at any decay
# strength, and every level is one batched matmul over all chunks. After the last level P_t is
# Γ(t, chunk start) and Q_s is Γ(chunk end, s).


def _blocks(x, m):
    """[..., C, F] -> [..., C/(2m), 2, m, F]."""
    s = x.shape
    return x.reshape(*s[:-2], s[-2] // (2 * m), 2, m, s[-1])


def _unblocks(x):
    """[..., nb, 2, m, F] -> [..., nb·2m, F]."""
    s = x.shape
    return x.reshape(*s[:-4], s[-4] * 2 * s[-2], s[-1])


def decay_levels(d):
    """d [..., C, F] (C a power of 2) -> (levels [(m, P_R, Q_L)], P, Q) as described above."""
    C = d.shape[-2]
    P, Q = d, mx.ones_like(d)
    levels = []
    m = 1
    while m < C:
        Pb, Qb = _blocks(P, m), _blocks(Q, m)
        levels.append((m, Pb[..., 1, :, :], Qb[..., 0, :, :]))      # (m, P_R, Q_L)
        # R's P picks up L's whole product, L's Q picks up R's: one broadcast product of the whole
        # array by a small [.., 2, 1, F] factor (no full-size stack; 1.5x faster on the CPU)
        one = mx.ones_like(Pb[..., 0:1, -1:, :])
        P = (Pb * mx.concatenate([one, Pb[..., 0:1, -1:, :]], axis=-3)).reshape(P.shape)
        Q = (Qb * mx.concatenate([Pb[..., 1:2, -1:, :], one], axis=-3)).reshape(Q.shape)
        m *= 2
    return levels, P, Q


def half(x, m, side):
    """The ``side`` half (0 left, 1 right) of every 2m-block of x [.., C, F]: [.., C/2m, m, F]."""
    return _blocks(x, m)[..., side, :, :]


def add_half(x, h, m: int, side: int):
    """x [.., C, F] with h [.., C/2m, m, F] added to the ``side`` half (0 left, 1 right) of every
    2m-block: one concatenation and a half-size add instead of a zero-padded full-size addend
    (GLA fwd+bwd 7% faster on the CPU, measured interleaved in one process)."""
    xb = _blocks(x, m)
    halves = [xb[..., 0:1, :, :], xb[..., 1:2, :, :]]
    halves[side] = halves[side] + h[..., None, :, :]
    return _unblocks(mx.concatenate(halves, axis=-3))


def _join_lower(A, X, B):
    """[[A, 0], [X, B]] from m×m blocks [.., nb, m, m]: the 2m×2m diagonal blocks [.., nb, 2m, 2m]."""
    return mx.concatenate([mx.concatenate([A, mx.zeros_like(A)], axis=-1),
                           mx.concatenate([X, B], axis=-1)], axis=-2)


def intra_apply(r, u, w, levels):
    """y_t = Σ_{s≤t} [Σ_i r_ti u_si Γ_i(t,s)] w_s over the lower triangle only: [..., C, V]."""
    y = (r * u).sum(-1, keepdims=True) * w
    for m, PR, QL in levels:
        rb, ub, wb = half(r, m, 1) * PR, half(u, m, 0) * QL, half(w, m, 0)
        if m == 1:
            yR = (rb * ub).sum(-1, keepdims=True) * wb
        else:
            yR = (rb @ ub.swapaxes(-1, -2)) @ wb
        y = add_half(y, yR, m, 1)
    return y


def pair_levels(X, Y, levels, strict: bool, copy_transposes: bool = False):
    """M[t,s] = Σ_i X_ti Y_si Γ_i(t,s) for s ≤ t (s < t when strict), 0 above: [..., C, C]."""
    C = X.shape[-2]
    if strict:
        M = mx.zeros(X.shape[:-2] + (C, 1, 1), dtype=X.dtype)
    else:
        M = (X * Y).sum(-1)[..., None, None]
    for m, PR, QL in levels:
        Mb = M.reshape(*M.shape[:-3], M.shape[-3] // 2, 2, m, m)
        ML, MR = Mb[..., 0, :, :], Mb[..., 1, :, :]
        M = _join_lower(ML, (half(X, m, 1) * PR) @ tr(half(Y, m, 0) * QL, copy_transposes), MR)
    return M[..., 0, :, :]


def state_step(S, D, r, u, w, a=None, b=None, before_decay: bool = False, readout_before: bool = False):
    """One token of the recurrence on MLX arrays: P = D ⊙ S, P += a (bᵀ X) (X = S with ``before_decay``, else P),
    S' = P + u wᵀ, y = S'ᵀ r (Sᵀ r with ``readout_before``). S [B,H,K,V]; D broadcasting to it; r, a, b, u
    [B,H,1,K]; w [B,H,1,V]. Returns (y [B,H,1,V], S'): the per-token loops' step (``naive_loop``, ``_stepwise``)."""
    P = D * S
    if a is not None:
        P = P + a.swapaxes(-1, -2) * (b @ (S if before_decay else P))
    S_next = P + u.swapaxes(-1, -2) * w
    return r @ (S if readout_before else S_next), S_next


def rows_later(M):
    """M [.., C, F] with every row moved one down (row 0 zero): M'[t] = M[t-1]."""
    return mx.concatenate([mx.zeros_like(M[..., :1, :]), M[..., :-1, :]], axis=-2)


def rows_earlier(M):
    """M [.., C, F] with every row moved one up (the last row zero): M'[t] = M[t+1]."""
    return mx.concatenate([M[..., 1:, :], mx.zeros_like(M[..., :1, :])], axis=-2)


def p_before(P):
    """P_{t−1} [.., C, F], with P_{−1} = 1: the decay that b_t meets where the transition comes before the decay."""
    return rows_later(P) + (mx.arange(P.shape[-2]) == 0)[:, None]


def chunks_rank1(S, r, u, w, a, b, d, before_decay: bool = False):
    """All chunks with a general rank-1 transition (a not a multiple of u, or one ``before_decay``; see the module
    docstring for the WY/UT form), for MLX autodiff: the tests check ``rank1``'s core and its written VJP against
    it (the decay hierarchy, an unrolled scan, M_ru applied to w without being formed).
    r, u, a, b [B,H,n,C,K]; w [B,H,n,C,V]; d = e^l [B,H,n,C,F].
    Returns (y [B,H,n,C,V], chunk-entry states, final state)."""
    levels, P, Q = decay_levels(d)
    g = P[..., -1, :, None]
    if before_decay:  # b_t meets Γ(t-1, s): b one token earlier, non-strict pairs, read one row later
        b_early = rows_earlier(b)
        L = rows_later(pair_levels(b_early, a, levels, strict=False))
        Lu = rows_later(pair_levels(b_early, u, levels, strict=False))
        bP = b * p_before(P)  # b_t ⊙ e^{G_{t-1}}
    else:
        L = pair_levels(b, a, levels, strict=True)
        Lu = pair_levels(b, u, levels, strict=True)
        bP = b * P
    Tm = unit_lower_inv(L)
    U = Tm @ (Lu @ w)
    Wm = Tm @ bP
    aQt = (a * Q).swapaxes(-1, -2)
    dSu = (u * Q).swapaxes(-1, -2) @ w
    states, Xs = [], []
    for c in range(d.shape[2]):
        states.append(S)
        X = U[:, :, c] + Wm[:, :, c] @ S
        Xs.append(X)
        S = g[:, :, c] * S + aQt[:, :, c] @ X + dSu[:, :, c]
    states, X = mx.stack(states, axis=2), mx.stack(Xs, axis=2)
    y = ((r * P) @ states + pair_levels(r, a, levels, strict=False) @ X
         + intra_apply(r, u, w, levels))
    return y, states, S
