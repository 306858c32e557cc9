"""The chunked form (the ``mlx`` backend) of any spec against the float64 reference, on given inputs:
forward output, final state, and the gradient of every input and of the initial state under random
cotangents on both ``o`` and the final state. Returns {quantity: relative error}; NaN or Inf in the chunked
result is an error of +inf (it never passes a tolerance)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from recgen import chunked
from recgen.math import reference


def parts(state) -> list:
    return list(state) if isinstance(state, (tuple, list)) else [state]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def compare(rec, xs: dict, h0, do, dht, scale: float, *, dtype=mx.float32, chunk_size=None, ref=None) -> dict:
    """``xs``, ``h0``, ``do``, ``dht``: float64 numpy, already representable in ``dtype`` (the reference sees the
    same numbers). ``h0`` may be None. ``ref``: (o, state, grads) of the reference, if already computed."""
    norm = rec.has_normalizer
    if ref is None:
        o_r, s_r = reference.run(rec, initial_state=h0, scale=scale, **xs)
        g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    else:
        o_r, s_r, g_r = ref
    names = list(xs)
    h0s = [] if h0 is None else parts(h0)
    primals = [mx.array(xs[n], dtype=dtype) for n in names] + [mx.array(s, dtype=dtype) for s in h0s]
    cots = [mx.array(do, dtype=dtype)] + [mx.array(s, dtype=dtype) for s in parts(dht)]
    kw = {"compute_dtype": mx.float64} if dtype == mx.float64 else {}

    def fun(*args):
        st = args[len(names):]
        st = None if not st else (tuple(st) if norm else st[0])
        o, s = chunked.forward(rec, dict(zip(names, args[:len(names)])), scale=scale, initial_state=st,
                               chunk_size=chunk_size, **kw)
        return [o, *parts(s)]

    outs, grads = mx.vjp(fun, primals, cots)
    f32 = lambda a: np.array(a.astype(mx.float64 if dtype == mx.float64 else mx.float32))  # noqa: E731
    res = {"o": rel(f32(outs[0]), o_r)}
    for i, s in enumerate(parts(s_r)):
        res[f"state{i}"] = rel(f32(outs[1 + i]), s)
    for n, g in zip(names, grads):
        res["d" + n] = rel(f32(g), g_r[n])
    if h0 is not None:
        for i, g in enumerate(parts(g_r["initial_state"])):
            res[f"dh0_{i}"] = rel(f32(grads[len(names) + i]), g)
    return res


def bad(res: dict, fwd_tol: float, grad_tol: float) -> dict:
    """The entries of ``res`` above their tolerance (forward: o and states; everything else: gradients)."""
    return {k: v for k, v in res.items()
            if not v <= (fwd_tol if k == "o" or k.startswith("state") else grad_tol)}
