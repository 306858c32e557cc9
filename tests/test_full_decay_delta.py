"""A rank-1 transition with a full (i, j) decay: declared, then checked everywhere it runs against the float64
reference interpreter, which is itself checked against a handwritten reference (``references/full_decay_delta``)
and complex-step gradients of it.

- the reference interpreter: forward ≤ 1e-12, every gradient ≤ 1e-9 against complex steps of the handwritten one;
- the ``mlx`` backend (no chunked form exists: the roles at once, the state token by token), float32 and float64
  (the fuzzer's float64 bounds: MLX's CPU exp and softplus are float32-accurate even in float64):
  odd T, T = 1, GQA, K != V, log-decays to about -10, an initial state, cotangents on o and the final state;
- the recurrent kernels on the Metal emulator (forward and backward), both orders of transition and decay.
"""
import mlx.core as mx
import numpy as np
import pytest
from references.full_decay_delta import full_decay_delta
from spec_check import compare

import recgen as rg
from recgen import ops
from recgen.math import reference
from recgen.spec.layouts import Sizes
from recgen.testing import kernel_inputs, rel_err


def spec(before_decay: bool):
    @rg.recurrence
    def full_decay_delta_spec(q: rg.Key, k: rg.Key, v: rg.Value, dt: rg.Value, A: rg.Param["i", "j"],
                              beta: rg.Scalar):
        return rg.Step(decay=rg.exp(rg.softplus(dt) * A),
                       transition=rg.rank1(-beta * k, k, before_decay=before_decay),
                       update=rg.outer(beta * k, v), readout=rg.scale * q)
    return full_decay_delta_spec


def _inputs(rec, sizes, seed):
    return kernel_inputs(rec, sizes, np.random.default_rng(seed))


def _handwritten(xs, scale, h0, before_decay):
    return full_decay_delta(xs["q"], xs["k"], xs["v"], xs["dt"], xs["A"], xs["beta"], scale, h0, before_decay)


@pytest.mark.parametrize("before_decay", [False, True])
def test_reference_interpreter_against_handwritten_and_complex_steps(before_decay):
    rec = spec(before_decay)
    sizes = Sizes(B=1, T=4, H=2, Hk=1, Kin=3, K=3, V=2)
    xs, h0, do, dht, scale = _inputs(rec, sizes, 1)
    o_r, S_r = reference.run(rec, initial_state=h0, scale=scale, **xs)
    o_h, S_h = _handwritten(xs, scale, h0, before_decay)
    assert rel_err(o_r, o_h) <= 1e-12 and rel_err(S_r, S_h) <= 1e-12
    g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    step = 1e-30

    def loss(args, h):
        o, S = _handwritten(args, scale, h, before_decay)
        return (o * do).sum() + (S * dht).sum()

    for name in list(xs) + ["initial_state"]:
        x = h0 if name == "initial_state" else xs[name]
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xc = x.astype(complex)
            xc[idx] += 1j * step
            args = xs if name == "initial_state" else {**xs, name: xc}
            g[idx] = loss(args, xc if name == "initial_state" else h0).imag / step
        assert rel_err(g_r[name], g) <= 1e-9, (name, rel_err(g_r[name], g))


@pytest.mark.parametrize("before_decay", [False, True])
@pytest.mark.parametrize("dtype,bounds", [(mx.float64, (1e-6, 1e-5)), (mx.float32, (1e-5, 1e-4))])
@pytest.mark.parametrize("sizes", [Sizes(B=2, T=7, H=4, Hk=2, Kin=8, K=8, V=5),
                                   Sizes(B=1, T=1, H=2, Hk=1, Kin=4, K=4, V=6)])
def test_mlx_backend_matches_reference(before_decay, dtype, bounds, sizes):
    rec = spec(before_decay)
    xs, h0, do, dht, scale = _inputs(rec, sizes, 2 + sizes.T)
    errs = compare(rec, xs, h0, do, dht, scale, dtype=dtype)
    for name, e in errs.items():
        assert e <= (bounds[0] if name in ("o", "state0") else bounds[1]), (name, e)


def test_op_runs_it_and_its_gradients_reach_every_input():
    """Through ``recgen.load`` on this machine's default backend: outputs and gradients equal the reference's."""
    rec = spec(False)
    sizes = Sizes(B=1, T=9, H=2, Hk=2, Kin=4, K=4, V=3)
    xs, h0, do, dht, scale = _inputs(rec, sizes, 5)
    op = rg.load(rec)
    names = list(xs)

    def loss(*a):
        o, S = op(*a[:len(names)], scale=scale, initial_state=a[-1], output_final_state=True)
        return (o * mx.array(do, mx.float32)).sum() + (S * mx.array(dht, mx.float32)).sum()

    args = [mx.array(xs[n], mx.float32) for n in names] + [mx.array(h0, mx.float32)]
    g = mx.grad(loss, argnums=list(range(len(args))))(*args)
    g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    for name, gi in zip(names + ["initial_state"], g):
        assert rel_err(np.array(gi), g_r[name]) <= 1e-4, name
    assert ops.choose_backward(rec, rg.tuning.resolve("gpu", "cuda", environ={}), 4096, None) == "recurrent"


def test_metal_kernels_match_reference():
    kernels = pytest.importorskip("recgen.verify.kernels")
    from recgen.verify.typecheck import clang_problem

    if clang_problem() is not None:
        pytest.skip(clang_problem())
    for seed, (before_decay, sizes) in enumerate([(False, Sizes(B=2, T=5, H=4, Hk=2, Kin=8, K=8, V=12)),
                                                  (True, Sizes(B=2, T=5, H=4, Hk=2, Kin=8, K=8, V=12)),
                                                  (True, Sizes(B=1, T=1, H=2, Hk=1, Kin=8, K=8, V=12))]):
        rec = spec(before_decay)
        xs, h0, do, dht, scale = _inputs(rec, sizes, 40 + seed)
        o, ht, g = kernels.emulate(rec, xs, initial_state=h0, do=do, dht=dht, scale=scale)
        o_r, ht_r = reference.run(rec, initial_state=h0, scale=scale, **xs)
        g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
        assert rel_err(o, o_r) <= 1e-5 and rel_err(ht, ht_r) <= 1e-5
        for name in g_r:
            assert rel_err(g[name], g_r[name]) <= 1e-4, (before_decay, name, rel_err(g[name], g_r[name]))
