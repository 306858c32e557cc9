"""mlx-lm's RWKV-7 WKV (``mlx_lm.models.rwkv7.Rwkv7TimeMixing._wkv7``) on recgen's ``rwkv7`` op.

mlx-lm's time-mixing layer calls ``self._wkv7(r, w, k, v, a, b, state)`` with r, w, k, v, a, b ``[B,T,H,D]`` and its
state ``[B,H,Dv,Dk]`` (zeros of r's type when None); one step is

    S_t = S_{t-1} (diag(w_t) + a_t b_tᵀ) + v_t k_tᵀ,   y_t = S_t r_t

with w the decay itself (the model's exp(-0.606531·σ(·)), in (0.54, 1)). recgen's state ``[B,H,K,V]`` is the
transpose, where this is FLA's ``rwkv7`` order S_t = diag(w_t) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ with the same
a and b, log-decay log w (taken in float32 from the w the model passes, so the decay is the one its own loop
multiplies by; w must be positive) and scale 1. Returns ``(y [B,T,H,Dv], state [B,H,Dv,Dk])`` in r's type and the
state's (r's when None), as mlx-lm's Metal kernel does. Lazy, ``mx.compile``-safe, differentiable w.r.t. every
input and the state.
"""
from __future__ import annotations

from ..spec.layouts import InputError
from .calls import call_in_layout, check_floating_arrays


def check_inputs(r, w, k, v, a, b, state):
    """Shapes and kinds from metadata only (no host sync)."""
    named = dict(r=r, w=w, k=k, v=v, a=a, b=b)
    if state is not None:
        named["state"] = state
    check_floating_arrays(named)
    if r.ndim != 4:
        raise InputError(f"argument 'r': expected [B,T,H,Dk], got shape {tuple(r.shape)}")
    for name in ("w", "k", "a", "b"):
        if tuple(named[name].shape) != tuple(r.shape):
            raise InputError(f"argument {name!r}: expected the shape of r [B,T,H,Dk] = {tuple(r.shape)}, got "
                             f"shape {tuple(named[name].shape)}")
    B, T, H, Dk = r.shape
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise InputError(f"argument 'v': expected [B,T,H,Dv] with (B, T, H) = {(B, T, H)}, got shape {tuple(v.shape)}")
    if state is not None and tuple(state.shape) != (B, H, v.shape[3], Dk):
        raise InputError(f"argument 'state': expected [B,H,Dv,Dk] = {(B, H, v.shape[3], Dk)}, got shape "
                         f"{tuple(state.shape)}")


def wkv7(self, r, w, k, v, a, b, state):
    """A drop-in for the method ``Rwkv7TimeMixing._wkv7`` (``self`` is unused): see the module docstring."""
    import mlx.core as mx

    from .. import ops

    del self
    check_inputs(r, w, k, v, a, b, state)
    B, T, H, Dk = r.shape
    Dv = v.shape[3]
    state_dtype = r.dtype if state is None else state.dtype
    h0 = mx.zeros((B, H, Dk, Dv), dtype=mx.float32) if state is None else state.swapaxes(-1, -2)
    lw = mx.log(w.astype(mx.float32))
    y, ht = call_in_layout(ops.rwkv7, T, H, r, lw, k, v, a, b, scale=1.0, initial_state=h0, output_final_state=True)
    return y.astype(r.dtype), ht.swapaxes(-1, -2).astype(state_dtype)
