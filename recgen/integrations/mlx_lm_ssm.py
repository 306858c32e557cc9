"""mlx-lm's Mamba-2 state-space update (``mlx_lm.models.ssm.ssm_update``) on recgen's ``simple_gla`` op.

mlx-lm's Mamba-2 family (mamba2, nemotron_h, falcon_h1, granitemoehybrid, plamo2) routes its scan through
``ssm_update(hidden_states, A_log, B, C, D, dt, dt_bias, state=None, time_step_limit=(0.001, 100.0),
mask=None, lengths=None)``: per head a scalar decay, so the SSD is simple GLA with

    Δ_t = clip(softplus(dt_t + dt_bias), *time_step_limit)      (float32)
    log-decay g_t = Δ_t · A,  A = -exp(A_log)
    S_t = e^{g_t} S_{t-1} + B_t (Δ_t x_t)ᵀ,  y_t = S_tᵀ C_t + D x_t

(keys B, C ``[b,l,G,N]`` shared by the H/G heads of a group, values x ``[b,l,H,P]``). mlx-lm's state is
``[b,H,P,N]`` (recgen's ``[b,H,N,P]``: a swap of the last two axes), float32 when None. ``mask`` ``[b,l]`` and
``lengths`` ``[b]`` (right padding: the tokens at and after ``lengths`` are padding) mark tokens that leave
the state unchanged (log-decay 0, no update). mlx-lm's ``ssm_attn`` agrees on every real token, and on the
state when given ``mask`` and ``lengths`` together (as mamba2, falcon_h1, granitemoehybrid and plamo2 pass
them; nemotron_h passes ``mask`` alone); given right padding through only one of them its state is not that
of the last real token (``lengths`` alone lets the padding's updates in, ``mask`` alone drops the updates of
a 256-token block ending in padding), nor at ``lengths == 0``. Here the state is always that after the last real token.
"""
from __future__ import annotations

from ..spec.layouts import InputError
from .calls import call_in_layout, check_floating_arrays, shape_error


def check_inputs(x, A_log, B, C, D, dt, dt_bias, state, mask, lengths):
    """Shapes and kinds from metadata only (no host sync)."""
    import mlx.core as mx

    named = dict(hidden_states=x, A_log=A_log, B=B, C=C, D=D, dt=dt, dt_bias=dt_bias)
    if state is not None:
        named["state"] = state
    check_floating_arrays(named)
    if x.ndim != 4:
        raise shape_error("hidden_states", x.shape, "[b,l,H,P]")
    b, l, H, P = x.shape
    if B.ndim != 4 or tuple(B.shape[:2]) != (b, l) or H % B.shape[2]:
        raise shape_error("B", B.shape, f"[b,l,G,N] with b={b}, l={l} and G dividing H={H}")
    N = B.shape[3]
    if tuple(C.shape) != tuple(B.shape):
        raise shape_error("C", C.shape, f"the shape of B [b,l,G,N] = {tuple(B.shape)}")
    if tuple(dt.shape) != (b, l, H):
        raise shape_error("dt", dt.shape, f"[b,l,H] = {(b, l, H)}")
    for name, a in (("A_log", A_log), ("D", D), ("dt_bias", dt_bias)):
        if a.size != H and a.size != 1:
            raise shape_error(name, a.shape, f"[H] = ({H},)")
    if state is not None and tuple(state.shape) != (b, H, P, N):
        raise shape_error("state", state.shape, f"[b,H,P,N] = {(b, H, P, N)}")
    for name, a, shape in (("mask", mask, (b, l)), ("lengths", lengths, (b,))):
        if a is None:
            continue
        if not isinstance(a, mx.array):
            raise InputError(f"argument {name!r}: expected an mx.array, got {type(a).__name__}")
        if tuple(a.shape) != shape:
            raise shape_error(name, a.shape, f"{list(shape)}")


def ssm_update(hidden_states, A_log, B, C, D, dt, dt_bias, state=None, time_step_limit=(0.001, 100.0),
               mask=None, lengths=None):
    """mlx-lm's ``ssm_update`` on recgen's ops; returns ``(y [b,l,H,P], state [b,H,P,N])``."""
    import mlx.core as mx
    import mlx.nn as nn

    from .. import ops

    x = hidden_states
    check_inputs(x, A_log, B, C, D, dt, dt_bias, state, mask, lengths)
    b, l, H, P = x.shape
    N = B.shape[-1]
    delta = mx.clip(nn.softplus(dt.astype(mx.float32) + dt_bias), time_step_limit[0], time_step_limit[1])
    A = -mx.exp(A_log.reshape(-1)).astype(delta.dtype)
    lg = delta * A
    u = delta[..., None] * x
    keep = None if mask is None else mask.astype(mx.bool_)
    if lengths is not None:
        real = mx.arange(l)[None, :] < lengths[:, None]
        keep = real if keep is None else keep & real
    if keep is not None:
        lg = mx.where(keep[..., None], lg, 0.0)
        u = mx.where(keep[..., None, None], u, 0.0)
    h0 = mx.zeros((b, H, N, P), dtype=mx.float32) if state is None else state.swapaxes(-1, -2)
    y, ht = call_in_layout(ops.simple_gla, l, H, C, B, u, lg, scale=1.0, initial_state=h0, output_final_state=True)
    y = y.astype(x.dtype) + x * D.reshape(1, 1, -1, 1)
    return y, ht.swapaxes(-1, -2).astype(mx.float32 if state is None else state.dtype)
