"""Mamba-1 selective scan, float64 numpy reference in mamba's own layout
(as ``mamba_ssm.ops.selective_scan_interface.selective_scan_ref``, without z gating,
with time-varying single-group B and C).

Shapes: u, delta [Bt, Dch, L]; A [Dch, N] (real, negative); B, C [Bt, N, L];
D [Dch]; delta_bias [Dch]; state x [Bt, Dch, N].

Forward, per batch element:

    pre_l  = delta_l + delta_bias              (bias optional)
    dt_l   = softplus(pre_l) if delta_softplus else pre_l
    x_l    = exp(dt_l[d] A[d,n]) x_{l-1} + dt_l[d] B_l[n] u_l[d]
    y_l[d] = sum_n x_l[d,n] C_l[n]
    out_l  = y_l + D * u_l                     (D optional)

Returns (out [Bt,Dch,L], last_state x_L [Bt,Dch,N]).

Backward of L = sum(out * dout) + sum(x_L * dht), dx = dL/dx_l starting at dht:

    dD = sum_{b,l} dout u ;  du = D dout
    dx += dout_l[d] C_l[n] ;  dC_l[n] = sum_d dout_l[d] x_l[d,n]
    E = exp(dt A) ;  dZ = dx * x_{l-1} * E            (Z = dt A)
    dA += dt dZ ;  ddt_l[d] = sum_n (dZ A + dx B_l[n] u_l[d])
    dB_l[n] = sum_d dx dt_l[d] u_l[d] ;  du_l[d] += dt_l[d] sum_n dx B_l[n]
    dx <- E * dx                                       (= dL/dx_{l-1})
    ddelta = ddt * sigmoid(pre) (softplus) or ddt ;  ddelta_bias = sum_{b,l} ddelta

The gradients of D / delta_bias are None when those inputs are None. The initial_state
gradient is always returned (w.r.t. the zero state when ``initial_state`` is None).
"""
from __future__ import annotations

import numpy as np

__all__ = ["selective_scan", "selective_scan_bwd", "softplus", "sigmoid"]


def _dtype(*xs):
    return np.result_type(np.float64, *[np.asarray(x) for x in xs if x is not None])


def softplus(x):
    """log(1 + exp(x)), stable for large |Re x|, analytic (complex-safe) on each branch."""
    x = np.asarray(x)
    out = np.empty_like(x, dtype=np.result_type(np.float64, x))
    pos = np.real(x) > 0
    out[pos] = x[pos] + np.log1p(np.exp(-x[pos]))
    out[~pos] = np.log1p(np.exp(x[~pos]))
    return out


def sigmoid(x):
    """1 / (1 + exp(-x)), stable for large |Re x|, analytic on each branch."""
    x = np.asarray(x)
    out = np.empty_like(x, dtype=np.result_type(np.float64, x))
    pos = np.real(x) > 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    e = np.exp(x[~pos])
    out[~pos] = e / (1.0 + e)
    return out


def _dt(delta, delta_bias, delta_softplus):
    pre = delta if delta_bias is None else delta + delta_bias[None, :, None]
    return (softplus(pre) if delta_softplus else pre), pre


def _forward(u, delta, A, B, C, D, delta_bias, delta_softplus, initial_state, dt_type):
    Bt, Dch, L = u.shape
    N = A.shape[1]
    dt, pre = _dt(delta, delta_bias, delta_softplus)
    x = np.zeros((Bt, Dch, N), dt_type) if initial_state is None else np.array(initial_state, dtype=dt_type)
    y = np.zeros((Bt, Dch, L), dt_type)
    states = [x]
    for l in range(L):
        dA = np.exp(dt[:, :, l, None] * A[None])                         # [Bt, Dch, N]
        dBu = dt[:, :, l, None] * B[:, None, :, l] * u[:, :, l, None]     # [Bt, Dch, N]
        x = dA * x + dBu
        y[:, :, l] = np.einsum("bdn,bn->bd", x, C[:, :, l])
        states.append(x)
    out = y if D is None else y + D[None, :, None] * u
    return out, states, dt, pre


def selective_scan(u, delta, A, B, C, D=None, delta_bias=None, delta_softplus=False, initial_state=None):
    """Returns (out [Bt,Dch,L], last_state [Bt,Dch,N])."""
    dt_type = _dtype(u, delta, A, B, C, D, delta_bias, initial_state)
    out, states, _, _ = _forward(u, delta, A, B, C, D, delta_bias, delta_softplus, initial_state, dt_type)
    return out, states[-1]


def selective_scan_bwd(u, delta, A, B, C, dout, dht, D=None, delta_bias=None, delta_softplus=False,
                       initial_state=None):
    """Gradients of sum(out*dout) + sum(last_state*dht).

    Returns dict u, delta, A, B, C, D, delta_bias, initial_state.
    """
    Bt, Dch, L = u.shape
    N = A.shape[1]
    dt_type = _dtype(u, delta, A, B, C, D, delta_bias, initial_state, dout, dht)
    _, states, dt, pre = _forward(u, delta, A, B, C, D, delta_bias, delta_softplus, initial_state, dt_type)
    dout = np.zeros((Bt, Dch, L), dt_type) if dout is None else dout
    dx = np.zeros((Bt, Dch, N), dt_type) if dht is None else np.array(dht, dtype=dt_type)
    du = np.zeros((Bt, Dch, L), dt_type)
    ddt = np.zeros((Bt, Dch, L), dt_type)
    dA = np.zeros((Dch, N), dt_type)
    dB = np.zeros((Bt, N, L), dt_type)
    dC = np.zeros((Bt, N, L), dt_type)
    dD = None
    if D is not None:
        dD = np.sum(dout * u, axis=(0, 2))
        du = du + D[None, :, None] * dout
    for l in range(L - 1, -1, -1):
        x_l, x_prev = states[l + 1], states[l]
        dt_l = dt[:, :, l, None]                                          # [Bt, Dch, 1]
        E = np.exp(dt_l * A[None])
        # y_l = x_l C_l
        dx = dx + dout[:, :, l, None] * C[:, None, :, l]
        dC[:, :, l] = np.einsum("bd,bdn->bn", dout[:, :, l], x_l)
        # x_l = E x_{l-1} + dt B u
        dZ = dx * x_prev * E
        dA = dA + np.sum(dt_l * dZ, axis=0)
        ddt[:, :, l] = np.sum(dZ * A[None] + dx * B[:, None, :, l] * u[:, :, l, None], axis=-1)
        dB[:, :, l] = np.einsum("bdn,bd->bn", dx, dt[:, :, l] * u[:, :, l])
        du[:, :, l] = du[:, :, l] + dt[:, :, l] * np.einsum("bdn,bn->bd", dx, B[:, :, l])
        dx = E * dx
    ddelta = ddt * sigmoid(pre) if delta_softplus else ddt
    ddelta_bias = None if delta_bias is None else np.sum(ddelta, axis=(0, 2))
    return {
        "u": du,
        "delta": ddelta,
        "A": dA,
        "B": dB,
        "C": dC,
        "D": dD,
        "delta_bias": ddelta_bias,
        "initial_state": dx,
    }
