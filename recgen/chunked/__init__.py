r"""Pure-MLX chunked (matmul) forms of any recurrence spec: the ``mlx`` backend of ``recgen.ops``.

    o, final_state = recgen.chunked.forward(rec, inputs, scale=..., initial_state=None, chunk_size=64)
    o, final_state = recgen.chunked.naive_loop(rec, inputs, scale=..., initial_state=None)

``inputs`` maps each input name of ``rec`` to an ``mx.array`` in the layouts of
``recgen.shapes`` (FLA's). ``final_state`` is S [B,H,K,V] float32, or (S, z) with a normalizer.
Everything is computed in float32; ``o`` is cast back to the dtype of the first value input.
Both are plain MLX graphs: ``mx.grad`` / ``mx.vjp`` give gradients for every input and
``initial_state``, with cotangents accepted for ``final_state``.

The forward is a Python loop over chunks of ``chunk_size`` tokens inside one ``mx.custom_function``
whose VJP recomputes the chunk boundary states, then differentiates chunk by chunk in reverse
(``mx.vjp`` per chunk, evaluated and detached before the next): fwd+bwd memory is one chunk's
intermediates plus T/C boundary states, not T states. Second-order gradients are not supported.
The per-chunk math is in ``recgen.chunked.core`` (formulas there).

Supported: decay with no free index (scalar), key-indexed (i), value-indexed (j) or full (i, j);
a rank-1 transition with a scalar or key-indexed decay; a normalizer state with a scalar or
key-indexed decay; feature maps (sympow degree 2); a skip. Not supported (NotImplementedError,
naming the term): a rank-1 transition together with a value-indexed or full (i, j) decay.
Decays that are not written as exp(e) enter through log(D) and must be positive.
"""
from __future__ import annotations

from functools import partial

import mlx.core as mx

from .. import ir
from ..shapes import InputError, check_state, infer_sizes
from . import core
from .terms import bind, evaluate, plan

__all__ = ["forward", "naive_loop", "supported"]



def supported(rec: ir.Recurrence) -> None:
    """Raise NotImplementedError naming the term when ``rec`` has no chunked form here."""
    p = plan(rec)
    if rec.step.transition is not None and p.decay_class == "full":
        raise NotImplementedError(
            f"{rec.name}: the chunked MLX form does not support a rank-1 transition (transition a = "
            f"{rec.step.transition.a}, b = {rec.step.transition.b}) together with a value-indexed decay "
            f"D = {rec.step.decay} (free indices {rec.free_indices(rec.step.decay)}); use naive_loop or a kernel backend")
    if p.zdecay_class == "full":  # validate() forbids it; guard anyway
        raise NotImplementedError(f"{rec.name}: normalizer decay {rec.step.normalizer.decay} is value-indexed")


def _out_dtype(rec, inputs):
    for x in rec.inputs:
        if x.kind == "value":
            return inputs[x.name].dtype
    return mx.float32


def _prepare(rec, inputs, initial_state, dtype=mx.float32):
    for name, a in inputs.items():
        if not isinstance(a, mx.array):
            raise InputError(f"argument {name!r}: expected an mx.array, got {type(a).__name__}")
    sizes = infer_sizes(rec, {k: tuple(v.shape) for k, v in inputs.items()})
    xs = {k: v.astype(dtype) for k, v in inputs.items()}
    if initial_state is None:
        S = mx.zeros(sizes.state_shape, dtype=dtype)
        z = mx.zeros(sizes.state_shape[:3], dtype=dtype) if rec.has_normalizer else None
    else:
        check_state(rec, sizes, initial_state)
        if rec.has_normalizer:
            S, z = initial_state
            S, z = S.astype(dtype), z.astype(dtype)
        else:
            S, z = initial_state.astype(dtype), None
    return sizes, xs, S, z


def _finish(rec, ys, S, z, out_dtype, sizes, dtype=mx.float32):
    if ys:
        o = ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)
    else:
        o = mx.zeros((sizes.B, 0, sizes.H, sizes.V), dtype=dtype)
    return o.astype(out_dtype), ((S, z) if rec.has_normalizer else S)


def _time_splitter(bounds):
    """Split along T with a VJP that is one concatenation (MLX's own split/slice VJPs scatter
    each piece's cotangent into a full-size zero array: O(T²/C) memory and time)."""

    @mx.custom_function
    def split(x):
        return tuple(mx.split(x, bounds, axis=1))

    @split.vjp
    def split_vjp(primals, cotangents, outputs):
        cots = [mx.zeros_like(o) if c is None else c for c, o in zip(cotangents, outputs)]
        return (mx.concatenate(cots, axis=1),)

    return split


def _split_time(rec, xs, bounds):
    """Per-token inputs split along T once; parameters repeated per chunk."""
    n = len(bounds) + 1
    split = _time_splitter(bounds) if bounds else None
    parts = {}
    for x in rec.inputs:
        if x.per_token:
            parts[x.name] = list(split(xs[x.name])) if bounds else [xs[x.name]]
        else:
            parts[x.name] = [xs[x.name]] * n
    return parts


def _readout(p, rec, t, y, n):
    """o = y / N(n) + skip, [B,H,C,V] -> [B,C,H,V]."""
    if rec.has_normalizer:
        y = y / p.N(n)[..., None]
    if "skip" in t:
        y = y + t["skip"]
    return y.transpose(0, 2, 1, 3)


def _chunk(p, names, scale, sizes, has_z, *arrays):
    """One chunk: (S[, z], *inputs in rec order) -> (o [B,C,H,V], S_new[, z_new])."""
    rec = p.rec
    S = arrays[0]
    z = arrays[1] if has_z else None
    chunk = dict(zip(names, arrays[2 if has_z else 1:]))
    C = next(chunk[x.name].shape[1] for x in rec.inputs if x.per_token)
    B, H, K, V = sizes.B, sizes.H, sizes.K, sizes.V
    t = evaluate(p, bind(p, chunk, H), scale, B, H, C, K, V, S.dtype)
    n = None
    if p.fuse_z:  # z rides along as the extra value column of S (same decay and update)
        ones = mx.ones((B, H, C, 1), dtype=S.dtype)
        ta = dict(t, w=mx.concatenate([t["w"], ones], axis=-1))
        Sa = mx.concatenate([S, z[..., None]], axis=-1)
        G = mx.cumsum(t["logdecay"], axis=2)
        ya, Sa = core.chunk_diag(Sa, ta, p.decay_class, G)
        y, n, S, z = ya[..., :V], ya[..., V], Sa[..., :V], Sa[..., V]
    else:
        if p.decay_class == "full":
            y, S = core.chunk_full(S, t, t["logdecay"])
        else:
            y, S = core.chunk_diag(S, t, p.decay_class, mx.cumsum(t["logdecay"], axis=2))
        if has_z:
            tz = {"r": t["r"], "u": t["zupdate"], "w": mx.ones((B, H, C, 1), dtype=S.dtype)}
            yz, zs = core.chunk_diag(z[..., None], tz, p.zdecay_class, mx.cumsum(t["zlogdecay"], axis=2))
            n, z = yz[..., 0], zs[..., 0]
    o = _readout(p, rec, t, y, n)
    return (o, S, z) if has_z else (o, S)


def forward(rec: ir.Recurrence, inputs: dict, *, scale: float, initial_state=None, chunk_size: int = 64,
            compute_dtype=None):
    """Chunked forward of ``rec``: returns (o [B,T,H,V], final_state); see the module docstring.

    ``compute_dtype`` (default float32) exists for verification: ``mx.float64`` on the CPU runs the
    same chunked algebra in double precision, so tests can separate the algorithm's exactness from
    float32 rounding amplified by an ill-conditioned spec (power retention's ratio readout).
    The final state and ``o`` then stay float64."""
    dtype = compute_dtype or mx.float32
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise InputError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    supported(rec)
    p = plan(rec)
    sizes, xs, S, z = _prepare(rec, inputs, initial_state, dtype)
    out_dtype = dtype if compute_dtype is not None else _out_dtype(rec, inputs)
    T = sizes.T
    if T == 0 or sizes.B == 0:
        return _finish(rec, [], S, z, out_dtype, sizes, dtype)
    C = min(chunk_size, T)
    bounds = list(range(C, T, C))
    has_z = rec.has_normalizer
    names = [x.name for x in rec.inputs]
    fn = partial(_chunk, p, names, float(scale), sizes, has_z)
    scan = _chunk_scan(rec, fn, bounds, has_z)
    state = [S, z] if has_z else [S]
    outs = scan(*state, *[xs[nm] for nm in names])
    o = outs[0].astype(out_dtype)
    return o, ((outs[1], outs[2]) if has_z else outs[1])


def _detach(arrays):
    """Evaluate and cut from the graph. Inside a gradient transformation ``mx.eval`` keeps the
    graph (and every intermediate buffer) of a traced array alive; a copy through host memory
    does not. The backward is therefore not itself differentiable (no second-order gradients)."""
    import numpy as np

    arrays = list(arrays)
    mx.eval(arrays)
    return [mx.array(np.asarray(a), dtype=a.dtype) for a in arrays]


def _chunk_scan(rec, fn, bounds, has_z):
    """The loop over chunks as one custom function whose VJP recomputes chunk by chunk.

    Forward: chunk after chunk, nothing kept but the outputs. Backward: one forward pass to
    recover the T/C boundary states, then chunks in reverse, each differentiated with ``mx.vjp``
    and evaluated before the next, so peak memory is one chunk's intermediates plus the boundary
    states, whatever T (gradient checkpointing with an explicit schedule; ``mx.checkpoint`` alone
    leaves the order to MLX's lazy evaluator, which measured no saving here).
    """
    ns = 2 if has_z else 1
    per_token = [x.per_token for x in rec.inputs]
    n = len(bounds) + 1

    def chunks(xs):
        out = []
        for x, tok in zip(xs, per_token):
            out.append(mx.split(x, bounds, axis=1) if (tok and bounds) else [x] * n)
        return [[col[c] for col in out] for c in range(n)]

    def run(state, xs, keep):
        ys, states = [], []
        for args in chunks(xs):
            if keep:
                states.append(state)
            res = fn(*state, *args)
            ys.append(res[0])
            state = _detach(res[1:]) if keep else list(res[1:])
        return ys, state, states

    @mx.custom_function
    def scan(*arrays):
        ys, state, _ = run(list(arrays[:ns]), list(arrays[ns:]), keep=False)
        o = ys[0] if n == 1 else mx.concatenate(ys, axis=1)
        return (o, *state)

    @scan.vjp
    def scan_vjp(primals, cotangents, outputs):
        cots = [mx.zeros_like(o) if c is None else c for c, o in zip(cotangents, outputs)]
        state0, xs = list(primals[:ns]), list(primals[ns:])
        _, _, states = run(state0, xs, keep=True)
        dos = mx.split(cots[0], bounds, axis=1) if bounds else [cots[0]]
        dstate = list(cots[1:])
        grads = [[] for _ in xs]
        for c, args in reversed(list(enumerate(chunks(xs)))):
            _, g = mx.vjp(fn, [*states[c], *args], [dos[c], *dstate])
            g = _detach(g)
            dstate = list(g[:ns])
            for k, gk in enumerate(g[ns:]):
                if per_token[k] or not grads[k]:
                    grads[k].append(gk)
                else:
                    grads[k][0] = grads[k][0] + gk
        out = []
        for k, gl in enumerate(grads):
            out.append(mx.concatenate(gl[::-1], axis=1) if (per_token[k] and len(gl) > 1) else gl[0])
        return (*dstate, *out)

    return scan


def naive_loop(rec: ir.Recurrence, inputs: dict, *, scale: float, initial_state=None):
    """The per-token MLX loop of the same spec (the benchmark baseline; memory grows with T)."""
    p = plan(rec)
    sizes, xs, S, z = _prepare(rec, inputs, initial_state)
    out_dtype = _out_dtype(rec, inputs)
    T, B, H, K, V = sizes.T, sizes.B, sizes.H, sizes.K, sizes.V
    parts = _split_time(rec, xs, list(range(1, T)))
    ys = []
    for step in range(T):
        chunk = {nm: parts[nm][step] for nm in parts}
        t = evaluate(p, bind(p, chunk, H), float(scale), B, H, 1, K, V, S.dtype)
        ld = t["logdecay"]
        if p.decay_class == "scalar":
            D = mx.exp(ld)[..., None]                     # [B,H,1,1]
        elif p.decay_class == "key":
            D = mx.exp(ld)[:, :, 0, :, None]              # [B,H,K,1]
        else:
            D = mx.exp(ld)[:, :, 0]                       # [B,H,K|1,V]
        P = D * S
        if "a" in t:
            bP = (t["b"] @ P)                             # [B,H,1,V]
            P = P + t["a"].swapaxes(-1, -2) * bP
        S = P + t["u"].swapaxes(-1, -2) * t["w"]         # u [B,H,K,1] * w [B,H,1,V]
        y = t["r"] @ S                                    # [B,H,1,V]
        n = None
        if rec.has_normalizer:
            zl = t["zlogdecay"]
            d = mx.exp(zl)[..., 0][..., None] if p.zdecay_class == "scalar" else mx.exp(zl)[:, :, 0]
            z = d * z + t["zupdate"][:, :, 0]
            n = (t["r"][:, :, 0] * z).sum(-1)[..., None]  # [B,H,1]
        ys.append(_readout(p, rec, t, y, n))
    return _finish(rec, ys, S, z, out_dtype, sizes)
