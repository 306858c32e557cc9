"""``recgen.ops.gated_delta_product`` against the handwritten float64 reference (``references.gated_delta_product``):
forward, final state and every gradient (q, k, v, g, beta, the initial state), with cotangents on o and the final
state. ``tests/test_delta_product.py`` runs it on the CPU (backend "mlx", the chunked form); ``tests/gpu`` on the
CUDA kernels (recurrent and chunked backward) and the chunked form with its chunk kernels.

Inputs: fresh random data, log-decays spread down to -20 (one exactly -20), unit-norm keys, β = sigmoid(normal),
a random initial state; rounded to the op's dtype first, and the reference is given exactly what the op saw.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from helpers import l2norm, log_decay, rel_err, sigmoid
from references.gated_delta_product import gated_delta_product as reference
from references.gated_delta_product import gated_delta_product_bwd as reference_bwd

from recgen.ops import GatedDeltaProduct


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    Hk: int
    K: int
    V: int
    n: int          # num_householder
    gated: bool     # g given, else None (the ungated DeltaProduct)
    scale: float | None = None

    @property
    def id(self) -> str:
        return (f"B{self.B}T{self.T}H{self.H}Hk{self.Hk}K{self.K}V{self.V}n{self.n}"
                + ("" if self.gated else "-ungated") + ("" if self.scale is None else f"-scale{self.scale}"))


def inputs(case: Case, rng) -> dict:
    """Float64 inputs (q, k, v, g, beta, initial_state, do, dht) in FLA's layouts, each exactly a float32."""
    B, T, H, Hk, K, V, n = case.B, case.T, case.H, case.Hk, case.K, case.V, case.n
    r32 = lambda a: np.asarray(a, np.float32).astype(np.float64)  # noqa: E731
    g = None
    if case.gated:
        g = log_decay(rng, (B, T, H))
        g.reshape(-1)[rng.integers(g.size)] = -20.0
    return dict(q=r32(rng.standard_normal((B, T, Hk, K))), k=r32(l2norm(rng.standard_normal((B, T * n, Hk, K)))),
                v=r32(rng.standard_normal((B, T * n, H, V))), g=None if g is None else r32(g),
                beta=r32(sigmoid(rng.standard_normal((B, T * n, H)))),
                initial_state=r32(rng.standard_normal((B, H, K, V))),
                do=r32(rng.standard_normal((B, T, H, V))), dht=r32(rng.standard_normal((B, H, K, V))))


def delta_product_errors(case: Case, dtype: str, rng, *, backend: str, backward: str | None = None,
                         compiled: bool = False) -> dict[str, float]:
    """Relative errors of ``GatedDeltaProduct(backend=backend, backward=backward)`` (its VJP under ``mx.compile``
    with ``compiled``) at ``case``, inputs in ``dtype``: "o", "ht0", and "d<name>" for every input and the initial
    state."""
    x = inputs(case, rng)
    op = GatedDeltaProduct(backend=backend, backward=backward)
    names = [nm for nm in ("q", "k", "v", "g", "beta") if x[nm] is not None]
    mdt = getattr(mx, dtype)
    m32 = lambda a: mx.array(np.asarray(a, np.float32))  # noqa: E731
    f64 = lambda a: np.array(a.astype(mx.float32), np.float64)  # noqa: E731

    def f(*args):
        arrays = dict(zip(names, args))
        return op(arrays["q"], arrays["k"], arrays["v"], arrays.get("g"), arrays["beta"], case.n, scale=case.scale,
                  initial_state=args[-1], output_final_state=True)

    def vjp(*args):
        outs, grads = mx.vjp(f, list(args[:-2]), list(args[-2:]))
        return (*outs, *grads)

    prim = [m32(x[nm]).astype(mdt) for nm in names] + [m32(x["initial_state"])]
    cot = [m32(x["do"]).astype(mdt), m32(x["dht"])]
    res = (mx.compile(vjp) if compiled else vjp)(*prim, *cot)
    mx.eval(res)
    o, ht, grads = res[0], res[1], res[2:]
    seen = {nm: f64(a) for nm, a in zip(names, prim)}
    h0, do, dht = f64(prim[-1]), f64(cot[0]), f64(cot[1])
    args = (seen["q"], seen["k"], seen["v"], seen.get("g"), seen["beta"], case.n)
    o_ref, ht_ref = reference(*args, scale=case.scale, initial_state=h0)
    g_ref = reference_bwd(*args, do, dht, scale=case.scale, initial_state=h0)
    errs = {"o": rel_err(f64(o), o_ref), "ht0": rel_err(f64(ht), ht_ref)}
    for nm, gr in zip(names + ["initial_state"], grads):
        errs["d" + nm] = rel_err(f64(gr), g_ref[nm])
    return errs
