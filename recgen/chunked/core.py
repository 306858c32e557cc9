r"""Chunked (matmul) forms of one chunk, in MLX ops; every formula is exact, none divides by a
cumulative product of decays.

Per (b, h), a chunk of C tokens t = 0..C-1 enters with state S (K×V). With per-token log-decay
l_t (scalar or key-vector) and its in-chunk inclusive cumulative sum G_t, write
Γ(t, s) = exp(G_t − G_s) (the decay applied between token s and token t, s ≤ t), formed only
for s ≤ t after masking, so it is ≤ 1 for decays ≤ 1 and never overflows.

No transition (simple GLA, GLA, power retention):
    y_t   = (r_t ⊙ e^{G_t})ᵀ S + Σ_{s≤t} [Σ_i r_ti u_si Γ_i(t,s)] w_s
    S_new = e^{G_C} ⊙ S + Σ_s (u_s ⊙ Γ(C,s)) w_sᵀ

Rank-1 transition Q = P + a (bᵀP), P = D ⊙ S (delta rules). Unrolling, S_t = Λ(t,0) S +
Σ_{s≤t} Λ(t,s) (a_s x_sᵀ + u_s w_sᵀ) with x_t = (Λ_t S_{t-1})ᵀ b_t (the decayed "prediction"),
which solves the unit lower-triangular system (WY/UT form)
    x_t − Σ_{s<t} L[t,s] x_s = (b_t ⊙ e^{G_t})ᵀ S + Σ_{s<t} [Σ_i b_ti u_si Γ_i(t,s)] w_s,
    L[t,s] = Σ_i b_ti a_si Γ_i(t,s)   (s < t),
so X = (I − L)^{-1} RHS, then
    y_t   = (r_t ⊙ e^{G_t})ᵀ S + Σ_{s≤t} [r_t·Γ(t,s)·a_s] x_s + Σ_{s≤t} [r_t·Γ(t,s)·u_s] w_s
    S_new = e^{G_C} ⊙ S + Σ_s (a_s ⊙ Γ(C,s)) x_sᵀ + Σ_s (u_s ⊙ Γ(C,s)) w_sᵀ.
(I − L)^{-1} comes from forward substitution on 16×16 diagonal blocks merged by the 2×2 block
formula; no matrix power series.

Key-vector decays form the pairwise factor Γ_i(t, s) as a [C, C, K] tensor (exact at any decay
strength; the split q·e^{G}, k·e^{−G} overflows). Full (i, j) decays (selective scan) form the
[c, c, K, V] tensor over sub-chunks of c ≤ 16 tokens, passing the state between sub-chunks.
"""
from __future__ import annotations

import mlx.core as mx

NEG_INF = float("-inf")
SUB = 16  # block size of the triangular solve and sub-chunk length for full (i, j) decays


def _mask(C: int, strict: bool):
    t = mx.arange(C)
    return (t[:, None] > t[None, :]) if strict else (t[:, None] >= t[None, :])


def pair_decay(G, cls: str):
    """Γ(t, s) = exp(G_t − G_s) for s ≤ t, 0 above the diagonal: [B,H,C,C] or [B,H,C,C,K]."""
    C = G.shape[2]
    m = _mask(C, strict=False)
    if cls == "scalar":
        d = G[..., :, None] - G[..., None, :]
        return mx.exp(mx.where(m, d, NEG_INF))
    d = G[:, :, :, None, :] - G[:, :, None, :, :]
    return mx.exp(mx.where(m[:, :, None], d, NEG_INF))


def pair(X, Y, E, cls: str, strict: bool):
    """M[t,s] = Σ_i X_ti Y_si Γ_i(t,s), masked to s ≤ t (s < t when strict): [B,H,C,C]."""
    if cls == "scalar":
        M = (X @ Y.swapaxes(-1, -2)) * E
    else:
        M = ((X[:, :, :, None, :] * E) * Y[:, :, None, :, :]).sum(-1)
    if strict:
        M = M * _mask(X.shape[2], strict=True)
    return M


def _decay_to_end(G, cls):
    """Γ(C, s) = exp(G_C − G_s) shaped to scale key rows: [B,H,C,1] or [B,H,C,K]."""
    GC = G[:, :, -1:]
    return mx.exp(GC - G)[..., None] if cls == "scalar" else mx.exp(GC - G)


def _state_decay(G, cls):
    """e^{G_C} shaped to scale S [B,H,K,V]."""
    g = mx.exp(G[:, :, -1])
    return g[..., None, None] if cls == "scalar" else g[..., None]


def _row_scale(X, G, cls):
    """X_t ⊙ e^{G_t}."""
    return X * (mx.exp(G)[..., None] if cls == "scalar" else mx.exp(G))


def _rowsub(L):
    """(I − L)^{-1} for strictly lower L [..., n, n] (n small) by forward substitution."""
    n = L.shape[-1]
    eye = mx.eye(n, dtype=L.dtype)
    batch = L.shape[:-2]
    rows = [mx.broadcast_to(eye[0], batch + (n,))]
    for t in range(1, n):
        prev = mx.stack(rows, axis=-2)                       # [..., t, n]
        rows.append(eye[t] + (L[..., t:t + 1, :t] @ prev)[..., 0, :])
    return mx.stack(rows, axis=-2)


def unit_lower_inv(L):
    """(I − L)^{-1} for strictly lower-triangular L [..., C, C]: blockwise forward substitution.

    Diagonal blocks of 16 are inverted by forward substitution (batched over blocks), then
    merged pairwise: [[A, 0], [N_c, D]]^{-1} with N = I − L has lower-left block D⁻¹ L_c A⁻¹.
    """
    C = L.shape[-1]
    if C <= SUB:
        return _rowsub(L)
    nb = 1
    while SUB * nb < C:
        nb *= 2
    Cp = SUB * nb
    if Cp != C:
        pad = [(0, 0)] * (L.ndim - 2) + [(0, Cp - C), (0, Cp - C)]
        L = mx.pad(L, pad)
    blocks = mx.stack([L[..., k * SUB:(k + 1) * SUB, k * SUB:(k + 1) * SUB] for k in range(nb)], axis=-3)
    inv = _rowsub(blocks)                                    # [..., nb, m, m]
    m = SUB
    while nb > 1:
        merged = []
        for k in range(nb // 2):
            A, D = inv[..., 2 * k, :, :], inv[..., 2 * k + 1, :, :]
            r0 = (2 * k + 1) * m
            c0 = 2 * k * m
            Lc = L[..., r0:r0 + m, c0:c0 + m]
            low = D @ (Lc @ A)
            top = mx.concatenate([A, mx.zeros_like(A)], axis=-1)
            bot = mx.concatenate([low, D], axis=-1)
            merged.append(mx.concatenate([top, bot], axis=-2))
        inv = mx.stack(merged, axis=-3)
        nb //= 2
        m *= 2
    out = inv[..., 0, :, :]
    return out[..., :C, :C] if Cp != C else out


def chunk_diag(S, t: dict, cls: str, G=None):
    """One chunk with scalar or key-vector decay (optionally a rank-1 transition).

    S [B,H,K,V]; t: role -> [B,H,C,K] (key side) / [B,H,C,V] (w); G: cumulative log-decay
    [B,H,C] or [B,H,C,K]. Returns (y [B,H,C,V], S_new).
    """
    r, u, w = t["r"], t["u"], t["w"]
    E = pair_decay(G, cls)
    y = _row_scale(r, G, cls) @ S
    Ru = pair(r, u, E, cls, strict=False)
    gend = _decay_to_end(G, cls)
    S_new = _state_decay(G, cls) * S
    if "a" in t:
        a, b = t["a"], t["b"]
        L = pair(b, a, E, cls, strict=True)
        rhs = _row_scale(b, G, cls) @ S + pair(b, u, E, cls, strict=True) @ w
        X = unit_lower_inv(L) @ rhs
        y = y + pair(r, a, E, cls, strict=False) @ X
        S_new = S_new + (a * gend).swapaxes(-1, -2) @ X
    y = y + Ru @ w
    S_new = S_new + (u * gend).swapaxes(-1, -2) @ w
    return y, S_new


def chunk_full(S, t: dict, ld):
    """One chunk with a full (i, j) (or value-side) decay, no transition; ld [B,H,C,K|1,V].

    Sub-chunks of ≤ 16 tokens: pairwise Γ [B,H,c,c,K|1,V], exact at any decay strength.
    """
    r, u, w = t["r"], t["u"], t["w"]
    C = r.shape[2]
    ys = []
    for s0 in range(0, C, SUB):
        s1 = min(C, s0 + SUB)
        c = s1 - s0
        rc, uc, wc = r[:, :, s0:s1], u[:, :, s0:s1], w[:, :, s0:s1]
        G = mx.cumsum(ld[:, :, s0:s1], axis=2)                          # [B,H,c,K|1,V]
        m = _mask(c, strict=False)[:, :, None, None]
        E = mx.exp(mx.where(m, G[:, :, :, None] - G[:, :, None], NEG_INF))  # [B,H,c,c,K|1,V]
        # inter: Σ_i r_ti e^{G_t[i,j]} S[i,j]
        y = (rc[..., None] * mx.exp(G) * S[:, :, None]).sum(axis=3)          # [B,H,c,V]
        # intra: Σ_s w_sj Σ_i r_ti u_si Γ_ij(t,s)
        ru = rc[:, :, :, None, :] * uc[:, :, None, :, :]                # [B,H,c,c,K]
        if E.shape[4] == 1:  # decay independent of i
            A = ru.sum(-1)[..., None] * E[..., 0, :]                    # [B,H,c,c,V]
        else:
            A = (ru[..., None, :] @ E)[..., 0, :]                       # [B,H,c,c,V]
        y = y + (A * wc[:, :, None, :, :]).sum(axis=3)
        ys.append(y)
        gend = mx.exp(G[:, :, -1:] - G)                                 # [B,H,c,K|1,V]
        S = mx.exp(G[:, :, -1]) * S + ((uc[..., None] * gend) * wc[:, :, :, None, :]).sum(axis=2)
    return (ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=2)), S
