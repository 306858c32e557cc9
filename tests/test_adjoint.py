r"""The adjoint: symbolic partials vs hand-derived ones, the dot-product test <J x, y> = <x, Jᵀ y>
(J x by complex step, Jᵀ y by reference.grad), central finite differences, and the gates."""
from __future__ import annotations


import numpy as np
import pytest
import sympy as sp

from helpers import inner, random_cotangents, random_inputs, random_state, rel_err, state_parts
from recgen.math import adjoint, reference
from recgen.spec import fns
from recgen.spec.fns import exp, logsigmoid, sigmoid, softplus
from recgen.spec.ir import SCALE
from recgen.specs import BUILTINS

ALL = dict(BUILTINS)
SIZES = dict(B=2, T=6, H=4, K=3, V=2)


def _sym(name):
    return sp.Symbol(name, real=True)


def _partials(spec):
    """{(role, wrt): (expr, reduce)} of the derived adjoint."""
    out = {}
    for p in adjoint.derive(spec).partials:
        assert (p.role, p.wrt) not in out, p
        out[p.role, p.wrt] = (p.expr, p.reduce)
    return out


def _assert_partials(spec, expected):
    got = _partials(spec)
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    for key, (want, reduce) in expected.items():
        expr, red = got[key]
        assert sp.simplify(expr - want) == 0, (key, expr, want)
        assert red == reduce, (key, red, reduce)


# -- (a) symbolic partials -------------------------------------------------------------------------

def test_partials_gla():
    q, k, v, gk = map(_sym, "q k v gk".split())
    _assert_partials(BUILTINS["gla"], {
        ("decay", "gk"): (exp(gk), ("j",)),     # ∂e^{gk_i}/∂gk_i, summed over the value columns
        ("u", "k"): (1, ()), ("w", "v"): (1, ()), ("r", "q"): (SCALE, ())})


def test_partials_simple_gla():
    g = _sym("g")
    got = _partials(BUILTINS["simple_gla"])
    assert sp.simplify(got["decay", "g"][0] - exp(g)) == 0 and got["decay", "g"][1] == ("i", "j")


@pytest.mark.parametrize("name", ["delta_net", "gated_delta_net"])
def test_partials_delta_rule(name):
    k, beta, g = _sym("k"), _sym("beta"), _sym("g")
    expected = {
        ("a", "beta"): (-k, ("i",)), ("a", "k"): (-beta, ()),   # a = -β k
        ("b", "k"): (1, ()),                                    # b = k
        ("u", "beta"): (k, ("i",)), ("u", "k"): (beta, ()),     # u = β k
        ("w", "v"): (1, ()), ("r", "q"): (SCALE, ()),
    }
    if name == "gated_delta_net":
        expected["decay", "g"] = (exp(g), ("i", "j"))
    _assert_partials(BUILTINS[name], expected)


def test_partials_selective_scan():
    x, dt, A, D, bias = map(_sym, "x dt A D dt_bias".split())
    delta = softplus(dt + bias)
    sig = sigmoid(dt + bias)
    _assert_partials(BUILTINS["selective_scan"], {
        ("decay", "dt"): (A * sig * exp(delta * A), ("i",)),    # ∂e^{ΔA}/∂dt = A σ(dt+b) e^{ΔA}
        ("decay", "dt_bias"): (A * sig * exp(delta * A), ("i",)),
        ("decay", "A"): (delta * exp(delta * A), ()),
        ("u", "B"): (1, ()),
        ("w", "dt"): (sig * x, ()), ("w", "dt_bias"): (sig * x, ()), ("w", "x"): (delta, ()),
        ("r", "C"): (1, ()),
        ("skip", "D"): (x, ()), ("skip", "x"): (D, ()),
    })


def test_partials_selective_scan_linear_dt():
    x, dt, A = map(_sym, "x dt A".split())
    got = _partials(BUILTINS["selective_scan_linear_dt"])
    assert sp.simplify(got["decay", "dt"][0] - A * exp(dt * A)) == 0
    assert sp.simplify(got["decay", "A"][0] - dt * exp(dt * A)) == 0
    assert sp.simplify(got["w", "dt"][0] - x) == 0 and sp.simplify(got["w", "x"][0] - dt) == 0


def test_partials_power_retention():
    g = _sym("g")
    spec = BUILTINS["power_retention"]
    got = _partials(spec)
    assert sp.simplify(got["decay", "g"][0] - exp(g)) == 0
    assert sp.simplify(got["zdecay", "g"][0] - exp(g)) == 0
    assert sp.simplify(got["r", "phi(q)"][0] - SCALE**2) == 0
    assert got["u", "phi(k)"][0] == 1 and got["zupdate", "phi(k)"][0] == 1
    assert adjoint.derive(spec).dN == 1


def test_partials_mlstm_gates_stay_named():
    """Gates differentiate into gates (σ' = σ(1-σ), (log σ)' = σ(-x)), never into raw exponentials."""
    ig, fg, k = _sym("ig"), _sym("fg"), _sym("k")
    got = _partials(BUILTINS["mlstm_sigmoid"])
    assert sp.simplify(got["decay", "fg"][0] - sigmoid(-fg) * exp(logsigmoid(fg))) == 0
    assert sp.simplify(got["u", "ig"][0] - k * sigmoid(ig) * (1 - sigmoid(ig))) == 0
    n = sp.Symbol("n", real=True)
    assert sp.simplify(adjoint.derive(BUILTINS["mlstm_sigmoid"]).dN - n / sp.sqrt(n**2 + 1)) == 0
    for (_, _), (expr, _) in got.items():
        # no exp(-x)/(1+exp(-x))**2 style expansions: only exp of a gate or of a plain product
        for e in expr.atoms(sp.exp):
            assert not e.args[0].could_extract_minus_sign() or e.args[0].has(logsigmoid), expr


# -- (b) dot-product test and (c) finite differences ----------------------------------------------

def _case(spec, rng, T=None):
    sz = dict(SIZES, T=T or SIZES["T"])
    x = random_inputs(spec, rng, **sz)
    h0 = random_state(spec, rng, B=sz["B"], H=sz["H"], K=sz["K"], V=sz["V"])
    do, dht = random_cotangents(spec, rng, **sz)
    return x, h0, do, dht


def _direction(spec, x, h0, rng):
    dx = {k: rng.standard_normal(v.shape) for k, v in x.items()}
    dh = tuple(rng.standard_normal(p.shape) for p in state_parts(h0))
    return dx, (dh if spec.has_normalizer else dh[0])


def _shift(spec, x, h0, dx, dh, eps):
    xs = {k: x[k] + eps * dx[k] for k in x}
    hs = tuple(a + eps * b for a, b in zip(state_parts(h0), state_parts(dh)))
    return xs, (hs if spec.has_normalizer else hs[0])


def _vjp_dot(spec, x, h0, do, dht, dx, dh):
    """<x, Jᵀ y> with y = (do, dht)."""
    g = reference.grad(spec, do=do, dht=dht, initial_state=h0, **x)
    assert set(g) == set(x) | {"initial_state"}
    return sum(float(np.sum(dx[k] * g[k])) for k in x) + inner(dh, g["initial_state"])


@pytest.mark.parametrize("name", list(ALL))
def test_dot_product(name, rng):
    """<J x, y> = <x, Jᵀ y>, J x by complex step (exact to rounding), Jᵀ y by the reverse sweep."""
    spec = ALL[name]
    x, h0, do, dht = _case(spec, rng)
    dx, dh = _direction(spec, x, h0, rng)
    h = 1e-30
    xs = {k: x[k] + 1j * h * dx[k] for k in x}
    hs = tuple(a + 1j * h * b for a, b in zip(state_parts(h0), state_parts(dh)))
    o, S = reference.run(spec, initial_state=hs if spec.has_normalizer else hs[0], **xs)
    Jx_o, Jx_S = o.imag / h, tuple(p.imag / h for p in state_parts(S))
    assert np.iscomplexobj(o)
    lhs = float(np.sum(Jx_o * do)) + inner(Jx_S, dht)
    rhs = _vjp_dot(spec, x, h0, do, dht, dx, dh)
    assert abs(lhs - rhs) <= 1e-10 * max(abs(lhs), abs(rhs)), (lhs, rhs)
    # and the complex run's real part is the real run
    o_r, S_r = reference.run(spec, initial_state=h0, **x)
    assert rel_err(o.real, o_r) <= 1e-14


@pytest.mark.parametrize("name", list(ALL))
def test_finite_differences(name, rng):
    """Central differences of L = <F(θ), y> along a few random directions, rel 1e-6."""
    spec = ALL[name]
    x, h0, do, dht = _case(spec, rng)
    eps = 1e-5
    for _ in range(3):
        dx, dh = _direction(spec, x, h0, rng)

        def L(e):
            xs, hs = _shift(spec, x, h0, dx, dh, e)
            o, S = reference.run(spec, initial_state=hs, **xs)
            return float(np.sum(o * do)) + inner(S, dht)

        fd = (L(eps) - L(-eps)) / (2 * eps)
        an = _vjp_dot(spec, x, h0, do, dht, dx, dh)
        assert abs(fd - an) <= 1e-6 * max(abs(an), 1e-3), (fd, an)


@pytest.mark.parametrize("name", list(ALL))
def test_grad_without_initial_state_or_dht(name, rng):
    """initial_state=None and dht=None are the zero state / zero cotangent."""
    spec = ALL[name]
    x, h0, do, dht = _case(spec, rng)
    zero = tuple(np.zeros_like(p) for p in state_parts(h0))
    zero = zero if spec.has_normalizer else zero[0]
    g0 = reference.grad(spec, do=do, **x)
    g1 = reference.grad(spec, do=do, dht=zero, initial_state=zero, **x)
    for k in x:
        assert rel_err(g0[k], g1[k]) == 0.0, k
    o0, _ = reference.run(spec, **x)
    o1, _ = reference.run(spec, initial_state=zero, **x)
    assert rel_err(o0, o1) == 0.0


# -- (d) gates -------------------------------------------------------------------------------------

_EXPLICIT = {sigmoid: lambda a: 1 / (1 + sp.exp(-a)), softplus: lambda a: sp.log(1 + sp.exp(a)),
             logsigmoid: lambda a: -sp.log(1 + sp.exp(-a))}


@pytest.mark.parametrize("gate", [sigmoid, softplus, logsigmoid], ids=lambda g: g.__name__)
def test_gate_fdiff_matches_explicit_form(gate):
    x = sp.Symbol("x", real=True)
    d = sp.diff(gate(x), x)
    explicit = d.replace(sigmoid, _EXPLICIT[sigmoid])
    want = sp.diff(_EXPLICIT[gate](x), x)
    assert sp.simplify(explicit - want) == 0, (d, want)
    # and numerically, through the numpy gates, with central differences
    f = fns.NUMPY_GATES[gate.__name__]
    df = sp.lambdify(x, d, modules=[fns.NUMPY_GATES, "numpy"])
    for v in (-30.0, -3.0, -0.5, 0.0, 0.7, 4.0, 30.0):
        h = 1e-6
        fd = (f(v + h) - f(v - h)) / (2 * h)
        assert abs(fd - df(v)) <= 1e-8 * max(1.0, abs(df(v))), (gate, v)


@pytest.mark.parametrize("name", ["sigmoid", "softplus", "logsigmoid"])
def test_numpy_gates_finite_at_extremes(name):
    f = fns.NUMPY_GATES[name]
    x = np.array([-1000.0, -100.0, -1.0, 0.0, 1.0, 100.0, 1000.0])
    with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
        y = f(x)
    assert np.all(np.isfinite(y)), y
    exact = {"sigmoid": lambda t: 1 / (1 + np.exp(-np.clip(t, -700, 700))),
             "softplus": lambda t: np.logaddexp(0, t), "logsigmoid": lambda t: -np.logaddexp(0, -t)}[name]
    assert np.allclose(y, exact(x), rtol=1e-14, atol=1e-15)
    # their derivatives (the gates themselves) are finite there too
    s = sp.Symbol("s", real=True)
    gate = getattr(fns, name)
    df = sp.lambdify(s, sp.diff(gate(s), s), modules=[fns.NUMPY_GATES, "numpy"])
    assert np.all(np.isfinite(df(x)))


def test_numpy_sigmoid_relative_accuracy_in_left_tail():
    x = np.array([-5.0, -20.0, -40.0, -100.0, -700.0])
    want = np.exp(x) / (1 + np.exp(x))
    assert np.allclose(fns.NUMPY_GATES["sigmoid"](x), want, rtol=1e-13, atol=0)


@pytest.mark.parametrize("name", ["sigmoid", "softplus", "logsigmoid"])
def test_numpy_gates_complex_step(name):
    """The gates are analytic in their numpy form: complex step gives the exact derivative."""
    f = fns.NUMPY_GATES[name]
    s = sp.Symbol("s", real=True)
    df = sp.lambdify(s, sp.diff(getattr(fns, name)(s), s), modules=[fns.NUMPY_GATES, "numpy"])
    x = np.array([-50.0, -2.0, 0.3, 5.0, 50.0])
    d = np.imag(f(x + 1e-30j)) / 1e-30
    assert np.allclose(d, df(x), rtol=1e-13, atol=1e-15)
