"""HGRN2, float64 numpy reference, FLA conventions (``fla.layers.hgrn2.HGRN2Attention``, which runs
``chunk_gla(q, k=1 - exp(g), v=i, g=g)`` with g = logsigmoid(f), optionally lower-bounded).

Shapes: q [B,T,Hk,K]; v [B,T,H,V]; g [B,T,H,K] (log forget gate, <= 0); state S [B,H,K,V].
GQA: value head h reads key head h // (H // Hk).  ``scale=None`` -> K**-0.5, applied to q.

Forward, per (b, h), a_t = exp(g_t) [K]:

    S_t = diag(a_t) S_{t-1} + (1 - a_t) v_t^T ;   o_t = S_t^T (scale q_t)

Backward of L = sum(o * do) + sum(S_T * dht), dS = dL/dS_t starting at dht:

    dS += (scale q_t) do_t^T ;  dq_t = scale S_t do_t ;  dv_t = dS^T (1 - a_t)
    dg_t = a_t * (sum_j dS[:, j] S_{t-1}[:, j] - dS v_t) ;  dS <- diag(a_t) dS

``hgrn2_gate``: FLA's gate map, g = logsigmoid(f), or with a lower bound lb in [0, 1)
g = log(lb + (1 - lb) sigmoid(f)) (FLA: logaddexp(log lb, log1p(-lb) + logsigmoid(f))).
"""
from __future__ import annotations

import numpy as np

__all__ = ["hgrn2", "hgrn2_bwd", "hgrn2_gate"]


def hgrn2_gate(f, lower_bound=None):
    """The log forget gate of FLA's HGRN2 layer from the pre-activation f [.., H*K or H, K]."""
    ls = -np.logaddexp(0.0, -f) if np.isrealobj(f) else -np.log1p(np.exp(-f))
    if lower_bound is None:
        return ls
    return np.log(lower_bound + (1.0 - lower_bound) * np.exp(ls))


def _prep(q, v, g, scale, initial_state, *extra):
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    if H % Hk:
        raise ValueError(f"H={H} is not a multiple of Hk={Hk}")
    dt = np.result_type(np.float64, q, v, g, *[x for x in (initial_state, *extra) if x is not None])
    scale = K ** -0.5 if scale is None else scale
    qs = scale * np.repeat(q, H // Hk, axis=2)
    S0 = np.zeros((B, H, K, V), dt) if initial_state is None else np.array(initial_state, dtype=dt)
    return dt, scale, qs, S0


def _forward(qs, v, g, S):
    states = [S]
    o = np.zeros(v.shape, np.result_type(S, qs, v, g))
    for t in range(v.shape[1]):
        a = np.exp(g[:, t])                               # [B,H,K]
        S = a[..., None] * S + (1.0 - a)[..., None] * v[:, t, :, None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, qs[:, t])
        states.append(S)
    return o, states


def hgrn2(q, v, g, scale=None, initial_state=None):
    """Returns (o [B,T,H,V], ht [B,H,K,V])."""
    _, _, qs, S0 = _prep(q, v, g, scale, initial_state)
    o, states = _forward(qs, v, g, S0)
    return o, states[-1]


def hgrn2_bwd(q, v, g, do, dht, scale=None, initial_state=None):
    """Gradients of sum(o*do) + sum(ht*dht). Returns dict q, v, g, initial_state."""
    dt, scale, qs, S0 = _prep(q, v, g, scale, initial_state, do, dht)
    B, T, Hk, K = q.shape
    H = v.shape[2]
    _, states = _forward(qs, v, g, S0)
    dS = np.zeros(S0.shape, dt) if dht is None else np.array(dht, dtype=dt)
    dq, dv, dg = np.zeros(qs.shape, dt), np.zeros(v.shape, dt), np.zeros(g.shape, dt)
    for t in range(T - 1, -1, -1):
        a = np.exp(g[:, t])
        dq[:, t] = scale * np.einsum("bhkv,bhv->bhk", states[t + 1], do[:, t])
        dS = dS + qs[:, t, :, :, None] * do[:, t, :, None, :]
        dv[:, t] = np.einsum("bhkv,bhk->bhv", dS, 1.0 - a)
        du = np.einsum("bhkv,bhv->bhk", dS, v[:, t])
        dg[:, t] = a * (np.sum(dS * states[t], axis=-1) - du)
        dS = a[..., None] * dS
    return {"q": dq.reshape(B, T, Hk, H // Hk, K).sum(axis=3), "v": dv, "g": dg, "initial_state": dS}
