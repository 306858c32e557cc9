"""Every decay the decorator accepts is computed exactly by the chunked form, or rejected at declaration.

Decays nonnegative by construction but not written as exp(...) (x², cos²x, |m|·e^g, products of squares ...)
take an exact log factor by factor (``recgen.spec.decay``); a decay of exactly 0 is a reset (log -inf with a
zero gradient); decays sympy cannot prove nonnegative are a SpecError at declaration (value-indexed decays with
a rank-1 transition are accepted: ``test_full_decay_delta.py``). Checked against the float64 reference with
inputs that are negative and exactly 0, in float64 and float32, on the CPU forms and the GPU forms (forced on
the CPU)."""

import mlx.core as mx
import numpy as np
import pytest
import sympy as sp
from spec_check import bad, compare

import recgen as rg
from recgen import chunked, ops
from recgen import tuning

B, T, H, HK, K, V = 2, 37, 4, 2, 5, 3

DECAYS = {  # name -> decay of scalars x, y (in [-1, 1], some exactly 0) and a key gate a
    "square": lambda x, y, a: x ** 2,
    "product_of_squares": lambda x, y, a: x ** 2 * y ** 2,
    "cos_squared": lambda x, y, a: sp.cos(3 * x) ** 2,
    "mask_times_gate": lambda x, y, a: sp.Abs(x) * rg.exp(-rg.softplus(y)),
    "sigmoid_squared": lambda x, y, a: rg.sigmoid(4 * x) ** 2,
    "rational": lambda x, y, a: 1 / (1 + 3 * x ** 2),
    "sum_of_squares": lambda x, y, a: (x ** 2 + y ** 2) / 2,
    "key_square": lambda x, y, a: a ** 2,
    "key_mask_gate": lambda x, y, a: sp.Abs(x) * rg.exp(-a ** 2),
}


def _spec(decay, delta=False, norm=False):
    def f(q: rg.Key, k: rg.Key, v: rg.Value, x: rg.Scalar, y: rg.Scalar, a: rg.KeyGate, b: rg.Scalar):
        D = decay(x, y, a)
        beta = rg.sigmoid(b)
        return rg.Step(decay=D, update=rg.outer(beta * k, v), readout=rg.scale * q,
                       transition=rg.rank1(-beta * k, k) if delta else None,
                       normalizer=rg.normalizer(D, beta * k, lambda n: sp.sqrt(n ** 2 + 1)) if norm else None)
    return rg.recurrence(f, name="decay_check")


def _inputs(rec, rng):
    def with_zeros(shape):
        u = rng.uniform(-1, 1, shape)
        u[rng.uniform(size=shape) < 0.2] = 0.0
        return u
    xs = {"q": rng.standard_normal((B, T, HK, K)), "k": rng.standard_normal((B, T, HK, K)),
          "v": rng.standard_normal((B, T, H, V)), "x": with_zeros((B, T, H)), "y": with_zeros((B, T, H)),
          "a": with_zeros((B, T, H, K)), "b": rng.standard_normal((B, T, H))}
    if rec.step.transition is not None:
        xs["k"] /= np.linalg.norm(xs["k"], axis=-1, keepdims=True)
    xs = {n: a.astype(np.float32).astype(np.float64) for n, a in xs.items()}
    f = lambda *s: rng.standard_normal(s).astype(np.float32).astype(np.float64)  # noqa: E731
    h0, dht = f(B, H, K, V), f(B, H, K, V)
    if rec.has_normalizer:
        h0, dht = (h0, np.abs(f(B, H, K))), (dht, f(B, H, K))
    return xs, h0, f(B, T, H, V), dht


@pytest.fixture(params=["cpu_forms", "gpu_forms"])
def forms(request):
    gpu = request.param == "gpu_forms"
    with tuning.override(gpu_forms=gpu, compile=gpu, inverse_base=16 if gpu else 1):
        yield request.param


@pytest.mark.parametrize("name", sorted(DECAYS))
def test_nonnegative_decays_are_exact(name, forms, rng):
    rec = _spec(DECAYS[name])
    xs, h0, do, dht = _inputs(rec, rng)
    # float64: MLX's CPU cos/sigmoid/log are float32-accurate even in float64, hence 1e-6
    assert not bad(compare(rec, xs, h0, do, dht, 0.5, dtype=mx.float64, chunk_size=16), 1e-6, 1e-6)
    assert not bad(compare(rec, xs, h0, do, dht, 0.5, dtype=mx.float32, chunk_size=16), 1e-5, 1e-4)


@pytest.mark.parametrize("name", ["square", "mask_times_gate", "key_mask_gate"])
@pytest.mark.parametrize("kind", ["delta", "normalizer"])
def test_zero_decays_with_transition_and_normalizer(name, kind, rng):
    rec = _spec(DECAYS[name], delta=kind == "delta", norm=kind == "normalizer")
    xs, h0, do, dht = _inputs(rec, rng)
    assert not bad(compare(rec, xs, h0, do, dht, 0.5, dtype=mx.float64, chunk_size=8), 1e-6, 1e-6)


def test_all_zero_decay_resets_every_step(rng):
    """decay = 0 everywhere: each state is the step's own update."""
    rec = _spec(lambda x, y, a: 0 * x + sp.Integer(0))
    xs, h0, _, _ = _inputs(rec, rng)
    o, S = chunked.forward(rec, {n: mx.array(a, dtype=mx.float64) for n, a in xs.items()}, scale=1.0,
                           initial_state=mx.array(h0, dtype=mx.float64), compute_dtype=mx.float64)
    beta = 1 / (1 + np.exp(-xs["b"]))
    k = np.repeat(xs["k"], H // HK, axis=2)
    S_last = beta[:, -1, :, None, None] * k[:, -1, :, :, None] * xs["v"][:, -1, :, None, :]
    assert np.allclose(np.array(S), S_last, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("decay", [
    lambda x, y, a: x, lambda x, y, a: x * y, lambda x, y, a: -rg.exp(x), lambda x, y, a: sp.cos(x),
    lambda x, y, a: x ** 3, lambda x, y, a: 2 * rg.sigmoid(x) - 1, lambda x, y, a: a * rg.exp(x)])
def test_decays_that_can_be_negative_are_rejected_at_declaration(decay):
    with pytest.raises(rg.SpecError, match="can be negative.*log D"):
        _spec(decay)


def test_normalizer_decay_that_can_be_negative_is_rejected():
    def f(q: rg.Key, k: rg.Key, v: rg.Value, x: rg.Scalar):
        return rg.Step(decay=rg.exp(x), update=rg.outer(k, v), readout=q, normalizer=rg.normalizer(x, k))
    with pytest.raises(rg.SpecError, match="normalizer decay d = x: can be negative"):
        rg.recurrence(f)


@pytest.mark.parametrize("index", [["j"], ["i", "j"]])
def test_value_indexed_decay_with_transition_runs_stepwise(index, rng):
    """Declared, and the ``mlx`` backend (no chunked form: the state stepped token by token) matches the float64
    reference, gradients included."""
    from recgen.spec.layouts import Sizes
    from recgen.testing import kernel_inputs

    def f(q: rg.Key, k: rg.Key, v: rg.Value, beta: rg.Scalar, A: rg.Param[tuple(index)]):
        return rg.Step(decay=rg.exp(-A ** 2), transition=rg.rank1(-beta * k, k), update=rg.outer(k, v), readout=q)
    rec = rg.recurrence(f)
    xs, h0, do, dht, scale = kernel_inputs(rec, Sizes(B=1, T=6, H=2, Hk=1, Kin=4, K=4, V=3), rng)
    errs = compare(rec, xs, h0, do, dht, scale, dtype=mx.float64)
    assert max(errs.values()) <= 1e-5, errs


@pytest.mark.parametrize("name", ["square", "mask_times_gate"])
def test_kernel_backends_see_the_same_zero_decays(name, rng):
    """The Metal kernels compute D itself: on the emulator, x² and |m|·e^g decays with exact zeros match the
    reference (|m|'s derivative, sign(m), prints in both dialects)."""
    verify = pytest.importorskip("recgen.verify.kernels")
    from recgen.verify.typecheck import clang_problem

    if clang_problem():
        pytest.skip(clang_problem())
    from spec_check import rel

    from recgen.math import reference

    rec = _spec(DECAYS[name], delta=True)
    xs, h0, do, dht = _inputs(rec, rng)
    xs = {n: a[:, :5] for n, a in xs.items()}
    do = do[:, :5]
    o, ht, g = verify.emulate(rec, xs, initial_state=h0, do=do, dht=dht, scale=0.5)
    o_r, ht_r = reference.run(rec, initial_state=h0, scale=0.5, **xs)
    g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=0.5, **xs)
    assert rel(o, o_r) <= 1e-5 and rel(ht, ht_r) <= 1e-5
    for n in g_r:
        assert rel(g[n], g_r[n]) <= 1e-4, n


def test_op_with_square_decay_is_finite_for_negative_inputs(rng):
    """The issue's case: decay = x² with x = -0.5 gave all-NaN on the mlx backend."""
    rec = _spec(DECAYS["square"])
    xs, _, _, _ = _inputs(rec, rng)
    xs["x"][:] = -0.5
    o, _ = ops.load(rec, backend="mlx")(**{n: mx.array(a.astype(np.float32)) for n, a in xs.items()})
    assert np.isfinite(np.array(o)).all()


@pytest.mark.parametrize("name", ["simple_gla", "gla", "gated_delta_net"])
@pytest.mark.parametrize("dtype, bound", [(mx.float32, 1e-5), (mx.float64, 1e-13)])
def test_log_decay_gradient_error_is_absolute(name, dtype, bound, forms, rng):
    """The documented bound (README, benchmarks/decay_grad_accuracy.py): the chunked form's log-decay gradient
    has an error bounded by a small multiple of the precision times max|dl|, not relative to each dl_t. Where
    log-decays are below -15, dl_t is ~1e-7 of max|dl| and its relative error in float32 is O(1) or more."""
    from recgen import specs
    from recgen.math import reference

    rec = specs.BUILTINS[name]
    gname = "gk" if name == "gla" else "g"
    Bt, Tt, Ht, D = 1, 128, 2, 16
    xs = {}
    for x in rec.inputs:
        shape = {"scalar": (Bt, Tt, Ht), "key": (Bt, Tt, Ht, D), "key_gate": (Bt, Tt, Ht, D),
                 "value": (Bt, Tt, Ht, D)}[x.kind]
        xs[x.name] = rng.standard_normal(shape)
    strong = rng.uniform(size=xs[gname].shape) < 0.5
    xs[gname] = np.where(strong, -rng.uniform(15, 20, strong.shape), -rng.uniform(0, 1, strong.shape))
    if "beta" in xs:
        xs["beta"] = 1 / (1 + np.exp(-xs["beta"]))
        xs["k"] /= np.linalg.norm(xs["k"], axis=-1, keepdims=True)
    xs = {n: a.astype(np.float32).astype(np.float64) for n, a in xs.items()}
    do = rng.standard_normal((Bt, Tt, Ht, D)).astype(np.float32).astype(np.float64)
    ref = reference.grad(rec, do=do, scale=0.25, **xs)[gname]
    names = list(xs)
    kw = {"compute_dtype": mx.float64} if dtype == mx.float64 else {}

    def loss(*a):
        o, _ = chunked.forward(rec, dict(zip(names, a)), scale=0.25, chunk_size=16, **kw)
        return (o * mx.array(do, dtype=dtype)).sum()

    got = np.array(mx.grad(loss, argnums=names.index(gname))(*[mx.array(xs[n], dtype=dtype) for n in names]),
                   np.float64)
    assert np.abs(got - ref).max() <= bound * np.abs(ref).max()
    assert np.abs(ref[strong]).max() <= 1e-5 * np.abs(ref[~strong]).max()  # the strong decays' dl really is tiny
