"""The generated Metal kernels, verified on Linux (layers 1-4 of docs/design.md, "Verifying Metal without a Mac").

For every built-in with a recurrent kernel: MLX's exact wrapped source is captured, type-checked
by clang with address spaces, linted against Apple-GPU limits and executed on the CPU emulator;
forward, final state and every gradient are compared with the float64 reference.
These are not runs on Apple hardware: see the README.
"""
import numpy as np
import pytest

from recgen.math import reference

from recgen import specs
from recgen.codegen.lower import UnsupportedKernel, plan
from recgen.spec.layouts import Sizes

verify = pytest.importorskip("recgen.verify.kernels")
from recgen.verify.typecheck import clang_problem  # noqa: E402

pytestmark = pytest.mark.skipif(clang_problem() is not None, reason=clang_problem() or "")

from recgen.testing import kernel_inputs, rel_err  # noqa: E402

KERNEL_SPECS = ["gated_delta_net", "kda", "delta_net", "gla", "simple_gla", "selective_scan", "selective_scan_linear_dt",
                "retnet", "hgrn2", "mamba2", "mamba2_linear_dt", "mlstm", "mlstm_sigmoid", "rwkv6", "rwkv7"]


def _check(name, sizes, sanitizer=None, seed=0):
    rec = specs.BUILTINS[name] if isinstance(name, str) else name
    xs, h0, do, dht, scale = kernel_inputs(rec, sizes, np.random.default_rng(seed))
    o, ht, g = verify.emulate(rec, xs, initial_state=h0, do=do, dht=dht, scale=scale, sanitizer=sanitizer)
    o_r, ht_r = reference.run(rec, initial_state=h0, scale=scale, **xs)
    g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    for a, b in zip(_parts(ht), _parts(ht_r)):
        assert rel_err(a, b) <= 1e-5, ("final state", rel_err(a, b))
    assert rel_err(o, o_r) <= 1e-5, rel_err(o, o_r)
    for k in g_r:
        for a, b in zip(_parts(g[k]), _parts(g_r[k])):
            assert rel_err(a, b) <= 1e-4, (k, rel_err(a, b))


def _parts(state):
    """A state, or each part of a normalizer's (S, z)."""
    return tuple(state) if isinstance(state, (tuple, list)) else (state,)


@pytest.mark.parametrize("name", KERNEL_SPECS)
def test_metal_kernels_match_reference(name):
    """Odd T, K != V, GQA (where keys exist), V not a multiple of the column tile, strong decays."""
    Hk = 4 if name.startswith("selective") else 2
    _check(name, Sizes(B=2, T=5, H=4, Hk=Hk, Kin=8, K=8, V=12))


def test_metal_edge_threadgroups_and_t1():
    """Several warps and threadgroups, a partial last column tile, T = 1."""
    _check("gated_delta_net", Sizes(B=1, T=1, H=2, Hk=1, Kin=32, K=32, V=40), seed=1)
    _check("gla", Sizes(B=1, T=3, H=2, Hk=2, Kin=32, K=32, V=40), seed=2)


def test_metal_rwkv6_edges():
    """RWKV-6's pre-update readout and bonus: several warps and threadgroups, a partial column tile, T = 1 (the
    decode layout), no GQA as FLA has it, and GQA."""
    _check("rwkv6", Sizes(B=1, T=1, H=2, Hk=2, Kin=32, K=32, V=40), seed=4)
    _check("rwkv6", Sizes(B=2, T=3, H=2, Hk=1, Kin=32, K=32, V=40), seed=5)


@pytest.mark.parametrize("sanitizer", ["address", "thread"])
def test_metal_kernels_under_sanitizers(sanitizer):
    """ASan+UBSan (bounds, undefined behaviour) and TSan (threadgroup-memory races, barriers)."""
    _check("gated_delta_net", Sizes(B=1, T=3, H=2, Hk=1, Kin=8, K=8, V=12), sanitizer=sanitizer, seed=3)


def test_unsupported_kernel_is_a_clear_error():
    with pytest.raises(UnsupportedKernel, match="feature maps"):
        plan(specs.power_retention, Sizes(1, 2, 1, 1, 4, 10, 4))


def test_metal_normalizer_with_skip_term():
    """A normalizer beside a skip term (an mLSTM-style readout y / N(n) + D ⊙ v): the forward also writes y / N for
    the backward's normalizer gradient; several warps and threadgroups, a partial column tile, T = 1, and under
    ASan+UBSan (the extra output's bounds)."""
    from op_check import norm_skip

    _check(norm_skip(), Sizes(B=2, T=5, H=4, Hk=2, Kin=8, K=8, V=12), seed=12)
    _check(norm_skip(), Sizes(B=1, T=1, H=2, Hk=1, Kin=32, K=32, V=40), seed=13)
    _check(norm_skip(), Sizes(B=1, T=3, H=2, Hk=1, Kin=8, K=8, V=12), sanitizer="address", seed=14)


def test_metal_normalizer_kernels_t1():
    """A normalizer state (mlstm_sigmoid: sigmoid input gate, N(n) = sqrt(n^2 + 1)) at T = 1, several warps."""
    _check("mlstm_sigmoid", Sizes(B=1, T=1, H=2, Hk=1, Kin=32, K=32, V=40), seed=11)


def test_metal_kernels_param_signatures():
    """Parameters of every signature: (i) decay, () gain, (j) skip weight, (i, j) covered by selective_scan."""
    import recgen as rg

    @rg.recurrence
    def param_mix(q: rg.Key, k: rg.Key, v: rg.Value, lam: rg.Param["i"], gain: rg.Param[()], w: rg.Param["j"]):
        return rg.Step(decay=rg.exp(lam), update=rg.outer(rg.sigmoid(gain) * k, v), readout=rg.scale * q, skip=w * v)

    sizes = Sizes(B=2, T=4, H=4, Hk=2, Kin=8, K=8, V=12)
    xs, h0, do, dht, scale = kernel_inputs(param_mix, sizes, np.random.default_rng(21))
    xs["lam"] = -np.abs(xs["lam"])
    o, ht, g = verify.emulate(param_mix, xs, initial_state=h0, do=do, dht=dht, scale=scale)
    o_r, ht_r = reference.run(param_mix, initial_state=h0, scale=scale, **xs)
    g_r = reference.grad(param_mix, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    assert rel_err(o, o_r) <= 1e-5 and rel_err(ht, ht_r) <= 1e-5
    for k in g_r:
        assert rel_err(g[k], g_r[k]) <= 1e-4, (k, rel_err(g[k], g_r[k]))


def test_metal_readout_before_update_with_transition_and_full_decay():
    """The pre-update readout and the bonus beside a delta-rule transition (r do^T joins dS_{t-1} after the
    transition's adjoint) and beside a full (i, j) decay; a bonus on a post-update readout; T = 1 and odd T."""
    import recgen as rg

    @rg.recurrence
    def delta_pre(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar, beta: rg.Scalar, c: rg.Param["i"]):
        return rg.Step(decay=rg.exp(g), transition=rg.rank1(-beta * k, k), update=rg.outer(beta * k, v),
                       readout=rg.scale * q, readout_before_update=True, bonus=rg.scale * q * c * k)

    @rg.recurrence
    def scan_pre(x: rg.Value, dt: rg.Value, A: rg.Param["i", "j"], Bk: rg.Key, Ck: rg.Key, c: rg.Param["i"]):
        d = rg.softplus(dt)
        return rg.Step(decay=rg.exp(d * A), update=rg.outer(Bk, d * x), readout=Ck, readout_before_update=True,
                       bonus=Ck * c * Bk)

    @rg.recurrence
    def gla_bonus(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar, c: rg.Param["i"]):
        return rg.Step(decay=rg.exp(g), update=rg.outer(k, v), readout=rg.scale * q, bonus=c * k * q)

    for seed, (rec, sizes) in enumerate([(delta_pre, Sizes(B=2, T=5, H=4, Hk=2, Kin=8, K=8, V=12)),
                                         (delta_pre, Sizes(B=1, T=1, H=2, Hk=1, Kin=8, K=8, V=12)),
                                         (scan_pre, Sizes(B=2, T=5, H=2, Hk=2, Kin=8, K=8, V=12)),
                                         (gla_bonus, Sizes(B=2, T=3, H=2, Hk=1, Kin=8, K=8, V=12))]):
        xs, h0, do, dht, scale = kernel_inputs(rec, sizes, np.random.default_rng(30 + seed))
        if "beta" in xs:  # a contracting transition: unit keys come from kernel_inputs, β in (0, 1)
            assert np.allclose(np.linalg.norm(xs["k"], axis=-1), 1.0, atol=1e-6)
        o, ht, g = verify.emulate(rec, xs, initial_state=h0, do=do, dht=dht, scale=scale)
        o_r, ht_r = reference.run(rec, initial_state=h0, scale=scale, **xs)
        g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
        assert rel_err(o, o_r) <= 1e-5 and rel_err(ht, ht_r) <= 1e-5, (rec.name, rel_err(o, o_r), rel_err(ht, ht_r))
        for k in g_r:
            assert rel_err(g[k], g_r[k]) <= 1e-4, (rec.name, k, rel_err(g[k], g_r[k]))


def test_metal_rwkv7_edges():
    """RWKV-7's transition before the decay: several warps and threadgroups, a partial column tile, T = 1 (the
    decode layout), K != V, odd T with GQA and without."""
    _check("rwkv7", Sizes(B=1, T=1, H=2, Hk=2, Kin=32, K=32, V=40), seed=6)
    _check("rwkv7", Sizes(B=2, T=7, H=2, Hk=1, Kin=32, K=32, V=40), seed=7)
    _check("rwkv7", Sizes(B=1, T=3, H=2, Hk=2, Kin=16, K=16, V=8), seed=8)


def test_metal_transition_before_decay_combinations():
    """The transition before the decay with a scalar decay, beside the pre-update readout and a bonus, and beside
    a normalizer (its backward kernel): T = 1 and odd T."""
    import recgen as rg

    @rg.recurrence
    def dplr_pre_bonus(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar, beta: rg.Scalar, c: rg.Param["i"]):
        return rg.Step(decay=rg.exp(g), transition=rg.rank1(-beta * k, k, before_decay=True),
                       update=rg.outer(beta * k, v), readout=rg.scale * q, readout_before_update=True,
                       bonus=rg.scale * q * c * k)

    @rg.recurrence
    def dplr_norm(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar, beta: rg.Scalar, f: rg.Scalar):
        return rg.Step(decay=rg.exp(g), transition=rg.rank1(-beta * k, k, before_decay=True),
                       update=rg.outer(beta * k, v), readout=rg.scale * q,
                       normalizer=rg.normalizer(rg.sigmoid(f), k, lambda n: n**2 + 1))

    for seed, (rec, sizes) in enumerate([(dplr_pre_bonus, Sizes(B=2, T=5, H=4, Hk=2, Kin=8, K=8, V=12)),
                                         (dplr_pre_bonus, Sizes(B=1, T=1, H=2, Hk=1, Kin=8, K=8, V=12)),
                                         (dplr_norm, Sizes(B=2, T=5, H=2, Hk=2, Kin=8, K=8, V=12))]):
        xs, h0, do, dht, scale = kernel_inputs(rec, sizes, np.random.default_rng(40 + seed))
        o, ht, g = verify.emulate(rec, xs, initial_state=h0, do=do, dht=dht, scale=scale)
        o_r, ht_r = reference.run(rec, initial_state=h0, scale=scale, **xs)
        g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
        assert rel_err(o, o_r) <= 1e-5, (rec.name, rel_err(o, o_r))
        for a, b in zip(_parts(ht), _parts(ht_r)):
            assert rel_err(a, b) <= 1e-5, (rec.name, rel_err(a, b))
        for k in g_r:
            for a, b in zip(_parts(g[k]), _parts(g_r[k])):
                assert rel_err(a, b) <= 1e-4, (rec.name, k, rel_err(a, b))

