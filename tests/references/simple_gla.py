"""Simple GLA (scalar per-head decay, a.k.a. RetNet/Lightning with data-dependent gate),
float64 numpy reference, FLA conventions.

Shapes: q, k [B,T,Hk,K]; v [B,T,H,V]; g [B,T,H] (log-space decay); state S [B,H,K,V].
GQA: value head h reads key head h // (H // Hk).  ``scale=None`` -> K**-0.5, applied to q.

Forward:   S_t = exp(g_t) S_{t-1} + k_t v_t^T ;   o_t = S_t^T (scale q_t)

Backward of L = sum(o * do) + sum(S_T * dht), dS = dL/dS_t starting at dht:

    dq_t = scale S_t do_t ;  dS += (scale q_t) do_t^T
    dk_t = dS v_t ;  dv_t = dS^T k_t
    dg_t = exp(g_t) <dS, S_{t-1}> ;  dS <- exp(g_t) dS         (= dL/dS_{t-1})
"""
from __future__ import annotations

import numpy as np

__all__ = ["simple_gla", "simple_gla_bwd"]


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


def _forward(q, k, v, g, scale, initial_state, dt):
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    qs = scale * _expand_heads(q, H)
    ke = _expand_heads(k, H)
    S = np.zeros((B, H, K, V), dt) if initial_state is None else np.array(initial_state, dtype=dt)
    o = np.zeros((B, T, H, V), dt)
    states = [S]
    for t in range(T):
        S = np.exp(g[:, t])[..., None, None] * S + np.einsum("bhk,bhv->bhkv", ke[:, t], v[:, t])
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, qs[:, t])
        states.append(S)
    return o, states, qs, ke


def simple_gla(q, k, v, g, scale=None, initial_state=None):
    """Returns (o [B,T,H,V], ht [B,H,K,V])."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    dt = _dtype(q, k, v, g, initial_state)
    o, states, _, _ = _forward(q, k, v, g, scale, initial_state, dt)
    return o, states[-1]


def simple_gla_bwd(q, k, v, g, do, dht, scale=None, initial_state=None):
    """Gradients of sum(o*do) + sum(ht*dht). Returns dict q, k, v, g, initial_state."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    dt = _dtype(q, k, v, g, initial_state, do, dht)
    _, states, qs, ke = _forward(q, k, v, g, scale, initial_state, dt)
    do = np.zeros((B, T, H, V), dt) if do is None else do
    dS = np.zeros((B, H, K, V), dt) if dht is None else np.array(dht, dtype=dt)
    dq = np.zeros((B, T, H, K), dt)
    dk = np.zeros((B, T, H, K), dt)
    dv = np.zeros((B, T, H, V), dt)
    dg = np.zeros((B, T, H), dt)
    for t in range(T - 1, -1, -1):
        a = np.exp(g[:, t])[..., None, None]
        dq[:, t] = scale * np.einsum("bhkv,bhv->bhk", states[t + 1], do[:, t])
        dS = dS + np.einsum("bhk,bhv->bhkv", qs[:, t], do[:, t])
        dk[:, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, t])
        dv[:, t] = np.einsum("bhkv,bhk->bhv", dS, ke[:, t])
        dg[:, t] = np.sum(dS * a * states[t], axis=(-2, -1))
        dS = a * dS
    return {
        "q": _reduce_heads(dq, Hk),
        "k": _reduce_heads(dk, Hk),
        "v": dv,
        "g": dg,
        "initial_state": dS,
    }
