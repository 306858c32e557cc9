"""The chunk core's hand-derived VJP against MLX autodiff of the same forward, in float64.

``recgen.chunked.parallel`` writes the backward out (two scans over chunks, everything else
batched). Its forward is plain MLX, so MLX's autodiff of that forward is an independent derivation
of the same gradient: the two must agree to rounding (1e-12 relative), for every variant — scalar or
key-vector decay, with and without the delta-rule term b̃, the per-chunk transition composed or not,
and the GPU form of the diagonal scan (one matrix product) against the loop.
"""
from __future__ import annotations

import itertools
from functools import partial

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from recgen import tuning  # noqa: E402
from recgen.chunked import core, parallel  # noqa: E402

CPU = tuning.resolve("cpu", environ={})


@pytest.fixture(autouse=True)
def _cpu():
    mx.set_default_device(mx.cpu)


def _args(rng, key, delta, B=2, n=3, C=8, K=6, V=5):
    f = lambda *s, scale=1.0: mx.array(rng.normal(size=s) * scale, dtype=mx.float64)  # noqa: E731
    l = mx.array(-rng.uniform(0, 3, size=(B, n, C, K if key else 1)), dtype=mx.float64)
    args = [f(B, K, V), f(B, n, C, K), f(B, n, C, K, scale=0.3), f(B, n, C, V), l]
    return args + ([f(B, n, C, K, scale=0.3)] if delta else []), [f(B, n, C, V), f(B, K, V)]


def _rel(a, b):
    return float(mx.abs(a - b).max() / (mx.abs(b).max() + 1e-300))


@pytest.mark.parametrize("key,delta,compose", list(itertools.product([False, True], repeat=3)))
def test_written_vjp_equals_autodiff(key, delta, compose):
    rng = np.random.default_rng(hash((key, delta, compose)) % 2**32)
    args, cot = _args(rng, key, delta)
    Geo = parallel.KeyDecay if key else parallel.ScalarDecay

    def autodiff(*a):
        y, S_end, _ = parallel._forward(Geo(a[4], CPU), a[0], a[1], a[2], a[3], a[5] if delta else None, compose)
        return y, S_end

    core = parallel.core_fn(key, delta, compose, CPU)
    (y1, s1), g1 = mx.vjp(autodiff, args, cot)
    (y2, s2), g2 = mx.vjp(lambda *a: tuple(core(*a)[:2]), args, cot)
    assert _rel(y2, y1) < 1e-12 and _rel(s2, s1) < 1e-12
    errs = [_rel(b, a) for a, b in zip(g1, g2)]
    assert max(errs) < 1e-12, errs


@pytest.mark.parametrize("key", [False, True])
def test_matrix_scan_equals_loop(key):
    """The GPU form of the diagonal scan (one (n+1)×(n+1) decay matrix, its transpose for the
    backward) against the loop, forward and backward. MLX's CPU exp is float32-accurate even in
    float64, and the two forms exponentiate different sums: hence 1e-8, not 1e-12."""
    rng = np.random.default_rng(7 + key)
    args, cot = _args(rng, key, False, n=5)
    loop = parallel.core_fn(key, False, False, CPU)
    matrix = parallel.core_fn(key, False, False, tuning.with_changes(CPU, gpu_forms=True))
    (y1, s1), g1 = mx.vjp(lambda *a: tuple(loop(*a)[:2]), args, cot)
    (y2, s2), g2 = mx.vjp(lambda *a: tuple(matrix(*a)[:2]), args, cot)
    assert _rel(y2, y1) < 1e-8 and _rel(s2, s1) < 1e-8
    assert max(_rel(b, a) for a, b in zip(g1, g2)) < 1e-8


@pytest.mark.parametrize("C", [1, 2, 5, 16, 37, 64])
def test_unit_lower_inverses(C):
    """The triangular inverse from every base block size (1: block levels only, the CPU's; C: full
    C×C doubling only; between: mixed, the GPU's) in float64 against numpy's inverse, including C that is not a power of two, on entries large enough that a
    truncated power series would be far off."""
    from recgen.chunked.core import unit_lower_inv, unit_lower_inv_full

    rng = np.random.default_rng(C)
    L = np.tril(rng.normal(size=(3, 2, C, C)) * 0.5, -1)
    ref = np.linalg.inv(np.eye(C) - L)
    for name, inv in [("full", unit_lower_inv_full)] + [(f"base {b}", partial(unit_lower_inv, base=b))
                                                        for b in (1, 2, 8, 16, 64)]:
        got = np.array(inv(mx.array(L, dtype=mx.float64)))
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12 * np.abs(ref).max(), err_msg=name)


def test_cpu_exp_rounds_like_mx_exp():
    """``core.exp`` (2^(x·log2 e) through mx.power on the CPU, 2-3x faster than MLX's CPU exp) against
    float64 exp: in float32 no worse than mx.exp itself over the decays' range (strong ones included), its
    gradient e^x, and in float64 (the verification dtype) double-accurate, where mx.exp is float32-accurate."""
    from recgen.chunked.core import exp

    x64 = np.concatenate([np.random.default_rng(3).uniform(-80, 5, 20000), [0.0, -1e-8, -87.0, -100.0]])
    ref = np.exp(x64)
    x = mx.array(x64.astype(np.float32))
    rel = lambda got: float(np.max(np.abs(np.array(got, dtype=np.float64) - ref) / (ref + 1e-30)))  # noqa: E731
    assert rel(exp(x, True)) <= 1.2 * rel(mx.exp(x)) + 1e-7
    assert rel(exp(x, True)) < 1e-5 and exp(x, True).dtype == mx.float32
    assert rel(mx.grad(lambda a: exp(a, True).sum())(x)) < 1e-5
    got64 = exp(mx.array(x64, dtype=mx.float64), True)
    assert got64.dtype == mx.float64 and rel(got64) < 1e-12


@pytest.mark.parametrize("T,kdim", [(1, 1), (7, 4), (30, 4), (30, 1)])
def test_scan_full_written_vjp_equals_autodiff_of_the_loop(T, kdim):
    """``core.scan_full`` (two-level scan, written VJP) against MLX autodiff of the per-token loop, float64:
    T not a square (padding), T = 1, decays over (K, V) and broadcast over K (kdim 1), strong decays. Both
    exponentiate with ``core.exp`` (double-accurate in float64, where mx.exp is float32-accurate)."""
    from recgen.chunked.core import exp, scan_full

    rng = np.random.default_rng(T * 10 + kdim)
    B, H, K, V = 2, 3, 4, 5
    f = lambda *s: mx.array(rng.normal(size=s), dtype=mx.float64)  # noqa: E731
    args = [f(B, H, K, V), f(B, H, T, K), f(B, H, T, K), f(B, H, T, V),
            mx.array(-rng.uniform(0, 20, size=(B, H, T, kdim, V)), dtype=mx.float64)]

    def loop(S, r, u, w, ld):
        ys = []
        for t in range(T):
            S = exp(ld[:, :, t], True) * S + u[:, :, t, :, None] * w[:, :, t, None, :]
            ys.append((r[:, :, t, :, None] * S).sum(-2))
        return mx.stack(ys, axis=2), S

    for cot in ([f(B, H, T, V), f(B, H, K, V)], [f(B, H, T, V), mx.zeros((B, H, K, V), dtype=mx.float64)]):
        (y1, s1), g1 = mx.vjp(lambda *a: loop(*a), args, cot)
        (y2, s2), g2 = mx.vjp(lambda *a: scan_full(*a, pow2=True), args, cot)
        assert _rel(y2, y1) < 1e-12 and _rel(s2, s1) < 1e-12
        for name, a, b in zip(["dS0", "dr", "du", "dw", "dld"], g1, g2):
            assert b.shape == a.shape and _rel(b, a) < 1e-10, name
    # a cotangent for y only (the final state unused): dS_end enters as zeros
    g_only = mx.grad(lambda *a: (scan_full(*a, pow2=True)[0] * cot[0]).sum(), argnums=list(range(5)))(*args)
    for a, b in zip(g1, g_only):
        assert _rel(b, a) < 1e-10


@pytest.mark.parametrize("which", ["both", "values", "column"])
def test_split_last_joins_the_cotangents(which):
    """``core.split_last`` (a normalizer's column split off the values) and its VJP, one concatenation: the gradient
    of Σ a·y + Σ b·n is [a | b], with zeros where only one part reaches the loss."""
    rng = np.random.default_rng(3)
    x = mx.array(rng.normal(size=(2, 3, 5)).astype(np.float32))
    a, b = (mx.array(rng.normal(size=s).astype(np.float32)) for s in ((2, 3, 4), (2, 3)))

    def loss(x):
        y, n = core.split_last(x)
        return (0 if which == "column" else (a * y).sum()) + (0 if which == "values" else (b * n).sum())

    y, n = core.split_last(x)
    assert np.array_equal(np.array(y), np.array(x)[..., :-1]) and np.array_equal(np.array(n), np.array(x)[..., -1])
    want = np.concatenate([np.array(a) * (which != "column"), np.array(b)[..., None] * (which != "values")], -1)
    assert np.array_equal(np.array(mx.grad(loss)(x)), want)
