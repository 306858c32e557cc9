"""Validate the hand-written backwards of the numpy references by complex-step
differentiation (grad_i = Im f(x + i h e_i) / h, h = 1e-30: no subtractive cancellation, so
the check is exact to rounding), plus independent closed-form / cross-model sanity checks
of the forwards.  Small shapes, strong decays (log-decay down to -20), random initial states.
"""
from __future__ import annotations

import numpy as np
import pytest

from recgen.testing import rel_err

from .delta_net import delta_net, delta_net_bwd
from .gated_delta_net import gated_delta_net, gated_delta_net_bwd
from .gated_delta_product import gated_delta_product, gated_delta_product_bwd
from .gla import gla, gla_bwd
from .hgrn2 import hgrn2, hgrn2_bwd, hgrn2_gate
from .kda import kda, kda_bwd
from .mamba2 import mamba2, mamba2_bwd
from .mlstm import mlstm, mlstm_bwd
from .mlstm_sigmoid import mlstm_sigmoid, mlstm_sigmoid_bwd
from .rwkv6 import rwkv6, rwkv6_bwd
from .rwkv7 import rwkv7, rwkv7_bwd
from .power_retention import power_retention, power_retention_bwd, sympow2, sympow2_bwd
from .retnet import retnet, retnet_bwd, retnet_log_gamma
from .selective_scan import selective_scan, selective_scan_bwd, sigmoid, softplus
from .simple_gla import simple_gla, simple_gla_bwd

H_CS = 1e-30
TOL = 1e-10
B_, K_, V_ = 2, 3, 4

# (T, Hk, H, scale): T=1 edge, GQA with trivial key heads, GQA with 2 key heads + explicit scale
CASES = [(1, 1, 2, None), (5, 1, 2, None), (5, 2, 4, 0.7)]
CASE_IDS = ["T1-Hk1-H2", "T5-Hk1-H2", "T5-Hk2-H4-scale"]


# ----------------------------------------------------------------------------- helpers
def cs_grad(loss, inp, key):
    """Complex-step gradient of the real scalar loss(inp) w.r.t. inp[key], element-wise."""
    x = np.asarray(inp[key], dtype=np.float64)
    g = np.zeros(x.shape)
    for idx in np.ndindex(*x.shape):
        xc = x.astype(np.complex128)
        xc[idx] += 1j * H_CS
        g[idx] = np.imag(loss({**inp, key: xc})) / H_CS
    return g


def check_grads(loss, inp, grads):
    """grads: {input key: hand-written gradient}."""
    assert abs(np.imag(loss(inp))) == 0.0
    for key, gr in grads.items():
        assert np.isrealobj(gr), key
        ref = cs_grad(loss, inp, key)
        assert np.linalg.norm(ref) > 0, key
        err = rel_err(gr, ref)
        assert err <= TOL, f"{key}: rel err {err:.3e}"


def log_decay(rng, shape, lo=0.05, hi=1.5):
    g = -rng.uniform(lo, hi, shape)
    flat = g.reshape(-1)
    flat[rng.integers(flat.size)] = -20.0
    if flat.size > 2:
        flat[rng.integers(flat.size)] = -8.0
    return g


def fla_data(rng, T, Hk, H, K=K_, V=V_):
    return dict(
        q=rng.standard_normal((B_, T, Hk, K)),
        k=0.6 * rng.standard_normal((B_, T, Hk, K)),
        v=rng.standard_normal((B_, T, H, V)),
        S0=0.5 * rng.standard_normal((B_, H, K, V)),
    )


# ----------------------------------------------------------------------------- gated delta net
def _gdn_data(rng, T, Hk, H):
    d = fla_data(rng, T, Hk, H)
    d["g"] = log_decay(rng, (B_, T, H))
    d["beta"] = 1.0 / (1.0 + np.exp(-rng.standard_normal((B_, T, H))))
    return d


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_gated_delta_net_grad(T, Hk, H, scale):
    rng = np.random.default_rng(1000 + T + 10 * Hk)
    inp = _gdn_data(rng, T, Hk, H)
    do = rng.standard_normal((B_, T, H, V_))
    dht = rng.standard_normal((B_, H, K_, V_))

    def loss(x):
        o, ht = gated_delta_net(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, initial_state=x["S0"])
        return np.sum(o * do) + np.sum(ht * dht)

    gr = gated_delta_net_bwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], do, dht,
                             scale=scale, initial_state=inp["S0"])
    check_grads(loss, inp, {"q": gr["q"], "k": gr["k"], "v": gr["v"], "g": gr["g"], "beta": gr["beta"],
                            "S0": gr["initial_state"]})


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_gated_delta_net_transition_form(T, Hk, H, scale):
    """Per-(b,h) loop in the transition-matrix form S_t = (I - b k k^T) a S + b k v^T, explicit GQA index."""
    rng = np.random.default_rng(1100 + T + 10 * Hk)
    x = _gdn_data(rng, T, Hk, H)
    sc = K_ ** -0.5 if scale is None else scale
    o, ht = gated_delta_net(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, initial_state=x["S0"])
    G = H // Hk
    for b in range(B_):
        for h in range(H):
            S = x["S0"][b, h].copy()
            for t in range(T):
                kk, bt = x["k"][b, t, h // G], x["beta"][b, t, h]
                transition = np.eye(K_) - bt * np.outer(kk, kk)
                S = transition @ (np.exp(x["g"][b, t, h]) * S) + bt * np.outer(kk, x["v"][b, t, h])
                np.testing.assert_allclose(o[b, t, h], S.T @ (sc * x["q"][b, t, h // G]), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(ht[b, h], S, rtol=1e-12, atol=1e-12)


def test_gated_delta_net_none_initial_state():
    rng = np.random.default_rng(1200)
    x = _gdn_data(rng, 4, 1, 2)
    do, dht = rng.standard_normal((B_, 4, 2, V_)), rng.standard_normal((B_, 2, K_, V_))
    z = np.zeros_like(x["S0"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o0, h0 = gated_delta_net(*args)
    o1, h1 = gated_delta_net(*args, initial_state=z)
    np.testing.assert_array_equal(o0, o1)
    np.testing.assert_array_equal(h0, h1)
    g0, g1 = gated_delta_net_bwd(*args, do, dht), gated_delta_net_bwd(*args, do, dht, initial_state=z)
    for key in g0:
        np.testing.assert_array_equal(g0[key], g1[key])
    assert o0.dtype == np.float64 and g0["q"].dtype == np.float64


# ----------------------------------------------------------------------------- kda
def _kda_data(rng, T, Hk, H):
    d = _gdn_data(rng, T, Hk, H)
    d["g"] = log_decay(rng, (B_, T, H, K_))
    return d


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_kda_grad(T, Hk, H, scale):
    rng = np.random.default_rng(1300 + T + 10 * Hk)
    inp = _kda_data(rng, T, Hk, H)
    do = rng.standard_normal((B_, T, H, V_))
    dht = rng.standard_normal((B_, H, K_, V_))

    def loss(x):
        o, ht = kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, initial_state=x["S0"])
        return np.sum(o * do) + np.sum(ht * dht)

    gr = kda_bwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], do, dht, scale=scale, initial_state=inp["S0"])
    check_grads(loss, inp, {"q": gr["q"], "k": gr["k"], "v": gr["v"], "g": gr["g"], "beta": gr["beta"],
                            "S0": gr["initial_state"]})


def test_kda_with_a_channel_constant_gate_is_gated_delta_net():
    rng = np.random.default_rng(1400)
    T, Hk, H = 5, 2, 4
    x = _gdn_data(rng, T, Hk, H)
    do, dht = rng.standard_normal((B_, T, H, V_)), rng.standard_normal((B_, H, K_, V_))
    gk = np.repeat(x["g"][..., None], K_, axis=-1)
    oa, ha = kda(x["q"], x["k"], x["v"], gk, x["beta"], initial_state=x["S0"])
    ob, hb = gated_delta_net(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["S0"])
    np.testing.assert_allclose(oa, ob, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(ha, hb, rtol=1e-13, atol=1e-13)
    ga = kda_bwd(x["q"], x["k"], x["v"], gk, x["beta"], do, dht, initial_state=x["S0"])
    gb = gated_delta_net_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], do, dht, initial_state=x["S0"])
    np.testing.assert_allclose(ga["g"].sum(-1), gb["g"], rtol=1e-12, atol=1e-12)
    for key in ("q", "k", "v", "beta", "initial_state"):
        np.testing.assert_allclose(ga[key], gb[key], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- delta net
@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_delta_net_grad(T, Hk, H, scale):
    rng = np.random.default_rng(2000 + T + 10 * Hk)
    inp = _gdn_data(rng, T, Hk, H)
    del inp["g"]
    do = rng.standard_normal((B_, T, H, V_))
    dht = rng.standard_normal((B_, H, K_, V_))

    def loss(x):
        o, ht = delta_net(x["q"], x["k"], x["v"], x["beta"], scale=scale, initial_state=x["S0"])
        return np.sum(o * do) + np.sum(ht * dht)

    gr = delta_net_bwd(inp["q"], inp["k"], inp["v"], inp["beta"], do, dht, scale=scale, initial_state=inp["S0"])
    check_grads(loss, inp, {"q": gr["q"], "k": gr["k"], "v": gr["v"], "beta": gr["beta"],
                            "S0": gr["initial_state"]})


def test_delta_net_equals_gated_with_zero_gate():
    rng = np.random.default_rng(2100)
    T, Hk, H = 5, 2, 4
    x = _gdn_data(rng, T, Hk, H)
    do, dht = rng.standard_normal((B_, T, H, V_)), rng.standard_normal((B_, H, K_, V_))
    g0 = np.zeros((B_, T, H))
    oa, ha = delta_net(x["q"], x["k"], x["v"], x["beta"], initial_state=x["S0"])
    ob, hb = gated_delta_net(x["q"], x["k"], x["v"], g0, x["beta"], initial_state=x["S0"])
    np.testing.assert_allclose(oa, ob, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(ha, hb, rtol=1e-13, atol=1e-13)
    ga = delta_net_bwd(x["q"], x["k"], x["v"], x["beta"], do, dht, initial_state=x["S0"])
    gb = gated_delta_net_bwd(x["q"], x["k"], x["v"], g0, x["beta"], do, dht, initial_state=x["S0"])
    for key in ga:
        np.testing.assert_allclose(ga[key], gb[key], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- gla
def _gla_data(rng, T, Hk, H):
    d = fla_data(rng, T, Hk, H)
    d["gk"] = log_decay(rng, (B_, T, H, K_))
    return d


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_gla_grad(T, Hk, H, scale):
    rng = np.random.default_rng(3000 + T + 10 * Hk)
    inp = _gla_data(rng, T, Hk, H)
    do = rng.standard_normal((B_, T, H, V_))
    dht = rng.standard_normal((B_, H, K_, V_))

    def loss(x):
        o, ht = gla(x["q"], x["k"], x["v"], x["gk"], scale=scale, initial_state=x["S0"])
        return np.sum(o * do) + np.sum(ht * dht)

    gr = gla_bwd(inp["q"], inp["k"], inp["v"], inp["gk"], do, dht, scale=scale, initial_state=inp["S0"])
    check_grads(loss, inp, {"q": gr["q"], "k": gr["k"], "v": gr["v"], "gk": gr["gk"], "S0": gr["initial_state"]})


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_gla_closed_form(T, Hk, H, scale):
    """o_t = sum_{s<=t} (qs_t * exp(G_t - G_s)) . k_s v_s + (qs_t * exp(G_t)) . S0, G = cumsum(gk)."""
    rng = np.random.default_rng(3100 + T + 10 * Hk)
    x = _gla_data(rng, T, Hk, H)
    sc = K_ ** -0.5 if scale is None else scale
    o, ht = gla(x["q"], x["k"], x["v"], x["gk"], scale=scale, initial_state=x["S0"])
    G = np.cumsum(x["gk"], axis=1)
    grp = H // Hk
    for b in range(B_):
        for h in range(H):
            for t in range(T):
                S = np.exp(G[b, t, h])[:, None] * x["S0"][b, h]
                for s in range(t + 1):
                    S = S + np.exp(G[b, t, h] - G[b, s, h])[:, None] * np.outer(x["k"][b, s, h // grp], x["v"][b, s, h])
                np.testing.assert_allclose(o[b, t, h], S.T @ (sc * x["q"][b, t, h // grp]), rtol=1e-11, atol=1e-12)
            np.testing.assert_allclose(ht[b, h], S, rtol=1e-11, atol=1e-12)


# ----------------------------------------------------------------------------- simple gla
@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_simple_gla_grad(T, Hk, H, scale):
    rng = np.random.default_rng(4000 + T + 10 * Hk)
    inp = fla_data(rng, T, Hk, H)
    inp["g"] = log_decay(rng, (B_, T, H))
    do = rng.standard_normal((B_, T, H, V_))
    dht = rng.standard_normal((B_, H, K_, V_))

    def loss(x):
        o, ht = simple_gla(x["q"], x["k"], x["v"], x["g"], scale=scale, initial_state=x["S0"])
        return np.sum(o * do) + np.sum(ht * dht)

    gr = simple_gla_bwd(inp["q"], inp["k"], inp["v"], inp["g"], do, dht, scale=scale, initial_state=inp["S0"])
    check_grads(loss, inp, {"q": gr["q"], "k": gr["k"], "v": gr["v"], "g": gr["g"], "S0": gr["initial_state"]})


def test_simple_gla_equals_gla_broadcast():
    rng = np.random.default_rng(4100)
    T, Hk, H = 5, 2, 4
    x = fla_data(rng, T, Hk, H)
    g = log_decay(rng, (B_, T, H))
    gk = np.repeat(g[..., None], K_, axis=-1)
    do, dht = rng.standard_normal((B_, T, H, V_)), rng.standard_normal((B_, H, K_, V_))
    oa, ha = simple_gla(x["q"], x["k"], x["v"], g, initial_state=x["S0"])
    ob, hb = gla(x["q"], x["k"], x["v"], gk, initial_state=x["S0"])
    np.testing.assert_allclose(oa, ob, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(ha, hb, rtol=1e-13, atol=1e-13)
    ga = simple_gla_bwd(x["q"], x["k"], x["v"], g, do, dht, initial_state=x["S0"])
    gb = gla_bwd(x["q"], x["k"], x["v"], gk, do, dht, initial_state=x["S0"])
    for key in ("q", "k", "v", "initial_state"):
        np.testing.assert_allclose(ga[key], gb[key], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ga["g"], gb["gk"].sum(-1), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- selective scan
DCH, NST = 4, 3
SS_CASES = [(1, True, True), (5, True, True), (5, False, False), (5, False, True), (1, False, False)]
SS_IDS = ["L1-softplus-Dbias", "L5-softplus-Dbias", "L5-raw", "L5-raw-Dbias", "L1-raw"]


def _ss_data(rng, L, softplus_, with_opt):
    A = -np.exp(0.5 * rng.standard_normal((DCH, NST)))
    A[0, 0] = -30.0  # dt * A ~ -20
    A[2, 1] = -12.0
    d = dict(
        u=rng.standard_normal((B_, DCH, L)),
        delta=(0.6 * rng.standard_normal((B_, DCH, L))) if softplus_ else rng.uniform(0.2, 1.0, (B_, DCH, L)),
        A=A,
        B=rng.standard_normal((B_, NST, L)),
        C=rng.standard_normal((B_, NST, L)),
        x0=rng.standard_normal((B_, DCH, NST)),
    )
    if with_opt:
        d["D"] = rng.standard_normal(DCH)
        d["delta_bias"] = 0.3 * rng.standard_normal(DCH) + (0.0 if softplus_ else 0.5)
    return d


def _ss_call(x, softplus_):
    return selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], D=x.get("D"),
                          delta_bias=x.get("delta_bias"), delta_softplus=softplus_, initial_state=x["x0"])


@pytest.mark.parametrize("L,softplus_,with_opt", SS_CASES, ids=SS_IDS)
def test_selective_scan_grad(L, softplus_, with_opt):
    rng = np.random.default_rng(5000 + L + 10 * softplus_ + 100 * with_opt)
    inp = _ss_data(rng, L, softplus_, with_opt)
    dout = rng.standard_normal((B_, DCH, L))
    dht = rng.standard_normal((B_, DCH, NST))

    def loss(x):
        out, last = _ss_call(x, softplus_)
        return np.sum(out * dout) + np.sum(last * dht)

    gr = selective_scan_bwd(inp["u"], inp["delta"], inp["A"], inp["B"], inp["C"], dout, dht, D=inp.get("D"),
                            delta_bias=inp.get("delta_bias"), delta_softplus=softplus_, initial_state=inp["x0"])
    want = {key: gr[key] for key in ("u", "delta", "A", "B", "C")}
    want["x0"] = gr["initial_state"]
    if with_opt:
        want["D"], want["delta_bias"] = gr["D"], gr["delta_bias"]
    else:
        assert gr["D"] is None and gr["delta_bias"] is None
    check_grads(loss, inp, want)


@pytest.mark.parametrize("L,softplus_,with_opt", SS_CASES, ids=SS_IDS)
def test_selective_scan_closed_form(L, softplus_, with_opt):
    """x_l = exp(A sum_{r<=l} dt_r) x0 + sum_{s<=l} exp(A sum_{s<r<=l} dt_r) dt_s B_s u_s."""
    rng = np.random.default_rng(5100 + L + 10 * softplus_ + 100 * with_opt)
    x = _ss_data(rng, L, softplus_, with_opt)
    out, last = _ss_call(x, softplus_)
    pre = x["delta"] + (x["delta_bias"][None, :, None] if with_opt else 0.0)
    dt = np.log1p(np.exp(pre)) if softplus_ else pre
    cum = np.concatenate([np.zeros((B_, DCH, 1)), np.cumsum(dt, axis=-1)], axis=-1)  # cum[..., l+1] = sum_{r<=l}
    for l in range(L):
        xs = np.exp(x["A"][None] * cum[:, :, l + 1, None]) * x["x0"]
        for s in range(l + 1):
            w = np.exp(x["A"][None] * (cum[:, :, l + 1] - cum[:, :, s + 1])[..., None])
            xs = xs + w * (dt[:, :, s] * x["u"][:, :, s])[..., None] * x["B"][:, None, :, s]
        y = np.einsum("bdn,bn->bd", xs, x["C"][:, :, l]) + (x["D"][None] * x["u"][:, :, l] if with_opt else 0.0)
        np.testing.assert_allclose(out[:, :, l], y, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(last, xs, rtol=1e-11, atol=1e-12)


def test_selective_scan_equals_gla_when_decay_is_channel_uniform():
    """A[d,n] = a_n and dt uniform over channels -> GLA with K=N, V=Dch, q=C, k=B, v=dt*u, gk=dt*a, scale=1."""
    rng = np.random.default_rng(5200)
    L = 6
    a = -np.exp(rng.standard_normal(NST))
    a[0] = -20.0
    A = np.repeat(a[None], DCH, axis=0)
    delta = np.repeat(rng.uniform(0.1, 1.0, (B_, 1, L)), DCH, axis=1)
    u, Bm, Cm = rng.standard_normal((B_, DCH, L)), rng.standard_normal((B_, NST, L)), rng.standard_normal((B_, NST, L))
    D, x0 = rng.standard_normal(DCH), rng.standard_normal((B_, DCH, NST))
    out, last = selective_scan(u, delta, A, Bm, Cm, D=D, initial_state=x0)
    dt = delta[:, 0, :]                                            # [B, L]
    q = Cm.transpose(0, 2, 1)[:, :, None, :]                       # [B, L, 1, N]
    k = Bm.transpose(0, 2, 1)[:, :, None, :]
    v = (dt[:, None, :] * u).transpose(0, 2, 1)[:, :, None, :]    # [B, L, 1, Dch]
    gk = (dt[:, :, None] * a[None, None, :])[:, :, None, :]        # [B, L, 1, N]
    o, ht = gla(q, k, v, gk, scale=1.0, initial_state=x0.transpose(0, 2, 1)[:, None])
    np.testing.assert_allclose(out, o[:, :, 0, :].transpose(0, 2, 1) + D[None, :, None] * u, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(last, ht[:, 0].transpose(0, 2, 1), rtol=1e-12, atol=1e-12)


def test_softplus_sigmoid():
    x = np.array([-50.0, -3.0, -1e-3, 0.0, 2.0, 40.0])
    np.testing.assert_allclose(softplus(x), np.logaddexp(0.0, x), rtol=1e-15, atol=0)
    np.testing.assert_allclose(sigmoid(x), np.exp(-np.logaddexp(0.0, -x)), rtol=1e-14, atol=0)
    for xi in x:  # derivative of softplus is sigmoid (complex step)
        assert abs(np.imag(softplus(np.array([xi + 1j * H_CS])))[0] / H_CS - sigmoid(np.array([xi]))[0]) < 1e-15


# ----------------------------------------------------------------------------- power retention
def _pr_data(rng, T, Hk, H, d=K_, V=V_):
    Dp = d * (d + 1) // 2
    r = rng.standard_normal((B_, H, 3, d))
    return dict(
        q=rng.standard_normal((B_, T, Hk, d)),
        k=rng.standard_normal((B_, T, Hk, d)),
        v=rng.standard_normal((B_, T, H, V)),
        log_g=log_decay(rng, (B_, T, H)),
        S0=0.5 * rng.standard_normal((B_, H, Dp, V)),
        z0=sympow2(r).sum(axis=2),  # a sum of features: phi(q).z0 = sum_j (q.r_j)^2 > 0
    )


def test_sympow2():
    rng = np.random.default_rng(6000)
    x, y = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    px = sympow2(x)
    assert px.shape == (5, 10)
    np.testing.assert_allclose(np.sum(px * sympow2(y), -1), np.sum(x * y, -1) ** 2, rtol=1e-13)
    np.testing.assert_allclose(px[:, :4], np.stack([x[:, 0] ** 2, 2 ** 0.5 * x[:, 0] * x[:, 1],
                                                     2 ** 0.5 * x[:, 0] * x[:, 2], 2 ** 0.5 * x[:, 0] * x[:, 3]], -1))
    np.testing.assert_allclose(px[:, 4], x[:, 1] ** 2)
    gphi = rng.standard_normal((5, 10))
    dx = sympow2_bwd(x, gphi)
    ref = cs_grad(lambda inp: np.sum(sympow2(inp["x"]) * gphi), {"x": x}, "x")
    assert rel_err(dx, ref) <= TOL


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_power_retention_grad(T, Hk, H, scale):
    rng = np.random.default_rng(7000 + T + 10 * Hk)
    inp = _pr_data(rng, T, Hk, H)
    Dp = K_ * (K_ + 1) // 2
    do = rng.standard_normal((B_, T, H, V_))
    dS, dz = rng.standard_normal((B_, H, Dp, V_)), rng.standard_normal((B_, H, Dp))
    eps = 1e-3

    def loss(x):
        o, (S, z) = power_retention(x["q"], x["k"], x["v"], x["log_g"], scale=scale,
                                    initial_state=(x["S0"], x["z0"]), eps=eps)
        return np.sum(o * do) + np.sum(S * dS) + np.sum(z * dz)

    gr = power_retention_bwd(inp["q"], inp["k"], inp["v"], inp["log_g"], do, (dS, dz), scale=scale,
                             initial_state=(inp["S0"], inp["z0"]), eps=eps)
    check_grads(loss, inp, {"q": gr["q"], "k": gr["k"], "v": gr["v"], "log_g": gr["log_g"],
                            "S0": gr["initial_state"][0], "z0": gr["initial_state"][1]})


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_power_retention_quadratic_form(T, Hk, H, scale):
    """Zero initial state: o_t = sum_s w_ts (qs_t.k_s)^2 v_s / (sum_s w_ts (qs_t.k_s)^2 + eps)."""
    rng = np.random.default_rng(7100 + T + 10 * Hk)
    x = _pr_data(rng, T, Hk, H)
    sc = K_ ** -0.5 if scale is None else scale
    eps = 1e-6
    o, (S, z) = power_retention(x["q"], x["k"], x["v"], x["log_g"], scale=scale, eps=eps)
    grp = H // Hk
    lg = x["log_g"]
    for b in range(B_):
        for h in range(H):
            for t in range(T):
                num, den = np.zeros(V_), eps
                for s in range(t + 1):
                    qk = sc * x["q"][b, t, h // grp] @ x["k"][b, s, h // grp]
                    w = np.exp(np.sum(lg[b, s + 1:t + 1, h])) * qk ** 2
                    num, den = num + w * x["v"][b, s, h], den + w
                np.testing.assert_allclose(o[b, t, h], num / den, rtol=1e-11, atol=1e-12)
    # final state: z_T = sum_s w_Ts phi(k_s)
    Tw = np.exp(np.cumsum(lg[:, ::-1], axis=1)[:, ::-1] - lg)     # w_Ts = exp(sum_{r>s} g_r)
    ke = np.repeat(x["k"], grp, axis=2)
    np.testing.assert_allclose(z, np.einsum("bth,bthd->bhd", Tw, sympow2(ke)), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(S, np.einsum("bth,bthd,bthv->bhdv", Tw, sympow2(ke), x["v"]), rtol=1e-11, atol=1e-12)


def test_power_retention_none_initial_state():
    rng = np.random.default_rng(7200)
    x = _pr_data(rng, 3, 1, 2)
    args = (x["q"], x["k"], x["v"], x["log_g"])
    do = rng.standard_normal((B_, 3, 2, V_))
    zs = (np.zeros_like(x["S0"]), np.zeros_like(x["z0"]))
    g0 = power_retention_bwd(*args, do, None)
    g1 = power_retention_bwd(*args, do, (np.zeros_like(x["S0"]), np.zeros_like(x["z0"])), initial_state=zs)
    for key in ("q", "k", "v", "log_g"):
        np.testing.assert_array_equal(g0[key], g1[key])
    np.testing.assert_array_equal(g0["initial_state"][0], g1["initial_state"][0])
    np.testing.assert_array_equal(g0["initial_state"][1], g1["initial_state"][1])


# ----------------------------------------------------------------------------- retnet
@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_retnet_grad(T, Hk, H, scale):
    rng = np.random.default_rng(8000 + T + 10 * Hk)
    inp = fla_data(rng, T, Hk, H)
    inp["log_gamma"] = log_decay(rng, (H,))
    do, dht = rng.standard_normal((B_, T, H, V_)), rng.standard_normal((B_, H, K_, V_))

    def loss(x):
        o, ht = retnet(x["q"], x["k"], x["v"], x["log_gamma"], scale=scale, initial_state=x["S0"])
        return np.sum(o * do) + np.sum(ht * dht)

    gr = retnet_bwd(inp["q"], inp["k"], inp["v"], inp["log_gamma"], do, dht, scale=scale, initial_state=inp["S0"])
    check_grads(loss, inp, {"q": gr["q"], "k": gr["k"], "v": gr["v"], "log_gamma": gr["log_gamma"],
                            "S0": gr["initial_state"]})


def test_retnet_default_decays_and_simple_gla():
    """RetNet's fixed decays are 1 - 2^(-5-h) (FLA), and retention is simple GLA with g_t = log_gamma_h."""
    rng = np.random.default_rng(8100)
    T, Hk, H = 6, 2, 4
    x = fla_data(rng, T, Hk, H)
    np.testing.assert_allclose(np.exp(retnet_log_gamma(H)), [1 - 2.0 ** (-5 - h) for h in range(H)], rtol=1e-15)
    oa, ha = retnet(x["q"], x["k"], x["v"], initial_state=x["S0"])
    g = np.broadcast_to(retnet_log_gamma(H), (B_, T, H))
    ob, hb = simple_gla(x["q"], x["k"], x["v"], g, initial_state=x["S0"])
    np.testing.assert_allclose(oa, ob, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(ha, hb, rtol=1e-13, atol=1e-13)


# ----------------------------------------------------------------------------- hgrn2
@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_hgrn2_grad(T, Hk, H, scale):
    rng = np.random.default_rng(8200 + T + 10 * Hk)
    d = fla_data(rng, T, Hk, H)
    inp = dict(q=d["q"], v=d["v"], S0=d["S0"], g=log_decay(rng, (B_, T, H, K_)))
    do, dht = rng.standard_normal((B_, T, H, V_)), rng.standard_normal((B_, H, K_, V_))

    def loss(x):
        o, ht = hgrn2(x["q"], x["v"], x["g"], scale=scale, initial_state=x["S0"])
        return np.sum(o * do) + np.sum(ht * dht)

    gr = hgrn2_bwd(inp["q"], inp["v"], inp["g"], do, dht, scale=scale, initial_state=inp["S0"])
    check_grads(loss, inp, {"q": gr["q"], "v": gr["v"], "g": gr["g"], "S0": gr["initial_state"]})


def test_hgrn2_is_gla_with_tied_input_gate():
    """FLA's HGRN2 layer: chunk_gla(q, k = 1 - exp(g), v, g), g = logsigmoid(f), lower-bounded past layer 0."""
    rng = np.random.default_rng(8300)
    T, H = 6, 4
    x = fla_data(rng, T, H, H)
    lb = rng.uniform(0, 0.9, (H, K_))
    for g in (hgrn2_gate(3 * rng.standard_normal((B_, T, H, K_))),
              hgrn2_gate(3 * rng.standard_normal((B_, T, H, K_)), lower_bound=lb)):
        oa, ha = hgrn2(x["q"], x["v"], g, initial_state=x["S0"])
        ob, hb = gla(x["q"], 1 - np.exp(g), x["v"], g, initial_state=x["S0"])
        np.testing.assert_allclose(oa, ob, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(ha, hb, rtol=1e-13, atol=1e-13)
    f = rng.standard_normal((B_, T, H, K_))
    np.testing.assert_allclose(np.exp(hgrn2_gate(f, lb)), lb + (1 - lb) * sigmoid(f), rtol=1e-14)


# ----------------------------------------------------------------------------- mamba2
P_, N_ = 3, 4
# (T, G, H, softplus, dt_bias, D shape, z, dt_limit)
M2_CASES = [(1, 1, 2, True, True, "H", True, (0.0, np.inf)),
            (5, 2, 4, True, True, "HP", True, (0.0, np.inf)),
            (5, 1, 2, False, False, None, False, (0.0, np.inf)),
            (6, 2, 4, True, False, "H", False, (0.3, 1.2)),
            (5, 1, 2, False, True, "HP", True, (0.2, 2.0))]
M2_IDS = ["T1-softplus", "T5-G2-softplus-DHP", "T5-raw", "T6-G2-softplus-limit", "T5-raw-limit"]


def _m2_data(rng, T, G, H, softplus_, bias, dshape, z):
    A = -np.exp(0.5 * rng.standard_normal(H))
    A[0] = -15.0  # Delta A ~ -20
    d = dict(x=rng.standard_normal((B_, T, H, P_)),
             dt=(0.7 * rng.standard_normal((B_, T, H))) if softplus_ else rng.uniform(-0.3, 1.5, (B_, T, H)),
             A=A, B=rng.standard_normal((B_, T, G, N_)), C=rng.standard_normal((B_, T, G, N_)),
             h0=rng.standard_normal((B_, H, P_, N_)))
    if bias:
        d["dt_bias"] = 0.3 * rng.standard_normal(H) + (0.0 if softplus_ else 0.2)
    if dshape:
        d["D"] = rng.standard_normal(H if dshape == "H" else (H, P_))
    if z:
        d["z"] = rng.standard_normal((B_, T, H, P_))
    return d


def _m2_call(x, softplus_, limit):
    return mamba2(x["x"], x["dt"], x["A"], x["B"], x["C"], D=x.get("D"), z=x.get("z"), dt_bias=x.get("dt_bias"),
                  dt_softplus=softplus_, dt_limit=limit, initial_states=x["h0"])


@pytest.mark.parametrize("T,G,H,softplus_,bias,dshape,z,limit", M2_CASES, ids=M2_IDS)
def test_mamba2_grad(T, G, H, softplus_, bias, dshape, z, limit):
    rng = np.random.default_rng(8400 + T + 10 * G + 100 * softplus_)
    inp = _m2_data(rng, T, G, H, softplus_, bias, dshape, z)
    dout, dht = rng.standard_normal((B_, T, H, P_)), rng.standard_normal((B_, H, P_, N_))

    def loss(x):
        out, last = _m2_call(x, softplus_, limit)
        return np.sum(out * dout) + np.sum(last * dht)

    gr = mamba2_bwd(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], dout, dht, D=inp.get("D"), z=inp.get("z"),
                    dt_bias=inp.get("dt_bias"), dt_softplus=softplus_, dt_limit=limit, initial_states=inp["h0"])
    want = {key: gr[key] for key in ("x", "dt", "A", "B", "C")}
    want["h0"] = gr["initial_states"]
    for key in ("D", "z", "dt_bias"):
        if key in inp:
            want[key] = gr[key]
        else:
            assert gr[key] is None
    check_grads(loss, inp, want)


def test_mamba2_ssd_minimal_form():
    """ssd_minimal_discrete's quadratic form (X = Delta x, A = Delta A, zero initial state): y_t = sum_{s<=t}
    exp(sum_{s<r<=t} Delta_r A) (C_t . B_s) Delta_s x_s, final state h_T = sum_s exp(..) Delta_s x_s B_s^T."""
    rng = np.random.default_rng(8500)
    T, G, H = 7, 2, 4
    x = _m2_data(rng, T, G, H, True, True, None, False)
    out, last = mamba2(x["x"], x["dt"], x["A"], x["B"], x["C"], dt_bias=x["dt_bias"], dt_softplus=True)
    delta = softplus(x["dt"] + x["dt_bias"])
    cum = np.concatenate([np.zeros((B_, 1, H)), np.cumsum(delta * x["A"], axis=1)], axis=1)
    Be, Ce = np.repeat(x["B"], H // G, axis=2), np.repeat(x["C"], H // G, axis=2)
    for t in range(T):
        y, h = 0.0, 0.0
        for s in range(t + 1):
            w = np.exp(cum[:, t + 1] - cum[:, s + 1])                       # [B,H]
            y = y + (w * np.einsum("bhn,bhn->bh", Ce[:, t], Be[:, s]) * delta[:, s])[..., None] * x["x"][:, s]
            h = h + (w * delta[:, s])[..., None, None] * x["x"][:, s, :, :, None] * Be[:, s, :, None, :]
        np.testing.assert_allclose(out[:, t], y, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(last, h, rtol=1e-11, atol=1e-12)


def test_mamba2_limits_clip_delta():
    """dt_limit clips Delta (a clipped step has no gradient in dt), and without softplus a negative Delta is 0."""
    rng = np.random.default_rng(8600)
    x = _m2_data(rng, 5, 1, 2, False, False, None, False)
    x["dt"][0, 1, 0] = -0.25
    out, last = _m2_call(x, False, (0.0, np.inf))
    y = dict(x, dt=np.maximum(x["dt"], 0.0))
    out2, last2 = _m2_call(y, False, (0.0, np.inf))
    np.testing.assert_array_equal(out, out2)
    gr = mamba2_bwd(x["x"], x["dt"], x["A"], x["B"], x["C"], rng.standard_normal(out.shape), None,
                    initial_states=x["h0"])
    assert gr["dt"][0, 1, 0] == 0.0 and np.all(gr["dt"][x["dt"] > 0] != 0.0)


# ----------------------------------------------------------------------------- mlstm (sigmoid input gate)
@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_mlstm_sigmoid_grad(T, Hk, H, scale):
    rng = np.random.default_rng(8700 + T + 10 * Hk)
    inp = fla_data(rng, T, Hk, H)
    inp["ig"], inp["fg"] = 2 * rng.standard_normal((B_, T, H)), 3 * rng.standard_normal((B_, T, H))
    inp["fg"].reshape(-1)[0] = -20.0  # a forget gate of e^-20
    inp["n0"] = rng.standard_normal((B_, H, K_))
    do = rng.standard_normal((B_, T, H, V_))
    dC, dn = rng.standard_normal((B_, H, K_, V_)), rng.standard_normal((B_, H, K_))

    def loss(x):
        o, (C, n) = mlstm_sigmoid(x["q"], x["k"], x["v"], x["ig"], x["fg"], scale=scale,
                                  initial_state=(x["S0"], x["n0"]))
        return np.sum(o * do) + np.sum(C * dC) + np.sum(n * dn)

    gr = mlstm_sigmoid_bwd(inp["q"], inp["k"], inp["v"], inp["ig"], inp["fg"], do, (dC, dn), scale=scale,
                           initial_state=(inp["S0"], inp["n0"]))
    check_grads(loss, inp, {"q": gr["q"], "k": gr["k"], "v": gr["v"], "ig": gr["ig"], "fg": gr["fg"],
                            "S0": gr["initial_state"][0], "n0": gr["initial_state"][1]})


def test_mlstm_sigmoid_key_scale_is_query_scale():
    """xLSTM scales k by K^-1/2; C and n are linear in k and the readout in q, so scaling q instead is the same
    (zero initial state)."""
    rng = np.random.default_rng(8800)
    T, H = 6, 2
    x = fla_data(rng, T, H, H)
    ig, fg = rng.standard_normal((B_, T, H)), rng.standard_normal((B_, T, H))
    oa, _ = mlstm_sigmoid(x["q"], x["k"], x["v"], ig, fg)
    ob, _ = mlstm_sigmoid(x["q"], x["k"] * K_ ** -0.5, x["v"], ig, fg, scale=1.0)
    np.testing.assert_allclose(oa, ob, rtol=1e-13, atol=1e-13)


# ----------------------------------------------------------------------------- mlstm (xLSTM's exponential input gate)
@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_mlstm_grad(T, Hk, H, scale):
    """Both sides of the normalizer's kink: the inputs' |n_tᵀq̃_t| fall on both sides of 1."""
    rng = np.random.default_rng(8900 + T + 10 * Hk)
    inp = fla_data(rng, T, Hk, H)
    inp["ig"], inp["fg"] = 1.5 * rng.standard_normal((B_, T, H)), 3 * rng.standard_normal((B_, T, H))
    inp["fg"].reshape(-1)[0] = -20.0  # a forget gate of e^-20
    inp["n0"] = rng.standard_normal((B_, H, K_))
    do = rng.standard_normal((B_, T, H, V_))
    dC, dn = rng.standard_normal((B_, H, K_, V_)), rng.standard_normal((B_, H, K_))

    def loss(x):
        o, (C, n) = mlstm(x["q"], x["k"], x["v"], x["ig"], x["fg"], scale=scale, initial_state=(x["S0"], x["n0"]))
        return np.sum(o * do) + np.sum(C * dC) + np.sum(n * dn)

    gr = mlstm_bwd(inp["q"], inp["k"], inp["v"], inp["ig"], inp["fg"], do, (dC, dn), scale=scale,
                   initial_state=(inp["S0"], inp["n0"]))
    check_grads(loss, inp, {"q": gr["q"], "k": gr["k"], "v": gr["v"], "ig": gr["ig"], "fg": gr["fg"],
                            "S0": gr["initial_state"][0], "n0": gr["initial_state"][1]})


def test_mlstm_equals_xlstms_stabilized_form():
    """xLSTM's stabilized recurrence (running max m_t = max(log f_t + m_{t-1}, ig_t); C̃, ñ scaled by e^{-m_t};
    o = C̃ᵀq̃ / max(|ñᵀq̃|, e^{-m_t})), written out here, gives the reference's output, large input gates included
    (e^{ig} up to e^60, past where an unstabilized float32 loop would still hold, both sides of the kink)."""
    rng = np.random.default_rng(9000)
    T, H = 12, 2
    x = fla_data(rng, T, H, H)
    ig, fg = 20 * rng.standard_normal((B_, T, H)), 3 * rng.standard_normal((B_, T, H))
    ig = np.minimum(ig, 60.0)
    o, (C, n) = mlstm(x["q"], x["k"], x["v"], ig, fg)
    qs = K_ ** -0.5 * x["q"]
    logf = -np.logaddexp(0, -fg)
    Ct, nt, m = np.zeros((B_, H, K_, V_)), np.zeros((B_, H, K_)), np.full((B_, H), -np.inf)
    want, floors = np.zeros(o.shape), []
    for t in range(T):
        m_new = np.maximum(logf[:, t] + m, ig[:, t])
        fs, is_ = np.exp(logf[:, t] + m - m_new), np.exp(ig[:, t] - m_new)
        Ct = fs[..., None, None] * Ct + is_[..., None, None] * x["k"][:, t, :, :, None] * x["v"][:, t, :, None, :]
        nt = fs[..., None] * nt + is_[..., None] * x["k"][:, t]
        m = m_new
        den = np.maximum(np.abs(np.einsum("bhk,bhk->bh", nt, qs[:, t])), np.exp(-m))
        floors.append(np.abs(np.einsum("bhk,bhk->bh", nt, qs[:, t])) < np.exp(-m))
        want[:, t] = np.einsum("bhkv,bhk->bhv", Ct, qs[:, t]) / den[..., None]
    floors = np.array(floors)
    assert floors.any() and not floors.all()  # both sides of max(|x|, 1)
    np.testing.assert_allclose(o, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(C * np.exp(-m)[..., None, None], Ct, rtol=1e-10, atol=1e-300)


# ----------------------------------------------------------------------------- rwkv6
def _rwkv6_data(rng, T, Hk, H):
    d = fla_data(rng, T, Hk, H)
    d["r"] = d.pop("q")
    d["w"] = log_decay(rng, (B_, T, H, K_))
    d["u"] = rng.standard_normal((H, K_))
    return d


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_rwkv6_grad(T, Hk, H, scale):
    rng = np.random.default_rng(8000 + T + 10 * Hk)
    inp = _rwkv6_data(rng, T, Hk, H)
    do = rng.standard_normal((B_, T, H, V_))
    dht = rng.standard_normal((B_, H, K_, V_))

    def loss(x):
        o, ht = rwkv6(x["r"], x["k"], x["v"], x["w"], x["u"], scale=scale, initial_state=x["S0"])
        return np.sum(o * do) + np.sum(ht * dht)

    gr = rwkv6_bwd(inp["r"], inp["k"], inp["v"], inp["w"], inp["u"], do, dht, scale=scale, initial_state=inp["S0"])
    check_grads(loss, inp, {"r": gr["r"], "k": gr["k"], "v": gr["v"], "w": gr["w"], "u": gr["u"],
                            "S0": gr["initial_state"]})


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_rwkv6_closed_form(T, Hk, H, scale):
    """o_t = sum_{s<t} (rs_t * exp(G_{t-1} - G_s)) . k_s v_s + (rs_t u . k_t) v_t + (rs_t * exp(G_{t-1})) . S0,
    G = cumsum(w) (G_{-1} = 0): the readout sees the state before step t."""
    rng = np.random.default_rng(8100 + T + 10 * Hk)
    x = _rwkv6_data(rng, T, Hk, H)
    sc = K_ ** -0.5 if scale is None else scale
    o, ht = rwkv6(x["r"], x["k"], x["v"], x["w"], x["u"], scale=scale, initial_state=x["S0"])
    G = np.concatenate([np.zeros((B_, 1, H, K_)), np.cumsum(x["w"], axis=1)], axis=1)  # G[t] = sum_{s<t} w_s
    grp = H // Hk
    for b in range(B_):
        for h in range(H):
            for t in range(T + 1):
                S = np.exp(G[b, t, h])[:, None] * x["S0"][b, h]
                for s in range(t):
                    S = S + np.exp(G[b, t, h] - G[b, s + 1, h])[:, None] * np.outer(x["k"][b, s, h // grp],
                                                                                    x["v"][b, s, h])
                if t == T:
                    np.testing.assert_allclose(ht[b, h], S, rtol=1e-11, atol=1e-12)
                    continue
                rs, kt = sc * x["r"][b, t, h // grp], x["k"][b, t, h // grp]
                want = S.T @ rs + (rs * x["u"][h]) @ kt * x["v"][b, t, h]
                np.testing.assert_allclose(o[b, t, h], want, rtol=1e-11, atol=1e-12)


# ----------------------------------------------------------------------------- rwkv7
def _rwkv7_data(rng, T, Hk, H):
    """RWKV-7's own parametrization of the transition: a = -kk, b = kk * iclr with kk a unit direction and the
    in-context learning rate iclr in (0, 1); log-decays down to -20."""
    d = fla_data(rng, T, Hk, H)
    d["r"] = d.pop("q")
    d["w"] = log_decay(rng, (B_, T, H, K_))
    kk = rng.standard_normal((B_, T, Hk, K_))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    d["a"] = -kk
    d["b"] = kk * rng.uniform(0.05, 0.95, (B_, T, Hk, K_))
    return d


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_rwkv7_grad(T, Hk, H, scale):
    rng = np.random.default_rng(8200 + T + 10 * Hk)
    inp = _rwkv7_data(rng, T, Hk, H)
    do = rng.standard_normal((B_, T, H, V_))
    dht = rng.standard_normal((B_, H, K_, V_))
    sc = 1.0 if scale is None else scale

    def loss(x):
        o, ht = rwkv7(x["r"], x["w"], x["k"], x["v"], x["a"], x["b"], scale=sc, initial_state=x["S0"])
        return np.sum(o * do) + np.sum(ht * dht)

    gr = rwkv7_bwd(inp["r"], inp["w"], inp["k"], inp["v"], inp["a"], inp["b"], do, dht, scale=sc,
                   initial_state=inp["S0"])
    check_grads(loss, inp, {n: gr[n] for n in ("r", "w", "k", "v", "a", "b")} | {"S0": gr["initial_state"]})


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_rwkv7_mlx_lm_layout_form(T, Hk, H, scale):
    """Per-(b,h) loop in mlx-lm's layout (state [V,K], the transpose): S <- S (diag(e^w) + a b^T) + v k^T,
    y = S (scale r), with an explicit GQA index."""
    rng = np.random.default_rng(8300 + T + 10 * Hk)
    x = _rwkv7_data(rng, T, Hk, H)
    sc = 1.0 if scale is None else scale
    o, ht = rwkv7(x["r"], x["w"], x["k"], x["v"], x["a"], x["b"], scale=sc, initial_state=x["S0"])
    G = H // Hk
    for b in range(B_):
        for h in range(H):
            S = x["S0"][b, h].T.copy()
            for t in range(T):
                hk = h // G
                M = np.diag(np.exp(x["w"][b, t, h])) + np.outer(x["a"][b, t, hk], x["b"][b, t, hk])
                S = S @ M + np.outer(x["v"][b, t, h], x["k"][b, t, hk])
                np.testing.assert_allclose(o[b, t, h], S @ (sc * x["r"][b, t, hk]), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(ht[b, h], S.T, rtol=1e-12, atol=1e-12)

# ----------------------------------------------------------------------------- gated delta product
# (T, Hk, H, scale, n, gated)
GDP_CASES = [(1, 1, 2, None, 2, True), (4, 1, 2, None, 3, True), (3, 2, 4, 0.7, 2, True), (4, 2, 4, None, 2, False)]
GDP_IDS = ["T1-n2", "T4-n3", "T3-Hk2-H4-scale-n2", "T4-Hk2-H4-n2-ungated"]


def _gdp_data(rng, T, Hk, H, n, gated):
    d = _gdn_data(rng, T * n, Hk, H)
    d["q"] = d["q"][:, :T]
    d["g"] = log_decay(rng, (B_, T, H)) if gated else None
    return d


@pytest.mark.parametrize("T,Hk,H,scale,n,gated", GDP_CASES, ids=GDP_IDS)
def test_gated_delta_product_grad(T, Hk, H, scale, n, gated):
    rng = np.random.default_rng(9000 + T + 10 * Hk + 100 * n)
    inp = _gdp_data(rng, T, Hk, H, n, gated)
    if not gated:
        del inp["g"]
    do, dht = rng.standard_normal((B_, T, H, V_)), rng.standard_normal((B_, H, K_, V_))

    def loss(x):
        o, ht = gated_delta_product(x["q"], x["k"], x["v"], x.get("g"), x["beta"], n, scale=scale,
                                    initial_state=x["S0"])
        return np.sum(o * do) + np.sum(ht * dht)

    gr = gated_delta_product_bwd(inp["q"], inp["k"], inp["v"], inp.get("g"), inp["beta"], n, do, dht, scale=scale,
                                 initial_state=inp["S0"])
    want = {key: gr[key] for key in ("q", "k", "v", "beta")}
    want["S0"] = gr["initial_state"]
    if gated:
        want["g"] = gr["g"]
    else:
        assert gr["g"] is None
    check_grads(loss, inp, want)


@pytest.mark.parametrize("T,Hk,H,scale", CASES, ids=CASE_IDS)
def test_gated_delta_product_with_one_step_is_gated_delta_net(T, Hk, H, scale):
    """n = 1: every token is one gated delta-rule step (forward and every gradient)."""
    rng = np.random.default_rng(9100 + T + 10 * Hk)
    x = _gdn_data(rng, T, Hk, H)
    do, dht = rng.standard_normal((B_, T, H, V_)), rng.standard_normal((B_, H, K_, V_))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    oa, ha = gated_delta_product(*args, 1, scale=scale, initial_state=x["S0"])
    ob, hb = gated_delta_net(*args, scale=scale, initial_state=x["S0"])
    np.testing.assert_allclose(oa, ob, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(ha, hb, rtol=1e-13, atol=1e-13)
    ga = gated_delta_product_bwd(*args, 1, do, dht, scale=scale, initial_state=x["S0"])
    gb = gated_delta_net_bwd(*args, do, dht, scale=scale, initial_state=x["S0"])
    for key in gb:
        np.testing.assert_allclose(ga[key], gb[key], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,gated", [(2, True), (3, True), (3, False)])
def test_gated_delta_product_is_a_product_of_householder_transitions(n, gated):
    """Per (b, h), explicit matrices: S_t = prod_{j=n-1..0} (I - b_j k_j k_j^T) e^{g_t} S_{t-1} + (the updates,
    each carried through the later micro-steps' transitions), o_t = S_t^T (scale q_t)."""
    rng = np.random.default_rng(9200 + n + 10 * gated)
    T, Hk, H = 4, 2, 4
    x = _gdp_data(rng, T, Hk, H, n, gated)
    o, ht = gated_delta_product(x["q"], x["k"], x["v"], x["g"], x["beta"], n, initial_state=x["S0"])
    G = H // Hk
    for b in range(B_):
        for h in range(H):
            S = x["S0"][b, h].copy()
            for t in range(T):
                A, U = np.eye(K_), np.zeros((K_, V_))
                for j in range(n):
                    kk, bt = x["k"][b, t * n + j, h // G], x["beta"][b, t * n + j, h]
                    Hj = np.eye(K_) - bt * np.outer(kk, kk)
                    A, U = Hj @ A, Hj @ U + bt * np.outer(kk, x["v"][b, t * n + j, h])
                S = A @ ((1.0 if x["g"] is None else np.exp(x["g"][b, t, h])) * S) + U
                np.testing.assert_allclose(o[b, t, h], S.T @ (K_ ** -0.5 * x["q"][b, t, h // G]),
                                           rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(ht[b, h], S, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,gated", [(2, True), (3, False)])
def test_gated_delta_product_is_gated_delta_net_over_micro_steps(n, gated):
    """The composition recgen's op runs: gated DeltaNet over the T*n micro-steps, the gate at each token's first
    micro-step (0 elsewhere), q at its last (0 elsewhere), every n-th output; gradients of q and g are those
    positions' gradients."""
    rng = np.random.default_rng(9300 + n)
    T, Hk, H = 5, 2, 4
    x = _gdp_data(rng, T, Hk, H, n, gated)
    do, dht = rng.standard_normal((B_, T, H, V_)), rng.standard_normal((B_, H, K_, V_))
    qn = np.zeros((B_, T, n, Hk, K_))
    qn[:, :, -1] = x["q"]
    gn = np.zeros((B_, T, n, H))
    if gated:
        gn[:, :, 0] = x["g"]
    don = np.zeros((B_, T, n, H, V_))
    don[:, :, -1] = do
    flat = lambda a: a.reshape(B_, T * n, *a.shape[3:])  # noqa: E731
    micro = (flat(qn), x["k"], x["v"], flat(gn), x["beta"])
    oa, ha = gated_delta_product(x["q"], x["k"], x["v"], x["g"], x["beta"], n, initial_state=x["S0"])
    ob, hb = gated_delta_net(*micro, scale=K_ ** -0.5, initial_state=x["S0"])
    np.testing.assert_allclose(oa, ob[:, n - 1::n], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(ha, hb, rtol=1e-13, atol=1e-13)
    ga = gated_delta_product_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], n, do, dht, initial_state=x["S0"])
    gb = gated_delta_net_bwd(*micro, flat(don), dht, scale=K_ ** -0.5, initial_state=x["S0"])
    np.testing.assert_allclose(ga["q"], gb["q"][:, n - 1::n], rtol=1e-12, atol=1e-12)
    for key in ("k", "v", "beta", "initial_state"):
        np.testing.assert_allclose(ga[key], gb[key], rtol=1e-12, atol=1e-12)
    if gated:
        np.testing.assert_allclose(ga["g"], gb["g"][:, ::n], rtol=1e-12, atol=1e-12)
