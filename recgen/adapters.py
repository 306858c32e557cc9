"""Adapters from other projects' conventions to recgen's built-in ops (FLA layouts inside).

- ``selective_scan_fn``: mamba's ``selective_scan_fn`` arguments and layouts (u, delta ``[B,D,L]``,
  A ``[D,N]``, B and C ``[B,N,L]`` or ``[B,G,N,L]``, state ``[B,D,N]``). Channel d belongs to group
  d // (D/G), which recgen runs as value head g with D/G value channels and B, C as its keys.
- ``mlxlm_gated_delta_update``: mlx-lm's gated delta convention: linear decay ``g`` (recgen takes
  log g), q pre-scaled (scale = 1), state ``[B,H,V,K]`` (recgen's is ``[B,H,K,V]``).
"""
from __future__ import annotations

from .op_args import check_array
from .spec.layouts import InputError


def _check(**arrays):
    """Each given array argument is an mx.array of a float dtype (named in the error), before it is reshaped."""
    for name, a in arrays.items():
        if a is not None:
            check_array(name, a)


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, initial_state=None, backend=None):
    """Mamba-1 selective scan in mamba's layout; returns ``out`` or ``(out, last_state)``."""
    import mlx.core as mx

    from . import ops

    _check(u=u, delta=delta, A=A, B=B, C=C, D=D, delta_bias=delta_bias, initial_state=initial_state)
    if z is not None:
        raise InputError("argument 'z': the silu(z) output gate is not part of recgen's selective scan; "
                         "apply it to the output")
    if u.ndim != 3 or delta.shape != u.shape:
        raise InputError(f"arguments 'u', 'delta': expected equal shapes [B,D,L], got {u.shape} and {delta.shape}")
    Bt, Dch, L = u.shape
    if A.ndim != 2 or A.shape[0] != Dch:
        raise InputError(f"argument 'A': expected [D,N] = [{Dch},N], got {A.shape}")
    N = A.shape[1]
    Bg, Cg = (B[:, None] if B.ndim == 3 else B), (C[:, None] if C.ndim == 3 else C)
    G = Bg.shape[1]
    if Bg.shape != (Bt, G, N, L) or Cg.shape != Bg.shape or Dch % G:
        raise InputError(f"arguments 'B', 'C': expected [B,N,L] or [B,G,N,L] with G dividing D={Dch}, "
                         f"got {B.shape} and {C.shape}")
    V = Dch // G

    def heads(x):  # [B,D,L] -> [B,L,G,V]
        return x.transpose(0, 2, 1).reshape(Bt, L, G, V)

    x, dt = heads(u), heads(delta)
    A_ir = A.reshape(G, V, N).transpose(0, 2, 1)                       # [G,N,V]
    D_ir = (D if D is not None else mx.zeros((Dch,), dtype=u.dtype)).reshape(G, V)
    keys = lambda m: m.transpose(0, 3, 1, 2)                            # noqa: E731  [B,G,N,L] -> [B,L,G,N]
    h0 = None
    if initial_state is not None:
        h0 = initial_state.reshape(Bt, G, V, N).transpose(0, 1, 3, 2)   # [B,D,N] -> [B,G,N,V]
    if delta_softplus:
        bias = (delta_bias if delta_bias is not None else mx.zeros((Dch,), dtype=u.dtype)).reshape(G, V)
        o, ht = ops.selective_scan(x, dt, A_ir, keys(Bg), keys(Cg), D_ir, bias, initial_state=h0,
                                   output_final_state=True, backend=backend)
    else:
        if delta_bias is not None:
            dt = dt + delta_bias.reshape(G, V)
        o, ht = ops.selective_scan_linear_dt(x, dt, A_ir, keys(Bg), keys(Cg), D_ir, initial_state=h0,
                                             output_final_state=True, backend=backend)
    out = o.reshape(Bt, L, Dch).transpose(0, 2, 1)
    if not return_last_state:
        return out
    return out, ht.transpose(0, 1, 3, 2).reshape(Bt, Dch, N)


def mlxlm_gated_delta_update(q, k, v, g, beta, state=None, backend=None):
    """mlx-lm's convention: g is the linear decay in (0, 1], q already scaled, state ``[B,H,V,K]``.
    Returns ``(o, new_state)`` in that convention."""
    import mlx.core as mx

    from . import ops

    _check(q=q, k=k, v=v, g=g, beta=beta, state=state)
    h0 = None if state is None else state.swapaxes(-1, -2)
    o, ht = ops.gated_delta_net(q, k, v, mx.log(g), beta, scale=1.0, initial_state=h0, output_final_state=True,
                                backend=backend)
    return o, ht.swapaxes(-1, -2)
