"""RWKV-7 (FLA's ``chunk_rwkv7`` / ``fused_recurrent_rwkv7``, the DPLR generalized delta rule), float64 numpy
reference, FLA conventions.

Shapes: r, k, a, b [B,T,Hk,K]; w [B,T,H,K] (log-decay per key channel, one per VALUE head); v [B,T,H,V];
state S [B,H,K,V]. GQA: value head h reads key head h // (H // Hk) (FLA itself has Hk = H). ``scale`` defaults to
1.0 (``chunk_rwkv7``'s default), applied to r.

Forward (the rank-1 term reads the state BEFORE this step's decay):

    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T ;   o_t = S_t^T (scale r_t)

Backward of L = sum(o * do) + sum(S_T * dht), dS = dL/dS_t starting at dht, t = T-1 ... 0:

    dr_t = scale S_t do_t ;  dS += rs_t do_t^T                       (dS is now dL/dS_t in full)
    dk_t = dS v_t ;  dv_t = dS^T k_t
    sa_t = S_{t-1}^T a_t ;  db_t = dS sa_t ;  da_t = S_{t-1} (dS^T b_t)
    dw_t[i] = exp(w_t[i]) sum_j dS[i,j] S_{t-1}[i,j]
    dS <- diag(exp(w_t)) dS + a_t (b_t^T dS)                            (= dL/dS_{t-1})
"""
from __future__ import annotations

import numpy as np

__all__ = ["rwkv7", "rwkv7_bwd"]


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


def _forward(r, w, k, v, a, b, scale, initial_state, dt):
    B, T, Hk, K = r.shape
    H, V = v.shape[2], v.shape[3]
    rs, ke, ae, be = (_expand_heads(x, H) for x in (scale * r, k, a, b))
    S = np.zeros((B, H, K, V), dt) if initial_state is None else np.array(initial_state, dtype=dt)
    o = np.zeros((B, T, H, V), dt)
    states = [S]
    for t in range(T):
        sa = np.einsum("bhkv,bhk->bhv", S, ae[:, t])
        S = (np.exp(w[:, t])[..., None] * S + be[:, t][..., None] * sa[:, :, None, :]
             + np.einsum("bhk,bhv->bhkv", ke[:, t], v[:, t]))
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, rs[:, t])
        states.append(S)
    return o, states, (rs, ke, ae, be)


def rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None):
    """Returns (o [B,T,H,V], ht [B,H,K,V]). ``scale=None`` is the default, 1.0."""
    scale = 1.0 if scale is None else scale
    dt = _dtype(r, w, k, v, a, b, initial_state)
    o, states, _ = _forward(r, w, k, v, a, b, scale, initial_state, dt)
    return o, states[-1]


def rwkv7_bwd(r, w, k, v, a, b, do, dht, scale=1.0, initial_state=None):
    """Gradients of sum(o*do) + sum(ht*dht). Returns dict r, w, k, v, a, b, initial_state."""
    scale = 1.0 if scale is None else scale
    B, T, Hk, K = r.shape
    H, V = v.shape[2], v.shape[3]
    dt = _dtype(r, w, k, v, a, b, initial_state, do, dht)
    _, states, (rs, ke, ae, be) = _forward(r, w, k, v, a, b, scale, initial_state, dt)
    dS = np.zeros((B, H, K, V), dt) if dht is None else np.array(dht, dtype=dt)
    g = {n: np.zeros((B, T, H, K), dt) for n in ("r", "k", "a", "b", "w")}
    dv = np.zeros((B, T, H, V), dt)
    for t in range(T - 1, -1, -1):
        S, Sp = states[t + 1], states[t]
        e = np.exp(w[:, t])[..., None]
        g["r"][:, t] = scale * np.einsum("bhkv,bhv->bhk", S, do[:, t])
        dS = dS + np.einsum("bhk,bhv->bhkv", rs[:, t], do[:, t])
        g["k"][:, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, t])
        dv[:, t] = np.einsum("bhkv,bhk->bhv", dS, ke[:, t])
        sa = np.einsum("bhkv,bhk->bhv", Sp, ae[:, t])
        bdS = np.einsum("bhk,bhkv->bhv", be[:, t], dS)
        g["b"][:, t] = np.einsum("bhkv,bhv->bhk", dS, sa)
        g["a"][:, t] = np.einsum("bhkv,bhv->bhk", Sp, bdS)
        g["w"][:, t] = np.sum(dS * e * Sp, axis=-1)
        dS = e * dS + ae[:, t][..., None] * bdS[:, :, None, :]
    return {"r": _reduce_heads(g["r"], Hk), "w": g["w"], "k": _reduce_heads(g["k"], Hk), "v": dv,
            "a": _reduce_heads(g["a"], Hk), "b": _reduce_heads(g["b"], Hk), "initial_state": dS}
