"""sympow of degree 2, 3 and 4 (``rg.sympow(k, degree)``): φ(x)ᵀφ(y) = (xᵀy)^p, its VJP, and a degree-4 power
retention spec through the reference interpreter and the chunked forms (the kernel identity's with φ's rows by MLX
gathers, and the general one), forward, final state and every gradient, against an independent float64 oracle
(the attention form: Σ_s e^{G_t - G_s} (q_t·k_s)^4 v_s) and against the reference."""
import mlx.core as mx
import numpy as np
import pytest

import recgen as rg
from recgen import chunked, tuning
from recgen.chunked.terms import sympow_mx
from recgen.math import reference
from recgen.spec.analysis import analyze
from recgen.spec.features import sympow, sympow_vjp, sympow_width
from recgen.testing import rel_err


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_feature_map_identity_and_vjp(degree, rng):
    d = 5
    x, y, dphi = rng.standard_normal(d), rng.standard_normal(d), rng.standard_normal(sympow_width(d, degree))
    assert sympow(x, degree).shape == (sympow_width(d, degree),)
    assert abs(sympow(x, degree) @ sympow(y, degree) - (x @ y) ** degree) <= 1e-12 * abs(x @ y) ** degree + 1e-12
    # the VJP against MLX autodiff of the same map in float64 (gathers and products)
    got = sympow_vjp(x, dphi, degree)
    f64 = lambda a: mx.array(a, dtype=mx.float64)  # noqa: E731
    want = mx.vjp(lambda a: sympow_mx(a, degree), [f64(x)], [f64(dphi)])[1][0]
    assert rel_err(got, np.array(want)) <= 1e-12
    np.testing.assert_allclose(np.array(sympow_mx(f64(x), degree)), sympow(x, degree), rtol=1e-12)


@rg.recurrence
def power_retention4(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar):
    """Power retention of degree 4 with its normalizer."""
    pk = rg.sympow(k, 4)
    return rg.Step(decay=rg.exp(g), update=rg.outer(pk, v), readout=rg.scale**4 * rg.sympow(q, 4),
                   normalizer=rg.normalizer(rg.exp(g), pk, lambda n: n + 1e-2))


def _inputs(rng, B=2, T=9, H=2, Hk=1, d=3, V=4):
    q, k = rng.standard_normal((2, B, T, Hk, d))
    return dict(q=q, k=k, v=rng.standard_normal((B, T, H, V)), g=-3.0 * rng.uniform(0, 1, (B, T, H)) ** 3)


def test_degree4_reference_matches_the_attention_form(rng):
    xs = _inputs(rng)
    scale = 0.7
    o, (S, z) = reference.run(power_retention4, scale=scale, **xs)
    assert S.shape == (2, 2, 15, 4) and z.shape == (2, 2, 15)  # C(3 + 3, 4) rows
    q, k = (np.repeat(xs[n], 2, axis=2) for n in ("q", "k"))  # GQA: value heads 0, 1 read key head 0
    G = np.cumsum(xs["g"], 1)                                   # [B, T, H]
    w = np.exp(G[:, :, None] - G[:, None]) * np.tril(np.ones((9, 9)))[None, :, :, None]  # [B, t, s, H]
    A = w * (scale * np.einsum("bthd,bshd->btsh", q, k)) ** 4
    y, n = np.einsum("btsh,bshv->bthv", A, xs["v"]), A.sum(2)
    assert rel_err(o, y / (n[..., None] + 1e-2)) <= 1e-12


def test_degree4_chunked_form_matches_the_reference(rng):
    rec = power_retention4
    assert analyze(rec).feature_identity.degree == 4  # the kernel identity's forms (φ's rows by MLX gathers)
    xs = _inputs(rng)
    do, dS, dz = rng.standard_normal((2, 9, 2, 4)), rng.standard_normal((2, 2, 15, 4)), rng.standard_normal((2, 2, 15))
    names = list(xs)

    def f(*a):
        o, (S, z) = chunked.forward(rec, dict(zip(names, a)), scale=0.7, chunk_size=4, compute_dtype=mx.float64)
        return o, S, z

    f64 = lambda a: mx.array(a, dtype=mx.float64)  # noqa: E731
    o_r, s_r = reference.run(rec, scale=0.7, **xs)
    g_r = reference.grad(rec, do=do, dht=(dS, dz), scale=0.7, **xs)
    forms = ((True, "never"), (True, "always"), (False, "never"))  # the identity's: expanded, attention; the general
    for identity, attention in forms:
        with tuning.override(feature_identity=identity, feature_attention=attention):
            got, grads = mx.vjp(f, [f64(xs[n]) for n in names], [f64(do), f64(dS), f64(dz)])
        for a, b in zip(got, (o_r, *s_r)):
            assert rel_err(np.array(a), b) <= 1e-10
        for n, g in zip(names, grads):
            assert rel_err(np.array(g), g_r[n]) <= 1e-10, (identity, attention, n)


def test_other_degrees_are_rejected_when_declared():
    with pytest.raises(rg.SpecError, match="degree must be 2, 3 or 4"):
        @rg.recurrence
        def bad(q: rg.Key, k: rg.Key, v: rg.Value):
            return rg.Step(update=rg.outer(rg.sympow(k, 5), v), readout=rg.sympow(q, 5))


def test_the_gather_indices_are_made_once(monkeypatch):
    """``sympow_mx`` builds its index columns once per width, degree and type: a graph built each call (the attention
    form's final state, read or not) must not copy 4 × 766 480 indices from the host each time (d = 64, p = 4)."""
    from recgen.chunked import terms

    made = []
    real = terms.sympow_terms
    monkeypatch.setattr(terms, "sympow_terms", lambda *a: made.append(a) or real(*a))
    x = mx.array(np.random.default_rng(0).standard_normal((3, 11)), dtype=mx.float32)
    first, second = sympow_mx(x, 3), sympow_mx(x + 0, 3)
    assert made == [(11, 3)]
    np.testing.assert_allclose(np.array(second), np.array(first))
    np.testing.assert_allclose(np.array(first), sympow(np.array(x, np.float64), 3), rtol=1e-5)
