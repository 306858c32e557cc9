"""Gated DeltaProduct (Siems et al. 2025; FLA's ``chunk_gated_delta_product``), float64 numpy reference.

Shapes (FLA's, with block GQA as recgen's other built-ins): q [B,T,Hk,K]; k [B,T*n,Hk,K]; v [B,T*n,H,V];
beta [B,T*n,H]; g [B,T,H] or None (the ungated DeltaProduct); state S [B,H,K,V]. Token t's n micro-steps are
interleaved: micro-step j of token t is row t*n + j of k, v and beta. Value head h reads key head h // (H // Hk).
``scale=None`` -> K**-0.5, applied to q.

Forward, per (b, h), t = 1..T (FLA's ``naive_recurrent_gated_delta_product``):

    S      = exp(g_t) S_{t-1}                   (once per token, before its first micro-step; skipped if g is None)
    for j = 0..n-1, with (k, v, beta) = row t*n + j:
        p  = S^T k;   u = beta (v - p);   S <- S + k u^T        (= (I - beta k k^T) S + beta k v^T)
    S_t    = S;   o_t = S_t^T (scale q_t)       (one readout per token, after its last micro-step)

Returns (o [B,T,H,V], S_T [B,H,K,V]).

Backward of L = sum(o * do) + sum(S_T * dht), reverse loop with dS = dL/dS (starts at dht):

    dq_t = scale S_t do_t;   dS += (scale q_t) do_t^T
    for j = n-1..0, with S' the state before micro-step j:
        dk = dS u;  du = dS^T k;  dbeta = du . (v - p);  dv = beta du;  dp = -beta du
        dk += S' dp;  dS <- dS + k dp^T
    dg_t = <dS, exp(g_t) S_{t-1}>;   dS <- exp(g_t) dS      (= dL/dS_{t-1})

dinitial_state = the final dS. Key-head gradients (q, k) are summed over the value heads of their group.
"""
from __future__ import annotations

import numpy as np

__all__ = ["gated_delta_product", "gated_delta_product_bwd"]


def _dtype(*xs):
    return np.result_type(np.float64, *[np.asarray(x) for x in xs if x is not None])


def _expand_heads(x, H):
    Hk = x.shape[2]
    if H % Hk:
        raise ValueError(f"H={H} is not a multiple of Hk={Hk}")
    return np.repeat(x, H // Hk, axis=2)


def _reduce_heads(dx, Hk):
    B, T, H = dx.shape[:3]
    return dx.reshape(B, T, Hk, H // Hk, *dx.shape[3:]).sum(axis=3)


def _check(q, k, v, g, beta, n):
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    if k.shape != (B, T * n, Hk, K) or v.shape != (B, T * n, H, V) or beta.shape != (B, T * n, H):
        raise ValueError(f"k, v, beta need T*n = {T * n} rows: got {k.shape}, {v.shape}, {beta.shape}")
    if g is not None and g.shape != (B, T, H):
        raise ValueError(f"g: expected {(B, T, H)}, got {g.shape}")
    return B, T, Hk, K, H, V


def _forward(q, k, v, g, beta, n, scale, initial_state, dt):
    """o, the states after each token (``ends[t]``, ends[0] the initial one) and before each micro-step
    (``mids[t][j]``), scaled q and k, both per value head."""
    B, T, Hk, K, H, V = _check(q, k, v, g, beta, n)
    qs, ke = scale * _expand_heads(q, H), _expand_heads(k, H)
    S = np.zeros((B, H, K, V), dt) if initial_state is None else np.array(initial_state, dtype=dt)
    o = np.zeros((B, T, H, V), dt)
    ends, mids = [S], []
    for t in range(T):
        if g is not None:
            S = np.exp(g[:, t])[..., None, None] * S
        before = []
        for j in range(n):
            m = t * n + j
            before.append(S)
            p = np.einsum("bhkv,bhk->bhv", S, ke[:, m])
            u = beta[:, m][..., None] * (v[:, m] - p)
            S = S + np.einsum("bhk,bhv->bhkv", ke[:, m], u)
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, qs[:, t])
        ends.append(S)
        mids.append(before)
    return o, ends, mids, qs, ke


def gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None):
    """Returns (o [B,T,H,V], ht [B,H,K,V])."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    dt = _dtype(q, k, v, g, beta, initial_state)
    o, ends, _, _, _ = _forward(q, k, v, g, beta, num_householder, scale, initial_state, dt)
    return o, ends[-1]


def gated_delta_product_bwd(q, k, v, g, beta, num_householder, do, dht, scale=None, initial_state=None):
    """Gradients of sum(o*do) + sum(ht*dht): dict q, k, v, g (None if g is None), beta, initial_state.
    ``do`` / ``dht`` may be None (a zero cotangent)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    n = num_householder
    B, T, Hk, K, H, V = _check(q, k, v, g, beta, n)
    dt = _dtype(q, k, v, g, beta, initial_state, do, dht)
    _, ends, mids, qs, ke = _forward(q, k, v, g, beta, n, scale, initial_state, dt)
    do = np.zeros((B, T, H, V), dt) if do is None else do
    dS = np.zeros((B, H, K, V), dt) if dht is None else np.array(dht, dtype=dt)
    dq = np.zeros((B, T, H, K), dt)
    dk = np.zeros((B, T * n, H, K), dt)
    dv = np.zeros((B, T * n, H, V), dt)
    dbeta = np.zeros((B, T * n, H), dt)
    dg = None if g is None else np.zeros((B, T, H), dt)
    for t in range(T - 1, -1, -1):
        dq[:, t] = scale * np.einsum("bhkv,bhv->bhk", ends[t + 1], do[:, t])
        dS = dS + np.einsum("bhk,bhv->bhkv", qs[:, t], do[:, t])
        for j in range(n - 1, -1, -1):
            m, Sp = t * n + j, mids[t][j]
            k_m, b_m = ke[:, m], beta[:, m][..., None]
            r = v[:, m] - np.einsum("bhkv,bhk->bhv", Sp, k_m)
            du = np.einsum("bhkv,bhk->bhv", dS, k_m)
            dbeta[:, m] = np.sum(du * r, axis=-1)
            dv[:, m] = b_m * du
            dp = -b_m * du
            dk[:, m] = np.einsum("bhkv,bhv->bhk", dS, b_m * r) + np.einsum("bhkv,bhv->bhk", Sp, dp)
            dS = dS + np.einsum("bhk,bhv->bhkv", k_m, dp)
        if g is not None:
            a = np.exp(g[:, t])[..., None, None]
            dg[:, t] = np.sum(dS * a * ends[t], axis=(-2, -1))
            dS = a * dS
    return {"q": _reduce_heads(dq, Hk), "k": _reduce_heads(dk, Hk), "v": dv, "g": dg, "beta": dbeta,
            "initial_state": dS}
