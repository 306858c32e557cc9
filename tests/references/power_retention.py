"""Power retention (p = 2, symmetric feature map, ratio readout), float64 numpy reference.

Feature map (``sympow2``) on the last axis, x in R^d -> phi(x) in R^{d(d+1)/2}, row-major
over pairs a <= b:  phi(x)_{ab} = x_a^2 if a == b else sqrt(2) x_a x_b, so that
phi(x) . phi(y) = (x . y)^2.

Shapes: q, k [B,T,Hk,d]; v [B,T,H,V]; log_g [B,T,H]; state (S [B,H,D,V], z [B,H,D]),
D = d(d+1)/2.  GQA: value head h reads key head h // (H // Hk).  ``scale=None`` -> d**-0.5,
applied to q *before* the feature map (qs = scale q, so phi(qs) = scale^2 phi(q)).

Forward:

    S_t = exp(g_t) S_{t-1} + phi(k_t) v_t^T
    z_t = exp(g_t) z_{t-1} + phi(k_t)
    o_t = (S_t^T phi(qs_t)) / (phi(qs_t) . z_t + eps)      (eps = 1e-2 by default, recgen's built-in)

Returns (o [B,T,H,V], (S_T, z_T)).  With zero initial state this equals the quadratic form
o_t = sum_{s<=t} w_ts (qs_t.k_s)^2 v_s / (sum_{s<=t} w_ts (qs_t.k_s)^2 + eps),
w_ts = prod_{r=s+1..t} exp(g_r).

Backward of L = sum(o * do) + sum(S_T * dS_T) + sum(z_T * dz_T); (dS, dz) = dL/d(S_t, z_t):

    n_t = S_t^T p_t,  den_t = p_t . z_t + eps,  p_t = phi(qs_t)
    dn = do_t / den_t ;  dden = -(do_t . o_t) / den_t
    dp_t = S_t dn + z_t dden ;  dS += p_t dn^T ;  dz += p_t dden
    dphi(k_t) = dS v_t + dz ;  dv_t = dS^T phi(k_t)
    dg_t = exp(g_t) (<dS, S_{t-1}> + <dz, z_{t-1}>) ;  (dS, dz) <- exp(g_t) (dS, dz)
    dq = scale J_phi(qs)^T dp ;  dk = J_phi(k)^T dphi(k)

with J_phi^T g: d/dx_a gets 2 x_a g_aa (diagonal) and sqrt(2) x_b g_ab, sqrt(2) x_a g_ab
for x_a, x_b (off-diagonal).
"""
from __future__ import annotations

import numpy as np

__all__ = ["sympow2", "sympow2_bwd", "power_retention", "power_retention_bwd"]

_SQRT2 = 2.0 ** 0.5


def _dtype(*xs):
    return np.result_type(np.float64, *[np.asarray(x) for x in xs if x is not None])


def _pairs(d):
    return [(a, b) for a in range(d) for b in range(a, d)]


def sympow2(x):
    """Symmetric degree-2 feature map on the last axis: [..., d] -> [..., d(d+1)/2]."""
    x = np.asarray(x)
    cols = [x[..., a] * x[..., b] if a == b else _SQRT2 * x[..., a] * x[..., b] for a, b in _pairs(x.shape[-1])]
    return np.stack(cols, axis=-1)


def sympow2_bwd(x, gphi):
    """Vector-Jacobian product of ``sympow2``: returns dL/dx given gphi = dL/dphi(x)."""
    x = np.asarray(x)
    dx = np.zeros(x.shape, np.result_type(np.float64, x, gphi))
    for i, (a, b) in enumerate(_pairs(x.shape[-1])):
        gi = gphi[..., i]
        if a == b:
            dx[..., a] += 2.0 * x[..., a] * gi
        else:
            dx[..., a] += _SQRT2 * x[..., b] * gi
            dx[..., b] += _SQRT2 * x[..., a] * gi
    return dx


def _expand_heads(x, H):
    Hk = x.shape[2]
    if H % Hk:
        raise ValueError(f"H={H} is not a multiple of Hk={Hk}")
    return np.repeat(x, H // Hk, axis=2)


def _reduce_heads(dx, Hk):
    B, T, H = dx.shape[:3]
    return dx.reshape(B, T, Hk, H // Hk, *dx.shape[3:]).sum(axis=3)


def _forward(q, k, v, log_g, scale, initial_state, eps, dt):
    B, T, Hk, d = q.shape
    H, V = v.shape[2], v.shape[3]
    Dp = d * (d + 1) // 2
    qs = scale * _expand_heads(q, H)
    ke = _expand_heads(k, H)
    pq, pk = sympow2(qs), sympow2(ke)
    if initial_state is None:
        S, z = np.zeros((B, H, Dp, V), dt), np.zeros((B, H, Dp), dt)
    else:
        S, z = np.array(initial_state[0], dtype=dt), np.array(initial_state[1], dtype=dt)
    o = np.zeros((B, T, H, V), dt)
    states = [(S, z)]
    for t in range(T):
        a = np.exp(log_g[:, t])
        S = a[..., None, None] * S + np.einsum("bhd,bhv->bhdv", pk[:, t], v[:, t])
        z = a[..., None] * z + pk[:, t]
        num = np.einsum("bhdv,bhd->bhv", S, pq[:, t])
        den = np.sum(pq[:, t] * z, axis=-1) + eps
        o[:, t] = num / den[..., None]
        states.append((S, z))
    return o, states, qs, ke, pq, pk


def power_retention(q, k, v, log_g, scale=None, initial_state=None, eps=1e-2):
    """Returns (o [B,T,H,V], (S [B,H,D,V], z [B,H,D]))."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    st = (None, None) if initial_state is None else initial_state
    dt = _dtype(q, k, v, log_g, *st)
    o, states, *_ = _forward(q, k, v, log_g, scale, initial_state, eps, dt)
    return o, states[-1]


def power_retention_bwd(q, k, v, log_g, do, dht, scale=None, initial_state=None, eps=1e-2):
    """Gradients of sum(o*do) + sum(S_T*dS) + sum(z_T*dz) with dht = (dS, dz) (or None).

    Returns dict q, k, v, log_g, initial_state (the pair (dS0, dz0)).
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    B, T, Hk, d = q.shape
    H, V = v.shape[2], v.shape[3]
    Dp = d * (d + 1) // 2
    st = (None, None) if initial_state is None else initial_state
    dh = (None, None) if dht is None else dht
    dt = _dtype(q, k, v, log_g, *st, do, *dh)
    o, states, qs, ke, pq, pk = _forward(q, k, v, log_g, scale, initial_state, eps, dt)
    do = np.zeros((B, T, H, V), dt) if do is None else do
    dS = np.zeros((B, H, Dp, V), dt) if dh[0] is None else np.array(dh[0], dtype=dt)
    dz = np.zeros((B, H, Dp), dt) if dh[1] is None else np.array(dh[1], dtype=dt)
    dpq = np.zeros((B, T, H, Dp), dt)
    dpk = np.zeros((B, T, H, Dp), dt)
    dv = np.zeros((B, T, H, V), dt)
    dlg = np.zeros((B, T, H), dt)
    for t in range(T - 1, -1, -1):
        S_t, z_t = states[t + 1]
        S_p, z_p = states[t]
        a = np.exp(log_g[:, t])
        p = pq[:, t]
        den = np.sum(p * z_t, axis=-1) + eps                              # [B,H]
        dn = do[:, t] / den[..., None]                                    # [B,H,V]
        dden = -np.sum(do[:, t] * o[:, t], axis=-1) / den                 # [B,H]
        dpq[:, t] = np.einsum("bhdv,bhv->bhd", S_t, dn) + z_t * dden[..., None]
        dS = dS + np.einsum("bhd,bhv->bhdv", p, dn)
        dz = dz + p * dden[..., None]
        dpk[:, t] = np.einsum("bhdv,bhv->bhd", dS, v[:, t]) + dz
        dv[:, t] = np.einsum("bhdv,bhd->bhv", dS, pk[:, t])
        dlg[:, t] = a * (np.sum(dS * S_p, axis=(-2, -1)) + np.sum(dz * z_p, axis=-1))
        dS = a[..., None, None] * dS
        dz = a[..., None] * dz
    dq = scale * sympow2_bwd(qs, dpq)
    dk = sympow2_bwd(ke, dpk)
    return {
        "q": _reduce_heads(dq, Hk),
        "k": _reduce_heads(dk, Hk),
        "v": dv,
        "log_g": dlg,
        "initial_state": (dS, dz),
    }
