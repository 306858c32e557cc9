"""``recgen.ops.gated_delta_product`` (FLA's ``chunk_gated_delta_product``, a composition over gated DeltaNet) on
the CPU (backend "mlx", the chunked form) against the handwritten float64 reference: forward, final state and every
gradient, on fresh random data with log-decays to -20, unit-norm keys, K != V, odd T, T = 1, GQA, n = 1, 2, 3,
gated and ungated (g=None); under ``mx.compile``; packed sequences; FLA's in-kernel q/k normalization; and the
argument errors, each naming its argument and the expected shape."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from delta_product_check import Case, delta_product_errors
from helpers import l2norm, log_decay, rel_err, sigmoid
from op_check import assert_close
from references.gated_delta_product import gated_delta_product as reference
from references.gated_delta_product import gated_delta_product_bwd as reference_bwd

from recgen import ops
from recgen.errors import InputError

FWD, GRAD = 1e-5, 1e-4

CASES = [
    Case(2, 1, 4, 2, 8, 6, 2, True),               # T = 1, GQA
    Case(2, 9, 4, 2, 8, 6, 3, True),               # odd T, GQA, three micro-steps a token
    Case(1, 33, 3, 3, 16, 10, 1, True),            # n = 1: gated DeltaNet itself, several chunks
    Case(2, 7, 2, 1, 8, 12, 2, False),             # ungated (g=None), K < V, all value heads on one key head
    Case(1, 21, 2, 2, 8, 6, 3, True, 0.5),         # T·n = 63: several chunks, a token's steps across chunk edges
]


@pytest.fixture(autouse=True)
def _cpu():
    mx.set_default_device(mx.cpu)


def f32(a):
    return None if a is None else mx.array(np.asarray(a, np.float32))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_against_reference(case, rng):
    assert_close(delta_product_errors(case, "float32", rng, backend="mlx"), "float32")


def test_under_compile(rng):
    case = CASES[1]
    errs = delta_product_errors(case, "float32", rng, backend="mlx", compiled=True)
    assert_close(errs, "float32")
    assert set(errs) == {"o", "ht0", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"}


def test_bfloat16_inputs(rng):
    assert_close(delta_product_errors(CASES[3], "bfloat16", rng, backend="mlx"), "bfloat16")


def test_packed_sequences_are_separate_calls(rng):
    """cu_seqlens over T (FLA's): each sequence's tokens and their n micro-steps each; an empty sequence keeps its
    initial state. Forward, final states and every gradient against the reference run per sequence."""
    n, H, Hk, K, V, offsets = 2, 4, 2, 8, 6, [0, 3, 3, 10]
    T, N = offsets[-1], len(offsets) - 1
    x = dict(q=rng.standard_normal((1, T, Hk, K)), k=l2norm(rng.standard_normal((1, T * n, Hk, K))),
             v=rng.standard_normal((1, T * n, H, V)), g=log_decay(rng, (1, T, H)),
             beta=sigmoid(rng.standard_normal((1, T * n, H))), initial_state=rng.standard_normal((N, H, K, V)))
    x = {nm: np.asarray(a, np.float32).astype(np.float64) for nm, a in x.items()}
    do = np.asarray(rng.standard_normal((1, T, H, V)), np.float32).astype(np.float64)
    dht = np.asarray(rng.standard_normal((N, H, K, V)), np.float32).astype(np.float64)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def f(q, k, v, g, beta, h0):
        return ops.gated_delta_product(q, k, v, g, beta, n, initial_state=h0, output_final_state=True,
                                       cu_seqlens=offsets, backend="mlx")

    (o, ht), grads = mx.vjp(f, [f32(x[nm]) for nm in names], [f32(do), f32(dht)])
    want = {nm: np.zeros_like(x[nm]) for nm in names}
    o_ref, ht_ref = np.zeros_like(do), np.zeros_like(dht)
    for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
        tok, mic = slice(a, b), slice(a * n, b * n)
        args = (x["q"][:, tok], x["k"][:, mic], x["v"][:, mic], x["g"][:, tok], x["beta"][:, mic], n)
        h0 = x["initial_state"][i:i + 1]
        o_ref[:, tok], ht_ref[i:i + 1] = reference(*args, initial_state=h0)
        gr = reference_bwd(*args, do[:, tok], dht[i:i + 1], initial_state=h0)
        for nm, sl in (("q", tok), ("g", tok), ("k", mic), ("v", mic), ("beta", mic)):
            want[nm][:, sl] = gr[nm]
        want["initial_state"][i:i + 1] = gr["initial_state"]
    assert rel_err(o, o_ref) <= FWD and rel_err(ht, ht_ref) <= FWD
    np.testing.assert_array_equal(np.array(ht[1]), np.asarray(x["initial_state"][1], np.float32))  # empty sequence
    for nm, gr in zip(names, grads):
        assert rel_err(gr, want[nm]) <= GRAD, nm


def test_qk_l2norm_in_kernel(rng):
    """``use_qk_l2norm_in_kernel``: FLA's x / sqrt(Σx² + 1e-6) on q and k; gradients through it (the chain rule
    by hand: dx = (dy - (dy·y) y) / sqrt(Σx² + 1e-6))."""
    B, T, H, K, V, n = 2, 5, 2, 8, 6, 2
    x = dict(q=3 * rng.standard_normal((B, T, H, K)), k=3 * rng.standard_normal((B, T * n, H, K)),
             v=rng.standard_normal((B, T * n, H, V)), g=log_decay(rng, (B, T, H)),
             beta=sigmoid(rng.standard_normal((B, T * n, H))))
    x = {nm: np.asarray(a, np.float32).astype(np.float64) for nm, a in x.items()}
    do = np.asarray(rng.standard_normal((B, T, H, V)), np.float32).astype(np.float64)
    rstd = {nm: 1 / np.sqrt(np.sum(x[nm] ** 2, -1, keepdims=True) + 1e-6) for nm in ("q", "k")}
    qn, kn = x["q"] * rstd["q"], x["k"] * rstd["k"]
    names = ("q", "k", "v", "g", "beta")

    def f(q, k, v, g, beta):
        return ops.gated_delta_product(q, k, v, g, beta, n, use_qk_l2norm_in_kernel=True, backend="mlx")[0]

    (o,), grads = mx.vjp(f, [f32(x[nm]) for nm in names], [f32(do)])
    args = (qn, kn, x["v"], x["g"], x["beta"], n)
    assert rel_err(o, reference(*args)[0]) <= FWD
    gr = reference_bwd(*args, do, None)
    for nm, y in (("q", qn), ("k", kn)):
        gr[nm] = rstd[nm] * (gr[nm] - np.sum(gr[nm] * y, -1, keepdims=True) * y)
    for nm, g in zip(names, grads):
        assert rel_err(g, gr[nm]) <= GRAD, nm


def test_scale_default_and_final_state_off(rng):
    """scale=None is K^-1/2 (FLA's); without output_final_state the state is None."""
    B, T, H, K, V, n = 1, 4, 2, 8, 6, 2
    q, k = rng.standard_normal((B, T, H, K)), l2norm(rng.standard_normal((B, T * n, H, K)))
    v, beta = rng.standard_normal((B, T * n, H, V)), sigmoid(rng.standard_normal((B, T * n, H)))
    q, k, v, beta = (np.asarray(a, np.float32).astype(np.float64) for a in (q, k, v, beta))
    o, ht = ops.gated_delta_product(f32(q), f32(k), f32(v), None, f32(beta), n, backend="mlx")
    assert ht is None and o.shape == (B, T, H, V) and o.dtype == mx.float32
    assert rel_err(o, reference(q, k, v, None, beta, n, scale=K ** -0.5)[0]) <= FWD


def test_argument_errors():
    B, T, H, Hk, K, V, n = 1, 5, 4, 2, 8, 6, 2
    good = dict(q=mx.zeros((B, T, Hk, K)), k=mx.zeros((B, T * n, Hk, K)), v=mx.zeros((B, T * n, H, V)),
                g=mx.zeros((B, T, H)), beta=mx.zeros((B, T * n, H)), num_householder=n)
    cases = [(dict(num_householder=0), "'num_householder': expected a positive int"),
             (dict(num_householder=1.5), "'num_householder'"),
             (dict(num_householder=True), "'num_householder'"),
             (dict(num_householder=mx.array(2)), "'num_householder'.*force evaluation"),
             (dict(q=mx.zeros((B, T, K))), "'q': expected \\[B,T,Hk,K\\]"),
             (dict(k=mx.zeros((B, T, Hk, K))), "'k': expected \\[B,T\\*n,Hk,K\\] = \\[1, 10, 2, 8\\]"),
             (dict(k=mx.zeros((B, T * n, Hk, K + 1))), "'k': expected \\[B,T\\*n,Hk,K\\]"),
             (dict(v=mx.zeros((B, T, H, V))), "'v': expected \\[B,T\\*n,H,V\\] with B=1, T\\*n=10"),
             (dict(v=mx.zeros((B, T * n, 3, V))), "'v'.*H a multiple of Hk=2"),
             (dict(beta=mx.zeros((B, T, H))), "'beta': expected \\[B,T\\*n,H\\] = \\[1, 10, 4\\]"),
             (dict(g=mx.zeros((B, T * n, H))), "'g': expected \\[B,T,H\\] = \\[1, 5, 4\\]"),
             (dict(initial_state=mx.zeros((B, H, V, K))), "'initial_state': expected \\[N,H,K,V\\] = \\[1, 4, 8, 6\\]"),
             (dict(initial_state=mx.zeros((2, H, K, V)), cu_seqlens=[0, 2, 5]), None),  # two sequences: accepted
             (dict(initial_state=mx.zeros((B, H, K, V)), cu_seqlens=[0, 2, 5]), "'initial_state'.*\\[2, 4, 8, 6\\]"),
             (dict(cu_seqlens=[0, 2, 10]), "'cu_seqlens': expected nondecreasing ints from 0 to T=5"),
             (dict(cu_seqlens=mx.array([0, 5])), "'cu_seqlens'"),
             (dict(beta=np.zeros((B, T * n, H))), "'beta': expected an mx.array"),
             (dict(g=mx.zeros((B, T, H), dtype=mx.int32)), "'g': expected float32"),
             (dict(scale=float("nan")), "'scale'"),
             (dict(backend="tpu"), "backend='tpu'")]
    for change, match in cases:
        kw = good | change
        if match is None:
            o, ht = ops.gated_delta_product(**kw, output_final_state=True, backend="mlx")
            assert o.shape == (B, T, H, V) and ht.shape == (2, H, K, V)
            continue
        with pytest.raises(InputError, match=match):
            ops.gated_delta_product(**kw)


def test_errors_read_no_values():
    """The checks use metadata only: a lazy input whose evaluation would fail is never evaluated."""
    B, T, H, K, V, n = 1, 3, 2, 4, 4, 2
    lazy = mx.zeros((B, T * n, H, K)) / mx.zeros((B, T * n, H, K))   # NaN, never read
    with pytest.raises(InputError, match="'beta'"):
        ops.gated_delta_product(mx.zeros((B, T, H, K)), lazy, mx.zeros((B, T * n, H, V)), None,
                                mx.zeros((B, T, H)), n)


def test_head_first_warning_counts_tokens():
    """FLA's layout heuristic (T < H suggests head-first inputs) on the tokens, not on the T·n micro-steps: decoding
    (T = 1) never warns, T = 2 < H = 4 does, whatever n is."""
    H, K, V, n = 4, 4, 4, 3

    def call(T):
        return ops.gated_delta_product(mx.zeros((1, T, H, K)), mx.zeros((1, T * n, H, K)), mx.zeros((1, T * n, H, V)),
                                       mx.zeros((1, T, H)), mx.zeros((1, T * n, H)), n, backend="mlx")

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert call(1)[0].shape == (1, 1, H, V)
        assert call(5)[0].shape == (1, 5, H, V)
    with pytest.warns(UserWarning, match="gated_delta_product: .*T=2 < H=4"):
        call(2)
