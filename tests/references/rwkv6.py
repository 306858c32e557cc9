"""RWKV-6 (FLA's ``chunk_rwkv6`` / ``naive_recurrent_rwkv6``), float64 numpy reference, FLA conventions.

Shapes: r, k [B,T,Hk,K]; v [B,T,H,V]; w [B,T,H,K] (log-decay per key channel, one per VALUE head);
u [H,K] (the bonus); state S [B,H,K,V].  GQA: value head h reads key head h // (H // Hk) (FLA itself has Hk = H).
``scale=None`` -> K**-0.5, applied to r.

Forward (the readout sees the state BEFORE this step, plus the current token through the bonus):

    o_t = (S_{t-1} + diag(u) k_t v_t^T)^T (scale r_t) = S_{t-1}^T rs_t + (sum_i rs_t[i] u[i] k_t[i]) v_t
    S_t = diag(exp(w_t)) S_{t-1} + k_t v_t^T

Backward of L = sum(o * do) + sum(S_T * dht), dS = dL/dS_t starting at dht, t = T-1 ... 0:

    a_t  = sum_i rs_t[i] u[i] k_t[i] ;  b_t = do_t . v_t
    dr_t = scale (S_{t-1} do_t + b_t u k_t)
    dk_t = dS v_t + b_t rs_t u ;  dv_t = dS^T k_t + a_t do_t ;  du += b_t rs_t k_t
    dw_t[i] = exp(w_t[i]) sum_j dS[i,j] S_{t-1}[i,j]
    dS <- diag(exp(w_t)) dS + rs_t do_t^T                    (= dL/dS_{t-1})
"""
from __future__ import annotations

import numpy as np

__all__ = ["rwkv6", "rwkv6_bwd"]


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


def _forward(r, k, v, w, u, scale, initial_state, dt):
    B, T, Hk, K = r.shape
    H, V = v.shape[2], v.shape[3]
    rs = scale * _expand_heads(r, H)
    ke = _expand_heads(k, H)
    S = np.zeros((B, H, K, V), dt) if initial_state is None else np.array(initial_state, dtype=dt)
    o = np.zeros((B, T, H, V), dt)
    states = [S]
    for t in range(T):
        a = np.einsum("bhk,hk,bhk->bh", rs[:, t], u, ke[:, t])
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, rs[:, t]) + a[..., None] * v[:, t]
        S = np.exp(w[:, t])[..., None] * S + np.einsum("bhk,bhv->bhkv", ke[:, t], v[:, t])
        states.append(S)
    return o, states, rs, ke


def rwkv6(r, k, v, w, u, scale=None, initial_state=None):
    """Returns (o [B,T,H,V], ht [B,H,K,V])."""
    if scale is None:
        scale = r.shape[-1] ** -0.5
    dt = _dtype(r, k, v, w, u, initial_state)
    o, states, _, _ = _forward(r, k, v, w, u, scale, initial_state, dt)
    return o, states[-1]


def rwkv6_bwd(r, k, v, w, u, do, dht, scale=None, initial_state=None):
    """Gradients of sum(o*do) + sum(ht*dht). Returns dict r, k, v, w, u, initial_state."""
    if scale is None:
        scale = r.shape[-1] ** -0.5
    B, T, Hk, K = r.shape
    H, V = v.shape[2], v.shape[3]
    dt = _dtype(r, k, v, w, u, initial_state, do, dht)
    _, states, rs, ke = _forward(r, k, v, w, u, scale, initial_state, dt)
    dS = np.zeros((B, H, K, V), dt) if dht is None else np.array(dht, dtype=dt)
    dr = np.zeros((B, T, H, K), dt)
    dk = np.zeros((B, T, H, K), dt)
    dv = np.zeros((B, T, H, V), dt)
    dw = np.zeros((B, T, H, K), dt)
    du = np.zeros((H, K), dt)
    for t in range(T - 1, -1, -1):
        e = np.exp(w[:, t])[..., None]
        a = np.einsum("bhk,hk,bhk->bh", rs[:, t], u, ke[:, t])
        b = np.einsum("bhv,bhv->bh", do[:, t], v[:, t])
        dr[:, t] = scale * (np.einsum("bhkv,bhv->bhk", states[t], do[:, t]) + b[..., None] * u * ke[:, t])
        dk[:, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, t]) + b[..., None] * rs[:, t] * u
        dv[:, t] = np.einsum("bhkv,bhk->bhv", dS, ke[:, t]) + a[..., None] * do[:, t]
        du += np.einsum("bh,bhk,bhk->hk", b, rs[:, t], ke[:, t])
        dw[:, t] = np.sum(dS * e * states[t], axis=-1)
        dS = e * dS + np.einsum("bhk,bhv->bhkv", rs[:, t], do[:, t])
    return {
        "r": _reduce_heads(dr, Hk),
        "k": _reduce_heads(dk, Hk),
        "v": dv,
        "w": dw,
        "u": du,
        "initial_state": dS,
    }
