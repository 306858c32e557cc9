"""Mamba-2 SSD, float64 numpy reference in mamba_ssm's layout and argument names (``mamba_chunk_scan_combined``,
``ssd_minimal_discrete``; the gate map of its ``_chunk_cumsum_fwd`` kernel, z gating of ``chunk_scan_ref``).

Shapes: x [B,T,H,P]; dt [B,T,H]; A [H]; B, C [B,T,G,N] (head h reads group h // (H // G)); D [H] or [H,P];
z [B,T,H,P]; dt_bias [H]; state h [B,H,P,N].

Forward, per (b, head):

    pre_t = dt_t + dt_bias                            (bias optional)
    Delta_t = clip(softplus(pre_t) if dt_softplus else pre_t, *dt_limit)       (always clipped, as mamba)
    h_t = exp(Delta_t A) h_{t-1} + Delta_t x_t B_t^T                            ([P,N])
    y_t = h_t C_t + D x_t ;   out_t = y_t * silu(z_t)                            (z optional)

Returns (out [B,T,H,P], h_T [B,H,P,N]).

Backward of L = sum(out * dout) + sum(h_T * dht), dh = dL/dh_t starting at dht:

    dz = dout y silu'(z) ;  dy = dout silu(z)
    dD += dy x ;  dx = D dy ;  dh += dy C^T ;  dC_t = h_t^T dy
    E = exp(Delta A) ;  dZ = E <dh, h_{t-1}>                   (Z = Delta A)
    dA += Delta dZ ;  dDelta = A dZ + <dh, x B^T> ;  dx += Delta dh B ;  dB_t = Delta dh^T x
    dh <- E dh
    dpre = dDelta [lo <= Delta_raw <= hi] (sigmoid(pre) with softplus) ;  ddt = dpre ;  ddt_bias = sum_{b,t} dpre
(dB, dC summed over the heads of a group). The gradients of D, z, dt_bias are None when those are None.
"""
from __future__ import annotations

import numpy as np

__all__ = ["mamba2", "mamba2_bwd"]


def _softplus(x):
    pos = np.real(x) > 0
    return np.where(pos, x + np.log1p(np.exp(-np.where(pos, x, 0))), np.log1p(np.exp(np.where(pos, 0, x))))


def _sigmoid(x):
    return 0.5 * (1 + np.tanh(0.5 * x))


def _delta(dt, dt_bias, dt_softplus, dt_limit):
    """(Delta, dDelta/ddt): the clip's derivative is 0 strictly outside [lo, hi], as mamba's backward."""
    pre = dt if dt_bias is None else dt + dt_bias
    raw, dpre = (_softplus(pre), _sigmoid(pre)) if dt_softplus else (pre, np.ones_like(pre))
    lo, hi = dt_limit
    r = np.real(raw)
    inside = (r >= lo) & (r <= hi)
    return np.where(r < lo, lo, np.where(r > hi, hi, raw)), np.where(inside, dpre, 0.0)


def _prep(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_states, *extra):
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    if H % G:
        raise ValueError(f"H={H} is not a multiple of G={G}")
    arrs = [a for a in (x, dt, A, B, C, D, dt_bias, initial_states, *extra) if a is not None]
    dtype = np.result_type(np.float64, *arrs)
    Be, Ce = np.repeat(B, H // G, axis=2), np.repeat(C, H // G, axis=2)        # [b,T,H,N]
    Dm = np.zeros((H, P), dtype) if D is None else (np.repeat(D[:, None], P, 1) if D.ndim == 1 else D)
    delta, ddelta = _delta(dt, dt_bias, dt_softplus, dt_limit)
    h0 = np.zeros((b, H, P, N), dtype) if initial_states is None else np.array(initial_states, dtype=dtype)
    return dtype, Be, Ce, Dm, delta, ddelta, h0


def _forward(x, A, Be, Ce, Dm, delta, h):
    states, ys = [h], np.zeros(x.shape, np.result_type(h, x, A, Be, Dm, delta))
    for t in range(x.shape[1]):
        E = np.exp(delta[:, t] * A)                                              # [b,H]
        h = E[..., None, None] * h + (delta[:, t, :, None] * x[:, t])[..., None] * Be[:, t, :, None, :]
        ys[:, t] = np.einsum("bhpn,bhn->bhp", h, Ce[:, t]) + Dm * x[:, t]
        states.append(h)
    return ys, states


def mamba2(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, np.inf),
           initial_states=None):
    """Returns (out [B,T,H,P], final state [B,H,P,N])."""
    _, Be, Ce, Dm, delta, _, h0 = _prep(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_states, z)
    y, states = _forward(x, A, Be, Ce, Dm, delta, h0)
    return (y if z is None else y * z * _sigmoid(z)), states[-1]


def mamba2_bwd(x, dt, A, B, C, dout, dht, D=None, z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, np.inf),
               initial_states=None):
    """Gradients of sum(out*dout) + sum(h_T*dht). Returns dict x, dt, A, B, C, D, z, dt_bias, initial_states."""
    dtype, Be, Ce, Dm, delta, ddelta, h0 = _prep(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit,
                                                 initial_states, z, dout, dht)
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    y, states = _forward(x, A, Be, Ce, Dm, delta, h0)
    dz = None
    if z is not None:
        s = _sigmoid(z)
        dz = dout * y * s * (1 + z * (1 - s))
        dout = dout * z * s
    dh = np.zeros(h0.shape, dtype) if dht is None else np.array(dht, dtype=dtype)
    dx, dDelta = np.zeros(x.shape, dtype), np.zeros(dt.shape, dtype)
    dBe, dCe = np.zeros(Be.shape, dtype), np.zeros(Ce.shape, dtype)
    dA, dDm = np.zeros(H, dtype), np.zeros((H, P), dtype)
    for t in range(T - 1, -1, -1):
        dy = dout[:, t]                                                          # [b,H,P]
        dDm += np.sum(dy * x[:, t], axis=0)
        dx[:, t] = Dm * dy
        dh = dh + dy[..., None] * Ce[:, t, :, None, :]
        dCe[:, t] = np.einsum("bhpn,bhp->bhn", states[t + 1], dy)
        E = np.exp(delta[:, t] * A)
        dZ = E * np.einsum("bhpn,bhpn->bh", dh, states[t])
        dA += np.sum(delta[:, t] * dZ, axis=0)
        hB = np.einsum("bhpn,bhn->bhp", dh, Be[:, t])
        dDelta[:, t] = A * dZ + np.sum(hB * x[:, t], axis=-1)
        dx[:, t] += delta[:, t, :, None] * hB
        dBe[:, t] = delta[:, t, :, None] * np.einsum("bhpn,bhp->bhn", dh, x[:, t])
        dh = E[..., None, None] * dh
    dpre = dDelta * ddelta
    fold = lambda a: a.reshape(b, T, G, H // G, N).sum(axis=3)  # noqa: E731
    dD = None if D is None else (dDm.sum(axis=1) if D.ndim == 1 else dDm)
    return {"x": dx, "dt": dpre, "A": dA, "B": fold(dBe), "C": fold(dCe), "D": dD, "z": dz,
            "dt_bias": None if dt_bias is None else dpre.sum(axis=(0, 1)), "initial_states": dh}
