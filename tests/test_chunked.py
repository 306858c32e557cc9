"""recgen.chunked (pure-MLX chunked forms) against the float64 reference interpreter.

Every built-in spec: forward output, final state, and the gradient of every input and of the
initial state (through mx.vjp with random cotangents for o and final_state) must equal
``recgen.math.reference.run/grad``. Inputs are drawn in float64, rounded to float32 and given to
both sides, so the comparison measures the chunked computation, not input rounding.

Tolerances (‖a − b‖ / ‖b‖): forward (o, S, z) ≤ 1e-5; gradients ≤ 1e-4. Gradients of gates are
sums over K·V (parameters also over B·T) of products of opposite signs: float32 cancellation
puts them near 1e-5 (largest seen: 1.1e-5 for GLA's dgk at log-decay -20), so 1e-4 leaves
margin without hiding a wrong term (a wrong term gives O(1)).

Power retention is checked like every built-in (float32, log-decays down to -20: its readout's floor
ε = 1e-2 keeps it well-conditioned, docs/design.md) and, in addition, through ``compute_dtype=mx.float64``
(the same chunked algebra in double precision; MLX's CPU exp/log are float32-accurate even in float64, hence
a 1e-6 bound rather than 1e-12).
"""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from recgen import specs, tuning  # noqa: E402
from recgen.math import reference  # noqa: E402
from recgen.runtime import probe  # noqa: E402
from recgen.spec import ir  # noqa: E402
from recgen.testing import rel_err  # noqa: E402
from recgen.chunked import forward, naive_loop  # noqa: E402
from recgen.spec.features import sympow  # noqa: E402
from recgen.spec.frontend import Key, KeyGate, Scalar, Step, Value, Param, normalizer, rank1, outer, recurrence  # noqa: E402
from recgen.spec.fns import exp, sigmoid, softplus  # noqa: E402
from recgen.spec.layouts import infer_sizes  # noqa: E402

FWD_TOL, GRAD_TOL = 1e-5, 1e-4


@pytest.fixture(autouse=True)
def _cpu():
    mx.set_default_device(mx.cpu)


def r32(a):
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def make_inputs(rec, rng, B, T, H, Hk, K, V, gmin):
    """Fresh random inputs in FLA layouts (never zeros), float32-representable."""
    out = {}
    delta = rec.step.transition is not None
    for x in rec.inputs:
        if x.kind == "scalar":
            if x.name == "g":
                a = -rng.uniform(0, -gmin, (B, T, H))
            elif x.name == "dt" and rec.name == "mamba2_linear_dt":
                a = np.logaddexp(0, rng.normal(size=(B, T, H)))  # Δ > 0 as given
            elif x.name == "beta":
                a = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
            else:
                a = rng.normal(size=(B, T, H))
        elif x.kind == "key":
            a = rng.normal(size=(B, T, Hk, K))
            if delta and x.name == "k":
                a /= np.linalg.norm(a, axis=-1, keepdims=True)
        elif x.kind == "key_gate":
            a = -rng.uniform(0, -gmin, (B, T, H, K))
        elif x.kind == "value":
            a = rng.normal(size=(B, T, H, V))
            if x.name == "dt" and rec.name == "selective_scan_linear_dt":
                a = np.logaddexp(0, a)  # Δ > 0 as given
        else:
            shp = (H,) + tuple({"i": K, "j": V}[c] for c in x.index)
            a = -np.exp(rng.normal(size=shp)) if x.name == "A" else rng.normal(size=shp)
            if x.name == "log_gamma":  # retnet's per-head log-decays, log-uniform over [gmin, -1e-3]: with a
                # few heads all strong, dlog_gamma (a sum over B, T of float32 per-token terms) is tiny beside its
                # rounding (1e-5 absolute at T = 65 against 1e-4 .. 1e-7 values; exact with compute_dtype=float64)
                a = -np.exp(rng.uniform(np.log(1e-3), np.log(-gmin), shp))
        out[x.name] = r32(a)
    if rec.name == "rwkv7":  # RWKV-7's own transition: a = -kk (unit), b = kk ⊙ iclr (+ an independent part)
        kk = out["a"] / np.linalg.norm(out["a"], axis=-1, keepdims=True)
        out["a"], out["b"] = r32(-kk), r32(kk * rng.uniform(0.05, 0.95, kk.shape) + 0.1 * out["b"] / np.sqrt(K))
    return out


def compare(rec, T, *, chunk=64, B=2, H=4, Hk=2, K=8, V=6, gmin=-20.0, init=True, seed=0,
            f64=False, fn=None, in_dtype=None, tuning=None, scale=None):
    """Chunked (or ``fn``) vs the reference: returns {quantity: relative error}. ``in_dtype`` (e.g.
    mx.bfloat16): the inputs are given in it, rounded to it for the reference too (states stay float32).
    ``scale``: the readout scale (default: the spec's)."""
    rng = np.random.default_rng(seed)
    if rec.features:
        K = 4  # raw key width; the state has K(K+1)/2 = 10 rows
    d = make_inputs(rec, rng, B, T, H, Hk, K, V, gmin)
    if in_dtype is not None:
        d = {k: np.array(mx.array(v.astype(np.float32)).astype(in_dtype).astype(mx.float32)).astype(np.float64)
             for k, v in d.items()}
    sz = infer_sizes(rec, {k: v.shape for k, v in d.items()})
    if scale is None:
        scale = sz.Kin ** -0.5 if rec.default_scale == "key" else 1.0
    h0 = None
    if init:
        if rec.has_normalizer:  # a reachable state: sums of features
            kk = rng.normal(size=(B, H, 3, sz.Kin))
            phi = sympow(kk) if rec.features else kk
            h0 = (r32(phi.transpose(0, 1, 3, 2) @ rng.normal(size=(B, H, 3, V))), r32(phi.sum(2)))
        else:
            h0 = r32(rng.normal(size=sz.state_shape))
    do = r32(rng.normal(size=(B, T, H, sz.V)))
    dht = r32(rng.normal(size=sz.state_shape))
    if rec.has_normalizer:
        dht = (dht, r32(rng.normal(size=sz.state_shape[:3])))
    o_ref, s_ref = reference.run(rec, initial_state=h0, scale=scale, **d)
    g_ref = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **d)

    dt = np.float64 if f64 else np.float32
    names = list(d)
    flat_h0 = [] if h0 is None else (list(h0) if isinstance(h0, tuple) else [h0])
    given = in_dtype or (mx.float64 if f64 else mx.float32)
    primals = [mx.array(d[n].astype(dt)).astype(given) for n in names]
    primals += [mx.array(x.astype(dt)) for x in flat_h0]
    flat_dht = list(dht) if isinstance(dht, tuple) else [dht]
    cot = [mx.array(do.astype(dt)).astype(given)] + [mx.array(x.astype(dt)) for x in flat_dht]
    kw = {"compute_dtype": mx.float64} if f64 else {}
    call = fn or (lambda r, ins, **k: forward(r, ins, chunk_size=chunk, tuning=tuning, **k, **kw))

    def fun(*args):
        ins = dict(zip(names, args[:len(names)]))
        st = args[len(names):]
        st = None if not st else (tuple(st) if rec.has_normalizer else st[0])
        o, s = call(rec, ins, scale=scale, initial_state=st)
        return [o, *s] if rec.has_normalizer else [o, s]

    outs, grads = mx.vjp(fun, primals, cot)
    res = {"o": rel_err(outs[0], o_ref)}
    for i, s in enumerate(s_ref if rec.has_normalizer else (s_ref,)):
        res[f"state{i}"] = rel_err(outs[1 + i], s)
    for n, g in zip(names, grads):
        res["d" + n] = rel_err(g, g_ref[n])
    gi = g_ref["initial_state"]
    for i, g in enumerate(gi if rec.has_normalizer else (gi,)):
        if init:
            res[f"dh0_{i}"] = rel_err(grads[len(names) + i], g)
    return res


def assert_close(res, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL):
    bad = {k: v for k, v in res.items()
           if not (v <= (fwd_tol if k == "o" or k.startswith("state") else grad_tol))}
    assert not bad, f"errors above tolerance: {bad} (all: {res})"


MAIN = list(specs.BUILTINS)


@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (64, 64), (65, 64), (65, 16)])
@pytest.mark.parametrize("name", MAIN)
def test_builtin_strong_decay(name, T, chunk):
    """Log-decays down to -20, K ≠ V, GQA (Hk=2 < H=4), random initial state, random cotangents."""
    assert_close(compare(specs.BUILTINS[name], T, chunk=chunk, seed=T + chunk))


@pytest.mark.parametrize("name", MAIN)
def test_long_sequence(name):
    """T = 1000 for every built-in (the selective scans through the two-level scan and its written VJP)."""
    assert_close(compare(specs.BUILTINS[name], 1000, chunk=64, B=1, H=2, Hk=1, K=8, V=8, seed=7))


def test_power_retention_long_sequence_float64():
    assert_close(compare(specs.power_retention, 1000, chunk=64, B=1, H=2, Hk=1, V=8, gmin=-20.0, seed=7, f64=True),
                 1e-6, 1e-6)


@pytest.mark.parametrize("name", ["simple_gla", "delta_net", "selective_scan"])
def test_many_small_chunks_no_initial_state(name):
    assert_close(compare(specs.BUILTINS[name], 100, chunk=8, init=False, seed=3))


@pytest.mark.parametrize("T,chunk", [(64, 64), (65, 16)])
def test_power_retention_strong_decay_float64(T, chunk):
    assert_close(compare(specs.power_retention, T, chunk=chunk, gmin=-20.0, seed=T, f64=True), 1e-6, 1e-6)


@pytest.mark.parametrize("name", ["gated_delta_net", "gla", "selective_scan", "power_retention", "rwkv6", "rwkv7"])
def test_naive_loop_matches_reference(name):
    assert_close(compare(specs.BUILTINS[name], 17, seed=11, fn=naive_loop))


@pytest.mark.parametrize("blas", ["fast", "reference"])
def test_cpu_choices_follow_the_blas(blas):
    """The BLAS choice (``Tuning.cpu_blas``, else measured) sets the CPU's default chunk for key-vector decays and
    whether ``tr`` copies; both paths against the float64 reference at the default chunk."""
    t = probe.checked(tuning.resolve("cpu", environ={}, cpu_blas=blas))
    assert (t.key_chunk_size, t.chunk_size, t.copy_transposes) == ((32, 16, False) if blas == "fast" else (16, 16, True))
    with tuning.override(cpu_blas=blas):
        for name in ("gla", "gated_delta_net"):
            assert_close(compare(specs.BUILTINS[name], 70, chunk=None, seed=5))


def test_chunk_sizes_agree_and_bf16_output():
    rec = specs.gated_delta_net
    rng = np.random.default_rng(5)
    d = make_inputs(rec, rng, 1, 50, 2, 2, 16, 16, -5.0)
    ins = {k: mx.array(v.astype(np.float32)) for k, v in d.items()}
    o1, s1 = forward(rec, ins, scale=0.25, chunk_size=7)
    o2, s2 = forward(rec, ins, scale=0.25, chunk_size=64)
    assert rel_err(o1, o2) < 1e-5 and rel_err(s1, s2) < 1e-5
    ob, sb = forward(rec, {k: v.astype(mx.bfloat16) for k, v in ins.items()}, scale=0.25)
    assert ob.dtype == mx.bfloat16 and sb.dtype == mx.float32


def test_custom_spec_sigmoid_decay_uses_log():
    """A decay not written as exp(e) enters through log(D) -> logsigmoid, exact at strong gates."""

    @recurrence
    def sig_gla(q: Key, k: Key, v: Value, f: Scalar):
        return Step(decay=sigmoid(f), update=outer(k, v), readout=ir.SCALE * q)

    rng = np.random.default_rng(2)
    res = compare(sig_gla, 40, chunk=16, seed=2)
    assert_close(res)
    del rng


@recurrence
def dplr(q: Key, k: Key, kk: Key, v: Value, g: Scalar, beta: Scalar):
    """A rank-1 transition whose a is not a multiple of u (the general WY/UT path: ``rank1``'s core)."""
    return Step(decay=exp(g), transition=rank1(-beta * kk, k), update=outer(beta * k, v), readout=ir.SCALE * q)


@recurrence
def two_decays(q: Key, k: Key, v: Value, g: Scalar, f: Scalar):
    """A normalizer whose decay differs from the state's (z is not fused into S as a column)."""
    return Step(decay=exp(g), update=outer(k, v), readout=ir.SCALE * q,
                normalizer=normalizer(sigmoid(f), k, lambda n: n**2 + 1))


@recurrence
def scan_with_normalizer(x: Value, dt: Value, A: Param["i", "j"], Bk: Key, Ck: Key, f: Scalar):
    """A full (i, j) decay (the two-level scan) beside a normalizer with a scalar decay."""
    d = softplus(dt)
    return Step(decay=exp(d * A), update=outer(Bk, d * x), readout=Ck,
                normalizer=normalizer(sigmoid(f), Bk, lambda n: n**2 + 1))


@recurrence
def delta_pre(q: Key, k: Key, v: Value, g: Scalar, beta: Scalar, c: Param["i"]):
    """The delta rule (the parallel core's WY form) with the pre-update readout and a bonus."""
    return Step(decay=exp(g), transition=rank1(-beta * k, k), update=outer(beta * k, v), readout=ir.SCALE * q,
                readout_before_update=True, bonus=ir.SCALE * q * c * k)


@recurrence
def dplr_pre(q: Key, k: Key, kk: Key, v: Value, g: Scalar, beta: Scalar):
    """A general rank-1 transition (``rank1``'s core) with the pre-update readout, no bonus."""
    return Step(decay=exp(g), transition=rank1(-beta * kk, k), update=outer(beta * k, v), readout=ir.SCALE * q,
                readout_before_update=True)


@recurrence
def scan_pre(x: Value, dt: Value, A: Param["i", "j"], Bk: Key, Ck: Key, c: Param["i"]):
    """A full (i, j) decay (``core.scan_full``) with the pre-update readout and a bonus."""
    d = softplus(dt)
    return Step(decay=exp(d * A), update=outer(Bk, d * x), readout=Ck, readout_before_update=True, bonus=Ck * c * Bk)


@recurrence
def gla_bonus(q: Key, k: Key, v: Value, g: Scalar, c: Param["i"]):
    """A bonus with the usual post-update readout."""
    return Step(decay=exp(g), update=outer(k, v), readout=ir.SCALE * q, bonus=c * k * q)


READOUT_EXTENSIONS = {"delta_pre": delta_pre, "dplr_pre": dplr_pre, "scan_pre": scan_pre, "gla_bonus": gla_bonus}


@pytest.mark.parametrize("T,chunk", [(1, 16), (45, 16), (64, 64)])
@pytest.mark.parametrize("name", sorted(READOUT_EXTENSIONS))
def test_readout_before_update_and_bonus_on_every_form(name, T, chunk):
    """The pre-update readout (a shifted readout on the unchanged cores) and the bonus on each chunked form."""
    from recgen.chunked.terms import plan

    rec = READOUT_EXTENSIONS[name]
    assert plan(rec).decay_class == ("full" if name == "scan_pre" else "scalar")
    assert_close(compare(rec, T, chunk=chunk, seed=T + 3, gmin=-20.0))


@pytest.mark.parametrize("name", ["rwkv6", "scan_pre", "dplr_pre"])
def test_readout_extensions_segmented(name):
    """Segments of one chunk (a 1-byte budget): each segment's first readout comes from its own entry state."""
    rec = READOUT_EXTENSIONS.get(name) or specs.BUILTINS[name]
    with tuning.override(segment_budget=1):
        assert_close(compare(rec, 70, chunk=16, seed=21, gmin=-20.0))


@recurrence
def dplr_scalar(q: Key, k: Key, v: Value, g: Scalar, beta: Scalar):
    """A delta-rule-shaped transition before a scalar decay: (e^g I - β k kᵀ) S + β k vᵀ (the general form)."""
    return Step(decay=exp(g), transition=rank1(-beta * k, k, before_decay=True), update=outer(beta * k, v),
                readout=ir.SCALE * q)


@recurrence
def dplr_pre_bonus(q: Key, k: Key, v: Value, g: Scalar, beta: Scalar, c: Param["i"]):
    """A transition before the decay with the pre-update readout and a bonus."""
    return Step(decay=exp(g), transition=rank1(-beta * k, k, before_decay=True), update=outer(beta * k, v),
                readout=ir.SCALE * q, readout_before_update=True, bonus=ir.SCALE * q * c * k)


@recurrence
def dplr_norm(q: Key, k: Key, v: Value, g: Scalar, beta: Scalar, f: Scalar):
    """A transition before the decay beside a normalizer with its own decay."""
    return Step(decay=exp(g), transition=rank1(-beta * k, k, before_decay=True), update=outer(beta * k, v),
                readout=ir.SCALE * q, normalizer=normalizer(sigmoid(f), k, lambda n: n**2 + 1))


BEFORE_DECAY = {"dplr_scalar": dplr_scalar, "dplr_pre_bonus": dplr_pre_bonus, "dplr_norm": dplr_norm}


@pytest.mark.parametrize("T,chunk", [(1, 16), (45, 16), (64, 64)])
@pytest.mark.parametrize("name", sorted(BEFORE_DECAY))
def test_transition_before_decay_forms(name, T, chunk):
    """The transition before the decay (``rank1``'s shifted pairs) with a scalar decay, beside the pre-update
    readout and bonus, and beside a normalizer: strong decays, against the reference."""
    from recgen.chunked.terms import plan

    rec = BEFORE_DECAY[name]
    assert plan(rec).decay_class == "scalar" and not plan(rec).has_rho
    assert_close(compare(rec, T, chunk=chunk, seed=T + 11, gmin=-20.0))


def test_rwkv7_segmented():
    """Segments of one chunk (a 1-byte budget): each segment starts from its own entry state."""
    with tuning.override(segment_budget=1):
        assert_close(compare(specs.rwkv7, 70, chunk=16, seed=23, gmin=-20.0))


@recurrence
def dplr_key(q: Key, k: Key, kk: Key, v: Value, gk: KeyGate, beta: Scalar):
    """A general rank-1 transition after a key-vector decay (``rank1``'s core: A and M_ra, B and M_ru in pairs)."""
    return Step(decay=exp(gk), transition=rank1(-beta * kk, k), update=outer(beta * k, v), readout=ir.SCALE * q)


@pytest.mark.parametrize("T,chunk", [(1, 16), (45, 16), (64, 32)])
def test_general_rank1_after_a_key_decay(T, chunk):
    """Strong key-vector decays (to e^-20), a partial last chunk, T = 1, GQA, K != V: against the reference."""
    from recgen.chunked.terms import plan

    assert plan(dplr_key).decay_class == "key" and not plan(dplr_key).has_rho
    assert_close(compare(dplr_key, T, chunk=chunk, seed=T + 3, gmin=-20.0))


@pytest.mark.parametrize("key,before", [(False, False), (False, True), (True, False), (True, True)])
def test_rank1_core_vjp_matches_autodiff(key, before):
    """The rank-1 core's written VJP against MLX autodiff of the same algebra written independently
    (``core.chunks_rank1``: the hierarchy of decay levels and an unrolled scan), on random chunked operands with
    decays to e^-20: every output and every gradient, the log-decays' included."""
    from recgen.chunked import core, rank1

    rng = np.random.default_rng(7 + 2 * key + before)
    B, H, n, C, K, V = 2, 3, 3, 8, 8, 5
    f = lambda *s, sc=1.0: mx.array((rng.normal(size=s) * sc).astype(np.float32))  # noqa: E731
    S0, r, u, w = f(B, H, K, V), f(B, H, n, C, K), f(B, H, n, C, K, sc=0.5), f(B, H, n, C, V)
    kk = rng.normal(size=(B, H, n, C, K))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    a, b = mx.array((-kk).astype(np.float32)), mx.array((kk * rng.uniform(0.1, 0.9, kk.shape)).astype(np.float32))
    l = mx.array(-rng.uniform(0, 20 / C, (B, H, n, C, K if key else 1)).astype(np.float32))
    dy, dS = f(B, H, n, C, V), f(B, H, K, V)
    t = tuning.resolve("cpu", environ={})
    written = lambda *x: rank1.core_fn(key, before, t)(*x)[:2]  # noqa: E731
    auto = lambda S, r, u, w, a, b, l: [core.chunks_rank1(S, r, u, w, a, b, mx.exp(l), before)[i] for i in (0, 2)]  # noqa: E731
    ins = [S0, r, u, w, a, b, l]
    (y1, s1), g1 = mx.vjp(written, ins, [dy, dS])
    (y2, s2), g2 = mx.vjp(auto, ins, [dy, dS])
    assert rel_err(y1, y2) < 1e-5 and rel_err(s1, s2) < 1e-5
    for name, x, z in zip(("S0", "r", "u", "w", "a", "b", "l"), g1, g2):
        assert rel_err(x, z) < 1e-4, (name, rel_err(x, z))


@pytest.mark.parametrize("shift,grads", [(60.0, False), (30.0, True)])
def test_mlstm_large_input_gates_in_float32(shift, grads):
    """xLSTM's mLSTM without its stabilizer, in float32: input gates e^{shift + 2 N(0, 1)}. The output holds to
    e^60 and beyond, the gradients (which scale as 1 / max(|nᵀq|, 1)) to about e^35 (specs.mlstm)."""
    rng = np.random.default_rng(int(shift))
    B, T, H, K, V = 2, 40, 2, 16, 8
    x = dict(q=rng.normal(size=(B, T, H, K)), k=rng.normal(size=(B, T, H, K)), v=rng.normal(size=(B, T, H, V)),
             ig=shift + 2 * rng.normal(size=(B, T, H)), fg=3 * rng.normal(size=(B, T, H)))
    x = {n: a.astype(np.float32).astype(np.float64) for n, a in x.items()}
    args = [mx.array(x[n].astype(np.float32)) for n in ("q", "k", "v", "ig", "fg")]
    o_ref, _ = reference.run(specs.mlstm, **x)
    do = rng.normal(size=o_ref.shape)
    (o,), g = mx.vjp(lambda *a: [forward(specs.mlstm, dict(zip("q k v ig fg".split(), a)), scale=K ** -0.5)[0]],
                     args, [mx.array(do.astype(np.float32))])
    assert rel_err(o, o_ref) < 5e-4  # e^{±4} between tokens' gates: float32 sums lose a little (2e-4 over 5 seeds)
    if grads:
        g_ref = reference.grad(specs.mlstm, do=do, **x)
        for n, gg in zip(("q", "k", "v", "ig", "fg"), g):
            assert rel_err(gg, g_ref[n]) < 5e-4, n


def test_general_rank1_and_separate_normalizer():
    from recgen.chunked.terms import plan

    assert not plan(dplr).has_rho and not plan(two_decays).fuse_z  # the paths this test is for
    assert plan(scan_with_normalizer).decay_class == "full"
    assert_close(compare(dplr, 45, chunk=16, seed=4, gmin=-8.0))
    assert_close(compare(two_decays, 45, chunk=16, seed=5, gmin=-8.0))
    assert_close(compare(scan_with_normalizer, 45, chunk=16, seed=6, gmin=-8.0))


@pytest.mark.parametrize("name", ["gated_delta_net", "gla", "selective_scan", "dplr", "two_decays", "power_retention",
                                  "scan_with_normalizer"])
def test_segmented_matches_reference(name, recgen_env):
    """A 1-byte budget forces segments of one chunk: the segmented forward (entry states only) and
    the reverse recomputation must give the same results as one piece."""
    recgen_env(RECGEN_CHUNKED_BUDGET="1")
    rec = {"dplr": dplr, "two_decays": two_decays, "scan_with_normalizer": scan_with_normalizer}.get(name) \
        or specs.BUILTINS[name]
    assert_close(compare(rec, 70, chunk=16, seed=21, gmin=-20.0))


@pytest.mark.parametrize("name,chunk", [("simple_gla", 16), ("gla", 16), ("power_retention", 16),
                                        ("gated_delta_net", 16), ("gated_delta_net", 64), ("gla", 64),
                                        ("rwkv6", 16), ("rwkv6", 64), ("rwkv7", 16), ("rwkv7", 64)])
def test_gpu_forms_match_reference(name, chunk):
    """The GPU forms, forced on the CPU: the diagonal scan over chunks as one (n+1)×(n+1) matmul,
    the triangular inverse from 16×16 blocks (at chunk 64: two block levels above them) and the whole
    stretch through mx.compile (T = 200: 13 chunks of 16 or 4 of 64, the last one partial)."""
    with tuning.override(gpu_forms=True, compile=True, inverse_base=16):
        assert_close(compare(specs.BUILTINS[name], 200, chunk=chunk, K=16, seed=22, gmin=-20.0))


def _peak_fwd_bwd(rec, T, chunk):
    rng = np.random.default_rng(0)
    d = make_inputs(rec, rng, 1, T, 2, 2, 32, 32, -1.0)
    ins = [mx.array(d[n].astype(np.float32)) for n in d]

    def loss(*a):
        o, s = forward(rec, dict(zip(d, a)), scale=0.2, chunk_size=chunk)
        return o.sum() + s.sum()

    mx.eval(ins)
    mx.reset_peak_memory()
    mx.eval(mx.grad(loss, argnums=list(range(len(ins))))(*ins))
    return mx.get_peak_memory(), sum(a.nbytes for a in ins)


def test_memory_bounded_in_T(recgen_env):
    """With segments, fwd+bwd peak memory grows like the inputs and their gradients (plus the
    output and its cotangent), not like T states and not like the unsegmented working set."""
    rec = specs.gla  # key-vector decay: the largest per-token working set of the built-ins
    one_piece = [_peak_fwd_bwd(rec, T, 64) for T in (512, 2048)]
    recgen_env(RECGEN_CHUNKED_BUDGET=str(2**20))  # segments of 64 tokens here
    segmented = [_peak_fwd_bwd(rec, T, 64) for T in (512, 2048)]
    io_growth = segmented[1][1] - segmented[0][1]  # bytes of the extra inputs
    growth = segmented[1][0] - segmented[0][0]
    assert growth < 8 * io_growth, (growth, io_growth)  # inputs, grads (pieces + whole), o, do: ~6x
    assert growth < 0.75 * (one_piece[1][0] - one_piece[0][0]), (segmented, one_piece)
    naive_state_bytes = 1536 * 2 * 32 * 32 * 4  # the T states a naive loop keeps for its backward
    assert growth < naive_state_bytes, growth
