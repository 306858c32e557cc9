"""A feature-map spec as attention (``chunked.features.attention_form``, ``Tuning.feature_attention``): no expanded
state between chunks, each earlier chunk read through its scores (q·k)^p; the final state a graph of its own.
Forward, final state and every gradient against the float64 reference (degrees 2, 3, 4; GQA, K != V, odd T, T = 1,
T within one chunk, strong decays), the form actually taken (a spy), and the rules that choose it."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import recgen as rg
from recgen import chunked, tuning
from recgen.chunked import features
from recgen.errors import InputError
from recgen.math import reference
from recgen.spec.features import sympow, sympow_width
from recgen.testing import rel_err


def power_retention(p: int, eps: float = 1e-2):
    @rg.recurrence(name=f"power_retention{p}_attention_test")
    def spec(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar):
        pk = rg.sympow(k, p)
        return rg.Step(decay=rg.exp(g), update=rg.outer(pk, v), readout=rg.scale**p * rg.sympow(q, p),
                       normalizer=rg.normalizer(rg.exp(g), pk, lambda n: n + eps))
    return spec


SPECS = {p: power_retention(p) for p in (2, 3, 4)}


@rg.recurrence
def retention4(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar):
    """Degree 4 without a normalizer: y = φ(q)ᵀS alone."""
    return rg.Step(decay=rg.exp(g), update=rg.outer(rg.sympow(k, 4), v), readout=rg.scale**4 * rg.sympow(q, 4))


def _inputs(rng, B=2, T=9, H=2, Hk=1, d=3, V=4, strength=3.0):
    q, k = rng.standard_normal((2, B, T, Hk, d))
    return dict(q=q, k=k, v=rng.standard_normal((B, T, H, V)), g=-strength * rng.uniform(0, 1, (B, T, H)) ** 3)


@pytest.fixture
def taken(monkeypatch):
    """The calls of ``attention_form`` (a spy: the form the op took)."""
    calls = []
    real = features.attention_form
    monkeypatch.setattr(features, "attention_form", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


def _check(rec, xs, rng, scale, chunk_size, dtype=mx.float64, tol=(1e-10, 1e-10), h0=None):
    """Forward, final state and every gradient (cotangents on o and on both final states; ``h0``: from that initial
    state, its gradients too) against the reference."""
    has_z = rec.has_normalizer
    names = list(xs)
    o_r, s_r = reference.run(rec, scale=scale, initial_state=h0, **xs)
    s_r = s_r if has_z else (s_r,)
    do = rng.standard_normal(o_r.shape)
    dht = tuple(rng.standard_normal(s.shape) for s in s_r)
    g_r = reference.grad(rec, do=do, dht=dht if has_z else dht[0], scale=scale, initial_state=h0, **xs)
    h0s = () if h0 is None else (tuple(h0) if has_z else (h0,))

    def f(*a):
        state = None if h0 is None else (tuple(a[len(names):]) if has_z else a[len(names)])
        o, st = chunked.forward(rec, dict(zip(names, a)), scale=scale, chunk_size=chunk_size, initial_state=state,
                                compute_dtype=mx.float64 if dtype == mx.float64 else None)
        return (o, *(st if has_z else (st,)))

    arr = lambda a: mx.array(a, dtype=dtype)  # noqa: E731
    got, grads = mx.vjp(f, [arr(xs[n]) for n in names] + [arr(h) for h in h0s], [arr(c) for c in (do, *dht)])
    errs = {k: rel_err(np.array(a.astype(mx.float32) if dtype != mx.float64 else a), b)
            for k, a, b in zip(("o", "S", "z"), got, (o_r, *s_r))}
    want = [g_r[n] for n in names] + (list(g_r["initial_state"]) if has_z else [g_r["initial_state"]] if h0s else [])
    errs |= {"d" + n: rel_err(np.array(g.astype(mx.float32) if dtype != mx.float64 else g), w)
             for n, g, w in zip(names + ["S0", "z0"][:len(h0s)], grads, want)}
    bad = {k: v for k, v in errs.items() if not v <= (tol[1] if k.startswith("d") else tol[0])}
    assert not bad, (bad, errs)


@pytest.mark.parametrize("degree", [2, 3, 4])
@pytest.mark.parametrize("T,chunk", [(9, 4), (1, 4), (3, 4), (17, 8)])
def test_attention_form_matches_the_reference(degree, T, chunk, rng, taken):
    """Float64 end to end: GQA (two value heads over one key head), K != V, T odd, T = 1 and T within one chunk (no
    term between chunks), cotangents on the final states too."""
    with tuning.override(feature_attention="always"):
        _check(SPECS[degree], _inputs(rng, T=T), rng, 0.7, chunk)
    assert taken, "the attention form was not taken"


def test_attention_form_without_a_normalizer(rng, taken):
    with tuning.override(feature_attention="always"):
        _check(retention4, _inputs(rng, T=11, d=2, V=3), rng, 0.8, 4)
    assert taken


@pytest.mark.parametrize("given", [False, True])
def test_attention_form_in_float32_at_strong_decays(given, rng, taken):
    """Log-decays down to -20 (resets inside and between chunks), float32 against float64; ``given``: from a reachable
    initial state (S0, z0) = Σ_j (φ(w_j) v_jᵀ, φ(w_j)) over three random w, float32-exact."""
    xs = _inputs(rng, B=1, T=40, H=2, Hk=2, d=4, V=5, strength=20.0)
    h0 = None
    if given:
        phi = sympow(rng.standard_normal((1, 2, 3, 4)), 4)
        h0 = tuple(np.float32(a).astype(np.float64)
                   for a in (phi.swapaxes(-1, -2) @ rng.standard_normal((1, 2, 3, 5)), phi.sum(2)))
    with tuning.override(feature_attention="always"):
        _check(SPECS[4], xs, rng, 0.5, 8, dtype=mx.float32, tol=(1e-5, 1e-4), h0=h0)
    assert taken


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_attention_form_from_an_initial_state(degree, rng, taken):
    """A given initial state (S0, z0), read as e^{Γ_t} φ(q_t)ᵀS0 and decayed into the final state, its gradients
    too; degree 2 over MLX's tiles (their weights ω on the state); then with a budget of one chunk of queries' scores,
    which reads S0 in slices of 96 / R tokens' φ(q), whole chunks where that holds one (8, 4 and 2 at d = 4)."""
    xs = _inputs(rng, T=9, d=4)
    R = sympow_width(4, degree)
    h0 = (rng.standard_normal((2, 2, R, 4)), np.abs(rng.standard_normal((2, 2, R))))  # z0 ≥ 0 keeps n_t away from 0
    with tuning.override(feature_attention="always"):
        _check(SPECS[degree], xs, rng, 0.7, 4, h0=h0)
    one = 4 * 4 * 4 * 12 * features.ATTENTION_ARRAYS  # B·H = 4, chunks of 4, T padded to 12
    with tuning.override(feature_attention="always", segment_budget=one):
        _check(SPECS[degree], xs, rng, 0.7, 4, h0=h0)
    assert len(taken) == 2


def test_the_wide_rule_takes_attention_for_degree_4_and_not_for_degree_2(rng, taken):
    """The default (``"wide"``): a degree without row kernels and fewer multiply-adds runs as attention, degree 2
    keeps the expanded state; reading an initial state costs R V' a token more (φ(q)ᵀS0), which at 15 rows tips this
    case back to the expanded state."""
    xs = {n: mx.array(a, dtype=mx.float32) for n, a in _inputs(rng).items()}
    with tuning.override(feature_attention="wide"):
        chunked.forward(SPECS[2], xs, scale=0.5, chunk_size=4)
        assert not taken
        chunked.forward(SPECS[4], xs, scale=0.5, chunk_size=4)
        assert len(taken) == 1
        R = sympow_width(3, 4)
        state = (mx.zeros((2, 2, R, 4)), mx.zeros((2, 2, R)))
        chunked.forward(SPECS[4], xs, scale=0.5, chunk_size=4, initial_state=state)
        assert len(taken) == 1
    with tuning.override(feature_attention="never"):
        chunked.forward(SPECS[4], xs, scale=0.5, chunk_size=4)
        assert len(taken) == 1


def test_attends_rules():
    big = 2**40
    assert features.attends("always", 2, 16, 4096, 256, 2080, 64, 65, big)
    assert not features.attends("wide", 2, 16, 4096, 256, 2080, 64, 65, big)  # degree 2: its rows have kernels
    assert features.attends("wide", 4, 16, 4096, 256, sympow_width(64, 4), 64, 65, big)
    assert not features.attends("wide", 3, 1, 4096, 64, sympow_width(4, 3), 4, 5, big)  # 20 rows: the state is cheaper
    assert not features.attends("never", 4, 16, 4096, 256, sympow_width(64, 4), 64, 65, big)
    one = 4 * 16 * 256 * 4096 * features.ATTENTION_ARRAYS  # one chunk of queries against the whole sequence
    assert features.attention_groups(16, 4096, 256, 3 * one + 1) == 3
    assert features.attends("always", 4, 16, 4096, 256, 10**6, 64, 65, one)
    assert not features.attends("always", 4, 16, 4096, 256, 10**6, 64, 65, one - 1)


@pytest.mark.parametrize("group", [1, 2])
def test_attention_form_in_groups_of_queries(group, rng, taken):
    """A budget that holds ``group`` chunks of queries' scores at a time (``attention_groups``): the term between
    chunks in groups (the last one partial at group 2: five chunks), each against the keys up to its end."""
    rec = SPECS[4]
    B, T, H, C = 2, 17, 2, 4
    n = -(-T // C)
    one = 4 * B * H * C * n * C * features.ATTENTION_ARRAYS
    with tuning.override(feature_attention="always", segment_budget=group * one):
        assert features.attention_groups(B * H, n * C, C, group * one) == group
        _check(rec, _inputs(rng, B=B, T=T, H=H), rng, 0.7, C)
    assert taken


def test_feature_attention_choices_are_checked(recgen_env):
    with pytest.raises(InputError, match="feature_attention='sometimes'"):
        tuning.resolve("cpu", feature_attention="sometimes")
    with pytest.raises(InputError, match="RECGEN_FEATURE_ATTENTION"):
        recgen_env(RECGEN_FEATURE_ATTENTION="sometimes")
        tuning.current()
    recgen_env(RECGEN_FEATURE_ATTENTION="never")
    assert tuning.current().feature_attention == "never"


@pytest.mark.parametrize("given", [False, True])
def test_attention_form_is_lazy_under_compile(given, rng, taken):
    """Forward and gradient under ``mx.compile`` match the uncompiled op (no host sync on the path), from a zero and
    from a given initial state."""
    rec = SPECS[4]
    op = rg.load(rec, backend="mlx")
    xs = [mx.array(a.astype(np.float32)) for a in _inputs(rng, T=9, d=4).values()]
    R = sympow_width(4, 4)
    h0 = [mx.array(rng.standard_normal((2, 2, R, 4)).astype(np.float32)),
          mx.array(np.abs(rng.standard_normal((2, 2, R))).astype(np.float32))] if given else []

    def fwd(*a):
        o, (S, z) = op(*a[:4], initial_state=tuple(a[4:]) if given else None, output_final_state=True)
        return o, S, z

    def loss(*a):
        o, S, z = fwd(*a)
        return (o * o).sum() + S.sum() + z.sum()

    args, argnums = xs + h0, tuple(range(len(xs) + len(h0)))
    with tuning.override(feature_attention="always"):
        for a, b in zip(mx.compile(fwd)(*args), fwd(*args)):
            assert rel_err(np.array(a), np.array(b)) <= 1e-5
        grad = mx.grad(loss, argnums=argnums)
        for a, b in zip(mx.compile(grad)(*args), grad(*args)):
            assert rel_err(np.array(a), np.array(b)) <= 1e-4
    assert taken
