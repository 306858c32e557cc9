r"""Pure-MLX chunked (matmul) forms of any recurrence spec: the ``mlx`` backend of ``recgen.ops``.

    o, final_state = recgen.chunked.forward(rec, inputs, scale=..., initial_state=None, chunk_size=64)
    o, final_state = recgen.chunked.naive_loop(rec, inputs, scale=..., initial_state=None)

``inputs`` maps each input name of ``rec`` to an ``mx.array`` in the layouts of
``recgen.shapes`` (FLA's). ``final_state`` is S [B,H,K,V] float32, or (S, z) with a normalizer.
Everything is computed in float32; ``o`` is cast back to the dtype of the first value input.
Both are plain MLX graphs: ``mx.grad`` / ``mx.vjp`` give gradients for every input and
``initial_state``, with cotangents accepted for ``final_state``.

Scalar and key-vector decays (every built-in but the selective scan) use the chunk-parallel form
of ``recgen.chunked.core`` (``chunks_diag`` / ``chunks_rank1``): every per-chunk quantity (the
intra-chunk terms, the WY/UT inverse, the state contributions) for all chunks at once, decay
products from one exp per token and a hierarchy of multiplications (no pairwise exp), and only the
inter-chunk state scan sequential. Its VJP (``_parallel_scan``) recomputes stretches of
``SEG_BYTES``-bounded length in reverse, each differentiated with ``mx.vjp`` and detached before the
next: fwd+bwd memory is one stretch's intermediates plus the stretch boundary states, not T states.
Full (i, j) decays keep the per-chunk loop (``_chunk_scan``). Second-order gradients are not supported.

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


SEG_BYTES = 2**15  # the backward differentiates stretches of about this many bytes of inputs at a time


def _pow2(n: int) -> int:
    c = 1
    while c < n:
        c *= 2
    return c


def _to_chunks(x, n, C):
    """[B,H,T,F] -> [B,H,n,C,F], padding time with zeros."""
    T = x.shape[2]
    if n * C != T:
        x = mx.pad(x, [(0, 0), (0, 0), (0, n * C - T), (0, 0)])
    return x.reshape(x.shape[0], x.shape[1], n, C, x.shape[-1])


def _segment(p, names, scale, sizes, has_z, C, *arrays):
    """Chunk-parallel forward of one stretch of tokens (any length) from state (S, z).

    Returns (o [B,T,H,V], S_end, z_end, chunk-entry states [B,H,n,K,V], z chunk-entry states)."""
    rec = p.rec
    S, z = arrays[0], (arrays[1] if has_z else None)
    chunk = dict(zip(names, arrays[2 if has_z else 1:]))
    T = next(chunk[x.name].shape[1] for x in rec.inputs if x.per_token)
    B, H, K, V = sizes.B, sizes.H, sizes.K, sizes.V
    t = evaluate(p, bind(p, chunk, H), scale, B, H, T, K, V, S.dtype)
    n = -(-T // C)
    ch = lambda x: _to_chunks(x, n, C)  # noqa: E731
    ld = t["logdecay"]
    d = ch(mx.exp(ld if ld.ndim == 4 else ld[..., None]))
    if n * C != T:  # padded tokens: decay 1, every other role 0
        d = mx.where((mx.arange(n * C) < T).reshape(n, C, 1), d, 1.0)
    r, u, w = ch(t["r"]), ch(t["u"]), ch(t["w"])
    nz = zst = None
    if p.fuse_z:  # z rides along as the extra value column of S (same decay and update)
        w = mx.concatenate([w, ch(mx.ones((B, H, T, 1), dtype=S.dtype))], axis=-1)
        ya, st, Sa = core.chunks_diag(mx.concatenate([S, z[..., None]], axis=-1), r, u, w, d)
        ya = ya.reshape(B, H, n * C, V + 1)[:, :, :T]
        y, nz, S, z = ya[..., :V], ya[..., V], Sa[..., :V], Sa[..., V]
        st, zst = st[..., :V], st[..., V]
    else:
        if "a" in t:
            rho = ch(t["rho"][..., None])[..., 0] if p.has_rho else None
            y, st, S = core.chunks_rank1(S, r, u, w, ch(t["a"]), ch(t["b"]), d, rho)
        else:
            y, st, S = core.chunks_diag(S, r, u, w, d)
        y = y.reshape(B, H, n * C, V)[:, :, :T]
        if has_z:
            zl = t["zlogdecay"]
            dz = ch(mx.exp(zl if zl.ndim == 4 else zl[..., None]))
            if n * C != T:
                dz = mx.where((mx.arange(n * C) < T).reshape(n, C, 1), dz, 1.0)
            ones = ch(mx.ones((B, H, T, 1), dtype=S.dtype))
            yz, zst, zs = core.chunks_diag(z[..., None], r, ch(t["zupdate"]), ones, dz)
            nz, z, zst = yz.reshape(B, H, n * C)[:, :, :T], zs[..., 0], zst[..., 0]
    o = _readout(p, rec, t, y, nz)
    return o, S, z, st, zst


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
    has_z = rec.has_normalizer
    names = [x.name for x in rec.inputs]
    state = [S, z] if has_z else [S]
    if p.decay_class == "full":
        C = min(chunk_size, T)
        bounds = list(range(C, T, C))
        fn = partial(_chunk, p, names, float(scale), sizes, has_z)
        scan = _chunk_scan(rec, fn, bounds, has_z)
    else:
        C = _pow2(min(chunk_size, T))  # chunk length only affects speed, not the result
        tok_bytes = 4 * sizes.B * sizes.H * (sizes.K + sizes.V)
        seg = max(1, SEG_BYTES // (tok_bytes * C)) * C
        fn = partial(_segment, p, names, float(scale), sizes, has_z, C)
        scan = _parallel_scan(rec, fn, T, C, seg, has_z)
    outs = scan(*state, *[xs[nm] for nm in names])
    o = outs[0].astype(out_dtype)
    return o, ((outs[1], outs[2]) if has_z else outs[1])


def _parallel_scan(rec, fn, T, C, seg, has_z):
    """The chunk-parallel forward as one custom function. Forward: all chunks at once.
    Backward: the states entering each stretch of ``seg`` tokens (a states-only pass, stretch
    by stretch; lazy evaluation skips the outputs), then stretches in reverse, each recomputed and
    differentiated with ``mx.vjp`` (all its chunks at once) and evaluated before the next, so peak
    memory is one stretch's intermediates plus T/seg states, whatever T."""
    ns = 2 if has_z else 1
    per_token = [x.per_token for x in rec.inputs]
    starts = list(range(0, T, seg))
    multi = len(starts) > 1

    def seg_fn(*a):
        res = fn(*a)
        return list(res[:1 + ns])

    def seg_args(xs, k):
        t0, t1 = starts[k], min(T, starts[k] + seg)
        return [x[:, t0:t1] if tok else x for x, tok in zip(xs, per_token)]

    @mx.custom_function
    def scan(*arrays):
        return tuple(seg_fn(*arrays))

    @scan.vjp
    def scan_vjp(primals, cotangents, outputs):
        cots = [mx.zeros_like(o) if c is None else c for c, o in zip(cotangents, outputs)]
        state, xs = list(primals[:ns]), list(primals[ns:])
        seg_states = [state]
        for k in range(len(starts) - 1):
            state = _detach(fn(*state, *seg_args(xs, k))[1:1 + ns])
            seg_states.append(state)
        dstate = list(cots[1:])
        grads = [[] for _ in xs]
        for k in reversed(range(len(starts))):
            t0, t1 = starts[k], min(T, starts[k] + seg)
            do = cots[0][:, t0:t1] if multi else cots[0]
            prim, cot = [*seg_states[k], *seg_args(xs, k)], [do, *dstate]
            g = mx.vjp(seg_fn, prim, cot)[1]
            if multi:
                g = _detach(g)
            dstate = list(g[:ns])
            for j, gj in enumerate(g[ns:]):
                if per_token[j] or not grads[j]:
                    grads[j].append(gj)
                else:
                    grads[j][0] = grads[j][0] + gj
        out = []
        for j, gl in enumerate(grads):
            out.append(mx.concatenate(gl[::-1], axis=1) if (per_token[j] and len(gl) > 1) else gl[0])
        return (*dstate, *out)

    return scan


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
