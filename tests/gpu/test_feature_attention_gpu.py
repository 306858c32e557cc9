"""A feature-map spec as attention (``chunked.features.attention_form``) on the GPU: degree 4 by the default rule
(the decayed-scores and decay-factor kernels inside, the term between chunks replayed), and degree 2 with the rule
set to ``"always"`` (the final state through the sympow kernels' rows). Chunks of 256 (the GPU default) with a
partial second one, GQA, K != V, cotangents on o and both final states; forward, final state and every gradient
against the float64 reference, float32 and bfloat16; degree 4 in groups of one chunk of queries; and both from a
given initial state."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from op_check import TOL

import recgen as rg
from recgen import chunked, specs, tuning
from recgen.chunked import features
from recgen.math import reference
from recgen.spec.features import sympow, sympow_width
from recgen.spec.layouts import Sizes
from recgen.testing import kernel_inputs, rel_err

pytestmark = pytest.mark.gpu


@rg.recurrence
def power_retention4(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar):
    """Power retention of degree 4 with its normalizer."""
    pk = rg.sympow(k, 4)
    return rg.Step(decay=rg.exp(g), update=rg.outer(pk, v), readout=rg.scale**4 * rg.sympow(q, 4),
                   normalizer=rg.normalizer(rg.exp(g), pk, lambda n: n + 1e-2))


@pytest.mark.xdist_group("feature_attention")
@pytest.mark.parametrize("degree,d,mode,groups,given", [
    (4, 16, "wide", False, False), (2, 64, "always", False, False), (4, 16, "wide", True, False),
    (4, 16, "wide", False, True), (2, 64, "always", False, True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_feature_attention_matches_the_reference(degree, d, mode, groups, given, dtype, monkeypatch):
    """``given``: from a reachable initial state (S0, z0) = Σ_j (φ(w_j) v_jᵀ, φ(w_j)) over three random w, read as
    e^{Γ_t} φ(q_t)ᵀS0 (``features.initial_read``), its gradients too."""
    rec = power_retention4 if degree == 4 else specs.power_retention
    sizes = Sizes(B=1, T=300, H=4, Hk=2, Kin=d, K=sympow_width(d, degree), V=24)
    rng = np.random.default_rng(11)
    xs, _, do, dht, scale = kernel_inputs(rec, sizes, rng)
    h0 = None
    if given:
        phi = sympow(rng.standard_normal((1, 4, 3, d)), degree)
        h0 = tuple(np.float32(a).astype(np.float64)
                   for a in (phi.swapaxes(-1, -2) @ rng.standard_normal((1, 4, 3, 24)), phi.sum(2)))
    taken = []
    real = features.attention_form
    monkeypatch.setattr(features, "attention_form", lambda *a, **k: taken.append(1) or real(*a, **k))
    mdt = getattr(mx, dtype)
    names = list(xs)
    prim = [mx.array(xs[n], mx.float32).astype(mdt) for n in names] + [mx.array(a, mx.float32) for a in h0 or ()]
    cots = [mx.array(do, mx.float32).astype(mdt)] + [mx.array(s, mx.float32) for s in dht]

    def f(*a):
        state = tuple(a[len(names):]) if given else None
        o, (S, z) = chunked.forward(rec, dict(zip(names, a)), scale=scale, initial_state=state)
        return o, S, z

    # ``groups``: a budget that holds one chunk of queries' scores at a time, so two groups of one chunk
    budget = 4 * sizes.B * sizes.H * 256 * 512 * features.ATTENTION_ARRAYS if groups else None
    with tuning.override(feature_attention=mode, segment_budget=budget):
        outs, grads = mx.vjp(f, prim, cots)
    assert taken, "the attention form was not taken"
    seen = {n: np.array(a.astype(mx.float32), np.float64) for n, a in zip(names, prim)}
    cot64 = [np.array(c.astype(mx.float32), np.float64) for c in cots]
    o_r, s_r = reference.run(rec, scale=scale, initial_state=h0, **seen)
    g_r = reference.grad(rec, do=cot64[0], dht=tuple(cot64[1:]), scale=scale, initial_state=h0, **seen)
    ftol, gtol = TOL[dtype]
    errs = {k: rel_err(np.array(a.astype(mx.float32)), b) for k, a, b in zip(("o", "S", "z"), outs, (o_r, *s_r))}
    want = [g_r[n] for n in names] + (list(g_r["initial_state"]) if given else [])
    errs |= {"d" + n: rel_err(np.array(g.astype(mx.float32)), w)
             for n, g, w in zip(names + ["S0", "z0"], grads, want)}
    bad = {k: v for k, v in errs.items() if not v <= (gtol if k.startswith("d") else ftol)}
    assert not bad, (bad, errs)
