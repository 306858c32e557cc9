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
        PL, PR = Pb[..., 0, :, :], Pb[..., 1, :, :]
        QL, QR = Qb[..., 0, :, :], Qb[..., 1, :, :]
        levels.append((m, PR, QL))
        P = _unblocks(mx.stack([PL, PR * PL[..., -1:, :]], axis=-3))
        Q = _unblocks(mx.stack([QL * PR[..., -1:, :], QR], axis=-3))
        m *= 2
    return levels, P, Q


def _half(x, m, side):
    return _blocks(x, m)[..., side, :, :]


def intra_apply(r, u, w, levels):
    """y_t = Σ_{s≤t} [Σ_i r_ti u_si Γ_i(t,s)] w_s over the lower triangle only: [..., C, V]."""
    y = (r * u).sum(-1, keepdims=True) * w
    for m, PR, QL in levels:
        rb, ub, wb = _half(r, m, 1) * PR, _half(u, m, 0) * QL, _half(w, m, 0)
        if m == 1:
            yR = (rb * ub).sum(-1, keepdims=True) * wb
        else:
            yR = (rb @ ub.swapaxes(-1, -2)) @ wb
        y = y + _unblocks(mx.stack([mx.zeros_like(yR), yR], axis=-3))
    return y


def pair_levels(X, Y, levels, strict: bool):
    """M[t,s] = Σ_i X_ti Y_si Γ_i(t,s) for s ≤ t (s < t when strict), 0 above: [..., C, C]."""
    C = X.shape[-2]
    if strict:
        M = mx.zeros(X.shape[:-2] + (C, 1, 1), dtype=X.dtype)
    else:
        M = (X * Y).sum(-1)[..., None, None]
    for m, PR, QL in levels:
        Mb = M.reshape(*M.shape[:-3], M.shape[-3] // 2, 2, m, m)
        ML, MR = Mb[..., 0, :, :], Mb[..., 1, :, :]
        off = (_half(X, m, 1) * PR) @ (_half(Y, m, 0) * QL).swapaxes(-1, -2)
        top = mx.concatenate([ML, mx.zeros_like(ML)], axis=-1)
        bot = mx.concatenate([off, MR], axis=-1)
        M = mx.concatenate([top, bot], axis=-2)
    return M[..., 0, :, :]


def _scan_diag(S, g, dS):
    """S_c for every chunk (the state entering it) and the final state: S ← g ⊙ S + dS."""
    states = []
    for c in range(g.shape[2]):
        states.append(S)
        S = g[:, :, c] * S + dS[:, :, c]
    return mx.stack(states, axis=2), S


def chunks_diag(S, r, u, w, d):
    """All chunks, no transition. r, u [B,H,n,C,K]; w [B,H,n,C,V]; d [B,H,n,C,F].
    Returns (y [B,H,n,C,V], chunk-entry states [B,H,n,K,V], final state)."""
    levels, P, Q = decay_levels(d)
    g = P[..., -1, :, None]                                   # [B,H,n,F,1]
    dS = (u * Q).swapaxes(-1, -2) @ w                         # [B,H,n,K,V]
    states, S = _scan_diag(S, g, dS)
    y = (r * P) @ states + intra_apply(r, u, w, levels)
    return y, states, S


def chunks_rank1(S, r, u, w, a, b, d, rho=None):
    """All chunks with the rank-1 transition (see the module docstring for the WY/UT form).

    With a = ρ u (ρ per token, the delta rules) the solve is for Z = w + ρ ⊙ X (FLA's v_new):
    (I − diag(ρ) P_bu) Z = w + ρ ⊙ (b ⊙ e^G) S, P_bu = pair(b, u, strict); then
    y = (r ⊙ e^G) S + pair(r, u) Z and S_new = e^{G_C} S + (u ⊙ Γ(C,·))ᵀ Z.
    The inverse and every product not involving S are batched over all chunks; the scan does
    two [C,K]·[K,V]-sized matmuls per chunk."""
    levels, P, Q = decay_levels(d)
    g = P[..., -1, :, None]
    if rho is not None:
        Pbu = pair_levels(b, u, levels, strict=True)
        Tm = unit_lower_inv(rho[..., None] * Pbu)
        U = Tm @ w
        Wm = Tm @ (rho[..., None] * b * P)
        uQt = (u * Q).swapaxes(-1, -2)
        states, Zs = [], []
        for c in range(d.shape[2]):
            states.append(S)
            Z = U[:, :, c] + Wm[:, :, c] @ S
            Zs.append(Z)
            S = g[:, :, c] * S + uQt[:, :, c] @ Z
        states, Z = mx.stack(states, axis=2), mx.stack(Zs, axis=2)
        y = (r * P) @ states + pair_levels(r, u, levels, strict=False) @ Z
        return y, states, S
    L = pair_levels(b, a, levels, strict=True)
    Tm = unit_lower_inv(L)
    U = Tm @ (pair_levels(b, u, levels, strict=True) @ w)
    Wm = Tm @ (b * P)
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
