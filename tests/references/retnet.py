"""RetNet retention, float64 numpy reference, FLA conventions (``chunk_retention`` / ``naive_retention``):
simple GLA with a fixed decay per head.

Shapes: q, k [B,T,Hk,K]; v [B,T,H,V]; log_gamma [H] (default RetNet's, log(1 - 2^(-5-h))); state S [B,H,K,V].
GQA: value head h reads key head h // (H // Hk).  ``scale=None`` -> K**-0.5, applied to q.

Forward, per (b, h):   S_t = gamma_h S_{t-1} + k_t v_t^T ;   o_t = S_t^T (scale q_t),  gamma_h = exp(log_gamma_h)

Backward of L = sum(o * do) + sum(S_T * dht), dS = dL/dS_t starting at dht:

    dS += (scale q_t) do_t^T ;  dq_t = scale S_t do_t
    dk_t = dS v_t ;  dv_t = dS^T k_t
    dlog_gamma_h += gamma_h <dS, S_{t-1}> (summed over b, t) ;  dS <- gamma_h dS
"""
from __future__ import annotations

import numpy as np

__all__ = ["retnet", "retnet_bwd", "retnet_log_gamma"]


def retnet_log_gamma(H):
    """RetNet's decays in log space: log(1 - 2^(-5-h)), h = 0..H-1 (FLA: ``s = 1 - 2**(-5 - arange(H))``)."""
    return np.log1p(-np.exp2(-5.0 - np.arange(H)))


def _prep(q, k, v, log_gamma, scale, initial_state, *extra):
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    if H % Hk:
        raise ValueError(f"H={H} is not a multiple of Hk={Hk}")
    lg = retnet_log_gamma(H) if log_gamma is None else log_gamma
    dt = np.result_type(np.float64, q, k, v, lg, *[x for x in (initial_state, *extra) if x is not None])
    scale = K ** -0.5 if scale is None else scale
    qs = scale * np.repeat(q, H // Hk, axis=2)
    ke = np.repeat(k, H // Hk, axis=2)
    S0 = np.zeros((B, H, K, V), dt) if initial_state is None else np.array(initial_state, dtype=dt)
    return lg, dt, scale, qs, ke, S0


def _forward(qs, ke, v, gamma, S):
    states = [S]
    o = np.zeros(v.shape, np.result_type(S, qs, v, gamma))
    for t in range(v.shape[1]):
        S = gamma[None, :, None, None] * S + ke[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, qs[:, t])
        states.append(S)
    return o, states


def retnet(q, k, v, log_gamma=None, scale=None, initial_state=None):
    """Returns (o [B,T,H,V], ht [B,H,K,V])."""
    lg, _, _, qs, ke, S0 = _prep(q, k, v, log_gamma, scale, initial_state)
    o, states = _forward(qs, ke, v, np.exp(lg), S0)
    return o, states[-1]


def retnet_bwd(q, k, v, log_gamma, do, dht, scale=None, initial_state=None):
    """Gradients of sum(o*do) + sum(ht*dht). Returns dict q, k, v, log_gamma, initial_state."""
    lg, dt, scale, qs, ke, S0 = _prep(q, k, v, log_gamma, scale, initial_state, do, dht)
    B, T, Hk, K = q.shape
    H = v.shape[2]
    gamma = np.exp(lg)
    _, states = _forward(qs, ke, v, gamma, S0)
    dS = np.zeros(S0.shape, dt) if dht is None else np.array(dht, dtype=dt)
    dq, dk, dv = np.zeros(qs.shape, dt), np.zeros(ke.shape, dt), np.zeros(v.shape, dt)
    dlg = np.zeros(H, dt)
    for t in range(T - 1, -1, -1):
        dq[:, t] = scale * np.einsum("bhkv,bhv->bhk", states[t + 1], do[:, t])
        dS = dS + qs[:, t, :, :, None] * do[:, t, :, None, :]
        dk[:, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, t])
        dv[:, t] = np.einsum("bhkv,bhk->bhv", dS, ke[:, t])
        dlg += gamma * np.einsum("bhkv,bhkv->h", dS, states[t])
        dS = gamma[None, :, None, None] * dS
    fold = lambda a: a.reshape(B, T, Hk, H // Hk, K).sum(axis=3)  # noqa: E731
    return {"q": fold(dq), "k": fold(dk), "v": dv, "log_gamma": dlg, "initial_state": dS}
