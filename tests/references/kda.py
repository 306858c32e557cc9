"""Kimi Delta Attention (KDA), float64 numpy reference, FLA conventions (``chunk_kda`` /
``naive_recurrent_kda``): the gated delta rule with a per-channel gate.

Shapes: q, k [B,T,Hk,K]; v [B,T,H,V]; g [B,T,H,K] (log-space, per key channel); beta [B,T,H];
state S [B,H,K,V]. GQA: value head h reads key head h // (H // Hk). ``scale=None`` -> K**-0.5.

Forward, per (b, h), t = 1..T (the gate decays the rows of S *before* the delta prediction):

    S'_t  = diag(exp(g_t)) S_{t-1}
    p_t   = S'_t^T k_t
    u_t   = beta_t (v_t - p_t)
    S_t   = S'_t + k_t u_t^T
    o_t   = S_t^T (scale q_t)

Backward of L = sum(o * do) + sum(S_T * dht), as in ``gated_delta_net_bwd`` except

    dg_t[i] = sum_j dS'[i,j] S'_t[i,j] ;      dS <- diag(exp(g_t)) dS'
"""
from __future__ import annotations

import numpy as np

__all__ = ["kda", "kda_bwd"]


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


def _forward(q, k, v, g, beta, scale, initial_state, dt):
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    qs = scale * _expand_heads(q, H)
    ke = _expand_heads(k, H)
    S = np.zeros((B, H, K, V), dt) if initial_state is None else np.array(initial_state, dtype=dt)
    o = np.zeros((B, T, H, V), dt)
    states = [S]
    for t in range(T):
        S = np.exp(g[:, t])[..., None] * S
        p = np.einsum("bhkv,bhk->bhv", S, ke[:, t])
        u = beta[:, t][..., None] * (v[:, t] - p)
        S = S + np.einsum("bhk,bhv->bhkv", ke[:, t], u)
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, qs[:, t])
        states.append(S)
    return o, states, qs, ke


def kda(q, k, v, g, beta, scale=None, initial_state=None):
    """Returns (o [B,T,H,V], ht [B,H,K,V])."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    dt = _dtype(q, k, v, g, beta, initial_state)
    o, states, _, _ = _forward(q, k, v, g, beta, scale, initial_state, dt)
    return o, states[-1]


def kda_bwd(q, k, v, g, beta, do, dht, scale=None, initial_state=None):
    """Gradients of sum(o*do) + sum(ht*dht). Returns dict q, k, v, g, beta, initial_state."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    dt = _dtype(q, k, v, g, beta, initial_state, do, dht)
    _, states, qs, ke = _forward(q, k, v, g, beta, scale, initial_state, dt)
    do = np.zeros((B, T, H, V), dt) if do is None else do
    dS = np.zeros((B, H, K, V), dt) if dht is None else np.array(dht, dtype=dt)
    dq = np.zeros((B, T, H, K), dt)
    dk = np.zeros((B, T, H, K), dt)
    dv = np.zeros((B, T, H, V), dt)
    dg = np.zeros((B, T, H, K), dt)
    dbeta = np.zeros((B, T, H), dt)
    for t in range(T - 1, -1, -1):
        a = np.exp(g[:, t])[..., None]          # [B,H,K,1]
        Sd = a * states[t]                      # S'_t
        S_t = states[t + 1]
        k_t, b_t = ke[:, t], beta[:, t][..., None]
        r = v[:, t] - np.einsum("bhkv,bhk->bhv", Sd, k_t)
        u = b_t * r
        dq[:, t] = scale * np.einsum("bhkv,bhv->bhk", S_t, do[:, t])
        dS = dS + np.einsum("bhk,bhv->bhkv", qs[:, t], do[:, t])
        dk_t = np.einsum("bhkv,bhv->bhk", dS, u)
        du = np.einsum("bhkv,bhk->bhv", dS, k_t)
        dbeta[:, t] = np.sum(du * r, axis=-1)
        dv[:, t] = b_t * du
        dp = -b_t * du
        dSd = dS + np.einsum("bhk,bhv->bhkv", k_t, dp)
        dk[:, t] = dk_t + np.einsum("bhkv,bhv->bhk", Sd, dp)
        dg[:, t] = np.sum(dSd * Sd, axis=-1)
        dS = a * dSd
    return {"q": _reduce_heads(dq, Hk), "k": _reduce_heads(dk, Hk), "v": dv, "g": dg, "beta": dbeta,
            "initial_state": dS}
