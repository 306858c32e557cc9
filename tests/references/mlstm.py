"""xLSTM's mLSTM (recgen's ``mlstm``): exponential input gate, sigmoid forget gate, the normalizer max(|x|, 1) of
the paper (no stabilizer: it changes no value), float64 numpy reference, FLA-style layouts.

Shapes: q, k [B,T,Hk,K]; v [B,T,H,V]; ig, fg [B,T,H] (gate pre-activations); state (C [B,H,K,V], n [B,H,K]).
GQA: value head h reads key head h // (H // Hk).  ``scale=None`` -> K**-0.5, applied to q.

Forward, per (b, h), i_t = exp(ig_t), f_t = sigmoid(fg_t), qs_t = scale q_t:

    C_t = f_t C_{t-1} + i_t k_t v_t^T ;  n_t = f_t n_{t-1} + i_t k_t
    m_t = n_t^T qs_t ;  N_t = max(|m_t|, 1) ;  o_t = C_t^T qs_t / N_t

Backward of L = sum(o * do) + sum(C_T * dC_T) + sum(n_T * dn_T), (dC, dn) = dL/d(C_t, n_t):

    y = C_t^T qs_t ;  dy = do / N ;  dm = -(do . y) N' / N^2,  N' = sign(m) where |m| > 1, else 0
    dqs = C_t dy + n_t dm ;  dC += qs dy^T ;  dn += qs dm
    dk = i (dC v + dn) ;  dv = i dC^T k ;  dig = i (<dC, k v^T> + dn . k)

N branches on the real part of m (|m| > 1: N = ±m, else 1), so it is analytic where it is differentiable and the
complex-step checks apply.
    dfg = f (1 - f) (<dC, C_{t-1}> + dn . n_{t-1}) ;  (dC, dn) <- f (dC, dn)
"""
from __future__ import annotations

import numpy as np

__all__ = ["mlstm", "mlstm_bwd"]


def _sigmoid(x):
    return 0.5 * (1 + np.tanh(0.5 * x))


def _norm(m):
    """(N, N') of N(m) = max(|m|, 1), branching on the real part."""
    r = np.real(m)
    s = np.where(r > 1, 1.0, np.where(r < -1, -1.0, 0.0))
    return np.where(s != 0, s * m, 1.0 + 0 * m), s


def _prep(q, k, v, ig, fg, scale, initial_state, *extra):
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    if H % Hk:
        raise ValueError(f"H={H} is not a multiple of Hk={Hk}")
    st = () if initial_state is None else tuple(initial_state)
    ex = [a for e in extra if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    dt = np.result_type(np.float64, q, k, v, ig, fg, *st, *ex)
    scale = K ** -0.5 if scale is None else scale
    qs, ke = scale * np.repeat(q, H // Hk, axis=2), np.repeat(k, H // Hk, axis=2)
    if initial_state is None:
        C0, n0 = np.zeros((B, H, K, V), dt), np.zeros((B, H, K), dt)
    else:
        C0, n0 = np.array(initial_state[0], dtype=dt), np.array(initial_state[1], dtype=dt)
    return dt, scale, qs, ke, C0, n0


def _forward(qs, ke, v, i, f, C, n):
    states = [(C, n)]
    o = np.zeros(v.shape, np.result_type(C, qs, v, i, f))
    for t in range(v.shape[1]):
        C = f[:, t, :, None, None] * C + i[:, t, :, None, None] * ke[:, t, :, :, None] * v[:, t, :, None, :]
        n = f[:, t, :, None] * n + i[:, t, :, None] * ke[:, t]
        m = np.einsum("bhk,bhk->bh", n, qs[:, t])
        o[:, t] = np.einsum("bhkv,bhk->bhv", C, qs[:, t]) / _norm(m)[0][..., None]
        states.append((C, n))
    return o, states


def mlstm(q, k, v, ig, fg, scale=None, initial_state=None):
    """Returns (o [B,T,H,V], (C_T [B,H,K,V], n_T [B,H,K]))."""
    _, _, qs, ke, C0, n0 = _prep(q, k, v, ig, fg, scale, initial_state)
    o, states = _forward(qs, ke, v, np.exp(ig), _sigmoid(fg), C0, n0)
    return o, states[-1]


def mlstm_bwd(q, k, v, ig, fg, do, dht, scale=None, initial_state=None):
    """Gradients of sum(o*do) + sum(C_T*dht[0]) + sum(n_T*dht[1]). Returns dict q, k, v, ig, fg,
    initial_state (the pair (dC0, dn0))."""
    dt, scale, qs, ke, C0, n0 = _prep(q, k, v, ig, fg, scale, initial_state, do, None if dht is None else tuple(dht))
    B, T, Hk, K = q.shape
    H = v.shape[2]
    i, f = np.exp(ig), _sigmoid(fg)
    _, states = _forward(qs, ke, v, i, f, C0, n0)
    dC = np.zeros(C0.shape, dt) if dht is None else np.array(dht[0], dtype=dt)
    dn = np.zeros(n0.shape, dt) if dht is None else np.array(dht[1], dtype=dt)
    dq, dk, dv = np.zeros(qs.shape, dt), np.zeros(ke.shape, dt), np.zeros(v.shape, dt)
    dig, dfg = np.zeros(ig.shape, dt), np.zeros(fg.shape, dt)
    for t in range(T - 1, -1, -1):
        C, n = states[t + 1]
        Cp, n_p = states[t]
        m = np.einsum("bhk,bhk->bh", n, qs[:, t])
        N, dN = _norm(m)
        y = np.einsum("bhkv,bhk->bhv", C, qs[:, t])
        dy = do[:, t] / N[..., None]
        dm = -np.sum(do[:, t] * y, axis=-1) * dN / N**2
        dq[:, t] = scale * (np.einsum("bhkv,bhv->bhk", C, dy) + n * dm[..., None])
        dC = dC + qs[:, t, :, :, None] * dy[:, :, None, :]
        dn = dn + qs[:, t] * dm[..., None]
        it, ft = i[:, t], f[:, t]
        dCv = np.einsum("bhkv,bhv->bhk", dC, v[:, t])
        dk[:, t] = it[..., None] * (dCv + dn)
        dv[:, t] = it[..., None] * np.einsum("bhkv,bhk->bhv", dC, ke[:, t])
        dig[:, t] = it * np.sum((dCv + dn) * ke[:, t], axis=-1)
        dfg[:, t] = ft * (1 - ft) * (np.einsum("bhkv,bhkv->bh", dC, Cp) + np.sum(dn * n_p, axis=-1))
        dC, dn = ft[..., None, None] * dC, ft[..., None] * dn
    fold = lambda a: a.reshape(B, T, Hk, H // Hk, K).sum(axis=3)  # noqa: E731
    return {"q": fold(dq), "k": fold(dk), "v": dv, "ig": dig, "fg": dfg, "initial_state": (dC, dn)}
