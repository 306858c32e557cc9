"""Power retention's chunked form through the kernel identity (``recgen.chunked.features``) on the GPU at the width
models use, d = 64: four tiles of the expanded space (2560 rows), chunks of 256 (the GPU default) with a partial
last one, GQA, K != V, an initial state and cotangents on both states; forward, final state and every gradient
against the float64 reference, float32 (TF32 off, tests/gpu/conftest.py) and bfloat16."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from op_check import TOL

from recgen import ops, specs
from recgen.math import reference
from recgen.spec.layouts import Sizes
from recgen.testing import kernel_inputs, reachable_state, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.xdist_group("power_retention_d64")
@pytest.mark.parametrize("form", ["phi_formed", "phi_in_kernels", "jac_by_rows", "decayed_scores", "mix",
                                  "states_formed_again", "decay_factor_kernels"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_power_retention_at_d64_matches_the_reference(dtype, form):
    """φ's rows formed by the sympow kernels, or read by the feature product kernels (``Tuning.feature_kernels``, the
    default on CUDA; on fragments: TF32 operands, so float32 takes bfloat16's tolerances there), or the in-chunk
    scores and their gradients from the decayed-scores kernels (``Tuning.decayed_scores``) on formed rows; the
    kernels with the gradient through φ by rows (``Tuning.feature_jac_rows``); the kernels with the backward's
    products over chunks in one (``Tuning.feature_mix``), with the chunks' states kept from the forward (the
    default, ``Tuning.feature_keep_states``) or formed again."""
    from recgen import tuning

    fused = form in ("phi_in_kernels", "jac_by_rows", "mix", "states_formed_again", "decay_factor_kernels")
    switch = {"phi_formed": tuning.override(feature_kernels=False),
              "phi_in_kernels": tuning.override(feature_kernels=True, mma_scan=True),
              "jac_by_rows": tuning.override(feature_kernels=True, mma_scan=True, feature_jac_rows=True),
              "decayed_scores": tuning.override(decayed_scores=True, feature_kernels=False),
              "mix": tuning.override(feature_kernels=True, mma_scan=True, feature_mix=True),
              "states_formed_again": tuning.override(feature_kernels=True, mma_scan=True, feature_keep_states=False),
              "decay_factor_kernels": tuning.override(feature_kernels=True, mma_scan=True, decay_factor_kernels=True)}[form]
    with switch:
        _check_at_d64(dtype, TOL["bfloat16"] if fused else None)


def _check_at_d64(dtype, tf32_tol):
    rec = specs.power_retention
    sizes = Sizes(B=1, T=300, H=4, Hk=2, Kin=64, K=2080, V=24)
    rng = np.random.default_rng(7)
    xs, _, do, dht, scale = kernel_inputs(rec, sizes, rng)
    h0 = reachable_state(sizes, rng)
    mdt = getattr(mx, dtype)
    names = list(xs)
    prim = [mx.array(xs[n], mx.float32).astype(mdt) for n in names] + [mx.array(s, mx.float32) for s in h0]
    cots = [mx.array(do, mx.float32).astype(mdt)] + [mx.array(s, mx.float32) for s in dht]

    def f(*a):
        o, (S, z) = ops.power_retention(*a[:4], initial_state=(a[4], a[5]), output_final_state=True, backend="mlx")
        return o, S, z

    outs, grads = mx.vjp(f, prim, cots)
    seen = {n: np.array(a.astype(mx.float32), np.float64) for n, a in zip(names, prim)}
    cot64 = [np.array(c.astype(mx.float32), np.float64) for c in cots]
    o_r, s_r = reference.run(rec, initial_state=h0, scale=scale, **seen)
    g_r = reference.grad(rec, do=cot64[0], dht=tuple(cot64[1:]), initial_state=h0, scale=scale, **seen)
    ftol, gtol = tf32_tol or TOL[dtype]
    errs = {k: rel_err(np.array(a.astype(mx.float32)), b) for k, a, b in zip(("o", "S", "z"), outs, (o_r, *s_r))}
    errs |= {"d" + n: rel_err(np.array(g.astype(mx.float32)), r)
             for n, g, r in zip(names + ["S0", "z0"], grads, [g_r[n] for n in names] + list(g_r["initial_state"]))}
    bad = {k: v for k, v in errs.items() if not v <= (gtol if k.startswith("d") else ftol)}
    assert not bad, (bad, errs)


@pytest.mark.xdist_group("power_retention_d64")
def test_power_retention_decode_on_the_feature_decode_kernel():
    """A decode step through the op with ``Tuning.feature_decode`` (the kernel split over φ's rows, its role math and
    readout compiled around it): output, state and gradients against the float64 reference, float32."""
    from recgen import tuning

    rec = specs.power_retention
    sizes = Sizes(B=2, T=1, H=4, Hk=2, Kin=64, K=2080, V=24)
    rng = np.random.default_rng(11)
    xs, _, do, dht, scale = kernel_inputs(rec, sizes, rng)
    h0 = reachable_state(sizes, rng)
    names = list(xs)
    prim = [mx.array(xs[n], mx.float32) for n in names] + [mx.array(s, mx.float32) for s in h0]
    cots = [mx.array(do, mx.float32)] + [mx.array(s, mx.float32) for s in dht]

    def f(*a):
        o, (S, z) = ops.power_retention(*a[:4], initial_state=(a[4], a[5]), output_final_state=True)
        return o, S, z

    with tuning.override(feature_decode=True):
        outs, grads = mx.vjp(f, prim, cots)
        mx.eval(outs, grads)
    o_r, s_r = reference.run(rec, initial_state=h0, scale=scale, **xs)
    g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    ftol, gtol = TOL["float32"]
    for k, a, b in zip(("o", "S", "z"), outs, (o_r, *s_r)):
        assert rel_err(np.array(a), b) <= ftol, k
    for n, g, r in zip(names + ["S0", "z0"], grads, [g_r[n] for n in names] + list(g_r["initial_state"])):
        assert rel_err(np.array(g), r) <= gtol, n
