"""A feature map's chunked form through its kernel identity (``recgen.chunked.features``): the tiles of the expanded
space, the form against a float64 numpy loop, and power retention end to end (forward, final state, every gradient)
against the float64 reference interpreter, with several tiles (d = 20: two of 10 rows a block; d = 48: three),
GQA, K != V, odd T, T = 1, log-decays to -20, an initial state and cotangents on both states."""
import mlx.core as mx
import numpy as np
import pytest

import recgen as rg
from recgen import chunked, specs, tuning
from recgen.chunked import feature_rows as R
from recgen.chunked import features as F
from recgen.math import reference
from recgen.spec.analysis import analyze
from recgen.spec.features import sympow
from recgen.spec.layouts import Sizes
from recgen.testing import kernel_inputs, reachable_state, rel_err


@pytest.mark.parametrize("d,bs,count", [(4, 4, 1), (20, 10, 2), (48, 16, 3), (17, 1, 17)])
def test_tiles_weighted_products_are_the_squared_dot(d, bs, count, rng):
    ft = R.feature_tiles(d)
    assert (ft.bs, ft.count) == (bs, count)
    x, y = rng.standard_normal((2, 3, d))
    got = sum((R.tile_features(mx.array(x), ft, i).reshape(3, -1) * R.tile_features(mx.array(y), ft, i).reshape(3, -1)
               * mx.array(ft.weight(i))).sum(-1) for i in range(ft.count))
    np.testing.assert_allclose(np.array(got), (x * y).sum(-1) ** 2, rtol=1e-5)


def test_packed_states_round_trip_through_tiles(rng):
    d = 20
    S = mx.array(sympow(rng.standard_normal((2, 5, d))).swapaxes(-1, -2) @ rng.standard_normal((2, 5, 3)))
    tiles = R.to_tiles(S, d)
    assert tiles.shape == (2, R.feature_tiles(d).total, 3)
    np.testing.assert_allclose(np.array(R.from_tiles(tiles, d)), np.array(S), rtol=1e-6)


def _loop(q, k, W, g, S0):
    """S_t = e^{g_t} S + φ(k_t) W_tᵀ, Y_t = φ(q_t)ᵀ S_t in float64 numpy, per (b, h); S packed."""
    S, Y = S0.copy(), np.zeros(q.shape[:3] + (W.shape[-1],))
    for t in range(q.shape[2]):
        S = np.exp(g[:, :, t])[..., None, None] * S + sympow(k[:, :, t])[..., :, None] * W[:, :, t][..., None, :]
        Y[:, :, t] = np.einsum("bhf,bhfv->bhv", sympow(q[:, :, t]), S)
    return Y, S


@pytest.mark.parametrize("d,T,C", [(20, 13, 4), (48, 9, 8), (8, 1, 1), (4, 16, 16)])
def test_chunk_form_matches_a_numpy_loop(d, T, C, rng):
    """Every decay factor a sum of the log-decays it spans: exact in float64 with log-decays to -20 and a reset (a
    decay of 0, log -inf) mid-sequence."""
    B, H, V1 = 2, 2, 3
    q, k = rng.standard_normal((2, B, H, T, d)) / d ** 0.25
    W = rng.standard_normal((B, H, T, V1))
    g = -20.0 * rng.uniform(0, 1, (B, H, T)) ** 3
    g[0, 1, T // 2] = -np.inf
    S0 = sympow(rng.standard_normal((B, H, 3, d))).swapaxes(-1, -2) @ rng.standard_normal((B, H, 3, V1))
    f64 = lambda x: mx.array(x, dtype=mx.float64)  # noqa: E731
    Y, S_end = F.chunk_form(f64(q), f64(k), f64(W), f64(g), R.to_tiles(f64(S0), d), 0.5, C, pow2=True)
    Y_r, S_r = _loop(q, k, W, g, S0)
    assert rel_err(np.array(Y), 0.5 * Y_r) <= 1e-12
    assert rel_err(np.array(R.from_tiles(S_end, d)), S_r) <= 1e-12


def test_the_chunks_states_kept_from_the_forward_give_the_same_gradients(rng):
    """``chunk_form(keep=True)`` hands each tile's chunk states from the forward to the backward (three tiles here,
    the form the op takes where one tile holds the state): every gradient as when they are formed again, float64."""
    B, H, T, d, V1, C = 2, 2, 21, 48, 3, 8
    q, k = rng.standard_normal((2, B, H, T, d)) / d ** 0.25
    W, g = rng.standard_normal((B, H, T, V1)), -3.0 * rng.uniform(0, 1, (B, H, T))
    S0 = R.to_tiles(mx.array(rng.standard_normal((B, H, d * (d + 1) // 2, V1))), d)
    dY, dS = mx.array(rng.standard_normal((B, H, T, V1))), mx.array(rng.standard_normal(S0.shape))
    assert R.feature_tiles(d).count == 3
    grads = []
    for keep in (False, True):
        def f(*xs):
            return F.chunk_form(*xs, 0.5, C, keep=keep)
        outs, gs = mx.vjp(f, [mx.array(x, dtype=mx.float64) for x in (q, k, W, g)] + [S0.astype(mx.float64)], [dY, dS])
        grads.append([np.array(x) for x in (*outs, *gs)])
    for a, b in zip(*grads):
        assert rel_err(a, b) <= 1e-12


CASES = [Sizes(B=2, T=37, H=4, Hk=2, Kin=20, K=210, V=5),   # two tiles, GQA, odd T across chunks of 8
         Sizes(B=1, T=1, H=2, Hk=1, Kin=20, K=210, V=3),    # decode
         Sizes(B=1, T=16, H=2, Hk=2, Kin=48, K=1176, V=4)]  # three tiles


def _power_retention(sizes, seed, dtype, chunk):
    rec = specs.power_retention
    rng = np.random.default_rng(seed)
    xs, _, do, dht, scale = kernel_inputs(rec, sizes, rng)
    h0 = reachable_state(sizes, rng)
    names = list(xs)

    def f(*a):
        o, (S, z) = chunked.forward(rec, dict(zip(names, a[:4])), scale=scale, initial_state=(a[4], a[5]),
                                    chunk_size=chunk, compute_dtype=dtype)
        return o, S, z

    primals = [mx.array(x, dtype) for x in list(xs.values()) + list(h0)]
    cots = [mx.array(x, dtype) for x in (do, *dht)]
    got, grads = mx.vjp(f, primals, cots)
    o_r, s_r = reference.run(rec, initial_state=h0, scale=scale, **xs)
    g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    return got, grads, (o_r, *s_r), [g_r[n] for n in names] + list(g_r["initial_state"]), names


@pytest.mark.parametrize("sizes", CASES)
@pytest.mark.parametrize("dtype,fwd_tol,grad_tol", [(mx.float64, 1e-10, 1e-10), (mx.float32, 1e-5, 1e-4)])
@pytest.mark.parametrize("gram_slices", [1, 16])  # the decays' gradient as one product, or in slices read as rows
def test_power_retention_through_the_identity_matches_the_reference(sizes, dtype, fwd_tol, grad_tol, gram_slices):
    assert analyze(specs.power_retention).feature_identity is not None
    with tuning.override(gram_slices=gram_slices):
        got, grads, want, gwant, names = _power_retention(sizes, sizes.Kin + sizes.T, dtype, 8)
    for name, a, b in zip(("o", "S", "z"), got, want):
        assert rel_err(np.array(a), b) <= fwd_tol, name
    for name, a, b in zip(names + ["S0", "z0"], grads, gwant):
        assert rel_err(np.array(a), b) <= grad_tol, (name, rel_err(np.array(a), b))


@pytest.mark.parametrize("K,parts,want", [(2080 * 65, 16, 13), (2080 * 65, 20, 20), (2080 * 65, 8, 8),
                                           (8256 * 129, 16, 16),
                                           (7, 16, 7), (2 * 3, 16, 6), (1, 16, 1), (2080 * 65, 1, 1)])
def test_the_gram_slices_keep_rows_16_byte_aligned_where_a_divisor_allows(K, parts, want):
    """``features.gram_parts``: the largest divisor up to ``parts`` leaving slices of a multiple of 4 elements (2080·65 / 16
    would be 8450), else the largest divisor (K = 7, 6: no such slices)."""
    assert F.gram_parts(K, parts) == want
    assert K % want == 0


def test_the_switch_keeps_the_general_form(monkeypatch):
    """``Tuning.feature_identity`` off: the spec's general chunked form, the same numbers."""
    sizes = CASES[0]
    on = _power_retention(sizes, 3, mx.float64, 8)[0]
    with tuning.override(feature_identity=False):
        off = _power_retention(sizes, 3, mx.float64, 8)[0]
    for a, b in zip(on, off):
        assert rel_err(np.array(a), np.array(b)) <= 1e-10


def _spec(readout=None, skip=False, zdecay=False):
    @rg.recurrence
    def feat(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar, D: rg.Param["j"]):
        pk = rg.sympow(k)
        kw = {"skip": D * v} if skip else {}
        if zdecay:
            kw["normalizer"] = rg.normalizer(rg.exp(2 * g), pk, lambda n: n + 1)
        return rg.Step(decay=rg.exp(g), update=rg.outer(pk, v), readout=readout(q) if readout else rg.sympow(q), **kw)
    return feat


@pytest.mark.parametrize("make,form", [
    (lambda: _spec(), True),                                            # r = φ(q), c = 1
    (lambda: _spec(readout=lambda q: 3 * rg.scale * rg.sympow(q)), True),
    (lambda: _spec(skip=True), False),                                  # a skip term
    (lambda: _spec(zdecay=True), False),                                # a normalizer with its own decay
])
def test_which_specs_take_the_identity(make, form):
    fi = analyze(make()).feature_identity
    assert (fi is not None) == form
    if fi is not None:
        assert (fi.q, fi.k) == ("q", "k")
