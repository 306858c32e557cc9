"""The generated chunk kernels (``recgen.runtime.chunk_kernels``) on the Metal CPU emulator, against
float64 numpy: the triangular inverse and the chunk scan in both directions, scalar and key decays,
strong decays, V not a multiple of the column tile. (The CUDA form is checked on a GPU: ``tests/gpu``.)"""
import dataclasses

import numpy as np
import pytest

from recgen import specs, tuning
from recgen.codegen import chunk_sources as cs
from recgen.codegen.chunk_sources import ScanVariant
from recgen.chunked import rank1
from recgen.runtime import chunk_kernels as ck
from recgen.runtime import probe as pr
from recgen.spec.features import decayed_scores, decayed_scores_vjp, span_decays

verify = pytest.importorskip("recgen.verify.kernels")
from recgen.verify.typecheck import clang_problem  # noqa: E402

pytestmark = pytest.mark.skipif(clang_problem() is not None, reason=clang_problem() or "")


# The fragment frames' two lane layouts on the emulator: Metal's simdgroup_matrix ("metal") and CUDA's PTX m16n8k8
# ("metal_ptx": the Metal spelling of CUDA's layout by SIMD shuffles), so the indexing each layout needs is checked.
FRAGMENT_LAYOUTS = ["metal", "metal_ptx"]


def _scan(dialect, BH, n, C, K, V, F, has_e, reverse, has_a=True, has_b=True, mma=None, bv=32, **terms):
    """The scan's launch for these terms: on fragments where ``mma`` (default: where the dialect's measured
    tuning would put it), else the FMA frame."""
    if mma is None:
        mma = ck.use_mma(tuning.resolve("gpu", dialect, environ={}), C, K, V)
    v = ScanVariant(a=has_a, b=has_b, e=has_e, reverse=reverse, vec=not mma and V % 4 == 0, mma=mma, **terms)
    return ck.scan_launch(dialect, v, BH, n, C, K, V, F, bv)


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / (np.abs(b).max() + 1e-30))


@pytest.mark.parametrize("F", [1, 8])
@pytest.mark.parametrize("sanitizer", [None, "address", "thread"])
def test_decays_under_sanitizers(sanitizer, F):
    """The decays' pass under ASan+UBSan and TSan: a scalar decay's (F = 1: a SIMD group a chunk, ``lanes``; a partial
    share of lanes, chunks not a multiple of a threadgroup's four) and a key decay's (a thread a column, C = 40 not a
    multiple of the tokens it loads at once: the clamped loads stay in bounds); the same outputs as plain."""
    rng = np.random.default_rng(2)
    l = (-5 * rng.uniform(size=(5, 40, F)) ** 3).astype(np.float32)
    x = rng.normal(size=(5, 40, F)).astype(np.float32)
    launch = ck.decays_launch("metal", 5, 40, F, True, ("Q",), True, False)
    plain = verify.run_launch(launch, {"l": l, "X0": x})
    checked = verify.run_launch(launch, {"l": l, "X0": x}, sanitizer=sanitizer)
    assert all(np.array_equal(a, b) for a, b in zip(plain, checked)) and len(plain) == 5


@pytest.mark.parametrize("N,C,F,before,scaled,pq,d,q", [(3, 16, 32, False, (), True, True, True),
                                                       (5, 64, 40, False, (), True, True, True),
                                                       (3, 16, 40, True, ("Q", "P", "Pe", "Q"), True, True, True),
                                                       (3, 16, 40, True, ("Q", "P", "Pe", "Q"), False, True, True),
                                                       # C not a multiple of the tokens loaded at once (DECAYS_U)
                                                       (2, 24, 8, True, ("P", "Q"), True, True, False),
                                                       # F = 1: a SIMD group a chunk (lanes)
                                                       (5, 64, 1, False, ("Q",), True, False, True),
                                                       (3, 48, 1, True, ("P", "Q"), True, True, False),
                                                       (6, 128, 1, False, (), True, True, True),
                                                       (2, 16, 1, False, ("Q",), False, False, True)])
def test_key_decays_match_numpy(N, C, F, before, scaled, pq, d, q):
    """The decay geometry kernel (chunk_decays.j2): D = e^l, P_t = e^{sum_{tau<=t} l}, Q_s = e^{sum_{tau>s} l} per
    chunk and key column, G = P's last row (bit for bit), with ``before`` P_{t-1} (1 at t = 0), and roles X_i (bf16
    and float32) times the decay ``scaled`` names (without ``pq``: no P and Q; without ``q``: no Q; without ``d``: no
    D), log-decays down
    to -20 a token, some 0 and a reset (-inf), N F not a multiple of the threadgroup (128); a scalar decay (F = 1)
    with chunks a lane's share does not divide (C = 48) and of 1 to 4 tokens a lane."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(N + C + F)
    l = (-20 * rng.uniform(size=(N, C, F)) ** 3).astype(np.float32)
    l[rng.uniform(size=l.shape) < 0.05] = 0.0
    l[-1, C // 3, 0] = -np.inf
    xs = [rng.normal(size=(N, C, F)).astype(np.float32) for _ in scaled]
    ins = {"l": l} | {f"X{i}": (mx.array(x).astype(mx.bfloat16) if i % 2 else x) for i, x in enumerate(xs)}
    launch = ck.decays_launch("metal", N, C, F, before, scaled, pq, d, q)
    assert ("_lanes" in launch.source.name) == (F == 1)
    outs = verify.run_launch(launch, ins)
    assert len(outs) == d + pq + (pq and q) + 1 + before + len(scaled)
    l64 = l.astype(np.float64)
    back = np.cumsum(l64[:, ::-1], 1)[:, ::-1]
    after = np.concatenate([back[:, 1:], np.zeros_like(back[:, :1])], 1)  # sum over tau > s
    # P and Q carry the float32 rounding of their sums (|sum| up to 20 C / 4): relative 2^-24 C max|sum| at most
    tol = 2.0 ** -24 * C * np.abs(np.cumsum(np.where(np.isinf(l64), 0.0, l64), 1)).max()
    pe = np.exp(np.concatenate([np.zeros_like(l64[:, :1]), np.cumsum(l64, 1)[:, :-1]], 1))
    dec = {"P": np.exp(np.cumsum(l64, 1)), "Q": np.exp(after), "Pe": pe}
    want = ([(np.exp(l64), 2e-6)] if d else []) + ([(dec["P"], tol)] if pq else [])
    want += [(dec["Q"], tol)] if pq and q else []
    want += [(dec["P"][:, -1], tol)] + ([(dec["Pe"], tol)] if before else [])
    for i, w in enumerate(scaled):
        x = np.array(ins[f"X{i}"].astype(mx.float32), np.float64) if i % 2 else xs[i].astype(np.float64)
        want.append((x * dec[w], tol + 2e-7))
    for got, (w, rtol) in zip(outs, want):
        assert np.all(np.abs(got - w) <= rtol * np.abs(w) + 1e-38), float((np.abs(got - w) / np.abs(w)).max())
    if pq:
        assert np.array_equal(outs[d + 1 + q], outs[d][:, -1])  # G is P's last row to the bit


def _strong_decays(rng, shape):
    """Log-decays down to -20 a token, a reset (-inf) in the second row."""
    l = (-20 * rng.uniform(size=shape) ** 3).astype(np.float32)
    l.reshape(-1, shape[-1])[1, shape[-1] // 2] = -np.inf
    return l


@pytest.mark.parametrize("N,C,power,bf16,sanitizer", [(3, 7, 2, False, None), (2, 64, 1, True, None),
                                                       (2, 300, 3, False, None), (2, 24, 4, False, None),
                                                       (2, 40, 2, False, "address"),
                                                       (2, 40, 2, False, "thread")])
def test_decayed_scores_match_numpy(N, C, power, bf16, sanitizer):
    """The decayed-scores kernels (chunk_decayed_scores.j2): A = P^p ⊙ Γ, Γ[t, s] = e^{sum_{s<tau<=t} l_tau} on and
    below the diagonal, 0 above; and the gradients dP = p P^(p-1) Γ dA and each block of rows' part of
    dl_τ = Σ_{t>=τ>s} G[t, s] (G = A ⊙ dA) against float64: strong decays and a reset, powers 1 to 3, C not a
    multiple of a SIMD group or of a block, and past one threadgroup's threads (300 > 256), l in bf16. Γ's summed exponent carries
    float32 rounding: where e^x is not negligible (x > -87) its relative error is at most 2^-24 C |x|."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(N + C)
    l = _strong_decays(rng, (N, C))
    P, dA = rng.normal(size=(2, N, C, C)).astype(np.float32)
    ins = {"P": P, "l": mx.array(l).astype(mx.bfloat16) if bf16 else l}
    if bf16:
        l = np.array(ins["l"].astype(mx.float32))
    tol = 2.0 ** -24 * C * 87 + 1e-6
    (A,) = verify.run_launch(ck.decayed_scores_launch("metal", N, C, power), ins, sanitizer=sanitizer)
    want = decayed_scores(P, l, power)
    assert np.all(np.triu(A, 1) == 0)
    assert np.all(np.abs(A - want) <= tol * np.abs(want) + 1e-37), float(np.abs(A - want).max())
    dP, parts = verify.run_launch(ck.decayed_scores_launch("metal", N, C, power, grad=True), ins | {"dA": dA},
                                  sanitizer=sanitizer)
    assert _rel(dP, decayed_scores_vjp(P, l, dA, power)[0]) < 1e-5
    rb = min(16, C)  # each block of rows' part of dl: dl of the cotangent on that block's rows alone
    for b in range(-(-C // rb)):
        dA_b = np.zeros_like(dA)
        dA_b[:, b * rb:(b + 1) * rb] = dA[:, b * rb:(b + 1) * rb]
        assert _rel(parts[:, b], decayed_scores_vjp(P, l, dA_b, power)[1]) < 1e-5


def test_decayed_scores_gradient_matches_numpy(monkeypatch):
    """The decayed scores as the feature-map form calls them (``decayed_scores_fn``, the kernels on the emulator) and
    their VJP: dP = 2 P Γ dA, dl_τ = Σ_{t>=τ>s} G[t, s] (G = A ⊙ dA) in float64, strong decays and a reset; a
    cotangent above the diagonal changes nothing."""
    mx = pytest.importorskip("mlx.core")
    monkeypatch.setattr(ck, "mlx_call", _emulated_call)
    rng = np.random.default_rng(9)
    C = 24
    l = _strong_decays(rng, (2, 3, C))
    P, dA = rng.normal(size=(2, 2, 3, C, C)).astype(np.float32)
    fn = ck.decayed_scores_fn(tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True), 2)
    (A,), (dP, dl) = mx.vjp(fn, [mx.array(P), mx.array(l)], [mx.array(dA)])
    dP_r, dl_r = decayed_scores_vjp(P, l, dA)
    assert _rel(A, decayed_scores(P, l)) < 1e-5
    assert _rel(dP, dP_r) < 1e-5
    assert _rel(dl, dl_r) < 1e-5
    # the float64 reference itself, where no decay resets: e^{G_t - G_s} from the cumulative sums, below the diagonal
    G = np.cumsum(l[0, 0].astype(np.float64))
    assert np.allclose(span_decays(l[0, 0]), np.tril(np.exp(G[:, None] - G[None, :])), rtol=1e-12, atol=0)
    # a layout where the chunk's log-decays and column sums fit threadgroup memory (Metal's 32 KB: not 8192 tokens)
    assert cs.decayed_scores_layout("metal", 256, 16) == {"C": 256, "RB": 16, "NB": 16, "NT": 256}
    assert cs.decayed_scores_layout("metal", 8192, 16) is None
    # on by default where it was measured faster (CUDA), not on Metal (not measured on Apple hardware)
    assert tuning.resolve("gpu", "cuda", environ={}).decayed_scores
    assert not tuning.resolve("gpu", "metal", environ={}).decayed_scores


@pytest.mark.parametrize("C", [1, 4, 16])
def test_tril_inverse_matches_numpy(C):
    rng = np.random.default_rng(C)
    N = 3
    L = np.tril(rng.normal(size=(N, C, C)) * 0.5, -1).astype(np.float32)
    L += np.triu(rng.normal(size=(N, C, C)), 0).astype(np.float32)  # garbage above: must be ignored
    (T,) = verify.run_launch(ck.inverse_launch("metal", N, C), {"L": L})
    ref = np.linalg.inv(np.eye(C) - np.tril(L.astype(np.float64), -1))
    assert _rel(T, ref) < 1e-5


def _scan_ref(S0, A, X, Bm, g, E, reverse, has_a=True, has_b=True):
    """float64: carried_c = S; Y_c = X_c + A_c S; S <- g_c ⊙ S + B_cᵀ Y_c (+ E_c)."""
    BH, n = X.shape[:2]
    S = S0.astype(np.float64).copy()
    carried, Y = np.zeros((BH, n) + S0.shape[1:]), np.zeros(X.shape)
    for c in (range(n - 1, -1, -1) if reverse else range(n)):
        carried[:, c] = S
        Y[:, c] = X[:, c] + (A[:, c] @ S if has_a else 0)
        S = g[:, c][..., None] * S + (Bm[:, c].swapaxes(-1, -2) @ Y[:, c] if has_b else 0)
        if E is not None:
            S = S + E[:, c]
    return carried, Y, S


def _check_scan(launch, rng, BH, n, C, K, V, F, has_e, reverse, has_a, has_b):
    """Run a scan launch on the emulator with fresh inputs (decays down to e^-20) against ``_scan_ref``."""
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    S0, A, X, Bm = f(BH, K, V), f(BH, n, C, K) * 0.2, f(BH, n, C, V), f(BH, n, C, K) * 0.2
    g = np.exp(-20 * rng.uniform(size=(BH, n, F))).astype(np.float32)
    E = f(BH, n, K, V) if has_e else None
    ins = ({"S0": S0, "X": X, "g": g} | ({"E": E} if has_e else {}) | ({"A": A} if has_a else {})
           | ({"Bm": Bm} if has_b else {}))
    outs = verify.run_launch(launch, ins)
    if not has_a:  # no Y written: Y = X
        outs[1] = X
    for got, want in zip(outs, _scan_ref(S0, A, X, Bm, g, E, reverse, has_a, has_b)):
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-5, _rel(got, want)


@pytest.mark.parametrize("F,has_e,reverse,has_a,has_b", [
    (1, False, False, True, True), (32, False, False, True, True), (1, True, True, True, True), (32, True, True, True, True),
    (1, False, False, False, True), (32, True, True, False, True), (1, True, True, True, False), (32, True, True, True, False)])
def test_chunk_scan_matches_numpy(F, has_e, reverse, has_a, has_b):
    BH, n, C, K, V = 2, 3, 16, 32, 42 if has_e else 44  # two column tiles, the second partial; 44: 16-byte accesses
    launch = _scan("metal", BH, n, C, K, V, F, has_e, reverse, has_a, has_b)
    _check_scan(launch, np.random.default_rng(F + 2 * has_e), BH, n, C, K, V, F, has_e, reverse, has_a, has_b)


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("F,has_e,reverse,has_a,has_b,C,K,V", [
    (1, False, False, True, True, 32, 32, 48),    # 2 groups, 2 row blocks of Y round-robin, BV 16
    (32, True, False, True, True, 16, 32, 32),    # 2 groups share Y's one row block by columns (YCT 2)
    (64, True, True, True, True, 16, 64, 40),     # 4 groups, 1 block of Y (groups 1-3 idle), BV 8
    (1, False, False, False, True, 16, 32, 32),   # Y = X: B fragments straight from X
    (32, True, True, True, False, 16, 32, 64)])   # S <- g S + E: no B term, 2 column threadgroups
def test_chunk_scan_mma_matches_numpy(frame, F, has_e, reverse, has_a, has_b, C, K, V):
    """The fragment scan (chunk_scan_mma.j2) in each lane layout (``FRAGMENT_LAYOUTS``)."""
    BH, n = 2, 3
    launch = _scan(frame, BH, n, C, K, V, F, has_e, reverse, has_a, has_b, mma=True)
    assert launch.source.name.startswith("recgen_chunk_scan_mma")
    _check_scan(launch, np.random.default_rng(F + C + V), BH, n, C, K, V, F, has_e, reverse, has_a, has_b)


def _scan_mma_launch_at_bv(bv, *args, **kw):
    """The fragment scan's launch with at most ``bv`` columns a threadgroup (more threadgroups of columns)."""
    return _scan(*args, mma=True, bv=bv, **kw)


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("has_e", [False, True])
def test_chunk_scan_mma_with_product_term(frame, has_e):
    """The fragment scan's E term given as factors: S <- g S + B^T Y (+ E) + Pa^T Pb, never multiplied out;
    and the decay gradient's row sums dg_c = sum_j carried_c * St_c, per threadgroup of columns (V = 32: 2)."""
    rng = np.random.default_rng(3 + has_e)
    BH, n, C, K, V = 2, 3, 16, 32, 32
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    ins = {"S0": f(BH, K, V), "A": f(BH, n, C, K) * 0.2, "X": f(BH, n, C, V), "Bm": f(BH, n, C, K) * 0.2,
           "g": np.exp(-20 * rng.uniform(size=(BH, n, K))).astype(np.float32), "Pa": f(BH, n, C, K), "Pb": f(BH, n, C, V),
           "St": f(BH, n, K, V)}
    E = ins["Pa"].astype(np.float64).swapaxes(-1, -2) @ ins["Pb"]
    if has_e:
        ins["E"] = f(BH, n, K, V)
        E = E + ins["E"]
    launch = _scan_mma_launch_at_bv(16, frame, BH, n, C, K, V, K, has_e, True, True, True, p=True, dg=True)  # 2 partial sums a row
    outs = verify.run_launch(launch, ins)
    want = _scan_ref(ins["S0"], ins["A"], ins["X"], ins["Bm"], ins["g"], E, True)
    for got, w in zip(outs[:3], want):
        assert _rel(got, w) < 1e-5, _rel(got, w)
    assert outs[3].shape == (BH, n, 2, K)
    assert _rel(outs[3].sum(2), (want[0] * ins["St"]).sum(-1)) < 1e-5


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("F,has_e,reverse,dg", [(1, False, False, False), (128, True, True, True)])
def test_chunk_scan_mma_on_eight_groups(frame, F, has_e, reverse, dg):
    """``Tuning.scan_nw`` = 8 (the fragment scan with twice the SIMD groups: one 16-row state block and one item of
    Y each at C = 64, K = 128), forward and reverse, scalar and key decays, with the product term and the decay
    gradient's row sums, against float64 numpy."""
    rng = np.random.default_rng(5 + F)
    BH, n, C, K, V = 1, 2, 64, 128, 32
    assert cs.scan_mma_layout(C, K, V, 32, 8) == {"BV": 32, "NW": 8, "LD": 40, "YCT": 2}
    assert cs.scan_mma_layout(C, 64, V, 32, 8)["NW"] == 4  # 4 state blocks: no more groups than blocks
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    ins = {"S0": f(BH, K, V), "A": f(BH, n, C, K) * 0.1, "X": f(BH, n, C, V), "Bm": f(BH, n, C, K) * 0.1,
           "g": np.exp(-20 * rng.uniform(size=(BH, n, F))).astype(np.float32)}
    E = None
    terms = {}
    if dg:
        ins |= {"Pa": f(BH, n, C, K), "Pb": f(BH, n, C, V), "St": f(BH, n, K, V)}
        E = ins["Pa"].astype(np.float64).swapaxes(-1, -2) @ ins["Pb"]
        terms = dict(p=True, dg=True)
    if has_e:
        ins["E"] = f(BH, n, K, V)
        E = ins["E"] if E is None else E + ins["E"]
    v = ScanVariant(a=True, b=True, e=has_e, reverse=reverse, mma=True, **terms)
    launch = ck.scan_launch(frame, v, BH, n, C, K, V, F, 32, 8)
    assert launch.threadgroup[0] == 256
    outs = verify.run_launch(launch, ins)
    want = _scan_ref(ins["S0"], ins["A"], ins["X"], ins["Bm"], ins["g"], E, reverse)
    for got, w in zip(outs[:3], want):
        assert _rel(got, w) < 1e-5, _rel(got, w)
    if dg:
        assert _rel(outs[3].sum(2), (want[0] * ins["St"]).sum(-1)) < 1e-5


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("has_a", [True, False])
def test_chunk_scan_mma_scales_b_rows(frame, has_a):
    """The forward's u ⊙ Q formed as read: B's rows scaled by Bq (decays down to e^-20), B given in bf16 (the
    roles' 16-bit type), against float64 numpy at the bf16-rounded B; V = 32 at BV 16: two column threadgroups."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(11 + has_a)
    BH, n, C, K, V = 2, 3, 16, 32, 32
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    Bm = mx.array(f(BH, n, C, K) * 0.2).astype(mx.bfloat16)
    Bq = np.exp(-20 * rng.uniform(size=(BH, n, C))).astype(np.float32)
    ins = {"S0": f(BH, K, V), "X": f(BH, n, C, V), "Bm": Bm, "Bq": Bq,
           "g": np.exp(-20 * rng.uniform(size=(BH, n, 1))).astype(np.float32)} | ({"A": f(BH, n, C, K) * 0.2} if has_a else {})
    launch = _scan_mma_launch_at_bv(16, frame, BH, n, C, K, V, 1, False, False, has_a, True, q=True)
    assert "_q_" in launch.source.name
    outs = verify.run_launch(launch, ins)
    B64 = np.array(Bm.astype(mx.float32)).astype(np.float64) * Bq[..., None]
    want = _scan_ref(ins["S0"], ins.get("A"), ins["X"], B64, ins["g"], None, False, has_a)
    for got, w in list(zip(outs, want))[:: 1 if has_a else 2]:  # without A no Y is written
        assert _rel(got, w) < 1e-5, _rel(got, w)


WIDE_SCANS = [(32, 64, 32, 2, False, True, False), (64, 64, 24, 4, False, False, False),
              (64, 64, 32, 4, True, False, False), (64, 64, 32, 4, False, True, True), (32, 96, 32, 2, True, True, True)]


# GDN's (A) under ASan too; simple GLA's (no A) plain, and under TSan where its copy of X takes two barriers a chunk
WIDE_FORWARD_SCANS = ([s + (True, z) for s in WIDE_SCANS for z in (None, "address")]
                      + [s + (False, None) for s in WIDE_SCANS] + [WIDE_SCANS[3] + (False, "thread")])


@pytest.mark.parametrize("C,K,V,nw,pf,wl,vc,has_a,sanitizer", WIDE_FORWARD_SCANS)
def test_chunk_scan_on_the_wide_multiply_add(C, K, V, nw, pf, wl, vc, has_a, sanitizer):
    """GDN's forward scan on the wide multiply-add (``ScanVariant.w16``, CUDA's m16n8k16 lane layout in
    ``metal_ptx``): hoisted, A, X and Bm in bf16, Bm's rows scaled by Bq (decays down to e^-20), carried and Y in
    bf16, against float64 at the bf16 inputs. Its products take the state, Y and Bq ⊙ Bm in bf16 (as FLA's
    chunk_fwd_h): within that rounding. ``pf`` (where each group has one item of Y): A's and X's fragments loaded a
    chunk ahead; ``wl``: A's rows read 16 bytes a load, the copies transposed, the keys and tokens permuted; ``vc``:
    X, Y and the states' columns a lane's eight (each row 16 bytes a lane). Without A (``has_a`` off: simple GLA's,
    Y = X unwritten) each group copies its item of X for the update as it would Y."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(C + K + has_a)
    BH, n = 2, 3
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    bf = lambda a: mx.array(a).astype(mx.bfloat16)  # noqa: E731
    A, X, Bm = bf(f(BH, n, C, K) * 0.2), bf(f(BH, n, C, V)), bf(f(BH, n, C, K) * 0.2)
    Bq = np.exp(-20 * rng.uniform(size=(BH, n, C))).astype(np.float32)
    ins = {"S0": f(BH, K, V), "X": X, "Bm": Bm, "Bq": Bq,
           "g": np.exp(-3 * rng.uniform(size=(BH, n, 1))).astype(np.float32)} | ({"A": A} if has_a else {})
    v = ScanVariant(a=has_a, mma=True, q=True, hoist=True, s16=True, w16=True, pf=pf and has_a, wl=wl, vc=vc)
    launch = ck.scan_launch("metal_ptx", v, BH, n, C, K, V, 1, 32, nw, None, "bfloat16")
    assert "_w16" in launch.source.name and dict(launch.template)["NW"] == nw and ("_wl" in launch.source.name) == wl
    assert ("_noa" in launch.source.name) != has_a
    assert ("_vc" in launch.source.name) == vc == (vc and cs.scan_value_quads(C, K, V, 32, nw))
    assert not pf or cs.scan_prefetches(C, K, V, 32, nw)
    outs = verify.run_launch(launch, ins, sanitizer=sanitizer)
    f64 = lambda a: np.array(a.astype(mx.float32), np.float64)  # noqa: E731
    want = _scan_ref(ins["S0"], f64(A) if has_a else None, f64(X), f64(Bm) * Bq[..., None], ins["g"], None, False,
                     has_a)
    for got, w in list(zip(outs, want))[:: 1 if has_a else 2]:  # without A no Y is written
        assert _rel(got, w) < 1e-2, _rel(got, w)
    with pytest.raises(ValueError, match="wide multiply-add"):
        ck.scan_launch("metal", v, BH, n, C, K, V, 1, 32, nw, None, "bfloat16")  # Metal has none
    # Bm read in the model's layout [B, n C, HK, K] (one key head under BH = 2 value heads): bit for bit the same
    Bm_model = mx.contiguous(Bm[:1].reshape(1, n * C, 1, K))
    wide_ml = ck.scan_launch("metal_ptx", dataclasses.replace(v, ml=True), BH, n, C, K, V, 1, 32, nw, (2, 1, n, True),
                             "bfloat16")
    ml = verify.run_launch(wide_ml, ins | {"Bm": Bm_model}, sanitizer=sanitizer)
    same = verify.run_launch(launch, ins | {"Bm": mx.concatenate([Bm[:1], Bm[:1]])})
    for a, b in list(zip(ml, same))[:: 1 if has_a else 2]:
        assert np.array_equal(np.asarray(a), np.asarray(b))
    if has_a:  # nx, every state-free operand a step ahead (``Tuning.scan_ahead_most``): bit for bit, both layouts
        for ml_, given, want_ in ((None, ins, outs), ((2, 1, n, True), ins | {"Bm": Bm_model}, same)):
            ahead = ck.scan_launch("metal_ptx", dataclasses.replace(v, pf=False, nx=True, ml=ml_ is not None), BH, n, C,
                                   K, V, 1, 32, nw, ml_, "bfloat16")
            assert "_nx" in ahead.source.name
            for a, b in zip(verify.run_launch(ahead, given, sanitizer=sanitizer), want_):
                assert np.array_equal(np.asarray(a), np.asarray(b))
    if not has_a:  # ... and X too, the model's value input [B, n C, H, V] (xm: simple GLA's v)
        X_model = mx.contiguous(X.reshape(1, BH, n * C, V).transpose(0, 2, 1, 3))
        xm = verify.run_launch(ck.scan_launch("metal_ptx", dataclasses.replace(v, ml=True, xm=True), BH, n, C, K, V, 1,
                                              32, nw, (2, 1, n, True), "bfloat16"),
                               ins | {"Bm": Bm_model, "X": X_model}, sanitizer=sanitizer)
        for a, b in list(zip(xm, same))[::2]:
            assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="w16"):
        ScanVariant(mma=True, q=True, hoist=True, s16=True, w16=True, reverse=True)
    with pytest.raises(ValueError, match="nx"):
        ScanVariant(mma=True, q=True, hoist=True, s16=True, w16=True, pf=True, nx=True)
    with pytest.raises(ValueError, match="w16"):
        ScanVariant(a=False, mma=True, q=True, hoist=True, s16=True, w16=True, reverse=True, p=True, aq=False)


@pytest.mark.parametrize("has_a", [True, False])
def test_scans_of_few_heads_take_half_the_columns(has_a, monkeypatch):
    """``Tuning.scan_min_groups``: a scan that would have fewer threadgroups (few (batch, head) pairs, long prefill)
    runs with half the value columns a threadgroup, twice the groups; GDN's and simple GLA's wide forward scans (CUDA's
    lane layout, ``metal_ptx``) so against float64 at their bf16 inputs, and the launch's BV is the half."""
    mx = pytest.importorskip("mlx.core")
    t = tuning.resolve("cpu", environ={}, dialect="metal_ptx", chunk_kernels=True, mma_scan=True, scan_hoist=True,
                       states_16bit=True, wide_fragments=True, scan_wide_loads=True, scan_min_groups=8)
    assert ck.scan_tuning(t, 2, 64).scan_bv == 16 and ck.scan_tuning(t, 4, 64).scan_bv == 32
    assert ck.scan_tuning(dataclasses.replace(t, scan_min_groups=0), 1, 32).scan_bv == 32
    launches = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: launches.append(launch) or _emulated_call(launch, *a))
    rng = np.random.default_rng(17 + has_a)
    BH, n, C, K, V = 2, 3, 32, 64, 64
    f, bf, u = _bf16_draws(rng)
    A, X, Bm = bf(f(BH, n, C, K) * 0.2), bf(f(BH, n, C, V)), bf(f(BH, n, C, K) * 0.2)
    Bq, g, S0 = u(BH, n, C, 1), np.exp(-3 * rng.uniform(size=(BH, n, 1))).astype(np.float32), f(BH, K, V)
    carried, Y, S_end = ck.chunk_scan(mx.array(S0), A if has_a else None, X, Bm, mx.array(g), None, t, reverse=False,
                                      Bq=mx.array(Bq), st=mx.bfloat16)
    (launch,) = launches
    assert dict(launch.template)["BV"] == 16 and "_w16" in launch.source.name, launch.source.name
    f64 = lambda a: np.array(a.astype(mx.float32), np.float64)  # noqa: E731
    want = _scan_ref(S0, f64(A) if has_a else None, f64(X), f64(Bm) * Bq, g, None, False, has_a)
    for got, w in list(zip((carried, Y, S_end), want))[:: 1 if has_a else 2]:
        assert _rel(np.asarray(got.astype(mx.float32)), w) < 1e-2


def _bf16_draws(rng):
    """(f, bf, u): float32 normals of a shape, an array in bf16, float32 uniforms in [0.05, 1) of a shape."""
    mx = pytest.importorskip("mlx.core")
    return (lambda *s: rng.normal(size=s).astype(np.float32), lambda a: mx.array(a).astype(mx.bfloat16),
            lambda *s: rng.uniform(0.05, 1.0, size=s).astype(np.float32))


def _checked_reverse_p_scan(launch, ins, sanitizer):
    """A reverse scan with a P term (Pa with row scales Pq), A with Aq and dg (B where ``ins`` has Bm) run on the
    emulator against float64 at its bf16 inputs, within bf16 rounding, dg from the float state (not its bf16 copy).
    Returns its outputs (carried, Y, S_end, dg's parts)."""
    mx = pytest.importorskip("mlx.core")
    outs = verify.run_launch(launch, ins, sanitizer=sanitizer)
    f64 = lambda a: np.array(mx.array(a).astype(mx.float32), np.float64)  # noqa: E731
    Pe = np.einsum("bnck,bncv->bnkv", f64(ins["Pq"])[..., None] * f64(ins["Pa"]), f64(ins["Pb"]))
    has_b = "Bm" in ins
    want = _scan_ref(ins["S0"], f64(ins["Aq"])[..., None] * f64(ins["A"]), f64(ins["X"]),
                     f64(ins["Bm"]) if has_b else None, ins["g"], Pe, True, has_b=has_b)
    for got, w in zip(outs[:3], want):
        assert _rel(got, w) < 1e-2, _rel(got, w)
    assert _rel(np.asarray(outs[3], np.float64).sum(2), (want[0] * f64(ins["St"])).sum(-1)) < 1e-2
    return outs


@pytest.mark.parametrize("sanitizer", [None, "address"])
@pytest.mark.parametrize("C,K,V,nw,pf,wl,vc", WIDE_SCANS)
def test_reverse_scan_on_the_wide_multiply_add(C, K, V, nw, pf, wl, vc, sanitizer):
    """GDN's backward scan on the wide multiply-add (``ScanVariant.w16`` in reverse, CUDA's lane layout in
    ``metal_ptx``): hoisted, A with its row scales Aq (applied to A S: A's pairs raw), Bm, the P term Pa with Pq
    (applied to Pb's pairs), dg = Σ carried ⊙ St, every product operand and St in bf16; against float64 at the
    bf16 inputs, within bf16 rounding; and in the model's layout (A and Pa the key inputs, one key head under two
    value heads) bit for bit the chunks' layout."""
    mx = pytest.importorskip("mlx.core")
    BH, n = 2, 3
    rng = np.random.default_rng(C + K + 1)
    f, bf, u = _bf16_draws(rng)
    A1, Pa1 = bf(f(1, n, C, K) * 0.2), bf(f(1, n, C, K) * 0.2)
    A, Pa = mx.concatenate([A1, A1]), mx.concatenate([Pa1, Pa1])  # the value heads share their key head
    ins = {"S0": f(BH, K, V), "A": A, "Aq": u(BH, n, C), "X": bf(f(BH, n, C, V)), "Bm": bf(f(BH, n, C, K) * 0.2),
           "g": np.exp(-3 * rng.uniform(size=(BH, n, 1))).astype(np.float32), "Pa": Pa, "Pb": bf(f(BH, n, C, V)),
           "Pq": u(BH, n, C), "St": bf(f(BH, n, K, V))}
    v = ScanVariant(mma=True, reverse=True, p=True, dg=True, aq=True, pq=True, hoist=True, s16=True, w16=True, pf=pf,
                    wl=wl, vc=vc)
    launch = ck.scan_launch("metal_ptx", v, BH, n, C, K, V, 1, 32, nw, None, "bfloat16")
    assert "_w16" in launch.source.name and dict(launch.template)["NW"] == nw and ("_wl" in launch.source.name) == wl
    carried, Y, S_end, dgp = _checked_reverse_p_scan(launch, ins, sanitizer)
    model = {"A": mx.contiguous(A1.reshape(1, n * C, 1, K)), "Pa": mx.contiguous(Pa1.reshape(1, n * C, 1, K))}
    ml = verify.run_launch(ck.scan_launch("metal_ptx", dataclasses.replace(v, ml=True), BH, n, C, K, V, 1, 32, nw,
                                          (2, 1, n, True), "bfloat16"), ins | model)
    for a, b in zip(ml, (carried, Y, S_end, dgp)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("sanitizer", [None, "address"])
@pytest.mark.parametrize("C,K,V,nw,hoist,w16,wl,vc", [(32, 32, 32, 2, True, False, False, False),
                                                    (64, 64, 24, 4, False, False, False, False),
                                                    (32, 64, 32, 2, True, True, False, False),
                                                    (32, 64, 32, 2, True, True, True, False),
                                                    (64, 64, 32, 4, True, True, True, True)])
def test_reverse_scan_without_b_takes_its_product_as_factors(C, K, V, nw, hoist, w16, wl, vc, sanitizer):
    """Simple GLA's backward scan with its E term as the factors Paᵀ Pb (``Tuning.scan_products_alone``): no B term,
    A with row scales Aq, Pa with Pq, dg = Σ carried ⊙ St, 16-bit states and operands; against float64 at the bf16
    inputs, within bf16 rounding; on the wide multiply-add too (``w16``, CUDA's lane layout), with its wide loads
    (``wl``) and a lane's eight columns (``vc``)."""
    BH, n = 2, 3
    rng = np.random.default_rng(C + K + 5)
    f, bf, u = _bf16_draws(rng)
    ins = {"S0": f(BH, K, V), "A": bf(f(BH, n, C, K) * 0.2), "Aq": u(BH, n, C), "X": bf(f(BH, n, C, V)),
           "g": np.exp(-3 * rng.uniform(size=(BH, n, 1))).astype(np.float32), "Pa": bf(f(BH, n, C, K) * 0.2),
           "Pb": bf(f(BH, n, C, V)), "Pq": u(BH, n, C), "St": bf(f(BH, n, K, V))}
    v = ScanVariant(mma=True, b=False, reverse=True, p=True, dg=True, aq=True, pq=True, hoist=hoist, s16=True, w16=w16,
                    wl=wl, vc=vc)
    launch = ck.scan_launch("metal_ptx", v, BH, n, C, K, V, 1, 32, nw, None, "bfloat16")
    assert ("_w16" in launch.source.name) == w16 and ("_wl" in launch.source.name) == wl
    _checked_reverse_p_scan(launch, ins, sanitizer)


def test_chunk_scan_mma_layouts():
    """Which sizes the fragment scan takes, and the dialect choice: CUDA by default (tensor cores), Metal
    never by default (its multiply-add is a shuffle reference); outside its layouts the FMA frame runs."""
    assert cs.scan_mma_layout(64, 128, 128) == {"BV": 32, "NW": 4, "LD": 40, "YCT": 4}
    assert cs.scan_mma_layout(16, 32, 40) == {"BV": 8, "NW": 2, "LD": 8, "YCT": 1}
    assert cs.scan_mma_layout(16, 32, 32) == {"BV": 32, "NW": 2, "LD": 40, "YCT": 2}  # Y's columns split: 2 items
    assert cs.scan_mma_layout(64, 128, 44) is None and cs.scan_mma_layout(8, 128, 128) is None
    assert _scan("cuda", 4, 2, 64, 128, 128, 1, False, False).source.name.startswith("recgen_chunk_scan_mma")
    assert _scan("cuda", 4, 2, 64, 128, 44, 1, False, False).source.name.startswith("recgen_chunk_scan_v4")
    assert _scan("metal", 4, 2, 64, 128, 128, 1, False, False).source.name.startswith("recgen_chunk_scan_v4")
    with pytest.raises(ValueError, match="multiples of 16"):
        _scan("metal", 1, 2, 8, 32, 8, 1, False, False, mma=True)


def test_chunk_scan_refuses_unsupported_sizes():
    with pytest.raises(ValueError, match="multiple of 4"):
        _scan("metal", 1, 2, 8, 30, 4, 1, False, False)


def test_chunk_scan_layout_fits_each_dialect():
    """At GDN's shapes the staging depths follow each dialect's threadgroup memory; a size whose tiles
    do not fit has no kernel (the core keeps its MLX ops) rather than a failing launch."""
    assert cs.scan_supported("cuda", 64, 256) and not cs.scan_supported("metal", 64, 256)
    assert not cs.scan_supported("cuda", 64, 30)
    assert cs.scan_layout("cuda", 64, 128) == {"NR": 16, "NT": 128, "KB": 32, "TB": 32, "SLAB": 4224}
    assert cs.scan_layout("metal", 64, 128) == {"NR": 16, "NT": 128, "KB": 16, "TB": 8, "SLAB": 1088}


def _emulated_call(launch, dialect, user, extra, debug=False, kernel_cache=""):
    """``launch.mlx_call`` with the Metal CPU emulator underneath: the same launch recipe, the
    buffers through numpy (fine outside mx.compile, which the CPU path does not use); outputs in the types the launch
    declares (numpy has no bf16: the emulator's bf16 values come back widened)."""
    mx = pytest.importorskip("mlx.core")
    runtime = {r[0] for r in launch.runtime}
    names = [n for n in launch.source.inputs if n not in runtime]
    ins = {n: a if a.dtype in (mx.bfloat16, mx.float16) else np.array(a.astype(mx.float32))  # 16 bits: typed buffers
           for n, a in zip(names, list(user) + list(extra))}
    return [mx.array(o).astype(getattr(mx, dt)) for o, (_, dt) in zip(verify.run_launch(launch, ins), launch.outputs)]


def _emulate_noting_bf16(monkeypatch) -> dict:
    """Kernels on the emulator (``_emulated_call``), noting by kernel kind the inputs that arrive in bf16."""
    mx = pytest.importorskip("mlx.core")
    seen = {}

    def call(launch, dialect, user, extra, debug=False, kernel_cache=""):
        kind = launch.source.name.split("_metal")[0].removeprefix("recgen_chunk_")
        names = [n for n in launch.source.inputs if n not in {r[0] for r in launch.runtime}]
        bf = {n for n, a in zip(names, user) if a.dtype == mx.bfloat16}
        if bf:
            seen.setdefault(kind, set()).update(bf)
        return _emulated_call(launch, dialect, user, extra)

    monkeypatch.setattr(ck, "mlx_call", call)
    return seen


def _sympow_skip():
    """A feature map outside the kernel identity's form (a skip term): φ through the sympow kernels."""
    import recgen as rg

    @rg.recurrence
    def sympow_skip(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar, D: rg.Param["j"]):
        return rg.Step(decay=rg.exp(g), update=rg.outer(rg.sympow(k), v), readout=rg.sympow(q), skip=D * v)

    return sympow_skip


@pytest.mark.parametrize("name,T", [("gated_delta_net", 40), ("delta_net", 16), ("gated_delta_net", 1),
                                    ("simple_gla", 40), ("gla", 40), ("kda", 40), ("power_retention", 40),
                                    ("power_retention/scores", 40), ("sympow_skip", 40)])
def test_chunked_core_with_kernels_matches_reference(name, T, monkeypatch):
    """The chunked core with the generated kernels wired in (inverse, forward and backward scans, the
    key-vector decay's pair kernels and backward tail, a feature map's φ), end to end against the float64
    reference: forward, final state, every gradient; strong decays, K != V, GQA, a partial last chunk (T = 40 with
    chunk 16), T = 1 (C = 1: one row group). Power retention's kernel-identity form takes φ's rows from the sympow
    kernels (``feature_rows.PackedRows``), with "/scores" its in-chunk scores from the decayed-scores kernels; the
    skip spec's general form its roles."""
    pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    name, _, form = name.partition("/")
    key = name in ("gla", "kda")  # K = 32: a slab of the pair kernels
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, decayed_scores=form == "scores")
    rec = _sympow_skip() if name == "sympow_skip" else specs.BUILTINS[name]
    assert_close(compare(rec, T, chunk=16, K=32 if key else 16, V=6, seed=5, tuning=t))
    kinds = {c.split("_metal")[0] for c in calls}
    delta = rec.step.transition is not None
    want = ({"recgen_chunk_tril_inverse", "recgen_chunk_scan", "recgen_chunk_scan_e_rev"} if delta
            else {"recgen_chunk_scan_noa", "recgen_chunk_scan_nob_e_rev"})
    if key:  # a delta rule's two pairs of u (A and M_ru) in one pass; the backward's elementwise tail
        want |= ({"recgen_chunk_pair_dual", "recgen_chunk_pair_grad_dual", "recgen_chunk_bwd_key_delta"} if delta
                 else {"recgen_chunk_pair_xs", "recgen_chunk_pair_grad_xs", "recgen_chunk_bwd_key"})  # GLA: r's scale
        # with u ⊙ Q (the forward's without Q), GLA's backward with r ⊙ P too (its reverse scan scales the rows);
        # KDA's r ⊙ P is of the rfac·r its pair gradients read, formed by MLX; GLA's backward pass writes no P nor Q
        # (its tail kernel forms its own: "_g")
        want |= {"recgen_chunk_decays_noq_q", "recgen_chunk_decays_q" if delta else "recgen_chunk_decays_g_q_p"}
    else:
        want |= {"recgen_chunk_decays_lanes_nod"}  # a scalar decay's P, Q and g (``KernelScalarDecay``)
    if rec.features:  # φ of 4 keys has 10 rows: no scan layout (K % 4), the core keeps MLX ops
        want = {"recgen_chunk_sympow", "recgen_chunk_sympow_grad"} | ({"recgen_chunk_decayed_scores", "recgen_chunk_decayed_scores_grad"} if form else set())
        if name == "sympow_skip":  # the general form's core builds the scalar decay's geometry (the identity its own)
            want |= {"recgen_chunk_decays_lanes_nod"}
    assert kinds == want, kinds


@pytest.mark.parametrize("name,K,pairs,want", [
    ("gated_delta_net", 16, False, {"recgen_chunk_decays_lanes_nod_q", "recgen_chunk_ut_mma_uf",
                                    "recgen_chunk_scan_mma_q", "recgen_chunk_scan_mma_aq_p_pq_dg_rev",
                                    "recgen_chunk_out_mma_uf_yt", "recgen_chunk_bwd_mma_delta_uf"}),
    ("delta_net", 16, False, {"recgen_chunk_decays_lanes_nod_q", "recgen_chunk_ut_mma_uf", "recgen_chunk_scan_mma_q",
                              "recgen_chunk_scan_mma_aq_p_pq_dg_rev",
                              "recgen_chunk_out_mma_uf_yt", "recgen_chunk_bwd_mma_delta_uf"}),
    ("gated_delta_net/formed", 16, False, {"recgen_chunk_decays_lanes_nod", "recgen_chunk_ut_mma",
                                           "recgen_chunk_scan_mma_q", "recgen_chunk_scan_mma_aq_p_pq_dg_rev",
                                           "recgen_chunk_out_mma_yt",
                                           "recgen_chunk_bwd_mma_delta"}),
    ("simple_gla", 16, False, {"recgen_chunk_decays_lanes_nod", "recgen_chunk_scan_mma_noa_q",
                               "recgen_chunk_scan_mma_nob_aq_e_rev", "recgen_chunk_out_mma_yt",
                               "recgen_chunk_bwd_mma"}),
    ("kda", 32, False, {"recgen_chunk_decays_noq_q", "recgen_chunk_decays_q",
                        "recgen_chunk_pair_dual", "recgen_chunk_ut_mma_key_uf",
                        "recgen_chunk_scan_mma_q", "recgen_chunk_out_mma_key_yt",
                        "recgen_chunk_scan_mma_aq_p_dg_rev", "recgen_chunk_pair_grad_dual",
                        "recgen_chunk_bwd_key_delta_uf"}),
    ("kda", 32, True, {"recgen_chunk_decays_noq_q", "recgen_chunk_decays_q",
                       "recgen_chunk_pair_dual_mma", "recgen_chunk_ut_mma_key_uf",
                       "recgen_chunk_scan_mma_q", "recgen_chunk_out_mma_key_yt",
                       "recgen_chunk_scan_mma_aq_p_dg_rev", "recgen_chunk_pair_grad_dual_mma",
                       "recgen_chunk_bwd_key_delta_uf"}),
    ("kda/formed", 32, True, {"recgen_chunk_decays_noq_q", "recgen_chunk_decays_q",
                              "recgen_chunk_pair_dual_mma", "recgen_chunk_ut_mma_key",
                              "recgen_chunk_scan_mma", "recgen_chunk_out_mma_key_yt",
                              "recgen_chunk_scan_mma_p_dg_rev", "recgen_chunk_pair_grad_dual_mma",
                              "recgen_chunk_bwd_key_delta"}),
    ("gla", 32, True, {"recgen_chunk_decays_noq_q", "recgen_chunk_decays_g_q_p",
                       "recgen_chunk_pair_mma_xs", "recgen_chunk_scan_mma_noa",
                       "recgen_chunk_out_mma_key_yt", "recgen_chunk_scan_mma_nob_e_rev",
                       "recgen_chunk_pair_grad_mma_xs", "recgen_chunk_bwd_key"})])
def test_chunked_core_with_mma_scan_matches_reference(name, K, pairs, want, monkeypatch):
    """The chunked core end to end on the fragment frames: a scalar decay's factors (``KernelScalarDecay``), the UT
    transform (GDN), the scans (forward and
    backward; GDN's backward taking E = (r ⊙ P)ᵀ dy as its factors), the readout and the backward's pass after
    its scan in place of the inverse kernel, the FMA scans and MLX's products (GDN and DeltaNet with factor reads:
    u = β k and b̃ = −k read from k by those kernels; "/formed": ``factor_reads`` off, the roles formed by MLX
    first); for a key-vector decay (kda, gla) the
    pair kernels form A and M_ru and the UT transform and readout take them formed with P per key element
    (``chunk_ut_key``, ``chunk_out_key``), with the pairs' earlier blocks on fragments where ``pairs``
    (``Tuning.mma_pairs``); kda with factor reads pairs k with itself and with r, its pairs' columns scaled by β, and
    the tail kernel writes dk and dβ's part. K = 16 (one group) or 32 (a slab of the pair kernels), V = 8 (one column tile), chunk 16,
    GQA, a partial last chunk, strong decays; forward, final state and every gradient against the float64
    reference."""
    pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    name, _, formed = name.partition("/")
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True, mma_pairs=pairs,
                       factor_reads=not formed, key_factor_reads=not formed)
    assert_close(compare(specs.BUILTINS[name], 40, chunk=16, K=K, V=8, seed=9 if K == 16 else 4, tuning=t))
    kinds = {c.split("_metal")[0] for c in calls}
    assert kinds == want, kinds


@pytest.mark.parametrize("name,kinds,on", [
    ("gla", {"recgen_chunk_pair_whole_xs", "recgen_chunk_decays_noq_q_yt", "recgen_chunk_scan_mma_noa_ho_s16_w16_wl",
             "recgen_chunk_decays_g_q_p", "recgen_chunk_scan_mma_nob_p_pq_ho_dg_s16_rev"}, False),
    ("gla", {"recgen_chunk_decays_g_q_p_yt", "recgen_chunk_scan_mma_nob_p_pq_ho_dg_s16_w16_wl_rev",
             "recgen_chunk_pair_whole_h8_xs_async"}, True),
    ("hgrn2", {"recgen_chunk_decays_g_q_p_yt", "recgen_chunk_scan_mma_nob_p_pq_ho_dg_s16_w16_wl_rev"}, True),
    ("kda", {"recgen_chunk_pair_dual_whole", "recgen_chunk_decays_noq_q", "recgen_chunk_scan_mma_ho"}, False),
    ("kda", {"recgen_chunk_pair_dual_whole_h8_async"}, True),
    ("rwkv7", {"recgen_chunk_pair_quad_nonstrict_mma_fold"}, False)])
def test_key_decays_forward_as_cuda_runs_them(name, kinds, on, monkeypatch):
    """A key-vector decay's chunked form as CUDA's table runs it (``metal_ptx``: its lane layout, bf16 inputs, chunks
    of 32: two blocks of 16, so a pair of blocks on fragments), end to end against the float64 reference (a partial
    last chunk, strong decays, GQA-free; forward, final state and every gradient): the forward pairs a whole chunk a
    threadgroup (``Tuning.pair_whole``: GLA's single pair read times the readout's scale, KDA's dual; RWKV-7's quad
    a block of rows, measured slower whole); without a delta rule (GLA) the decays' pass writes u ⊙ Q in bf16, the
    states' type, and the A-free forward scan takes it on the wide multiply-add (no row scales, a decay per key);
    every decays' pass reads the log-decay in its input's bf16 (no float32 cast); the backward's decays' pass writes
    u ⊙ Q and r ⊙ P in bf16 too and the reverse scan takes them on the wide multiply-add (``Tuning.key_scaled_16bit``,
    on in CUDA's table; ``on`` False turns it off), and the pair gradients copy their slabs to threadgroup memory a
    slab ahead where they fit (``Tuning.pair_grad_async``, on in the table; ``on`` False turns it off too). ``on``
    True adds ``Tuning.pair_halves`` (the whole-chunk pairs' halves on fragments: measured no faster, off) and
    ``Tuning.bwd_key_running`` (the backward's key tail summing dl as it goes) and ``Tuning.pair_whole_async`` (the
    forward's whole-chunk pairs copying their slabs ahead): both measured slower, off."""
    pytest.importorskip("mlx.core")
    import mlx.core as mx
    from recgen import specs
    from test_chunked import assert_close, compare

    calls, decays = [], []

    def call(launch, dialect, user, *a):
        calls.append(launch.source.name)
        decays.extend([user[0].dtype] if "_decays" in launch.source.name else [])
        return _emulated_call(launch, dialect, user, *a)

    monkeypatch.setattr(ck, "mlx_call", call)
    t = dataclasses.replace(tuning.resolve("gpu", "cuda", environ={}), dialect="metal_ptx", device="cpu",
                            kernel_cache=None, replay_graphs=False, compile=False, key_scaled_16bit=on,
                            pair_halves=on, pair_grad_async=on, bwd_key_running=on, pair_whole_async=on)
    assert_close(compare(specs.BUILTINS[name], 40, chunk=32, K=32, V=32, seed=4, tuning=t, in_dtype=mx.bfloat16),
                 1e-2, 1e-2)
    ran = {c.split("_metal")[0] for c in calls}
    assert kinds <= ran, ran
    assert not any("_whole" in c and "_quad" in c for c in ran), ran
    copied = {c for c in ran if c.startswith("recgen_chunk_pair_grad") and c.endswith("_async")}
    assert bool(copied) == (on and name != "rwkv7"), ran  # (RWKV-7's float quad slabs pass Metal's 32 KiB)
    assert any(c.startswith("recgen_chunk_bwd_key") for c in ran), ran
    assert all(c.endswith("_run") == on for c in ran if c.startswith("recgen_chunk_bwd_key")), ran
    assert all(c.endswith("_async") == on for c in ran if "_whole" in c), ran
    assert decays and set(decays) == {mx.bfloat16}, decays  # the log-decay as given (``Tuning.logdecay_16bit``)


@pytest.mark.parametrize("name", ["gla", "kda", "hgrn2", "rwkv6"])
@pytest.mark.parametrize("on", [True, False])
def test_key_decay_bare_roles_in_16_bits(name, on, monkeypatch):
    """``Tuning.key_roles_16bit``: a key-vector decay's bare roles (GLA's k and v, KDA's and RWKV-6's v, HGRN-2's)
    stay in the inputs' bf16 and the kernels that read them convert on load: the same results as with their float32
    copies, end to end against the float64 reference on CUDA's lane layout (``metal_ptx``; bf16 inputs, GQA, a
    partial last chunk, strong decays: forward, final state, every gradient); on, some kernel reads a bf16 role,
    off none does. The forward's decays' pass writes no Q (its scans take u ⊙ Q formed), the backward's does.
    With it, as on CUDA, ``Tuning.key_products_16bit``: without a delta rule (GLA, HGRN-2) the backward keeps its
    16-bit states, dy and v for the products over values and the reverse scan writes dS and dZ in bf16 (its ``s16``
    variant); no other reverse scan does."""
    pytest.importorskip("mlx.core")
    import dataclasses

    import mlx.core as mx
    from recgen import specs
    from test_chunked import assert_close, compare

    sixteen, decays, scans = [], [], []

    def call(launch, dialect, user, *a):
        name_ = launch.source.name
        sixteen.extend(name_ for x in user if x.dtype == mx.bfloat16)
        decays.extend([name_] if "_decays" in name_ else [])
        scans.extend([name_] if "_rev" in name_ else [])
        return _emulated_call(launch, dialect, user, *a)

    monkeypatch.setattr(ck, "mlx_call", call)
    t = tuning.resolve("cpu", environ={}, dialect="metal_ptx", chunk_kernels=True, mma_scan=True, mma_pairs=True,
                       key_roles_16bit=on, states_16bit=True, key_products_16bit=on)
    rec = dataclasses.replace(specs.BUILTINS[name], gqa="tiled") if name != "hgrn2" else specs.BUILTINS[name]
    assert_close(compare(rec, 40, chunk=16, K=32, V=8, seed=4, tuning=t, in_dtype=mx.bfloat16), 1e-2, 1e-2)
    assert bool(sixteen) == on, sixteen
    assert {"_noq" in n for n in decays} == {True, False}, decays
    s16 = on and name in ("gla", "hgrn2")
    assert scans and all(("_s16" in n) == s16 for n in scans), scans


@pytest.mark.parametrize("name,gqa,in_dtype", [("gated_delta_net", "block", None), ("gated_delta_net", "tiled", "bf16"),
                                           ("delta_net", "block", None)])
def test_chunked_core_reads_the_model_layout(name, gqa, in_dtype, monkeypatch):
    """``Tuning.model_rows``: GDN's and DeltaNet's five fused kernels read q, k, v in the model's layout [B, T, heads,
    D] (GQA's key heads shared: block and tiled maps, H = 4 over Hk = 2) and the backward's pass writes dq, dk so per
    value head, summed over groups after it. Whole chunks (T = 48, chunk 16) take that path and a partial last chunk
    (T = 40) the chunks' layout; both end to end against the float64 reference (forward, final state, every gradient,
    strong decays; bf16 inputs too)."""
    pytest.importorskip("mlx.core")
    import dataclasses

    import mlx.core as mx
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True, model_rows=True)
    rec = dataclasses.replace(specs.BUILTINS[name], gqa=gqa)
    assert not t.model_rows_dense  # H = 4 over Hk = 2: GQA, which the default reads so
    dtype = mx.bfloat16 if in_dtype else None
    for T, suffix in ((48, "_ml"), (40, "")):
        calls.clear()
        assert_close(compare(rec, T, chunk=16, K=16, V=8, seed=3, tuning=t, in_dtype=dtype),
                     *((1e-2, 1e-2) if in_dtype else ()))
        kinds = {c.split("_metal")[0] for c in calls}
        assert kinds == {"recgen_chunk_decays_lanes_nod_q", f"recgen_chunk_ut_mma_uf{suffix}",
                         f"recgen_chunk_scan_mma_q{suffix}", f"recgen_chunk_scan_mma_aq_p_pq_dg{suffix}_rev",
                         f"recgen_chunk_out_mma_uf{suffix}_yt",
                         f"recgen_chunk_bwd_mma_delta_uf{suffix}"}, (T, kinds)


@pytest.mark.parametrize("dialect,gqa,wide,alone", [("metal", "block", False, False), ("metal", "tiled", False, True),
                                                  ("metal_ptx", "block", True, True)])
def test_simple_gla_reads_the_model_layout(dialect, gqa, wide, alone, monkeypatch):
    """``Tuning.model_rows`` without a delta rule (simple GLA: u = k, w = v verbatim): the forward scan reads k and v
    and the staged readout q, k and v in the model's layout [B, T, heads, D] (GQA's key heads shared, H = 4 over Hk
    = 2); bf16 inputs, end to end against the float64 reference (forward, final state, every gradient, strong
    decays). ``wide``: as CUDA's table runs it (CUDA's lane layout, ``metal_ptx``), where the A-free scan on the wide
    multiply-add reads v so too (``xm``); elsewhere the scan copies v to the chunks' layout first. ``alone``
    (``Tuning.scan_products_alone``): the reverse scan takes its products as factors, so it and the backward's pass
    read q and k in the model's layout too, and write their gradients so (``parallel.reads_model_rows``); else the
    backward copies them to the chunks' layout. A partial last chunk (T = 40) takes the chunks' layout."""
    pytest.importorskip("mlx.core")
    import dataclasses

    import mlx.core as mx
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call",
                        lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    wide_kw = dict(states_16bit=True, wide_fragments=True, scan_hoist=True, scan_wide_loads=True, bwd_scores=True,
                   bwd_products=True, reverse_scan_hoist=True) if wide else {}
    t = tuning.resolve("cpu", environ={}, dialect=dialect, chunk_kernels=True, mma_scan=True, model_rows=True,
                       async_staging=True, scan_products_alone=alone, **wide_kw)
    rec = dataclasses.replace(specs.BUILTINS["simple_gla"], gqa=gqa)
    for T in (64, 40):
        calls.clear()
        assert_close(compare(rec, T, chunk=16, K=32, V=32, seed=5, tuning=t, in_dtype=mx.bfloat16), 1e-2, 1e-2)
        kinds = {c.split(f"_{dialect}")[0] for c in calls}
        whole = T % 16 == 0
        assert ("recgen_chunk_out_async_ml_zm_yt" + ("_w16" if wide else "") in kinds) == whole, kinds
        assert any(k.startswith("recgen_chunk_scan_mma_noa_q") and "_ml" in k for k in kinds) == whole, kinds
        assert any(k.endswith("_xm") for k in kinds) == (whole and wide), kinds
        backward = {k for k in kinds if k.startswith("recgen_chunk_bwd_mma")}
        assert len(backward) == 1 and ("_ml" in backward.pop()) == (whole and alone), kinds
        assert any(k.startswith("recgen_chunk_scan_mma") and k.endswith("_rev") and "_ml" in k
                   for k in kinds) == (whole and alone), kinds


@pytest.mark.parametrize("name,K,V,mma,want,extra", [
    ("rwkv7", 32, 6, False, {"recgen_chunk_decays_g_q_q_p", "recgen_chunk_decays_g_pe_q_q_p",
                             "recgen_chunk_pair_quad_nonstrict", "recgen_chunk_pair_grad_quad_nonstrict",
                             "recgen_chunk_tril_inverse", "recgen_chunk_scan_e", "recgen_chunk_scan_e_rev",
                             "recgen_chunk_bwd_key_rank1_before"}, {}),
    ("rwkv7", 32, 8, True, {"recgen_chunk_decays_g_q_q_p", "recgen_chunk_decays_g_pe_q_q_p",
                            "recgen_chunk_pair_quad_nonstrict", "recgen_chunk_pair_grad_quad_nonstrict",
                            "recgen_chunk_ut_mma_key", "recgen_chunk_scan_mma_p", "recgen_chunk_scan_mma_p_dg_rev",
                            "recgen_chunk_bwd_key_rank1_before"}, {}),
    ("rwkv7", 32, 8, True, {"recgen_chunk_decays_g_q_q_p", "recgen_chunk_decays_g_pe_q_q_p",  # CUDA's defaults
                            "recgen_chunk_pair_quad_nonstrict_fold", "recgen_chunk_pair_grad_quad_nonstrict_fold",
                            "recgen_chunk_ut_mma_key_tb", "recgen_chunk_scan_mma_p", "recgen_chunk_scan_mma_p_dg_rev",
                            "recgen_chunk_out_mma_key_m2_yt", "recgen_chunk_bwd_key_rank1_before"},
     {"pair_fold": True, "ut_products": True, "rank1_readout": True}),
    ("dplr_key", 16, 8, True, {"recgen_chunk_ut_mma_key", "recgen_chunk_scan_mma_p", "recgen_chunk_scan_mma_p_dg_rev",
                               "recgen_chunk_bwd_key_rank1"}, {}),
    ("dplr_key", 16, 8, True, {"recgen_chunk_ut_mma_key_tb", "recgen_chunk_scan_mma_p", "recgen_chunk_scan_mma_p_dg_rev",
                               "recgen_chunk_out_mma_key_m2_yt", "recgen_chunk_bwd_key_rank1"},
     {"ut_products": True, "rank1_readout": True})])
def test_general_rank1_core_with_kernels_matches_reference(name, K, V, mma, want, extra, monkeypatch):
    """The general rank-1 core (``chunked.rank1``) with the generated kernels: RWKV-7 (the transition before a
    key-vector decay: the quad pair kernels, b's pairs one token earlier non-strict, a ⊙ Q, u ⊙ Q, r ⊙ P and P_{t-1}
    formed in the decays' pass, the FMA scans), and a transition after a key-vector decay on the fragment frames (the
    update's u wᵀ as the forward scan's product term, the UT transform with A given; K = 16 keeps the pairs in MLX
    ops); the backward's elementwise tail as the rank-1 kernel (``chunk_bwd_rank1``) in both;
    GQA, a partial last chunk, strong decays: forward, final state and every gradient against the float64
    reference."""
    pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare, dplr_key

    rec = dplr_key if name == "dplr_key" else specs.BUILTINS[name]
    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=mma, **extra)
    assert_close(compare(rec, 40, chunk=16, B=1, H=2, Hk=1, K=K, V=V, seed=5, tuning=t))
    assert {c.split("_metal")[0] for c in calls} == want


@pytest.mark.parametrize("readout_kernel", [False, True])
def test_general_rank1_core_applies_the_readout_scale_inside(readout_kernel, monkeypatch):
    """RWKV-7 at a readout scale other than 1 on the kernels: the core takes r itself and scales y (and dy in its
    backward), so the role scale·r is never formed; forward, final state and every gradient against the float64
    reference, whose r is scaled first; with the three readout terms as one kernel too (``Tuning.rank1_readout``)."""
    pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare

    seen = []
    real = rank1.core_fn
    monkeypatch.setattr(rank1, "core_fn", lambda *a: seen.append(a[3]) or real(*a))  # (key, before, t, rfac, out)
    monkeypatch.setattr(ck, "mlx_call", _emulated_call)
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True,
                       rank1_readout=readout_kernel)
    assert_close(compare(specs.BUILTINS["rwkv7"], 24, chunk=16, B=1, H=2, Hk=1, K=32, V=8, seed=7, tuning=t,
                         scale=0.37))
    assert seen and all(abs(c - 0.37) < 1e-12 for c in seen), seen


def test_fused_backward_pass_beside_the_fma_scans(monkeypatch):
    """V = 12 (not a multiple of 8) has no fragment scan, while the backward's fragment pass (which needs K only)
    still runs: the reverse scan then gets u ⊙ Q and the product (r ⊙ P)ᵀ dy formed by MLX from the row-scaled
    factors (``chunk_kernels.chunk_scan``'s fallback); end to end against the float64 reference."""
    pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True)
    assert_close(compare(specs.BUILTINS["gated_delta_net"], 24, chunk=16, K=16, V=12, seed=3, tuning=t))
    kinds = {c.split("_metal")[0] for c in calls}
    assert "recgen_chunk_bwd_mma_delta" in kinds and "recgen_chunk_scan_e_rev_v4" in kinds, kinds


@pytest.mark.parametrize("how", ["pf", "hoist", "pf+hoist"])
@pytest.mark.parametrize("C,K,V,F,has_e,reverse,has_b", [(16, 32, 16, 1, False, False, True), (32, 32, 32, 32, True, True, True),
                                                     (16, 16, 8, 1, True, True, False), (64, 64, 64, 1, False, False, True)])
def test_chunk_scan_prefetching_matches_numpy(C, K, V, F, has_e, reverse, has_b, how):
    """The fragment scan with each group's A and X fragments loaded a chunk ahead (``ScanVariant.pf``) or its
    state-free operands at each step's start (``hoist``: A's and X's fragments, B's transposed rows), in both
    directions, scalar and key decays, with and without B and E, against ``_scan_ref``; three chunks so the
    prefetched fragments of chunks 1 and 2 are the ones used (without B: the product-free scan, E's elements hoisted
    too). Layouts without one item of Y a group refuse both."""
    flags = {x: True for x in how.split("+")}
    v = ScanVariant(a=True, b=has_b, e=has_e, reverse=reverse, mma=True, **flags)
    assert cs.scan_prefetches(C, K, V)
    BH = 1 if C == 64 else 2  # the GPU's chunk: one (batch, head) keeps the emulator quick
    _check_scan(ck.scan_launch("metal", v, BH, 3, C, K, V, F), np.random.default_rng(C + K + V), BH, 3, C, K, V, F,
                has_e, reverse, True, has_b)
    assert not cs.scan_prefetches(32, 16, 32)  # one group, two items
    with pytest.raises(ValueError, match="one item"):
        ck.scan_launch("metal", v, 2, 3, 32, 16, 32, F)


@pytest.mark.parametrize("reverse", [False, True])
def test_chunk_scan_hoisting_without_a_matches_numpy(reverse):
    """Hoisting where the scan has no A term (Y = X: simple GLA's forward): only B's transposed rows are loaded at
    each step's start, and any layout takes it (two items of Y a group here)."""
    v = ScanVariant(a=False, b=True, e=reverse, reverse=reverse, mma=True, hoist=True)
    _check_scan(ck.scan_launch("metal", v, 2, 3, 32, 16, 32, 1), np.random.default_rng(5), 2, 3, 32, 16, 32, 1,
                reverse, reverse, False, True)


@pytest.mark.parametrize("name", ["simple_gla", "gla"])
def test_chunked_core_with_hoisted_product_free_scans_matches_reference(name, monkeypatch):
    """``Tuning.scan_hoist_e`` end to end: the backward's product-free reverse scan (A with its row scales, E) of a
    scalar decay (simple GLA) and a key decay (GLA) hoisted; forward, final state and every gradient against the
    float64 reference."""
    pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True, scan_hoist_e=True)
    assert_close(compare(specs.BUILTINS[name], 40, chunk=16, K=16, V=8, seed=4, tuning=t))
    hoisted = {c.split("_metal")[0] for c in calls if "_ho" in c}
    assert hoisted and all("_e_" in c and c.endswith("_rev") for c in hoisted), {c.split("_metal")[0] for c in calls}


@pytest.mark.parametrize("how", ["scan_prefetch", "scan_hoist"])
def test_chunked_core_with_prefetching_scans_matches_reference(how, monkeypatch):
    """``Tuning.scan_prefetch`` and ``scan_hoist`` (with ``reverse_scan_hoist``) end to end: GDN's fragment scans
    (the forward one, and the reverse one with its row scales and factors) load their A and X fragments a chunk
    ahead, or every state-free operand at each step's start; forward, final state and every gradient against the
    float64 reference (K = 16, V = 8: one group, one item of Y). The diagonal reverse form is in
    ``test_chunk_scan_prefetching_matches_numpy``."""
    pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    flags = {"scan_prefetch": True} if how == "scan_prefetch" else {"scan_hoist": True, "reverse_scan_hoist": True}
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True, **flags)
    assert_close(compare(specs.BUILTINS["gated_delta_net"], 40, chunk=16, K=16, V=8, seed=2, tuning=t))
    kinds = {c.split("_metal")[0] for c in calls}
    tag = "_pf" if how == "scan_prefetch" else "_ho"
    want = {"recgen_chunk_scan_mma_q" + tag, "recgen_chunk_scan_mma_aq_p_pq" + tag + "_dg_rev"}
    assert {k for k in kinds if tag in k} == want, kinds


@pytest.mark.parametrize("most,hoisted", [(264, True), (1, False)])
def test_scans_hoist_only_up_to_their_threadgroup_bound(most, hoisted, monkeypatch):
    """``Tuning.scan_hoist_most``: a scan of more threadgroups than that (here B·H · V / BV = 2 · 1) is not
    hoisted, so large grids keep the unhoisted scans' occupancy; the result is the same either way."""
    pytest.importorskip("mlx.core")
    import mlx.core as mx

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True, scan_hoist=True,
                       scan_hoist_most=most)
    rng = np.random.default_rng(3)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    S0, A, X, Bm = f(2, 16, 16), f(2, 2, 16, 16) / 4, f(2, 2, 16, 16), f(2, 2, 16, 16) / 4
    g = np.full((2, 2, 1), 0.5, np.float32)
    got = ck.chunk_scan(*(mx.array(a) for a in (S0, A, X, Bm, g)), None, t, reverse=False)
    assert any("_ho" in c for c in calls) == hoisted, calls
    for a, want in zip(got, _scan_ref(S0, A, X, Bm, g, None, False)):
        assert _rel(np.array(a), want) < 1e-3


@pytest.mark.parametrize("form", ["products", "product-free"])
def test_hoisted_reverse_scan_at_the_gpu_layout_matches_unhoisted(form):
    """The GPU's hoisted reverse scans (GDN's backward: P, dg, Aq, Pq terms; simple GLA's: Aq and E, no B) at K = 128
    over four groups, two 16-row state blocks a group (the layout a hoisted reverse scan takes on CUDA), give bit for
    bit what the unhoisted scan of the same layout gives; under ASan+UBSan too."""
    rng = np.random.default_rng(17)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    BH, n, C, K, V = 1, 2, 64, 128, 32
    ins = {"S0": f(BH, K, V), "A": f(BH, n, C, K) / 8, "Aq": rng.uniform(size=(BH, n, C)).astype(np.float32),
           "X": f(BH, n, C, V), "Bm": f(BH, n, C, K) / 8, "g": np.full((BH, n, 1), 0.5, np.float32),
           "Pa": f(BH, n, C, K) / 8, "Pb": f(BH, n, C, V), "Pq": rng.uniform(size=(BH, n, C)).astype(np.float32),
           "St": f(BH, n, K, V)}
    terms = (dict(reverse=True, p=True, dg=True, aq=True, pq=True, mma=True) if form == "products"
             else dict(reverse=True, b=False, e=True, aq=True, mma=True))
    if form != "products":
        ins = {k: v for k, v in ins.items() if k in ("S0", "A", "Aq", "X", "g")} | {"E": f(BH, n, K, V)}
    assert cs.scan_mma_layout(C, K, V, 32, 4)["NW"] == 4
    want = verify.run_launch(ck.scan_launch("metal", ScanVariant(**terms), BH, n, C, K, V, 1, 32, 4), ins)
    for sanitizer in (None, "address"):
        hoisted = ck.scan_launch("metal", ScanVariant(hoist=True, **terms), BH, n, C, K, V, 1, 32, 4)
        got = verify.run_launch(hoisted, ins, sanitizer=sanitizer)
        for a, b in zip(got, want):
            assert np.array_equal(a, b)


def _out_ref(r, u, Z, St, l):
    """float64 M[t, s] = (r_t . u_s) prod_{s<tau<=t} e^{l_tau} (s <= t, else 0) and
    y_t = e^{G_t} r_t S + sum_{s<=t} M[t, s] z_s, per chunk."""
    N, C, _ = r.shape
    l = l.astype(np.float64)
    y, M = np.zeros(Z.shape), np.zeros((N, C, C))
    for t in range(C):
        y[:, t] = np.exp(l[:, :t + 1].sum(1))[:, None] * np.einsum("nk,nkv->nv", r[:, t], St)
        for s in range(t + 1):
            M[:, t, s] = (r[:, t] * u[:, s]).sum(-1) * np.exp(l[:, s + 1:t + 1].sum(1))
            y[:, t] += M[:, t, s][:, None] * Z[:, s]
    return y, M


@pytest.mark.parametrize("staging", ["sync", "async"])
@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("C,K,V,bv", [(16, 16, 24, 64), (32, 40, 32, 16), (64, 16, 16, 64), (32, 32, 128, 128)])
def test_chunk_out_mma_matches_numpy(frame, C, K, V, bv, staging):
    """The fragment readout (chunk_out_mma.j2): one chunk per threadgroup row, C / 16 groups each forming
    its rows of M = (R U^T) * Gamma; V split over threadgroups of BV columns (V = 32 at BV 16: two), R, U,
    S_c, Z staged KB at a time (K = 40: five blocks of 8; the last case CUDA's BV 128, KB 32); decays down to
    e^-20 a token, a run of weak ones after strong ones (anchored sums). "async": the same readout with its blocks
    copied two deep (chunk_out_async.j2, float32 operands)."""
    rng = np.random.default_rng(C + K + V)
    N = 2
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    l = (-20 * rng.uniform(size=(N, C)) ** 3).astype(np.float32)
    l[0, : C // 2], l[0, C // 2:] = -20.0, -0.01
    ins = {"R": f(N, C, K), "U": f(N, C, K), "Z": f(N, C, V), "St": f(N, K, V), "logd": l, "Rs": np.array([0.3], np.float32)}
    launch = (ck.out_mma_launch(frame, N, C, K, V, None, bv) if staging == "sync"
              else ck.out_async_launch(frame, N, C, K, V, ("float32",) * 4, None, bv))
    assert dict(launch.template)["BV"] == next(b for b in (bv, 64, 32, 16, 8) if V % b == 0)
    y, M = verify.run_launch(launch, ins)
    want_y, want_M = _out_ref(0.3 * ins["R"], *(ins[k] for k in ("U", "Z", "St", "logd")))  # the readout role is Rs R
    assert _rel(y, want_y) < 1e-5 and _rel(M, want_M) < 1e-5


@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_chunk_out_mma_writes_the_model_layout(out):
    """``yt``: y written as [B, n C, H, V] in the output's type (B = 2, H = 3, n = 2 chunks: every index of the
    chunk -> (b, h, chunk) map differs), against the float64 readout moved there (bf16: within its rounding)."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(7)
    B, H, n, C, K, V = 2, 3, 2, 16, 16, 24
    N = B * H * n
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    ins = {"R": f(N, C, K), "U": f(N, C, K), "Z": f(N, C, V), "St": f(N, K, V),
           "logd": (-5 * rng.uniform(size=(N, C))).astype(np.float32), "Rs": np.ones(1, np.float32)}
    launch = ck.out_mma_launch("metal", N, C, K, V, (H, n, out))
    assert launch.outputs[0] == ((B, n * C, H, V), out)
    y, M = verify.run_launch(launch, ins)
    want_y, want_M = _out_ref(*(ins[k] for k in ("R", "U", "Z", "St", "logd")))
    want_y = want_y.reshape(B, H, n * C, V).transpose(0, 2, 1, 3)
    assert y.shape == want_y.shape
    assert _rel(y, want_y) < (1e-5 if out == "float32" else 4e-3) and _rel(M, want_M) < 1e-5
    del mx


def _key_decays(rng, N, C, K):
    """Per-key-element P_t = e^{G_t} [N, C, K] from log-decays down to -20 a token, a run of weak ones after strong
    ones in the first chunk."""
    l = -20 * rng.uniform(size=(N, C, K)) ** 3
    l[0, : C // 2], l[0, C // 2:] = -20.0, -0.01
    return np.exp(np.cumsum(l, 1)).astype(np.float32)


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("C,K,V,yt", [(16, 16, 24, None), (32, 40, 32, None), (16, 32, 16, "bfloat16")])
def test_chunk_out_mma_key_matches_numpy(frame, C, K, V, yt):
    """The key-vector decay's readout (``key``): M given, R staged as Rs R ⊙ P with P per key element; y alone is
    written (in the model's layout and type where ``yt``: B = 2, H = 3, n = 2)."""
    rng = np.random.default_rng(C + K + V)
    B, H, n = 2, 3, 2
    N = B * H * n
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    ins = {"R": f(N, C, K), "Mi": np.tril(f(N, C, C)), "Z": f(N, C, V), "St": f(N, K, V), "Pk": _key_decays(rng, N, C, K),
           "Rs": np.array([0.3], np.float32)}
    launch = ck.out_mma_launch(frame, N, C, K, V, None if yt is None else (H, n, yt), key=True)
    (y,) = verify.run_launch(launch, ins)
    R, P, M, Z, St = (ins[k].astype(np.float64) for k in ("R", "Pk", "Mi", "Z", "St"))
    want = 0.3 * (R * P) @ St + M @ Z  # Rs scales the first term only: M comes formed of the readout role
    if yt is not None:
        want = want.reshape(B, H, n * C, V).transpose(0, 2, 1, 3)
    assert y.shape == want.shape
    assert _rel(y, want) < (1e-5 if yt is None else 4e-3)


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("C,K,V,yt", [(16, 16, 24, None), (32, 40, 32, "bfloat16"), (64, 16, 8, None)])
def test_chunk_out_mma_rank1_matches_numpy(frame, C, K, V, yt):
    """The general rank-1 core's readout (``m2``): y = Rs ((r ⊙ P) S_c + M_ra X + M_ru w), R given already scaled,
    both pairs lower, w in bf16 (converted as read); y in the model's layout and type where ``yt``."""
    rng = np.random.default_rng(C + K + V + 7)
    B, H, n = 2, 3, 2
    N = B * H * n
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    mx = pytest.importorskip("mlx.core")
    w = mx.array(f(N, C, V)).astype(mx.bfloat16)  # a bf16 buffer: the kernel converts as it reads
    ins = {"R": f(N, C, K) * _key_decays(rng, N, C, K), "Mi": np.tril(f(N, C, C)), "Z": f(N, C, V),
           "St": f(N, K, V), "M2": np.tril(f(N, C, C)), "Z2": w, "Rs": np.array([0.3], np.float32)}
    launch = ck.out_mma_launch(frame, N, C, K, V, None if yt is None else (H, n, yt), key=True, m2=True)
    assert "_key_m2" in launch.source.name
    (y,) = verify.run_launch(launch, ins)
    R, M, Z, St, M2 = (ins[k].astype(np.float64) for k in ("R", "Mi", "Z", "St", "M2"))
    Z2 = np.array(w.astype(mx.float32)).astype(np.float64)
    want = 0.3 * (R @ St + M @ Z + M2 @ Z2)  # the pairs are of r itself: Rs scales every term
    if yt is not None:
        want = want.reshape(B, H, n * C, V).transpose(0, 2, 1, 3)
    assert y.shape == want.shape
    assert _rel(y, want) < (1e-5 if yt is None else 4e-3)
    with pytest.raises(ValueError, match="key-vector decay form"):
        cs.out_mma_source(frame, key=False, m2=True)


def test_chunk_out_mma_layouts():
    """Column blocks and staging depths by dialect: CUDA's 48 KiB take BV 128 (OUT_BV) and KB 32; Metal's 32 KiB
    a shallower staging depth; sizes outside the layouts have none."""
    assert cs.out_mma_layout("cuda", 64, 128, 128) == {"BV": 128, "KB": 32, "LD": 68, "LDA": 36, "LDB": 136, "XB": 4352}
    assert cs.out_mma_layout("metal", 64, 128, 128) == {"BV": 128, "KB": 16, "LD": 68, "LDA": 20, "LDB": 136, "XB": 2176}
    assert cs.out_mma_layout("metal", 16, 8, 40) == {"BV": 8, "KB": 8, "LD": 36, "LDA": 12, "LDB": 8, "XB": 192}
    assert cs.out_mma_layout("cuda", 128, 128, 128) is None and cs.out_mma_layout("cuda", 64, 12, 128) is None
    assert cs.out_mma_layout("cuda", 64, 128, 44) is None
    with pytest.raises(ValueError, match="16, 32 or 64"):
        ck.out_mma_launch("metal", 1, 8, 16, 16)


def _ut_ref(bt, u, w, l):
    """float64 A[t, s] = (bt_t . u_s) prod_{s<tau<=t} e^{l_tau} (s < t), T = (I - A)^{-1}, T w, T (bt * e^{G})."""
    N, C, _ = bt.shape
    l = l.astype(np.float64)
    A = np.zeros((N, C, C))
    for t in range(C):
        for s in range(t):
            A[:, t, s] = (bt[:, t] * u[:, s]).sum(-1) * np.exp(l[:, s + 1:t + 1].sum(1))
    T = np.linalg.inv(np.eye(C) - A)
    return T, T @ w, T @ (bt * np.exp(np.cumsum(l, 1))[..., None])


@pytest.mark.parametrize("staging", ["sync", "async"])
@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("C,K,V,bw", [(16, 16, 24, 128), (32, 40, 16, 128), (32, 64, 128, 64), (16, 128, 128, 128)])
def test_chunk_ut_mma_matches_numpy(frame, C, K, V, bw, staging):
    """The fragment UT transform (chunk_ut_mma.j2): A formed on fragments, inverted in threadgroup memory,
    applied to W and Bt * e^G in passes of BW columns (K = 40: BW 8, five passes; K = 64, V = 128: BW 64, KB 32;
    BW 128: one pass each);
    keys scaled like unit-norm ones times beta (A's entries below 1), decays down to e^-20 a token, a run of
    weak ones after strong ones. "async": the same transform with its blocks copied two deep (chunk_ut_async.j2,
    float32 operands: the products' row blocks as one sequence over the passes)."""
    rng = np.random.default_rng(C + K + V)
    N = 2
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    l = (-20 * rng.uniform(size=(N, C)) ** 3).astype(np.float32)
    l[0, : C // 2], l[0, C // 2:] = -20.0, -0.01
    ins = {"Bt": -f(N, C, K) / np.sqrt(K), "U": f(N, C, K) / np.sqrt(K), "W": f(N, C, V), "logd": l}
    launch = (ck.ut_mma_launch(frame, N, C, K, V, bw) if staging == "sync"
              else ck.ut_async_launch(frame, N, C, K, V, ("float32",) * 3, bw))
    assert dict(launch.template)["BW"] == next(b for b in (bw, 64, 32, 16, 8) if K % b == 0 and V % b == 0)
    outs = verify.run_launch(launch, ins)
    for got, want in zip(outs, _ut_ref(*(ins[k] for k in ("Bt", "U", "W", "logd")))):
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-5, _rel(got, want)


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("C,K,V,bw", [(16, 16, 24, 128), (32, 40, 16, 128), (32, 64, 128, 64)])
def test_chunk_ut_mma_key_matches_numpy(frame, C, K, V, bw):
    """The key-vector decay's UT transform (``key``): A given (strictly lower, entries as unit-norm keys times beta
    make them), inverted and applied to W and Bt ⊙ P with P per key element."""
    rng = np.random.default_rng(C + K + V + 1)
    N = 3
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    A = np.tril(f(N, C, C), -1) * 0.5 / np.sqrt(C)
    ins = {"Ai": A, "W": f(N, C, V), "Bt": -f(N, C, K) / np.sqrt(K), "Pk": _key_decays(rng, N, C, K)}
    outs = verify.run_launch(ck.ut_mma_launch(frame, N, C, K, V, bw, key=True), ins)
    T = np.linalg.inv(np.eye(C) - A.astype(np.float64))
    for got, want in zip(outs, (T, T @ ins["W"], T @ (ins["Bt"].astype(np.float64) * ins["Pk"]))):
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-5, _rel(got, want)
    # B given (``tb``, the general rank-1 core's): U = T (B w), formed as (T B) w in the kernel
    Bm = np.tril(f(N, C, C), -1) * 0.5 / np.sqrt(C)
    outs = verify.run_launch(ck.ut_mma_launch(frame, N, C, K, V, bw, key=True, tb=True), ins | {"Bm": Bm})
    want_u = T @ (Bm.astype(np.float64) @ ins["W"])
    for got, want in zip(outs, (T, want_u, T @ (ins["Bt"].astype(np.float64) * ins["Pk"]))):
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-5, _rel(got, want)


def test_chunk_ut_mma_at_the_cuda_layout(monkeypatch):
    """C = 64 (the GPU default: block levels m = 16 and 32 of the inverse) at CUDA's layout, which exceeds Metal's
    32 KiB of threadgroup memory, so the Metal spelling of its lane layout (metal_ptx) runs with only that limit waived (the lint and the type
    check's static_assert; the CPU emulator has no such limit); every other layer as usual."""
    import sys

    vk, vt = sys.modules["recgen.verify.kernels"], sys.modules["recgen.verify.typecheck"]  # the modules, not the functions

    real = vk.lint
    monkeypatch.setattr(vk, "lint", lambda *a, **k: [i for i in real(*a, **k) if i.rule != "threadgroup_memory"])
    monkeypatch.setattr(vt, "_limit_asserts", lambda src: "")
    rng = np.random.default_rng(64)
    N, C, K, V = 2, 64, 32, 16
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    l = (-3 * rng.uniform(size=(N, C)) ** 3).astype(np.float32)
    l[1] = -0.01  # weak decays: the whole chunk couples (A's far blocks matter)
    ins = {"Bt": -f(N, C, K) / np.sqrt(K), "U": f(N, C, K) / np.sqrt(K), "W": f(N, C, V), "logd": l}
    lay = cs.ut_mma_layout("cuda", C, K, V)
    launch = ck.Launch(cs.ut_mma_source("metal_ptx"), (), (((N, C, C), "float32"), ((N, C, V), "float32"), ((N, C, K), "float32")),
                       (N * 2 * C, 1, 1), (2 * C, 1, 1), (("C", C), ("K", K), ("V", V)) + tuple(lay.items()))
    for got, want in zip(verify.run_launch(launch, ins), _ut_ref(*(ins[k] for k in ("Bt", "U", "W", "logd")))):
        assert _rel(got, want) < 1e-5, _rel(got, want)


def test_chunk_ut_mma_layouts():
    """CUDA's 48 KiB hold C = 64 (A and Tm, 17 KiB each, staging 16 deep); Metal's 32 KiB do not (MLX ops and the
    inverse kernel there); BW (UT_BW = 128 where it divides K and V) divides both."""
    assert cs.ut_mma_layout("cuda", 64, 128, 128) == {"BW": 128, "KB": 16, "LD": 68, "LDA": 20, "LDB": 136, "XS": 2560}
    assert cs.ut_mma_layout("metal", 64, 128, 128) is None
    assert cs.ut_mma_layout("metal", 32, 40, 16)["BW"] == 8
    assert cs.ut_mma_layout("cuda", 8, 16, 16) is None and cs.ut_mma_layout("cuda", 64, 12, 16) is None
    with pytest.raises(ValueError, match="threadgroup memory"):
        ck.ut_mma_launch("metal", 1, 64, 128, 128)


def _bwd_ref(ins, rs):
    """float64 of the backward's pass after the scan (``chunk_bwd_mma.j2``), written from ``parallel._backward``'s MLX
    form: Er = dMR ⊙ Γ, Ea = dMA ⊙ Γ (strict), dr = P DRP + Er u, du = Q DUQ + Erᵀ r + Eaᵀ b̃, db̃ = P DR + Ea u,
    dG = Σ_i (r dr − u du + b̃ db̃), dG_{C-1} += Σ u Q DUQ + g DG, dl = reverse cumsum; r = rs R, dR = rs dr."""
    f64 = lambda k: np.asarray(ins[k], np.float64) if k in ins else None  # noqa: E731
    R, U, l = f64("R"), f64("U"), f64("logd")
    N, C, K = R.shape
    r = rs * R
    gam = np.zeros((N, C, C))
    for t in range(C):
        for s in range(t + 1):
            gam[:, t, s] = np.exp(l[:, s + 1:t + 1].sum(1))
    P, Q = np.exp(np.cumsum(l, 1))[..., None], gam[:, C - 1, :, None]
    Er = f64("dMR") * gam
    dr = P * f64("DRP") + Er @ U
    du = Q * f64("DUQ") + Er.swapaxes(-1, -2) @ r
    outs, g = [rs * dr], r * dr
    if "dMA" in ins:
        Ea, Bt = f64("dMA") * np.tril(gam, -1), f64("Bt")
        du = du + Ea.swapaxes(-1, -2) @ Bt
        dbt = P * f64("DR") + Ea @ U
        g = g + Bt * dbt
    g = (g - U * du).sum(-1)
    g[:, -1] += (U * Q * f64("DUQ")).sum((1, 2)) + P[:, -1, 0] * f64("DG")
    outs += [du] + ([dbt] if "dMA" in ins else []) + [np.cumsum(g[:, ::-1], 1)[:, ::-1]]
    return outs


def _bwd_inputs(rng, N, C, K, delta, strong=True):
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    l = (-20 * rng.uniform(size=(N, C)) ** 3).astype(np.float32)
    if strong:  # a run of weak decays after strong ones: Γ from anchored sums
        l[0, : C // 2], l[0, C // 2:] = -20.0, -0.01
    ins = {"dMR": f(N, C, C), "R": f(N, C, K), "U": f(N, C, K), "DUQ": f(N, C, K), "DRP": f(N, C, K), "logd": l,
           "DG": f(N), "Rs": np.array([0.3], np.float32)}
    return ins | ({"dMA": f(N, C, C), "Bt": f(N, C, K), "DR": f(N, C, K)} if delta else {})


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("C,K,delta,bw", [(16, 16, True, 32), (32, 40, True, 32), (32, 64, True, 16), (16, 24, False, 32),
                                          (32, 64, False, 32)])
def test_chunk_bwd_mma_matches_numpy(frame, C, K, delta, bw):
    """The backward's fragment pass after the scan (chunk_bwd_mma.j2) against float64: the delta rule's form and the
    diagonal one; keys in passes of BW columns (K = 40: five passes of 8; K = 64 at most 16: four), C / 16 groups
    owning rows, E read by rows and by columns; decays down to e^-20 a token and weak ones after strong ones; dM
    dense (its upper part must be ignored); the readout role scaled (Rs = 0.3)."""
    ins = _bwd_inputs(np.random.default_rng(C + K + delta), 2, C, K, delta)
    launch = ck.bwd_mma_launch(frame, 2, C, K, ("float32",) * (3 if delta else 2), bw)
    assert dict(launch.template)["BW"] == next(b for b in (bw, 16, 8) if b <= bw and K % b == 0)
    outs = verify.run_launch(launch, ins)
    want = _bwd_ref(ins, 0.3)
    assert len(outs) == len(want)
    for got, w in zip(outs, want):
        assert got.shape == w.shape and _rel(got, w) < 1e-5, _rel(got, w)


def _check_bwd_forming(launch, ins, formed, operands, sanitizer):
    """The pass given ``operands`` in place of the inputs ``formed`` holds (which it forms from them), against the
    float64 pass (``_bwd_ref``) given those products."""
    given = {k: x for k, x in ins.items() if k not in formed} | operands
    outs = verify.run_launch(launch, given, sanitizer=sanitizer)
    want = _bwd_ref(ins | formed, 0.3)
    assert len(outs) == len(want)
    for got, w in zip(outs, want):
        assert got.shape == w.shape and _rel(got, w) < 1e-5, _rel(got, w)


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("C,K,V,delta,bw,sanitizer", [(16, 16, 24, True, 32, None), (32, 40, 8, True, 32, None),
                                                      (16, 24, 16, False, 32, None), (32, 32, 160, True, 32, None),
                                                      (16, 16, 80, True, 32, "address"),
                                                      (16, 16, 16, True, 16, "thread")])
def test_chunk_bwd_mma_forms_the_products_over_values(frame, C, K, V, delta, bw, sanitizer):
    """``prods`` (V given): the pass forms DUQ = Z dS_nextᵀ, DRP = dy S_cᵀ and DR = Δ S_cᵀ from [C, V] and [K, V]
    inputs in place of reading them; against the float64 pass given those products (``_bwd_ref``), K = 40 in five
    passes of 8, V = 8 (one step over values), V = 160 (staged 32 at a time), V ≠ K; under ASan+UBSan and TSan."""
    rng = np.random.default_rng(C + K + V + delta)
    N = 2
    ins = _bwd_inputs(rng, N, C, K, delta)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    vals = {"Zv": f(N, C, V), "dYv": f(N, C, V), "Sv": f(N, K, V), "dSv": f(N, K, V)} | (
        {"Dv": f(N, C, V)} if delta else {})
    v64 = {k: x.astype(np.float64) for k, x in vals.items()}
    tr = lambda x: x.swapaxes(-1, -2)  # noqa: E731
    formed = {"DUQ": v64["Zv"] @ tr(v64["dSv"]), "DRP": v64["dYv"] @ tr(v64["Sv"])} | (
        {"DR": v64["Dv"] @ tr(v64["Sv"])} if delta else {})
    launch = ck.bwd_mma_launch(frame, N, C, K, ("float32",) * (3 if delta else 2), bw, V=V)
    _check_bwd_forming(launch, ins, formed, vals, sanitizer)
    with pytest.raises(ValueError, match="multiple of 8"):
        ck.bwd_mma_launch(frame, N, C, K, ("float32",) * 3, bw, V=12)


@pytest.mark.parametrize("C,K,V,delta,prods,wl,sanitizer", [(16, 16, 32, True, False, False, None),
                                                         (32, 40, 16, True, False, False, None),
                                                         (32, 24, 48, False, False, False, None),
                                                         (16, 16, 32, True, True, False, None),
                                                         (16, 24, 32, False, True, False, None),
                                                         (16, 16, 16, True, False, False, "address"),
                                                         (16, 16, 16, False, False, False, "thread"),
                                                         (32, 32, 32, True, True, False, "address"),
                                                         (16, 16, 32, True, True, False, "thread"),
                                                         (32, 24, 64, True, True, True, None),
                                                         (16, 16, 32, False, True, True, None),
                                                         (32, 40, 32, True, False, True, None),
                                                         (16, 16, 64, True, True, True, "address"),
                                                         (16, 16, 32, True, True, True, "thread")])
def test_chunk_bwd_mma_forms_the_pair_cotangents(C, K, V, delta, prods, wl, sanitizer):
    """``scores`` (``Tuning.bwd_scores``): the pass forms dMR = dy Zᵀ (and dMA = Δ Zᵀ) on the wide multiply-add from
    bf16 rows [C, V] in place of reading them (CUDA's m16n8k16 lane layout, spelled in ``metal_ptx``), alone and
    with the products over values formed too, on it as well from the bf16 states [K, V] (K = 24: passes of 8
    columns); against the float64 pass given those products of the bf16 values (float32 accumulation: no rounding
    beyond the inputs'); under ASan+UBSan and TSan. ``wl`` (``Tuning.bwd_wide_loads``): their operands read 16 bytes
    a load, the values permuted within 32."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(C + K + V + delta + 2 * prods)
    N = 2
    ins = _bwd_inputs(rng, N, C, K, delta)
    bf = lambda *s: mx.array(rng.normal(size=s).astype(np.float32)).astype(mx.bfloat16)  # noqa: E731
    rows = {"Zv": bf(N, C, V), "dYv": bf(N, C, V)} | ({"Dv": bf(N, C, V)} if delta else {})
    r64 = {k: np.array(x.astype(mx.float32), np.float64) for k, x in rows.items()}
    tr = lambda x: x.swapaxes(-1, -2)  # noqa: E731
    formed = {"dMR": r64["dYv"] @ tr(r64["Zv"])} | ({"dMA": r64["Dv"] @ tr(r64["Zv"])} if delta else {})
    states = {}
    if prods:  # on the wide multiply-add too: the states in the rows' type
        states = {"Sv": bf(N, K, V), "dSv": bf(N, K, V)}
        s64 = {k: np.array(x.astype(mx.float32), np.float64) for k, x in states.items()}
        formed |= {"DUQ": r64["Zv"] @ tr(s64["dSv"]), "DRP": r64["dYv"] @ tr(s64["Sv"])} | (
            {"DR": r64["Dv"] @ tr(s64["Sv"])} if delta else {})
    launch = ck.bwd_mma_launch("metal_ptx", N, C, K, ("float32",) * (3 if delta else 2), 32, V=V if prods else 0,
                               scores=(V, "bfloat16"), wide_loads=wl)
    assert "_sc_" in launch.source.name and launch.source.inputs[:2] == ("Zv", "dYv"), launch.source.inputs
    assert ("_wl_" in launch.source.name) == wl
    _check_bwd_forming(launch, ins, formed, rows | states, sanitizer)
    with pytest.raises(ValueError, match="multiple of 16"):
        ck.bwd_mma_launch("metal_ptx", N, C, K, ("float32",) * 3, 32, scores=(24, "bfloat16"))
    with pytest.raises(ValueError, match="wide multiply-add"):
        ck.bwd_mma_launch("metal", N, C, K, ("float32",) * 3, 32, scores=(V, "bfloat16"))
    with pytest.raises(ValueError, match="multiple of 32"):
        ck.bwd_mma_launch("metal_ptx", N, C, K, ("float32",) * 3, 32, scores=(48, "bfloat16"), wide_loads=True)


def test_chunk_bwd_refuses_wide_products_on_states_of_another_type():
    """The pass's products over values on the wide multiply-add read the states as pairs of the rows' 16-bit type:
    float32 states are refused before any kernel is built."""
    mx = pytest.importorskip("mlx.core")
    t = tuning.resolve("gpu", "cuda", environ={})
    b16 = lambda *s: mx.zeros(s, dtype=mx.bfloat16)  # noqa: E731
    rows = (b16(1, 1, 16, 16), b16(1, 1, 16, 16), b16(1, 1, 16, 16))
    states = (mx.zeros((1, 1, 16, 16)), mx.zeros((1, 1, 16, 16)))
    with pytest.raises(ValueError, match="wide products"):
        ck.chunk_bwd(None, None, b16(1, 1, 16, 16), b16(1, 1, 16, 16), b16(1, 1, 16, 16), None, None, None,
                     mx.zeros((1, 1, 16, 1)), mx.zeros((1, 1)), t, prods=rows + states, scores=rows)


def test_chunk_bwd_mma_at_the_cuda_layout(monkeypatch):
    """C = 64 at CUDA's layout (its staged blocks pass Metal's 32 KiB): the Metal spelling runs with only
    that limit waived, as ``test_chunk_ut_mma_at_the_cuda_layout``; bf16 roles in and their gradients out in bf16."""
    import sys

    vk, vt = sys.modules["recgen.verify.kernels"], sys.modules["recgen.verify.typecheck"]
    real = vk.lint
    monkeypatch.setattr(vk, "lint", lambda *a, **k: [i for i in real(*a, **k) if i.rule != "threadgroup_memory"])
    monkeypatch.setattr(vt, "_limit_asserts", lambda src: "")
    mx = pytest.importorskip("mlx.core")
    N, C, K = 2, 64, 64  # two passes of 32 columns
    ins = _bwd_inputs(np.random.default_rng(64), N, C, K, True, strong=False)
    for k in ("R", "Bt"):  # rounded to bf16 first: the reference sees what the kernel reads
        ins[k] = np.array(mx.array(ins[k]).astype(mx.bfloat16).astype(mx.float32))
    lay = cs.bwd_mma_layout("cuda", C, K, True)
    assert lay == {"BW": 32, "LD": 68, "LDB": 40, "XS": 7680} and cs.bwd_mma_layout("metal", C, K, True) is None
    types = ("bfloat16", "float32", "bfloat16")
    launch = ck.Launch(cs.bwd_mma_source("metal_ptx", True), (), tuple(((N, C, K), t) for t in types) + (((N, C), "float32"),),
                       (N * 2 * C, 1, 1), (2 * C, 1, 1), (("C", C), ("K", K)) + tuple(lay.items())
                       + tuple(zip(("RT", "UT", "BT"), types)))
    typed = ins | {k: mx.array(ins[k]).astype(mx.bfloat16) for k in ("R", "Bt")}
    outs = verify.run_launch(launch, {k: v if isinstance(v, np.ndarray) else v for k, v in typed.items()})
    for got, w, t in zip(outs, _bwd_ref(ins, 0.3), types + ("float32",)):
        assert _rel(got, w) < (4e-3 if t == "bfloat16" else 1e-5), (t, _rel(got, w))


def _factor_inputs(rng, N, C, K):
    """A key x [N, C, K] and a factor per token f [N, C] (β-like, some 0: a token that writes nothing), float32."""
    x = (rng.normal(size=(N, C, K)) / np.sqrt(K)).astype(np.float32)
    f = rng.uniform(size=(N, C)).astype(np.float32)
    f[:, 1] = 0.0
    return x, f


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("C,K,V,bf", [(16, 16, 24, -1.0), (32, 40, 16, -0.5)])
def test_chunk_ut_mma_reads_factors(frame, C, K, V, bf):
    """Factor reads (``uf``): the UT transform given one key x, a factor per token Uf and a constant Bf computes
    what the plain kernel computes from the roles b̃ = Bf x and u = Uf ⊙ x, against float64."""
    rng = np.random.default_rng(C + K)
    N = 2
    x, uf = _factor_inputs(rng, N, C, K)
    l = (-20 * rng.uniform(size=(N, C)) ** 3).astype(np.float32)
    ins = {"U": x, "Uf": uf, "Bf": np.array([bf], np.float32), "W": rng.normal(size=(N, C, V)).astype(np.float32),
           "logd": l}
    outs = verify.run_launch(ck.ut_mma_launch(frame, N, C, K, V, uf=True), ins)
    x64 = x.astype(np.float64)
    for got, want in zip(outs, _ut_ref(bf * x64, uf[..., None] * x64, ins["W"], l)):
        assert got.shape == want.shape and _rel(got, want) < 1e-5, _rel(got, want)


@pytest.mark.parametrize("ot", ["bfloat16", "float16"])
def test_chunk_ut_mma_writes_16_bit_products(ot):
    """``o16`` (``Tuning.ut_16bit``): the factor-read UT transform writes U = T w and W = T (b̃ e^G) in a 16-bit type
    (T stays float32), each within that type's rounding of the float64 products."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(3)
    N, C, K, V = 2, 32, 16, 24
    x, uf = _factor_inputs(rng, N, C, K)
    l = (-5 * rng.uniform(size=(N, C)) ** 3).astype(np.float32)
    ins = {"U": x, "Uf": uf, "Bf": np.array([-1.0], np.float32), "W": rng.normal(size=(N, C, V)).astype(np.float32),
           "logd": l}
    launch = ck.ut_mma_launch("metal", N, C, K, V, uf=True, ot=ot)
    assert [dt for _, dt in launch.outputs] == ["float32", ot, ot]
    x64 = x.astype(np.float64)
    want = _ut_ref(-x64, uf[..., None] * x64, ins["W"], l)
    for got, w, tol in zip(verify.run_launch(launch, ins), want, (1e-5, 4e-3, 4e-3)):
        assert _rel(np.asarray(got, np.float64), w) < tol, _rel(np.asarray(got, np.float64), w)
    with pytest.raises(ValueError, match="o16"):
        cs.ut_mma_source("metal", uf=False, o16=True)
    del mx


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("C,K,V", [(16, 16, 24), (32, 40, 32)])
def test_chunk_out_mma_reads_factors(frame, C, K, V):
    """Factor reads (``uf``): the readout given a key x and a factor per token Uf forms M = (r (Uf ⊙ x)ᵀ) ⊙ Γ as it
    reads x; y and M against float64."""
    rng = np.random.default_rng(C + K + 5)
    N = 2
    x, uf = _factor_inputs(rng, N, C, K)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    l = (-20 * rng.uniform(size=(N, C)) ** 3).astype(np.float32)
    ins = {"R": f(N, C, K), "U": x, "Uf": uf, "Z": f(N, C, V), "St": f(N, K, V), "logd": l,
           "Rs": np.array([0.3], np.float32)}
    y, M = verify.run_launch(ck.out_mma_launch(frame, N, C, K, V, uf=True), ins)
    want_y, want_M = _out_ref(0.3 * ins["R"], uf[..., None] * x.astype(np.float64), ins["Z"], ins["St"], l)
    assert _rel(y, want_y) < 1e-5 and _rel(M, want_M) < 1e-5


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("C,K,bw", [(16, 16, 32), (32, 40, 32), (32, 64, 16)])
def test_chunk_bwd_mma_reads_factors(frame, C, K, bw):
    """Factor reads (``uf``): the backward's pass given a key x, a factor per token Uf and a constant Bf (u = Uf ⊙ x,
    b̃ = Bf x) writes dx = Uf du + Bf db̃ and dUf = Σ_i du ⊙ x in place of du and db̃; against the float64 pass on
    the formed roles (``_bwd_ref``), both chained by hand. Keys in passes of BW columns (K = 40: five of 8)."""
    rng = np.random.default_rng(C + K + 11)
    N, bf = 2, -1.0
    ins = _bwd_inputs(rng, N, C, K, True)
    x, uf = _factor_inputs(rng, N, C, K)
    x64, uf64 = x.astype(np.float64), uf.astype(np.float64)[..., None]
    dr, du, dbt, dl = _bwd_ref(ins | {"U": uf64 * x64, "Bt": bf * x64}, 0.3)
    given = {k: v for k, v in ins.items() if k != "Bt"} | {"U": x, "Uf": uf, "Bf": np.array([bf], np.float32)}
    launch = ck.bwd_mma_launch(frame, N, C, K, ("float32", "float32"), bw, uf=True)
    got = verify.run_launch(launch, given)
    want = [dr, uf64 * du + bf * dbt, (du * x64).sum(-1), dl]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and _rel(g, w) < 1e-5, _rel(g, w)


def _bwd_key_factor_ref(ins, rs, bf):
    """float64 of the key-decay tail with factor reads (``uf``): u = f x and b̃ = bf x, DUX and DBX the pairs' gradients
    of x (as second operand, as A's first), so dr = P DRP + DRX, dx = DBX + DUX + f Q DUQ + bf P DR, df's part
    Σ_i x Q DUQ, dG = r dr − x DUX − u Q DUQ + x DBX + bf x P DR, dG_{C-1} += Σ_s u Q DUQ + g DG."""
    f64 = lambda k: np.asarray(ins[k], np.float64)  # noqa: E731
    R, X, L, f = f64("R"), f64("U"), f64("L"), f64("Uf")[..., None]
    P = np.exp(np.cumsum(L, 1))
    Q = np.exp(np.concatenate([np.cumsum(L[:, ::-1], 1)[:, ::-1][:, 1:], np.zeros_like(L[:, :1])], 1))
    dr = P * f64("DRP") + f64("DRX")
    uqd = f * X * Q * f64("DUQ")
    dx = f64("DBX") + f64("DUX") + f * Q * f64("DUQ") + bf * P * f64("DR")
    g = rs * R * dr - X * f64("DUX") - uqd + X * f64("DBX") + bf * X * P * f64("DR")
    g[:, -1] += uqd.sum(1) + P[:, -1] * f64("DG")
    return [rs * dr, dx, (X * Q * f64("DUQ")).sum(-1), np.cumsum(g[:, ::-1], 1)[:, ::-1]]


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
def test_chunk_key_kernels_read_factors(frame):
    """Factor reads for a key-vector decay (KDA): the UT transform reading b̃ = Bf x (A given) and the backward's tail
    kernel (``uf``: dx, dr, the per-group parts of df summed, dl) against float64; two groups of 32 key columns."""
    rng = np.random.default_rng(21)
    N, C, K, V, bf = 2, 16, 64, 8, -1.0
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    x, uf = _factor_inputs(rng, N, C, K)
    Pk = _key_decays(rng, N, C, K)
    A = np.tril(f(N, C, C), -1) * 0.5 / np.sqrt(C)
    outs = verify.run_launch(ck.ut_mma_launch(frame, N, C, K, V, key=True, uf=True),
                             {"Ai": A, "W": f(N, C, V), "Bt": x, "Pk": Pk, "Bf": np.array([bf], np.float32)})
    T = np.linalg.inv(np.eye(C) - A.astype(np.float64))
    assert _rel(outs[2], T @ (bf * x.astype(np.float64) * Pk)) < 1e-5 and _rel(outs[0], T) < 1e-5
    ins = {"R": f(N, C, K), "U": x, "Uf": uf, "Bf": np.array([bf], np.float32), "L": -f(N, C, K) ** 2,
           "DRX": f(N, C, K), "DUX": f(N, C, K), "DBX": f(N, C, K), "DRP": f(N, C, K), "DUQ": f(N, C, K),
           "DR": f(N, C, K), "DG": f(N, K), "Rs": np.array([0.3], np.float32)}
    dr, dx, dfp, dl = verify.run_launch(ck.bwd_key_launch(frame, N, C, K, ("float32",) * 2, uf=True), ins)
    assert dfp.shape == (N, K // 32, C)
    for got, want in zip((dr, dx, dfp.sum(1), dl), _bwd_key_factor_ref(ins, 0.3, bf)):
        assert got.shape == want.shape and _rel(got, want) < 1e-5, _rel(got, want)
    with pytest.raises(ValueError, match="multiple of 32"):
        ck.bwd_key_launch(frame, N, C, 40, ("float32",) * 2, uf=True)


def _bwd_key_ref(ins, rs):
    """float64 of the key-decay tail (``chunk_bwd_key.j2``), written from ``parallel._backward``'s MLX form: P, Q from
    anchored sums per key column, dr = P DRP + DRX, du = Q DUQ + DUX, db̃ = P DR + DBX, dG = r dr − u du + b̃ db̃,
    dG_{C-1} += Σ_s u Q DUQ + g DG, dl = reverse cumsum; r = rs R, dR = rs dr."""
    f64 = lambda k: np.asarray(ins[k], np.float64) if k in ins else None  # noqa: E731
    R, U, L = f64("R"), f64("U"), f64("L")
    r = rs * R
    P = np.exp(np.cumsum(L, 1))
    Q = np.exp(np.concatenate([np.cumsum(L[:, ::-1], 1)[:, ::-1][:, 1:], np.zeros_like(L[:, :1])], 1))
    dr, du = P * f64("DRP") + f64("DRX"), Q * f64("DUQ") + f64("DUX")
    g = r * dr - U * du
    outs = [rs * dr, du]
    if "Bt" in ins:
        db = P * f64("DR") + f64("DBX")
        g = g + f64("Bt") * db
        outs.append(db)
    g[:, -1] += (U * Q * f64("DUQ")).sum(1) + P[:, -1] * f64("DG")
    return outs + [np.cumsum(g[:, ::-1], 1)[:, ::-1]]


@pytest.mark.parametrize("C,K,delta", [(16, 32, True), (16, 40, False), (8, 64, True), (1, 8, False)])
def test_chunk_bwd_key_matches_numpy(C, K, delta):
    """The key-vector decay's backward tail (chunk_bwd_key.j2) against float64: per key column, decays down to e^-20
    a token and a run of weak ones after strong ones (anchored sums); K = 40: a second, partial group of columns;
    C = 1; the readout role scaled (Rs = 0.3)."""
    rng = np.random.default_rng(C + K + delta)
    N = 3
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    L = (-20 * rng.uniform(size=(N, C, K)) ** 3).astype(np.float32)
    L[0, : C // 2], L[0, C // 2:] = -20.0, -0.01
    ins = {"R": f(N, C, K), "U": f(N, C, K), "L": L, "DRX": f(N, C, K), "DUX": f(N, C, K), "DRP": f(N, C, K),
           "DUQ": f(N, C, K), "DG": f(N, K), "Rs": np.array([0.3], np.float32)}
    if delta:
        ins |= {"Bt": f(N, C, K), "DBX": f(N, C, K), "DR": f(N, C, K)}
    outs = verify.run_launch(ck.bwd_key_launch("metal", N, C, K, ("float32",) * (3 if delta else 2)), ins)
    want = _bwd_key_ref(ins, 0.3)
    assert len(outs) == len(want)
    for got, w in zip(outs, want):
        assert got.shape == w.shape and _rel(got, w) < 1e-5, _rel(got, w)
    assert not cs.bwd_key_supported("metal", 128) and cs.bwd_key_supported("cuda", 64)


def _bwd_key_form(form: str, rng, N: int, C: int, K: int):
    """A key-decay tail's inputs (decays down to e^-20 a token, Rs = 0.3), its number of role types and the
    ``bwd_key_launch`` keywords of ``form``: plain, delta, uf (factor reads, Bf = -1), rank1, rank1_before."""
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    L = (-20 * rng.uniform(size=(N, C, K)) ** 3).astype(np.float32)
    ins = {"R": f(N, C, K), "U": f(N, C, K), "L": L, "DRX": f(N, C, K), "DUX": f(N, C, K), "DRP": f(N, C, K),
           "DUQ": f(N, C, K), "DG": f(N, K), "Rs": np.array([0.3], np.float32)}
    ins |= {"Bt": f(N, C, K), "DBX": f(N, C, K), "DR": f(N, C, K)} if form in ("delta", "uf") else {}
    ins |= {"Uf": f(N, C), "Bf": np.array([-1.0], np.float32)} if form == "uf" else {}
    ins |= ({"A": f(N, C, K), "B": f(N, C, K), "DAX": f(N, C, K), "DBX": f(N, C, K), "DAQ": f(N, C, K),
             "DBP": f(N, C, K)} if form.startswith("rank1") else {})
    types = {"plain": 2, "delta": 3, "uf": 2, "rank1": 4, "rank1_before": 4}[form]
    return ins, types, dict(uf=form == "uf", before=(form == "rank1_before") if form.startswith("rank1") else None)


@pytest.mark.parametrize("form", ["plain", "delta", "uf", "rank1", "rank1_before"])
def test_chunk_bwd_key_load_batches_agree(form):
    """The key-decay tail issues ``batch`` tokens' loads before their stores (``Tuning.bwd_key_batch``): batches of
    1, 4 and 16 tokens over a chunk of 21 (no multiple of either: the last batch partial) give the same bits, every
    form; plain and delta also against float64."""
    N, C, K = 2, 21, 64
    ins, types, kw = _bwd_key_form(form, np.random.default_rng(7 + len(form)), N, C, K)
    outs = [verify.run_launch(ck.bwd_key_launch("metal", N, C, K, ("float32",) * types, batch=b, **kw), ins)
            for b in (1, 4, 16)]
    for other in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(outs[0], other))
    if form in ("plain", "delta"):
        for a, want in zip(outs[0], _bwd_key_ref(ins, 0.3)):
            assert _rel(a, want) < 1e-5, _rel(a, want)


@pytest.mark.parametrize("form", ["plain", "delta", "uf", "rank1", "rank1_before"])
@pytest.mark.parametrize("sanitizer", [None, "address"])
def test_chunk_bwd_key_running_sums(form, sanitizer):
    """``running`` (``Tuning.bwd_key_running``): the key-decay tail writes dl as its reverse sum goes and adds the
    chunk's last term after, staging no dG: every form (plain, the delta rule's, factor reads, both rank-1 tails)
    against the staged kernel and, where a float64 reference exists, against it; decays down to e^-20 a token, two
    groups of 32 columns, ASan+UBSan."""
    N, C, K = 2, 16, 64
    ins, types, kw = _bwd_key_form(form, np.random.default_rng(len(form)), N, C, K)
    launch = ck.bwd_key_launch("metal", N, C, K, ("float32",) * types, running=True, **kw)
    assert launch.source.name.split("_metal_")[0].endswith("_run")
    got = verify.run_launch(launch, ins, sanitizer=sanitizer)
    staged = verify.run_launch(ck.bwd_key_launch("metal", N, C, K, ("float32",) * types, **kw), ins)
    for a, b in zip(got, staged):
        assert _rel(a, b) < 1e-6, _rel(a, b)
    assert np.array_equal(got[0], staged[0])  # only dl is summed otherwise
    if form in ("plain", "delta"):
        for a, want in zip(got, _bwd_key_ref(ins, 0.3)):
            assert _rel(a, want) < 1e-5, _rel(a, want)
    elif form == "uf":
        dr, dx, dfp, dl = got
        for a, want in zip((dr, dx, dfp.sum(1), dl), _bwd_key_factor_ref(ins, 0.3, -1.0)):
            assert _rel(a, want) < 1e-5, _rel(a, want)


def test_chunk_bwd_mma_layouts():
    """CUDA's 48 KiB: C = 64 at BW 32, the E tile holding both pair cotangents; Metal's 32 KiB: C = 32 (the staging
    area holds Γ first, so it is at least C × LD)."""
    assert cs.bwd_mma_layout("cuda", 64, 128, True) == {"BW": 32, "LD": 68, "LDB": 40, "XS": 7680}
    assert cs.bwd_mma_layout("cuda", 64, 128, False) == {"BW": 32, "LD": 68, "LDB": 40, "XS": 5120}
    assert cs.bwd_mma_layout("cuda", 64, 128, True, 16) == {"BW": 16, "LD": 68, "LDB": 24, "XS": 4608}
    assert cs.bwd_mma_layout("metal", 64, 128, True) is None and cs.bwd_mma_layout("metal", 64, 128, False) is None
    assert cs.bwd_mma_layout("metal", 32, 128, True) == {"BW": 32, "LD": 36, "LDB": 40, "XS": 3840}
    assert cs.bwd_mma_layout("metal", 16, 8, False) == {"BW": 8, "LD": 36, "LDB": 8, "XS": 576}
    assert cs.bwd_mma_layout("cuda", 128, 128, False) is None and cs.bwd_mma_layout("cuda", 64, 12, False) is None
    with pytest.raises(ValueError, match="threadgroup memory"):
        ck.bwd_mma_launch("metal", 1, 64, 128, ("float32",) * 3)


@pytest.mark.parametrize("dense,staging", [(False, False), (True, False), (True, True)])
def test_model_layout_without_gqa_only_where_asked(dense, staging, monkeypatch):
    """Without GQA (H = Hk) q, k, v are read in the model's layout only with ``Tuning.model_rows_dense`` (on in CUDA's
    measured table, off elsewhere); both ways end to end against the float64 reference, and as CUDA runs it, with the
    readout and UT transform staged by asynchronous copies."""
    pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True, model_rows=True,
                       model_rows_dense=dense, async_staging=staging)
    assert_close(compare(specs.BUILTINS["gated_delta_net"], 32, chunk=16, H=2, Hk=2, K=16, V=8, seed=2, tuning=t))
    assert any("_ml" in c for c in calls) == dense, calls
    assert any("_async" in c for c in calls) == staging, calls  # and with asynchronous staging (CUDA's defaults)


@pytest.mark.parametrize("name,dense", [("gated_delta_net", True), ("gated_delta_net", False), ("simple_gla", False)])
def test_products_in_the_backward_pass_end_to_end(monkeypatch, name, dense):
    """``Tuning.bwd_products``: the backward's fragment pass forms the products over values that read the states
    (the "_pv" kernels), end to end against the float64 reference: GDN with factor reads, in the model's layout (T a
    multiple of the chunk) or not (T = 40), and simple_gla (no delta rule); V = 8 values, K = 16."""
    pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True, model_rows=dense,
                       model_rows_dense=dense, bwd_products=True)
    assert_close(compare(specs.BUILTINS[name], 32 if dense else 40, chunk=16, H=2, Hk=2, K=16, V=8, seed=3, tuning=t))
    assert any(c.startswith("recgen_chunk_bwd_mma") and ("_ml_pv_metal" if dense else "_pv_metal") in c
               for c in calls), calls


@pytest.mark.parametrize("sanitizer", [None, "address", "thread"])
def test_model_layout_kernels_match_the_chunk_layout(sanitizer):
    """The five kernels' model-layout variants (``ml``: q, k, v as [B, T, heads, D], GQA's key head shared by H = 2
    value heads, two chunks a sequence, B = 2) give exactly what their chunk-layout forms give on the same values laid
    out as [B, H, T, D] with the key heads expanded (dq, dk per value head); plain, under ASan+UBSan and TSan."""
    rng = np.random.default_rng(11)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    B, H, HK, n, C, K, V = 2, 2, 1, 2, 16, 16, 8
    N, T, ml = B * H * n, n * C, (H, HK, n, True)
    q, k, v = f(B, T, HK, K), f(B, T, HK, K) / 4, f(B, T, H, V)

    def chunks(x):  # [B, T, HK|H, F] -> [B H n, C, F], key heads expanded
        return np.ascontiguousarray(np.repeat(x, H // x.shape[2], 2).transpose(0, 2, 1, 3)).reshape(N, C, -1)

    def by_head(x):  # [B, T, HK, K] -> [B H, n, C, K], the scans' operands
        return chunks(x).reshape(B * H, n, C, K)

    def model(x):  # [B H n, C, F] per value head -> [B, T, H, F]
        return x.reshape(B, H, T, -1).transpose(0, 2, 1, 3)

    uf, logd = rng.uniform(size=(N, C)).astype(np.float32), -f(N, C) ** 2
    fr = {"Uf": uf, "Bf": np.array([-1.0], np.float32), "logd": logd}
    ut = ({"U": chunks(k), "W": chunks(v)}, {"U": k, "W": v})
    ro = {"Uf": uf, "Z": f(N, C, V), "St": f(N, K, V), "logd": logd, "Rs": np.array([0.5], np.float32)}
    out = ({"R": chunks(q), "U": chunks(k)}, {"R": q, "U": k})
    bw = {k_: v_ for k_, v_ in _bwd_inputs(rng, N, C, K, True).items() if k_ not in ("R", "U", "Bt", "logd")}
    sc = {"S0": f(B * H, K, 32), "A": f(B * H, n, C, K), "X": f(B * H, n, C, 32), "g": np.full((B * H, n, 1), 0.5, np.float32),
          "Bq": rng.uniform(size=(B * H, n, C)).astype(np.float32)}
    rev = {"S0": sc["S0"], "Aq": sc["Bq"], "X": sc["X"], "Bm": f(B * H, n, C, K), "g": sc["g"], "Pb": f(B * H, n, C, 32),
           "Pq": sc["Bq"] * 0.7, "St": f(B * H, n, K, 32)}

    def scan(ml_, **terms):
        return ck.scan_launch("metal", ScanVariant(mma=True, ml=ml_ is not None, **terms), B * H, n, C, K, 32, 1, ml=ml_)

    cases = [(ck.ut_mma_launch("metal", N, C, K, V, uf=True), ck.ut_mma_launch("metal", N, C, K, V, uf=True, ml=ml),
              fr, ut, ()),
             (ck.out_mma_launch("metal", N, C, K, V, (H, n, "float32"), uf=True),
              ck.out_mma_launch("metal", N, C, K, V, (H, n, "float32"), uf=True, ml=ml), ro, out, ()),
             (ck.bwd_mma_launch("metal", N, C, K, ("float32",) * 2, 8, uf=True),
              ck.bwd_mma_launch("metal", N, C, K, ("float32",) * 2, 8, uf=True, ml=ml), bw | fr, out, (0, 1)),
             (scan(None, q=True), scan((H, HK, n, True), q=True), sc, ({"Bm": by_head(k)}, {"Bm": k}), ()),
             (scan(None, reverse=True, p=True, dg=True, aq=True, pq=True),
              scan((H, HK, n, True), reverse=True, p=True, dg=True, aq=True, pq=True), rev,
              ({"A": by_head(k), "Pa": by_head(q)}, {"A": k, "Pa": q}), ()),
             # hoisted (``ScanVariant.hoist``, the operands loaded at each step's start): the same sums exactly
             (scan(None, q=True), scan((H, HK, n, True), q=True, hoist=True), sc, ({"Bm": by_head(k)}, {"Bm": k}), ()),
             (scan(None, reverse=True, p=True, dg=True, aq=True, pq=True),
              scan((H, HK, n, True), reverse=True, p=True, dg=True, aq=True, pq=True, hoist=True), rev,
              ({"A": by_head(k), "Pa": by_head(q)}, {"A": k, "Pa": q}), ())]
    for plain, launch, common, (chunked, given), per_head in cases:
        want = verify.run_launch(plain, common | chunked)
        got = verify.run_launch(launch, common | given, sanitizer=sanitizer)
        for i, (a, b) in enumerate(zip(got, want)):
            b = model(b) if i in per_head else b
            assert np.array_equal(np.asarray(a).reshape(np.shape(b)), b), (launch.source.name, i)


@pytest.mark.parametrize("sanitizer", [None, "address", "thread"])
def test_key_model_layout_kernels_match_the_chunk_layout(sanitizer):
    """A key-vector decay's forward kernels in the model's layout (``ml``, GLA's: ``parallel._forward_key_model``):
    the decays' pass reading l [B, T, H, K] and u [B, T, HK, K], the whole-chunk pair reading r and u, the staged key
    readout reading r and w [B, T, H, V] (``zm``) give exactly what their chunk-layout forms give on the same values
    laid out as [B, H, T, D] with the key heads expanded (the pair reading the log-decays, forming e^l as the decays'
    pass forms the D its chunk-layout form reads); and the backward's (``Tuning.key_model_backward``): the decays'
    pass forming u ⊙ Q and r ⊙ P, the pair gradient copying r's and u's raw rows (and l's, forming e^l as the pair
    does: ``Tuning.pair_grad_logdecays``), the key tail reading r, u, l and
    writing dr, du, dl per value head in the model's layout (GQA's block map, H = 2 over HK = 1, two chunks a sequence,
    B = 2, strong decays); as CUDA runs them (``metal_ptx``), plain, under ASan+UBSan and TSan."""
    rng = np.random.default_rng(12)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    B, H, HK, n, C, K, V = 2, 2, 1, 2, 32, 32, 16
    N, T, ml = B * H * n, n * C, (H, HK, n, True)
    q, k, w = f(B, T, HK, K), f(B, T, HK, K) / 4, f(B, T, H, V)
    logd = -rng.uniform(0.0, 4.0, size=(B, T, H, K)).astype(np.float32)

    def chunks(x):  # [B, T, HK|H, F] -> [B H n, C, F], key heads expanded
        return np.ascontiguousarray(np.repeat(x, H // x.shape[2], 2).transpose(0, 2, 1, 3)).reshape(N, C, -1)

    yt = (H, n, "float32")
    ro = {"Mi": np.tril(f(N, C, C)) / 8, "St": f(N, K, V), "Pk": np.exp(np.cumsum(chunks(logd), 1)),
          "Rs": np.array([0.5], np.float32)}
    readout = [ck.out_async_launch("metal_ptx", N, C, K, V, ("float32",) * 4, yt, 128, key=True, **kw)
               for kw in ({}, {"ml": ml, "zm": True})]
    assert None not in readout
    grad = [ck.pair_launch("metal_ptx", N, C, K, False, True, mma=True, fold=True, scaled=True,
                           types=("float32",) * 2, ml=m, ld=ld) for m, ld in ((None, False), (ml, False), (ml, True))]
    tail = {"DRX": f(N, C, K), "DUX": f(N, C, K), "DRP": f(N, C, K), "DUQ": f(N, C, K), "DG": f(N, K),
            "Rs": np.array([0.5], np.float32)}
    cases = [(ck.decays_launch("metal_ptx", N, C, K, scaled=("Q",), q=False),
              ck.decays_launch("metal_ptx", N, C, K, scaled=("Q",), q=False, ml=ml), {},
              ({"l": chunks(logd), "X0": chunks(k)}, {"l": logd, "X0": k})),
             # the backward's (``Tuning.key_model_backward``): u ⊙ Q and r ⊙ P, no P nor Q
             (ck.decays_launch("metal_ptx", N, C, K, scaled=("Q", "P"), pq=False),
              ck.decays_launch("metal_ptx", N, C, K, scaled=("Q", "P"), pq=False, ml=ml), {},
              ({"l": chunks(logd), "X0": chunks(k), "X1": chunks(q)}, {"l": logd, "X0": k, "X1": q})),
             (grad[0], grad[1], {"dM": f(N, C, C) / 4, "Xsc": np.array([0.5], np.float32)},
              ({"X": chunks(q), "Y": chunks(k), "dk": "D"}, {"X": q, "Y": k, "dk": "D"})),
             # ... reading the log-decays as the model passes them (``Tuning.pair_grad_logdecays``)
             (grad[0], grad[2], {"dM": f(N, C, C) / 4, "Xsc": np.array([0.5], np.float32)},
              ({"X": chunks(q), "Y": chunks(k), "dk": "D"}, {"X": q, "Y": k, "dk": logd})),
             (ck.bwd_key_launch("metal_ptx", N, C, K, ("float32",) * 2),
              ck.bwd_key_launch("metal_ptx", N, C, K, ("float32",) * 2, ml=ml), tail,
              ({"R": chunks(q), "U": chunks(k), "L": chunks(logd)}, {"R": q, "U": k, "L": logd}), (0, 1, 2)),
             (ck.pair_launch("metal_ptx", N, C, K, False, mma=True, scaled=True, whole=True),
              ck.pair_launch("metal_ptx", N, C, K, False, mma=True, scaled=True, whole=True, ml=ml),
              {"Xsc": np.array([0.5], np.float32)},  # the model-layout pair forms the decays from l as it reads them
              ({"X": chunks(q), "Y": chunks(k), "dk": "D"}, {"X": q, "Y": k, "dk": logd})),
             (*readout, ro, ({"R": chunks(q), "Z": chunks(w)}, {"R": q, "Z": w}))]
    decays = {}  # the chunk-layout decays' outputs by name (D, P, G, Y0), as the decays' pass writes them

    def model(x):  # [B H n, C, K] per value head -> [B, T, H, K]
        return np.asarray(x).reshape(B, H, T, -1).transpose(0, 2, 1, 3)

    for plain, launch, common, (chunked, given), *per_head in cases:
        assert "_ml" in launch.source.name and "_ml" not in plain.source.name
        chunked, given = ({name: decays[x] if isinstance(x, str) else x for name, x in xs.items()}
                          for xs in (chunked, given))
        want = verify.run_launch(plain, common | chunked)
        decays = decays or dict(zip(plain.source.outputs, want))
        got = verify.run_launch(launch, common | given, sanitizer=sanitizer)
        for i, (a, b) in enumerate(zip(got, want)):
            b = model(b) if per_head and i in per_head[0] else b  # the key tail's outputs per value head, so laid out
            assert np.array_equal(np.asarray(a).reshape(np.shape(b)), b), (launch.source.name, i)
    # the tail writes dl in l's type where l is the model's 16-bit input: as rounding its float32 dl would
    import mlx.core as mx
    l16 = mx.array(logd).astype(mx.bfloat16)
    ins = tail | {"R": q, "U": k}
    want = verify.run_launch(ck.bwd_key_launch("metal_ptx", N, C, K, ("float32",) * 2, ml=ml),
                             ins | {"L": np.asarray(l16.astype(mx.float32))})
    launch = ck.bwd_key_launch("metal_ptx", N, C, K, ("float32",) * 2, ml=ml, dl_type="bfloat16")
    assert launch.outputs[-1][1] == "bfloat16"
    got = verify.run_launch(launch, ins | {"L": l16}, sanitizer=sanitizer)  # (returned as float32)
    assert np.array_equal(got[-1], np.asarray(mx.array(want[-1]).astype(mx.bfloat16).astype(mx.float32)))
    assert not np.array_equal(got[-1], want[-1])  # rounded indeed
    assert all(np.array_equal(a, b) for a, b in zip(got[:-1], want[:-1]))


@pytest.mark.parametrize("gqa,Hk", [("block", 2), ("tiled", 2), ("block", 4)])
def test_gla_reads_the_model_layout(gqa, Hk, monkeypatch):
    """GLA as CUDA's table runs it (``metal_ptx``: its lane layout, bf16 inputs, chunks of 32): with whole chunks
    (T = 64) the forward reads q, k, v and gk in the model's layout [B, T, heads, D] (``parallel._forward_key_model``:
    the decays' pass, the whole-chunk pair, the A-free wide scan's X (``xm``) and the staged key readout; GQA's key
    heads shared, H = 4 over Hk = 2, block and tiled, or none: ``Tuning.model_rows_dense``), the backward (with
    ``Tuning.key_model_backward`` off) copies them to the chunks' layout; end to end against the float64 reference
    (forward, final state, every gradient). With
    ``Tuning.key_model_backward`` the backward's decays' pass, pair gradient and key tail read q, k, gk so too and
    the tail writes dq, dk, dgk so, and with ``Tuning.pair_grad_logdecays`` the pair gradient forms its decays from
    gk: the same sums, so the same errors to the last bit."""
    pytest.importorskip("mlx.core")
    import mlx.core as mx
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call",
                        lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    table = tuning.resolve("gpu", "cuda", environ={})
    assert table.key_model_backward  # on in CUDA's measured table; off first here
    t = dataclasses.replace(table, dialect="metal_ptx", device="cpu", kernel_cache=None, replay_graphs=False,
                            compile=False, key_model_backward=False)
    rec = dataclasses.replace(specs.BUILTINS["gla"], gqa=gqa)
    err = compare(rec, 64, chunk=32, K=32, V=32, Hk=Hk, seed=4, tuning=t, in_dtype=mx.bfloat16)
    assert_close(err, 1e-2, 1e-2)
    kinds = {c.split("_metal")[0] for c in calls}
    assert {"recgen_chunk_decays_nod_noq_q_yt_ml", "recgen_chunk_pair_whole_xs_ml",
            "recgen_chunk_out_async_key_ml_zm_yt", "recgen_chunk_scan_mma_noa_ho_ml_s16_w16_wl_xm"} <= kinds, kinds
    assert not any("_ml" in c for c in kinds if "_rev" in c or "grad" in c or "bwd" in c), kinds
    calls.clear()
    t = dataclasses.replace(t, key_model_backward=True)
    assert compare(rec, 64, chunk=32, K=32, V=32, Hk=Hk, seed=4, tuning=t, in_dtype=mx.bfloat16) == err
    kinds = {c.split("_metal")[0] for c in calls}
    assert {"recgen_chunk_decays_g_q_p_yt_ml", "recgen_chunk_pair_grad_mma_fold_xs_async_ml",
            "recgen_chunk_bwd_key_ml"} <= kinds, kinds
    calls.clear()  # the pair gradient reading gk itself, the decays' pass writing no D
    t = dataclasses.replace(t, pair_grad_logdecays=True)
    assert compare(rec, 64, chunk=32, K=32, V=32, Hk=Hk, seed=4, tuning=t, in_dtype=mx.bfloat16) == err
    kinds = {c.split("_metal")[0] for c in calls}
    assert {"recgen_chunk_decays_nod_g_q_p_yt_ml", "recgen_chunk_pair_grad_mma_fold_xs_async_ml_ld"} <= kinds, kinds


def test_kda_factor_reads_keep_the_chunks_layout(monkeypatch):
    """KDA with factor reads (``Tuning.key_factor_reads``) at whole chunks, as CUDA's table runs it otherwise: its
    key-decay path reads the chunks' layout, so ``chunked._model_inputs`` hands it none (it was handed q, k, v as the
    model passes them, and failed reshaping them); end to end against the float64 reference, every gradient, float32
    and bf16 inputs (where the readout role scale·q, formed in bf16, cost dgk a digit: ``parallel._scaled``)."""
    pytest.importorskip("mlx.core")
    import mlx.core as mx
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call",
                        lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    t = dataclasses.replace(tuning.resolve("gpu", "cuda", environ={}), dialect="metal_ptx", device="cpu",
                            kernel_cache=None, replay_graphs=False, compile=False, key_factor_reads=True)
    assert_close(compare(specs.BUILTINS["kda"], 64, chunk=32, K=32, V=32, Hk=2, seed=4, tuning=t))
    assert_close(compare(specs.BUILTINS["kda"], 64, chunk=32, K=32, V=32, Hk=2, seed=4, tuning=t,
                         in_dtype=mx.bfloat16), 1e-2, 1e-2)
    assert "recgen_chunk_bwd_key_delta_uf" in {c.split("_metal")[0] for c in calls}  # the factor-read form ran
    assert not any("_ml" in c for c in calls), calls


@pytest.mark.parametrize("sanitizer", ["address", "thread"])
def test_chunk_kernels_under_sanitizers(sanitizer):
    """ASan+UBSan (bounds) and TSan (threadgroup-memory races across the staging barriers)."""
    rng = np.random.default_rng(7)
    BH, n, C, K, V = 1, 2, 16, 16, 36
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    ins = {"S0": f(BH, K, V), "A": f(BH, n, C, K), "X": f(BH, n, C, V), "Bm": f(BH, n, C, K),
           "g": np.full((BH, n, K), 0.5, np.float32), "E": f(BH, n, K, V)}
    for has_a, has_b in ((True, True), (False, True), (True, False)):
        sub = {k: v for k, v in ins.items() if (k != "A" or has_a) and (k != "Bm" or has_b)}
        outs = verify.run_launch(_scan("metal", BH, n, C, K, V, K, True, True, has_a, has_b), sub,
                                 sanitizer=sanitizer)
        if not has_a:
            outs[1] = ins["X"]
        for got, want in zip(outs, _scan_ref(*(ins[k] for k in ("S0", "A", "X", "Bm", "g", "E")), True, has_a, has_b)):
            assert _rel(got, want) < 1e-5
    V = 32  # the fragment scan: K = 16 (one group), C = 16, 2 column tiles per threadgroup
    sub = ins | {"S0": f(BH, K, V), "X": f(BH, n, C, V), "E": f(BH, n, K, V)}
    outs = verify.run_launch(_scan("metal", BH, n, C, K, V, K, True, True, mma=True), sub, sanitizer=sanitizer)
    for got, want in zip(outs, _scan_ref(*(sub[k] for k in ("S0", "A", "X", "Bm", "g", "E")), True)):
        assert _rel(got, want) < 1e-5
    ro = {"R": f(2, 32, 16), "U": f(2, 32, 16), "Z": f(2, 32, 8), "St": f(2, 16, 8), "logd": -f(2, 32) ** 2,
          "Rs": np.ones(1, np.float32)}
    outs = verify.run_launch(ck.out_mma_launch("metal", 2, 32, 16, 8), ro, sanitizer=sanitizer)  # 2 groups, 2 staged blocks
    for got, want in zip(outs, _out_ref(*(ro[k] for k in ("R", "U", "Z", "St", "logd")))):
        assert _rel(got, want) < 1e-5
    ut = {"Bt": -f(2, 32, 16) / 4, "U": f(2, 32, 16) / 4, "W": f(2, 32, 8), "logd": -f(2, 32) ** 2}
    outs = verify.run_launch(ck.ut_mma_launch("metal", 2, 32, 16, 8), ut, sanitizer=sanitizer)
    for got, want in zip(outs, _ut_ref(*(ut[k] for k in ("Bt", "U", "W", "logd")))):
        assert _rel(got, want) < 1e-5
    P = np.exp(np.cumsum(-f(2, 32, 16) ** 2, 1)).astype(np.float32)  # a key-vector decay's UT and readout kernels
    A = np.tril(f(2, 32, 32), -1) / 8
    outs = verify.run_launch(ck.ut_mma_launch("metal", 2, 32, 16, 8, key=True),
                             {"Ai": A, "W": ut["W"], "Bt": ut["Bt"], "Pk": P}, sanitizer=sanitizer)
    T = np.linalg.inv(np.eye(32) - A.astype(np.float64))
    for got, want in zip(outs, (T, T @ ut["W"], T @ (ut["Bt"] * P))):
        assert _rel(got, want) < 1e-5
    Bm = np.tril(f(2, 32, 32), -1) / 8  # and with B given: U = (T B) w
    outs = verify.run_launch(ck.ut_mma_launch("metal", 2, 32, 16, 8, key=True, tb=True),
                             {"Ai": A, "Bm": Bm, "W": ut["W"], "Bt": ut["Bt"], "Pk": P}, sanitizer=sanitizer)
    assert _rel(outs[1], T @ (Bm @ ut["W"])) < 1e-5
    M = np.tril(f(2, 32, 32))
    rank1 = {"R": ro["R"], "Mi": M, "Z": ro["Z"], "St": ro["St"], "M2": np.swapaxes(M, 1, 2) * np.tri(32), "Z2": ro["Z"],
             "Rs": ro["Rs"]}  # the general rank-1 core's readout: a second pair staged over the first
    (y,) = verify.run_launch(ck.out_mma_launch("metal", 2, 32, 16, 8, key=True, m2=True), rank1, sanitizer=sanitizer)
    want = ro["Rs"][0] * (ro["R"] @ ro["St"] + M @ ro["Z"] + rank1["M2"] @ ro["Z"])
    assert _rel(y, want) < 1e-5
    (y,) = verify.run_launch(ck.out_mma_launch("metal", 2, 32, 16, 8, key=True),
                             {"R": ro["R"], "Mi": M, "Z": ro["Z"], "St": ro["St"], "Pk": P, "Rs": ro["Rs"]},
                             sanitizer=sanitizer)
    assert _rel(y, (ro["R"].astype(np.float64) * P) @ ro["St"] + M @ ro["Z"]) < 1e-5
    kt = {"R": f(2, 8, 40), "U": f(2, 8, 40), "Bt": f(2, 8, 40), "L": -f(2, 8, 40) ** 2, "DRX": f(2, 8, 40),
          "DUX": f(2, 8, 40), "DBX": f(2, 8, 40), "DRP": f(2, 8, 40), "DUQ": f(2, 8, 40), "DR": f(2, 8, 40),
          "DG": f(2, 40), "Rs": np.ones(1, np.float32)}  # the key-decay tail: a partial second group of columns
    outs = verify.run_launch(ck.bwd_key_launch("metal", 2, 8, 40, ("float32",) * 3), kt, sanitizer=sanitizer)
    for got, want in zip(outs, _bwd_key_ref(kt, 1.0)):
        assert _rel(got, want) < 1e-5
    r1 = kt | {"A": f(2, 8, 40), "B": kt["Bt"], "DAX": f(2, 8, 40), "DAQ": f(2, 8, 40), "DBP": kt["DR"]}
    plain = verify.run_launch(ck.bwd_key_launch("metal", 2, 8, 40, ("float32",) * 4, True), r1)  # the rank-1 tail
    for got, want in zip(verify.run_launch(ck.bwd_key_launch("metal", 2, 8, 40, ("float32",) * 4, True), r1,
                                           sanitizer=sanitizer), plain):
        assert np.array_equal(got, want)
    for delta in (True, False):  # the backward's pass: 2 groups, 2 passes of 8 key columns
        bw = _bwd_inputs(rng, 2, 32, 16, delta)
        outs = verify.run_launch(ck.bwd_mma_launch("metal", 2, 32, 16, ("float32",) * (2 + delta), 8), bw,
                                 sanitizer=sanitizer)
        for got, want in zip(outs, _bwd_ref(bw, 0.3)):
            assert _rel(got, want) < 1e-5
    x, uf = _factor_inputs(rng, 2, 32, 16)  # factor reads: the UT transform, readout and backward's pass, as plain
    fr = {"U": x, "Uf": uf, "Bf": np.array([-1.0], np.float32)}
    bw = {k: v for k, v in _bwd_inputs(rng, 2, 32, 16, True).items() if k not in ("U", "Bt")}
    for launch, given in ((ck.ut_mma_launch("metal", 2, 32, 16, 8, uf=True), fr | {"W": ut["W"], "logd": ut["logd"]}),
                          (ck.out_mma_launch("metal", 2, 32, 16, 8, uf=True), ro | {"U": x, "Uf": uf}),
                          (ck.bwd_mma_launch("metal", 2, 32, 16, ("float32",) * 2, 8, uf=True), bw | fr),
                          (ck.ut_mma_launch("metal", 2, 32, 16, 8, key=True, uf=True),  # and a key-vector decay's
                           {"Ai": A, "W": ut["W"], "Bt": x, "Pk": P, "Bf": fr["Bf"]}),
                          (ck.bwd_key_launch("metal", 2, 8, 64, ("float32",) * 2, uf=True),
                           {"R": f(2, 8, 64), "U": f(2, 8, 64), "Uf": f(2, 8), "Bf": fr["Bf"], "L": -f(2, 8, 64) ** 2}
                           | {k: f(2, 8, 64) for k in ("DRX", "DUX", "DBX", "DRP", "DUQ", "DR")}
                           | {"DG": f(2, 64), "Rs": np.ones(1, np.float32)})):
        plain = verify.run_launch(launch, given)
        for got, want in zip(verify.run_launch(launch, given, sanitizer=sanitizer), plain):
            assert np.array_equal(got, want)
    L = np.tril(f(2, C, C), -1)
    (T,) = verify.run_launch(ck.inverse_launch("metal", 2, C), {"L": L}, sanitizer=sanitizer)
    assert _rel(T, np.linalg.inv(np.eye(C) - L.astype(np.float64))) < 1e-4
    pa = {"X": f(2, 48, 64), "Y": f(2, 48, 64), "dk": np.exp(-f(2, 48, 64) ** 2)}  # 3 blocks, 2 slabs
    (M,) = verify.run_launch(ck.pair_launch("metal", 2, 48, 64, True), pa, sanitizer=sanitizer)
    (Mf,) = verify.run_launch(ck.pair_launch("metal", 2, 48, 64, True, mma=True), pa, sanitizer=sanitizer)  # fragments
    assert _rel(Mf, M) < 1e-5
    assert _rel(M, _pair_ref(pa["X"], pa["Y"], pa["dk"], True)) < 1e-5
    dM = np.tril(f(2, 48, 48))
    dX, dY = verify.run_launch(ck.pair_launch("metal", 2, 48, 64, False, grad=True), pa | {"dM": dM},
                               sanitizer=sanitizer)
    assert np.isfinite(dX).all() and np.isfinite(dY).all()
    ip = float((dM * _pair_ref(pa["X"], pa["Y"], pa["dk"], False)).sum())  # <dM, M> is bilinear in X and Y
    assert abs(float((dX * pa["X"]).sum()) - ip) < 1e-4 * abs(ip) and abs(float((dY * pa["Y"]).sum()) - ip) < 1e-4 * abs(ip)
    dXf, dYf = verify.run_launch(ck.pair_launch("metal", 2, 48, 64, False, grad=True, mma=True), pa | {"dM": dM},
                                 sanitizer=sanitizer)  # the other blocks' parts on fragments
    assert _rel(dXf, dX) < 1e-5 and _rel(dYf, dY) < 1e-5
    dX, dX2, dY = verify.run_launch(ck.pair_launch("metal", 2, 48, 64, True, grad=True, dual=True),  # two operands
                                    pa | {"X2": pa["Y"], "dM": dM, "dM2": dM}, sanitizer=sanitizer)
    strict_ip = float((dM * _pair_ref(pa["X"], pa["Y"], pa["dk"], True)).sum())
    assert abs(float((dX * pa["X"]).sum()) - strict_ip) < 1e-4 * abs(ip) and np.isfinite(dX2).all()
    quad = pa | {"X2": f(2, 48, 64), "Yb": f(2, 48, 64)}  # RWKV-7's four pairs, on fragments, forward and gradient
    cots = {"dM": dM, "dM2": np.swapaxes(dM, 1, 2).copy(), "dMb": -dM, "dM2b": dM / 2}
    for grad, extra, fold in ((False, {}, False), (True, cots, False), (False, {}, True), (True, cots, True)):
        launch = ck.pair_launch("metal", 2, 48, 64, False, grad=grad, dual=True, quad=True, mma=True, fold=fold)
        plain = verify.run_launch(launch, quad | extra)
        for got, want in zip(verify.run_launch(launch, quad | extra, sanitizer=sanitizer), plain):
            assert np.array_equal(got, want)
    x, dphi = f(1, 2, 2, 16), f(1, 4, 2, 136)  # sympow's gradient: two value heads a key head, rows staged in turn
    (dx,) = verify.run_launch(ck.sympow_launch("metal", 1, 2, 4, 2, 16, True, grad=True), {"dphi": dphi, "x": x},
                              sanitizer=sanitizer)
    (phi,) = verify.run_launch(ck.sympow_launch("metal", 1, 2, 4, 2, 16, True), {"x": x}, sanitizer=sanitizer)
    ip = float((dphi * phi).sum())  # φ is quadratic in x: <dφ, φ(x)> = <dx, x> / 2
    assert abs(float((dx * x).sum()) / 2 - ip) < 1e-4 * abs(ip)


def _pair_decays(rng, N, C, K):
    """Per-token decays for the pair kernels' tests: down to e^-20, and about 1% exactly 0 (resets)."""
    dk = np.exp(-20 * rng.uniform(size=(N, C, K)) ** 3).astype(np.float32)
    dk[rng.uniform(size=dk.shape) < 0.01] = 0.0
    return dk


def _pair_ref(X, Y, dk, strict):
    """float64 M[t, s] = sum_i X_ti Y_si prod_{s<tau<=t} d_tau,i (s <= t or s < t)."""
    N, C, K = X.shape
    M = np.zeros((N, C, C))
    for t in range(C):
        for s in range(t if strict else t + 1):
            gam = np.prod(dk[:, s + 1:t + 1].astype(np.float64), axis=1)
            M[:, t, s] = (X[:, t] * Y[:, s] * gam).sum(-1)
    return M


def _pair_grads_ref(terms, Y, dk):
    """float64 (dX for each (X, dM, strict) of ``terms``, and dY summed over them) of the pairs M(X, Y): <dM, M(X, Y)>
    is linear in X and in Y, so each gradient is built from the reference column by column (dX[:, t, i] =
    <dM, M(e_ti, Y)>)."""
    N, C, K = Y.shape
    eye = np.eye(K)
    unit = lambda i: np.broadcast_to(eye[i], (N, C, K)) * 1.0  # noqa: E731
    dXs = [np.einsum("nts,ntsi->nti", dm, np.stack([_pair_ref(unit(i), Y, dk, lt) for i in range(K)], -1))
           for _, dm, lt in terms]
    dY = sum(np.einsum("nts,ntsi->nsi", dm, np.stack([_pair_ref(x, unit(i), dk, lt) for i in range(K)], -1))
             for x, dm, lt in terms)
    return dXs, dY


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("C,K", [(8, 64), (64, 32), (32, 64)])
def test_pair_kernels_match_numpy(strict, C, K):
    """Forward pair matrix and its two gradients (checked as the adjoint: <dM, M(X, Y)> is linear in
    X and in Y, so dX = ∂<dM, M>/∂X exactly), per-token decays down to e^-20 and some exactly 0 (resets): one
    block of rows (C = 8), and several (C = 32, 64: blocks of 16 rows, factors through the blocks between),
    K one slab or two."""
    rng = np.random.default_rng(11 + strict + C)
    N = 3
    X, Y, dM = (rng.normal(size=s).astype(np.float32) for s in ((N, C, K), (N, C, K), (N, C, C)))
    dk = _pair_decays(rng, N, C, K)
    (M,) = verify.run_launch(ck.pair_launch("metal", N, C, K, strict), {"X": X, "Y": Y, "dk": dk})
    assert _rel(M, _pair_ref(X, Y, dk, strict)) < 1e-5
    dX, dY = verify.run_launch(ck.pair_launch("metal", N, C, K, strict, grad=True), {"dM": dM, "X": X, "Y": Y, "dk": dk})
    (want_dX,), want_dY = _pair_grads_ref([(X, dM, strict)], Y, dk)
    assert _rel(dX, want_dX) < 1e-5
    assert _rel(dY, want_dY) < 1e-5



@pytest.mark.parametrize("frame,mma,fold", [("metal", False, False), ("metal", True, True), ("metal_ptx", True, True)])
def test_pair_kernels_scale_x_as_read(frame, mma, fold):
    """``scaled`` (GLA's readout scale): the pair of (c X, Y) and its gradients with X read times c, X in bf16 as
    the core hands r: equal to the unscaled kernels given c X in float32 (to rounding), and against float64; dX is
    that of the scaled X (it reads no X). Blocks between (C = 48), two slabs, decays down to e^-20 and some 0."""
    import mlx.core as mx

    rng = np.random.default_rng(5)
    N, C, K, c = 2, 48, 64, 0.125
    X = np.asarray(mx.array(rng.normal(size=(N, C, K)).astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))
    Y, dM = rng.normal(size=(N, C, K)).astype(np.float32), rng.normal(size=(N, C, C)).astype(np.float32)
    dk = _pair_decays(rng, N, C, K)
    xb = mx.array(X).astype(mx.bfloat16)  # exact: X was rounded to bf16 above
    sc = {"Xsc": np.array([c], np.float32)}
    (M,) = verify.run_launch(ck.pair_launch(frame, N, C, K, False, mma=mma, fold=fold, scaled=True),
                             {"X": xb, "Y": Y, "dk": dk} | sc)
    assert _rel(M, _pair_ref(c * X, Y, dk, False)) < 1e-5
    dX, dY = verify.run_launch(ck.pair_launch(frame, N, C, K, False, grad=True, mma=mma, fold=fold, scaled=True),
                               {"dM": dM, "X": xb, "Y": Y, "dk": dk} | sc)
    (want_dX,), want_dY = _pair_grads_ref([(c * X, dM, False)], Y, dk)
    assert _rel(dX, want_dX) < 1e-5 and _rel(dY, want_dY) < 1e-5
    plain = verify.run_launch(ck.pair_launch(frame, N, C, K, False, grad=True, mma=mma, fold=fold),
                              {"dM": dM, "X": c * X, "Y": Y, "dk": dk})
    assert np.array_equal(dX, plain[0]) and _rel(dY, plain[1]) < 1e-6


@pytest.mark.parametrize("C,K,strict", [(8, 32, True), (48, 64, True), (48, 64, False)])
def test_dual_pair_kernels_match_numpy(C, K, strict):
    """Two pairs of one Y in one pass: M = pair(X, Y) strictly below the diagonal (the delta rule's A) or with it
    (``strict`` off: the general rank-1 core's earlier b) and M2 = pair(X2, Y) with it, and their gradients (dY
    summed), element by element against float64."""
    rng = np.random.default_rng(C + strict)
    N = 2
    X, X2, Y = (rng.normal(size=(N, C, K)).astype(np.float32) for _ in range(3))
    dM, dM2 = (rng.normal(size=(N, C, C)).astype(np.float32) for _ in range(2))
    dk = _pair_decays(rng, N, C, K)
    first = strict
    M, M2 = verify.run_launch(ck.pair_launch("metal", N, C, K, first, dual=True), {"X": X, "X2": X2, "Y": Y, "dk": dk})
    assert _rel(M, _pair_ref(X, Y, dk, first)) < 1e-5 and _rel(M2, _pair_ref(X2, Y, dk, False)) < 1e-5
    dX, dX2, dY = verify.run_launch(ck.pair_launch("metal", N, C, K, first, grad=True, dual=True),
                                    {"dM": dM, "dM2": dM2, "X": X, "X2": X2, "Y": Y, "dk": dk})
    want_dXs, want_dY = _pair_grads_ref([(X, dM, first), (X2, dM2, False)], Y, dk)
    for got, want in zip((dX, dX2), want_dXs):
        assert _rel(got, want) < 1e-5
    assert _rel(dY, want_dY) < 1e-5


@pytest.mark.parametrize("frame,mma", [("metal", False), ("metal", True), ("metal_ptx", True)])
@pytest.mark.parametrize("C,K,strict", [(48, 64, False), (32, 32, True), (16, 32, False)])
def test_quad_pair_kernels_match_numpy(frame, mma, C, K, strict):
    """Four pairs in one pass (RWKV-7's b and r with a and u): M = pair(X, Y), M2 = pair(X2, Y), Mb = pair(X, Yb),
    M2b = pair(X2, Yb), the X pairs strictly below the diagonal where ``strict``, and their gradients, each summed
    over the pairs its operand is in; plain and with the other blocks on fragments in both lane layouts; blocks
    between (C = 48), one or two slabs, decays down to e^-20 and some exactly 0, against float64. (C = 64 passes
    Metal's 32 KiB: ``pair_supported`` says so, and CUDA runs it: tests/gpu.)"""
    rng = np.random.default_rng(C + K + strict)
    N = 2
    X, X2, Y, Yb = (rng.normal(size=(N, C, K)).astype(np.float32) for _ in range(4))
    dk = _pair_decays(rng, N, C, K)
    ins = {"X": X, "X2": X2, "Y": Y, "Yb": Yb, "dk": dk}
    launch = ck.pair_launch(frame, N, C, K, strict, dual=True, quad=True, mma=mma)
    assert "_quad" in launch.source.name and launch.source.name.split(f"_{frame}_")[0].endswith("_mma") == mma
    outs = verify.run_launch(launch, ins)
    wants = [_pair_ref(X, Y, dk, strict), _pair_ref(X2, Y, dk, False), _pair_ref(X, Yb, dk, strict),
             _pair_ref(X2, Yb, dk, False)]
    assert len(outs) == 4
    for got, want in zip(outs, wants):
        assert _rel(got, want) < 1e-5, _rel(got, want)
    dM, dM2, dMb, dM2b = (rng.normal(size=(N, C, C)).astype(np.float32) for _ in range(4))
    grads = verify.run_launch(ck.pair_launch(frame, N, C, K, strict, grad=True, dual=True, quad=True, mma=mma),
                              ins | {"dM": dM, "dM2": dM2, "dMb": dMb, "dM2b": dM2b})
    (dXa, dX2a), dYa = _pair_grads_ref([(X, dM, strict), (X2, dM2, False)], Y, dk)
    (dXb, dX2b), dYb = _pair_grads_ref([(X, dMb, strict), (X2, dM2b, False)], Yb, dk)
    assert len(grads) == 4
    for got, want in zip(grads, (dXa + dXb, dX2a + dX2b, dYa, dYb)):
        assert _rel(got, want) < 1e-5, _rel(got, want)
    assert cs.pair_supported("cuda", 64, 128, True, True) and not cs.pair_supported("metal", 64, 128, True, True)


@pytest.mark.parametrize("frame,mma,C,K,strict,dual,quad", [
    ("metal", False, 8, 64, True, False, False),    # one block of 8 rows: four row pairs
    ("metal", False, 4, 32, False, False, False),   # NT = 32 threads, two row pairs
    ("metal", False, 48, 64, False, True, False),   # three blocks, two slabs
    ("metal", True, 64, 32, True, True, False),
    ("metal", True, 48, 64, True, True, True),
    ("metal_ptx", True, 32, 32, False, True, True)])
def test_pair_kernels_with_folded_rows_match_numpy(frame, mma, C, K, strict, dual, quad):
    """``fold`` (``Tuning.pair_fold``): the own block's rows t and BS - 1 - t on one thread, their partial sums in
    one array (row t's s at s, the other row's at BS - s), reduced over 16 lanes; forward and gradients of single,
    dual and quad pairs, plain and on fragments in both lane layouts, decays down to e^-20 and some exactly 0,
    against float64; the gradients also equal the unfolded kernels' bit for bit (the same sums in the same order).
    An odd block of rows has no folded form."""
    rng = np.random.default_rng(C + K + strict + 2 * dual + 4 * quad)
    N = 2
    X, X2, Y, Yb = (rng.normal(size=(N, C, K)).astype(np.float32) for _ in range(4))
    dk = _pair_decays(rng, N, C, K)
    ins = {"X": X, "Y": Y, "dk": dk} | ({"X2": X2} if dual else {}) | ({"Yb": Yb} if quad else {})
    launch = ck.pair_launch(frame, N, C, K, strict, dual=dual, quad=quad, mma=mma, fold=True)
    assert launch.source.name.split(f"_{frame}_")[0].endswith("_fold")
    xs, ys = [(X, strict)] + ([(X2, False)] if dual else []), [Y] + ([Yb] if quad else [])
    outs = verify.run_launch(launch, ins)
    wants = [_pair_ref(x, y, dk, st) for y in ys for x, st in xs]
    assert len(outs) == len(wants)
    for got, want in zip(outs, wants):
        assert _rel(got, want) < 1e-5, _rel(got, want)
    names = [n for y in ("", "b")[:len(ys)] for n in ("dM" + y, "dM2" + y)[:len(xs)]]
    cots = {n: rng.normal(size=(N, C, C)).astype(np.float32) for n in names}
    grads = verify.run_launch(ck.pair_launch(frame, N, C, K, strict, grad=True, dual=dual, quad=quad, mma=mma,
                                             fold=True), ins | cots)
    plain = verify.run_launch(ck.pair_launch(frame, N, C, K, strict, grad=True, dual=dual, quad=quad, mma=mma),
                              ins | cots)
    per_y = [_pair_grads_ref([(x, cots[n], st) for (x, st), n in zip(xs, names[len(xs) * i:])], y, dk)
             for i, y in enumerate(ys)]
    want_dX = [sum(g[0][k] for g in per_y) for k in range(len(xs))]
    for got, want, same in zip(grads, want_dX + [g[1] for g in per_y], plain):
        assert _rel(got, want) < 1e-5, _rel(got, want)
        assert np.array_equal(got, same)
    with pytest.raises(ValueError, match="even block"):
        ck.pair_launch(frame, N, 5, K, strict, fold=True)


@pytest.mark.parametrize("frame,C,K,strict,dual,quad,scaled", [
    ("metal", 64, 64, False, False, False, True),      # GLA's: four blocks, slabs of 16 (Metal's memory)
    ("metal_ptx", 64, 128, True, False, False, False),  # slabs of 32 in CUDA's lane layout
    ("metal_ptx", 48, 32, False, True, False, False),   # three blocks, NT = 192: one item a group
    ("metal", 32, 64, True, True, False, False),        # KDA's dual pair
    ("metal_ptx", 64, 32, True, True, True, False),     # RWKV-7's quad, slabs of 16
    ("metal", 48, 64, True, True, True, False),         # ... of 8 in Metal's memory
    ("metal_ptx", 16, 32, True, False, False, True)])   # one block: no pairs of blocks, the carries alone
@pytest.mark.parametrize("sanitizer,halves", [(None, False), ("address", False), (None, True), ("address", True)])
def test_pair_kernels_a_whole_chunk_a_threadgroup(frame, C, K, strict, dual, quad, scaled, sanitizer, halves):
    """``whole`` (``Tuning.pair_whole``): the forward pairs with the whole chunk one threadgroup, each slab's X ⊙ pre
    and Y ⊙ suf staged once for every block and the blocks between applied as A's elements are read; single (X read
    times the readout's scale, in bf16), dual and quad, strict or not, both lane layouts, decays down to e^-20 and
    some exactly 0, plain and under ASan+UBSan, against float64; sizes without a layout are refused. ``halves``
    (``Tuning.pair_halves``): each block's second half against its first on fragments too, the carries within the
    halves."""
    import mlx.core as mx

    rng = np.random.default_rng(C + K + strict + 2 * dual + 4 * quad)
    N, c = 2, (0.125 if scaled else 1.0)
    X, X2, Y, Yb = (rng.normal(size=(N, C, K)).astype(np.float32) for _ in range(4))
    dk = _pair_decays(rng, N, C, K)
    Xin = X
    if scaled:  # r in bf16 as the core hands it
        X = np.asarray(mx.array(X).astype(mx.bfloat16).astype(mx.float32))
        Xin = mx.array(X).astype(mx.bfloat16)
    ins = ({"X": Xin, "Y": Y, "dk": dk} | ({"X2": X2} if dual else {}) | ({"Yb": Yb} if quad else {})
           | ({"Xsc": np.array([c], np.float32)} if scaled else {}))
    launch = ck.pair_launch(frame, N, C, K, strict, dual=dual, quad=quad, mma=True, scaled=scaled, whole=True,
                            halves=halves)
    assert launch.source.name.split(f"_{frame}_")[0].endswith("_whole" + ("_h8" if halves else "")
                                                              + ("_xs" if scaled else ""))
    outs = verify.run_launch(launch, ins, sanitizer=sanitizer)
    xs, ys = [(c * X, strict)] + ([(X2, False)] if dual else []), [Y] + ([Yb] if quad else [])
    wants = [_pair_ref(x, y, dk, st) for y in ys for x, st in xs]
    assert len(outs) == len(wants)
    for got, want in zip(outs, wants):
        assert _rel(got, want) < 1e-5, _rel(got, want)
    for bad in ((8, K), (80, K), (C, 12)):
        assert not cs.pair_whole_supported(frame, *bad)
        with pytest.raises(ValueError, match="chunk_pair_whole"):
            ck.pair_launch(frame, N, *bad, strict, mma=True, whole=True)
    with pytest.raises(ValueError, match="forward's form on fragments"):
        ck.pair_launch(frame, N, C, K, strict, grad=True, mma=True, whole=True)
    with pytest.raises(ValueError, match="halves are the whole-chunk form's"):
        ck.pair_launch(frame, N, C, K, strict, mma=True, halves=True)


def _pair_copy_inputs(rng, N, C, K, dual, quad, bf16, scale):
    """Inputs of the pair kernels that copy their slabs ahead: (float32 values of X, X2, Y, Yb as the kernels see
    them, the decays, the kernel's inputs for the form's operands (bf16 where ``bf16``), the operands' dtype names);
    ``scale``: X read times it (Xsc)."""
    import mlx.core as mx

    ops = {n: rng.normal(size=(N, C, K)).astype(np.float32) for n in ("X", "X2", "Y", "Yb")}
    if bf16:  # the values the kernels see: bf16 inputs widened
        ops = {n: np.asarray(mx.array(a).astype(mx.bfloat16).astype(mx.float32)) for n, a in ops.items()}
    names = ["X"] + (["X2"] if dual else []) + ["Y"] + (["Yb"] if quad else [])
    dk = _pair_decays(rng, N, C, K)
    ins = {n: (mx.array(ops[n]).astype(mx.bfloat16) if bf16 else ops[n]) for n in names} | {"dk": dk}
    ins |= {} if scale is None else {"Xsc": np.array([scale], np.float32)}
    return ops, dk, ins, ("bfloat16" if bf16 else "float32",) * len(names)


def test_pair_grad_parts_still_cut_the_generated_kernel():
    """``benchmarks/pair_grad_parts.py`` (where the pair gradient's time goes, docs/design.md) rewrites texts of the
    generated CUDA kernel: each variant still finds every text it replaces exactly once (the script raises where a
    template change moved one), and every variant is a different kernel with a name of its own."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("mlx.core")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "pair_grad_parts.py"
    spec = importlib.util.spec_from_file_location("pair_grad_parts", path)
    parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parts)
    launches = parts.launches(8)
    assert {"generated", "staging without loads", "loads first", "copied ahead"} <= set(launches)
    bodies = [launch.source.source for launch in launches.values()]
    assert len(set(bodies)) == len(bodies) and len({launch.source.name for launch in launches.values()}) == len(bodies)


@pytest.mark.parametrize("frame,C,K,strict,dual,quad,bf16,scaled,halves,sanitizer", [
    ("metal_ptx", 64, 64, False, False, False, True, True, False, None),     # GLA's: bf16 r and k, slabs of 16
    ("metal", 64, 48, False, False, False, True, True, True, "address"),      # ... halves, three slabs of 16
    ("metal_ptx", 32, 64, True, True, False, False, False, False, "address"),  # KDA's dual, float operands
    ("metal", 32, 32, True, True, True, True, False, False, None),            # RWKV-7's quad
    ("metal_ptx", 48, 64, False, False, False, False, False, False, "thread"),
    ("metal_ptx", 16, 32, True, False, False, True, False, False, None)])     # one block: the carries alone
def test_pair_whole_copies_its_slabs_ahead(frame, C, K, strict, dual, quad, bf16, scaled, halves, sanitizer):
    """``types`` with ``whole`` (``Tuning.pair_whole_async``): the whole-chunk pairs with each slab's raw rows (the
    chunk's decays and operands, each in its own type) copied to threadgroup memory a slab ahead and the walks
    reading them there (the carries still read X from its buffer): single (X read scaled), dual, quad, with halves,
    both lane layouts, decays down to e^-20 and some exactly 0, against float64 and the kernel reading its buffers;
    ASan+UBSan and TSan (a slab's copies start while the threads still multiply the last)."""
    pytest.importorskip("mlx.core")
    rng = np.random.default_rng(C + K + strict + 2 * dual + 4 * quad)
    N, c = 2, (0.125 if scaled else 1.0)
    ops, dk, ins, types = _pair_copy_inputs(rng, N, C, K, dual, quad, bf16, c if scaled else None)
    form = dict(dual=dual, quad=quad, mma=True, scaled=scaled, whole=True, halves=halves)
    launch = ck.pair_launch(frame, N, C, K, strict, types=types, **form)
    assert "_async" in launch.source.name
    got = verify.run_launch(launch, ins, sanitizer=sanitizer)
    xs, ys = [(c * ops["X"], strict)] + ([(ops["X2"], False)] if dual else []), [ops[y] for y in ["Y", "Yb"][:1 + quad]]
    wants = [_pair_ref(x, y, dk, st) for y in ys for x, st in xs]
    assert len(got) == len(wants)
    for a, want, b in zip(got, wants, verify.run_launch(ck.pair_launch(frame, N, C, K, strict, **form), ins)):
        assert _rel(a, want) < 1e-5 and _rel(a, b) < 1e-6, (_rel(a, want), _rel(a, b))
    with pytest.raises(ValueError, match="operand sizes"):
        ck.pair_launch(frame, N, C, K, strict, types=("float32",), **form | dict(dual=True))


@pytest.mark.parametrize("frame,mma,fold,C,K,strict,dual,quad,bf16,scaled", [
    ("metal_ptx", True, True, 64, 96, True, False, False, True, True),    # GLA's: bf16 r and k, three slabs
    ("metal", True, True, 48, 64, False, False, False, False, False),     # float operands, blocks between
    ("metal", False, False, 64, 64, True, False, False, True, False),     # plain own blocks and products
    ("metal_ptx", True, True, 32, 64, True, True, False, False, False),   # KDA's dual
    ("metal", True, False, 32, 96, False, True, True, True, False),       # RWKV-7's quad, bf16
    ("metal_ptx", True, True, 16, 32, False, False, False, True, True)])  # one block, one slab: no copy ahead
@pytest.mark.parametrize("sanitizer", [None, "address", "thread"])
def test_pair_gradients_copy_their_slabs_ahead(frame, mma, fold, C, K, strict, dual, quad, bf16, scaled, sanitizer):
    """``types`` (``Tuning.pair_grad_async``): the pair gradients with each slab's raw rows (decays and operands, in
    their own types) copied to threadgroup memory a slab ahead by 16-byte copies, the walks reading them there:
    the same sums in the same order as the kernels reading their buffers, so bit for bit their results, and against
    float64; single (X read scaled), dual, quad, on fragments and plain, folded or not, both lane layouts, one slab
    to three, decays down to e^-20 and some exactly 0, plain, under ASan+UBSan and under TSan (a slab's copies start
    while the threads still multiply the last); ``ld``: the log-decays copied in their type (bf16 or float32) and
    each decay formed as read, against float64 of those decays. Sizes past the threadgroup memory have no such
    layout; the forward has it only as the whole-chunk form (``test_pair_whole_copies_its_slabs_ahead``)."""
    pytest.importorskip("mlx.core")
    rng = np.random.default_rng(C + K + 2 * strict + 4 * dual + 8 * quad)
    N, c = 2, (0.125 if scaled else 1.0)
    ops, dk, ins, types = _pair_copy_inputs(rng, N, C, K, dual, quad, bf16, c if scaled else None)
    xs, ys = ["X", "X2"][:1 + dual], ["Y", "Yb"][:1 + quad]
    cots = {"dM" + x[1:] + y[1:]: rng.normal(size=(N, C, C)).astype(np.float32) for y in ys for x in xs}
    form = dict(grad=True, dual=dual, quad=quad, mma=mma, fold=fold, scaled=scaled)
    launch = ck.pair_launch(frame, N, C, K, strict, types=types, **form)
    assert launch.source.name.split(f"_{frame}_")[0].endswith("_async")
    got = verify.run_launch(launch, ins | cots, sanitizer=sanitizer)
    for a, b in zip(got, verify.run_launch(ck.pair_launch(frame, N, C, K, strict, **form), ins | cots)):
        assert np.array_equal(a, b)
    per_y = [_pair_grads_ref([((c if x == "X" else 1.0) * ops[x], cots["dM" + x[1:] + y[1:]], strict and x == "X")
                              for x in xs], ops[y], dk) for y in ys]
    wants = [sum(g[0][i] for g in per_y) for i in range(len(xs))] + [g[1] for g in per_y]
    for a, want in zip(got, wants):
        assert _rel(a, want) < 1e-5, _rel(a, want)
    if sanitizer != "thread":  # ``ld``: the log-decays' raw rows (bf16 with bf16 operands), each e^l formed as read
        import mlx.core as mx

        l = mx.array(np.log(np.maximum(dk, np.float32(1e-38))).astype(np.float32))  # exact zeros: e^-87.3
        l = l.astype(mx.bfloat16) if bf16 else l
        launch = ck.pair_launch(frame, N, C, K, strict, types=types, ld=True, dk_type=types[0], **form)
        assert launch.source.name.split(f"_{frame}_")[0].endswith("_async_ld")
        got = verify.run_launch(launch, ins | cots | {"dk": l}, sanitizer=sanitizer)
        seen = np.exp(np.asarray(l.astype(mx.float32), np.float64))  # the decays it forms
        per_y = [_pair_grads_ref([((c if x == "X" else 1.0) * ops[x], cots["dM" + x[1:] + y[1:]], strict and x == "X")
                                  for x in xs], ops[y], seen) for y in ys]
        wants = [sum(g[0][i] for g in per_y) for i in range(len(xs))] + [g[1] for g in per_y]
        for a, want in zip(got, wants):
            assert _rel(a, want) < 1e-5, _rel(a, want)
    assert not cs.pair_grad_async_supported(frame, 64, 128, True, True, (4, 4, 4, 4))  # past 32 KiB
    with pytest.raises(ValueError, match="threadgroup memory"):
        ck.pair_launch(frame, N, 64, 128, strict, grad=True, dual=True, quad=True, types=("float32",) * 4)
    with pytest.raises(ValueError, match="gradients' and the whole form's"):
        ck.pair_launch(frame, N, C, K, strict, types=types[:2])


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("C,K,strict,dual", [(64, 32, True, False), (48, 64, False, False), (64, 64, True, True),
                                             (16, 32, False, True)])
def test_pair_kernels_on_fragments_match_numpy(frame, C, K, strict, dual):
    """The pair kernels with the other blocks on fragment multiply-adds (``mma``), 16-token blocks: the forward's items
    (block, 8-column tile) round-robin over 4 SIMD groups (C = 64: 6 items of block 3, 2 a group), the gradients'
    products over the earlier (dX) or later (dY) blocks a column tile a group; one slab or two, single and dual;
    decays down to e^-20 and some exactly 0, against float64."""
    rng = np.random.default_rng(C + K + 2 * strict + dual)
    N = 2
    X, X2, Y = (rng.normal(size=(N, C, K)).astype(np.float32) for _ in range(3))
    dk = _pair_decays(rng, N, C, K)
    ins = {"X": X, "Y": Y, "dk": dk} | ({"X2": X2} if dual else {})
    launch = ck.pair_launch(frame, N, C, K, strict, dual=dual, mma=True)
    assert launch.source.name.split(f"_{frame}_")[0].endswith("_mma")
    outs = verify.run_launch(launch, ins)
    wants = [_pair_ref(X, Y, dk, strict)] + ([_pair_ref(X2, Y, dk, False)] if dual else [])
    assert len(outs) == len(wants)
    for got, want in zip(outs, wants):
        assert _rel(got, want) < 1e-5, _rel(got, want)
    # the gradients (the other blocks' parts on fragments), against the adjoint built from the reference
    dM, dM2 = (rng.normal(size=(N, C, C)).astype(np.float32) for _ in range(2))
    grads = verify.run_launch(ck.pair_launch(frame, N, C, K, strict, grad=True, dual=dual, mma=True),
                              ins | {"dM": dM} | ({"dM2": dM2} if dual else {}))
    want_dXs, want_dY = _pair_grads_ref([(X, dM, strict)] + ([(X2, dM2, False)] if dual else []), Y, dk)
    assert len(grads) == len(want_dXs) + 1
    for got, want in zip(grads, want_dXs):  # dX (and dX2)
        assert _rel(got, want) < 1e-5
    assert _rel(grads[-1], want_dY) < 1e-5
    with pytest.raises(ValueError, match="multiple of 16"):
        ck.pair_launch(frame, N, 8, K, strict, mma=True)


def test_the_feature_gradient_takes_at_most_the_tunings_simd_groups():
    """``Tuning.feature_jac_groups`` caps the gradient kernel's NG (the emulator cases above run NG = 1, 2, 4, 8)."""
    from recgen.codegen.chunk_sources import feature_mma_layout

    assert [feature_mma_layout("cuda", 256, 64, 65, g)["jac"]["NG"] for g in (8, 4, 2, 1)] == [8, 4, 2, 1]
    assert feature_mma_layout("cuda", 32, 64, 65, 8)["jac"]["NG"] == 2  # 16 NG divides C
    with tuning.override(feature_jac_groups=4):
        assert tuning.current().feature_jac_groups == 4


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("N,C,D,V,sanitizer", [(2, 32, 8, 5, None),     # 36 rows: one partial block of 64
                                               (1, 64, 12, 16, None),   # two blocks, four SIMD groups of tokens
                                               (3, 16, 5, 9, "address"),  # one group of tokens, V past a tile
                                               (1, 16, 4, 3, "thread"),
                                               (1, 128, 6, 7, None),    # the gradient's eight SIMD groups
                                               (1, 16, 64, 65, None)])  # Metal: one buffer of the state's block
def test_feature_product_kernels_match_numpy(frame, N, C, D, V, sanitizer):
    """φ(X)ᵀY and φ(X)S with φ formed as the fragments read it (features_states_mma.j2, features_out_mma.j2), and the
    gradient through them (features_jac_mma.j2), in each lane layout, against float64 numpy."""
    from recgen.spec.features import sympow, sympow_vjp

    rng = np.random.default_rng(D)
    X, Y = rng.standard_normal((N, C, D)).astype(np.float32), rng.standard_normal((N, C, V)).astype(np.float32)
    seq = (1, 2) if N > 1 else (1, 1)  # sequences of one chunk and two states (the second unread), or one each
    S_all = rng.standard_normal((N * seq[1], D * (D + 1) // 2, V)).astype(np.float32)
    S = S_all[::seq[1]]  # the states the chunks read
    phi = sympow(X.astype(np.float64))
    (dS,) = verify.run_launch(ck.feature_states_launch(frame, N, C, D, V), {"X": X, "Y": Y}, sanitizer=sanitizer)
    (Z,) = verify.run_launch(ck.feature_out_launch(frame, N, C, D, V, seq), {"X": X, "S": S_all}, sanitizer=sanitizer)
    (dX,) = verify.run_launch(ck.feature_jac_launch(frame, N, C, D, V, seq), {"X": X, "S": S_all, "Y": Y},
                              sanitizer=sanitizer)
    assert _rel(dS, np.einsum("ncf,ncv->nfv", phi, Y)) < 1e-5
    seqs = N if N > 1 else 1  # with a tail: sequences of one chunk (N > 1) or one of N, each its chunks then its T0
    T0 = rng.standard_normal((seqs, D * (D + 1) // 2, V)).astype(np.float32)
    (dS_t,) = verify.run_launch(ck.feature_states_launch(frame, N, C, D, V, seqs), {"X": X, "Y": Y, "T0": T0},
                                sanitizer=sanitizer)
    want = np.concatenate([dS.reshape(seqs, N // seqs, *dS.shape[1:]), T0[:, None]], axis=1).reshape(dS_t.shape)
    assert dS_t.shape == (N + seqs,) + dS.shape[1:] and _rel(dS_t, want) < 1e-6
    assert _rel(Z, np.einsum("ncf,nfv->ncv", phi, S)) < 1e-5
    want_dX = sympow_vjp(X.astype(np.float64), np.einsum("nfv,ncv->ncf", S.astype(np.float64), Y))
    assert _rel(dX, want_dX) < 1e-5
    (dX_rows,) = verify.run_launch(ck.feature_jac_launch(frame, N, C, D, V, seq, rows=True),
                                   {"X": X, "S": S_all, "Y": Y}, sanitizer=sanitizer)  # the same gradient by the rows of φ's pairs
    assert _rel(dX_rows, want_dX) < 1e-5


@pytest.mark.parametrize("frame", FRAGMENT_LAYOUTS)
@pytest.mark.parametrize("N,C,D,V,sanitizer", [(2, 32, 8, 5, None),      # 36 rows: one partial block of 128
                                               (1, 64, 16, 16, None),    # 136 rows: a whole block, then 8 rows
                                               (3, 16, 5, 9, "address"),  # V past a tile
                                               (1, 16, 4, 3, "thread")])
def test_the_states_and_readout_kernels_with_two_fragments_a_simd_group(frame, N, C, D, V, sanitizer):
    """φ(X)ᵀY with each SIMD group on two 16-row fragments (``Tuning.feature_states_fragments`` = 2: 128 rows a
    threadgroup), with and without a tail, and φ(X)S on two 16-token fragments (``feature_out_fragments``; one where
    C is 16), in each lane layout, against float64 numpy."""
    from recgen.spec.features import sympow

    rng = np.random.default_rng(D + N)
    X, Y = rng.standard_normal((N, C, D)).astype(np.float32), rng.standard_normal((N, C, V)).astype(np.float32)
    seq = (1, 2) if N > 1 else (1, 1)  # as test_feature_product_kernels_match_numpy's
    S_all = rng.standard_normal((N * seq[1], D * (D + 1) // 2, V)).astype(np.float32)
    out = ck.feature_out_launch(frame, N, C, D, V, seq, 2)
    assert dict(out.template)["TF"] == (2 if C >= 32 else 1)
    (Z,) = verify.run_launch(out, {"X": X, "S": S_all}, sanitizer=sanitizer)
    assert _rel(Z, np.einsum("ncf,nfv->ncv", sympow(X.astype(np.float64)), S_all[::seq[1]])) < 1e-5
    launch = ck.feature_states_launch(frame, N, C, D, V, 0, 2)
    assert dict(launch.template)["RF"] == 2 and launch.grid[0] == N * -(-(D * (D + 1) // 2) // 128) * 128
    (dS,) = verify.run_launch(launch, {"X": X, "Y": Y}, sanitizer=sanitizer)
    assert _rel(dS, np.einsum("ncf,ncv->nfv", sympow(X.astype(np.float64)), Y)) < 1e-5
    seqs = N if N > 1 else 1
    T0 = rng.standard_normal((seqs, D * (D + 1) // 2, V)).astype(np.float32)
    (dS_t,) = verify.run_launch(ck.feature_states_launch(frame, N, C, D, V, seqs, 2), {"X": X, "Y": Y, "T0": T0},
                                sanitizer=sanitizer)
    want = np.concatenate([dS.reshape(seqs, N // seqs, *dS.shape[1:]), T0[:, None]], axis=1).reshape(dS_t.shape)
    assert _rel(dS_t, want) < 1e-6


@pytest.mark.parametrize("jac_rows,fragments", [(False, 1), (True, 1), (False, 2)])  # the gradient through φ by
# the quadratic form or by rows; the states and readout kernels on one or two fragments a SIMD group
def test_power_retention_on_the_feature_product_kernels(monkeypatch, jac_rows, fragments):
    """The kernel-identity form with φ's products on the fragment kernels (``Tuning.feature_kernels``), end to end
    against the float64 reference: forward, final state, every gradient; GQA, a partial last chunk of 16."""
    pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True, feature_kernels=True,
                       feature_jac_rows=jac_rows, feature_states_fragments=fragments,
                       feature_out_fragments=fragments)
    assert_close(compare(specs.power_retention, 40, chunk=16, V=6, seed=5, tuning=t))
    kinds = {c.split("_metal")[0] for c in calls}
    jac = "recgen_chunk_feature_jac_rows" if jac_rows else "recgen_chunk_feature_jac"
    assert kinds == {"recgen_chunk_feature_states_tail", "recgen_chunk_feature_out", jac}, kinds


@pytest.mark.parametrize("D,gqa", [(4, "block"), (64, "block"), (16, "tile")])
def test_sympow_kernels_match_numpy(D, gqa):
    """φ = sympow(x) [B, T, Hk, D] -> [B, H, T, D(D + 1)/2] (value heads expanded: two a key head, in blocks or
    tiled) and its gradient (summed over the heads that share a key head) against recgen.spec.features (float64)."""
    from recgen.spec.features import sympow, sympow_vjp

    rng = np.random.default_rng(D)
    B, T, H, Hk = 2, 3, 4, 2
    heads = [h // 2 if gqa == "block" else h % Hk for h in range(H)]
    x = rng.normal(size=(B, T, Hk, D)).astype(np.float32)
    (phi,) = verify.run_launch(ck.sympow_launch("metal", B, T, H, Hk, D, gqa == "block"), {"x": x})
    want = sympow(x.astype(np.float64))[:, :, heads].transpose(0, 2, 1, 3)
    assert _rel(phi, want) < 1e-6
    dphi = rng.normal(size=phi.shape).astype(np.float32)
    (dx,) = verify.run_launch(ck.sympow_launch("metal", B, T, H, Hk, D, gqa == "block", grad=True),
                              {"dphi": dphi, "x": x})
    dwant = np.zeros(x.shape)
    for h, hk in enumerate(heads):
        dwant[:, :, hk] += sympow_vjp(x[:, :, hk].astype(np.float64), dphi[:, h].astype(np.float64))
    assert _rel(dx, dwant) < 1e-6


SMALL = (2, 16, 32, 32)  # n, C, K, V of the self-test at emulator-sized shapes (the GPU's: C = 64, K = V = 128)


@pytest.fixture
def fresh_probe():
    """A clean self-test cache."""
    probe = pr._probe  # the cached function itself (tests may monkeypatch the name)
    probe.cache_clear()
    pr.checked.cache_clear()
    pr._failed.clear()
    yield
    probe.cache_clear()
    pr.checked.cache_clear()
    pr._failed.clear()


@pytest.mark.parametrize("frame", ["base", "sympow", "tail", "scan", "mma", "pairs", "decode", "features", "ut16", "s16",
                                   "wide",
                                   "keyfactor", "rows", "hoist", "hoist_e", "async", "mix", "factors", "products"])
def test_probe_passes_where_kernels_run(frame, monkeypatch, fresh_probe):
    """The self-test builds, runs and checks tiny instances against float64 numpy: on the emulator they pass
    ("hoist" runs the hoisted scans in both directions; "s16" GDN's kernels and simple GLA's scans as CUDA's table
    runs them, hoisted and staged, with 16-bit states and with float32 ones)."""
    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    assert pr._probe("metal", frame, SMALL) is None
    assert pr.usable("metal", frame, SMALL)
    hoisted = {c.split("_metal")[0] for c in calls if "_ho" in c}
    gdn = {"recgen_chunk_scan_mma_q_ho", "recgen_chunk_scan_mma_aq_p_pq_ho_dg_rev"}
    assert hoisted == {"hoist": {"recgen_chunk_scan_mma_q_ho", "recgen_chunk_scan_mma_q_ho_rev"},
                       "hoist_e": {"recgen_chunk_scan_mma_nob_aq_e_ho_rev"},
                       "s16": gdn | {"recgen_chunk_scan_mma_q_ho_s16", "recgen_chunk_scan_mma_aq_p_pq_ho_dg_s16_rev",
                                     "recgen_chunk_scan_mma_noa_q_ho", "recgen_chunk_scan_mma_noa_q_ho_s16"},
                       "wide": {"recgen_chunk_scan_mma_q_ho_s16", "recgen_chunk_scan_mma_aq_p_pq_ho_dg_s16_rev",
                                "recgen_chunk_scan_mma_nob_aq_p_pq_ho_dg_s16_rev", "recgen_chunk_scan_mma_noa_q_ho_s16",
                                "recgen_chunk_scan_mma_noa_q_ho_ml_s16",
                                "recgen_chunk_scan_mma_nob_aq_p_pq_ho_dg_ml_s16_rev",
                                "recgen_chunk_scan_mma_noa_ho_s16",  # GLA's scans
                                "recgen_chunk_scan_mma_nob_p_pq_ho_dg_s16_rev"}
                       # Metal: the TF32 scans twice (GDN's, and simple GLA's reverse one)
                       }.get(frame, set())
    staged = {c.split("_metal")[0] for c in calls if "_async" in c}
    assert staged == {"async": {"recgen_chunk_out_async", "recgen_chunk_out_async_uf_ml_yt", "recgen_chunk_ut_async",
                                "recgen_chunk_out_async_key_yt",
                                "recgen_chunk_ut_async_uf_o16_ml"},
                      "s16": {"recgen_chunk_out_async_uf", "recgen_chunk_ut_async_uf_o16",
                              "recgen_chunk_ut_async_uf_o16_s16"},
                      "wide": {"recgen_chunk_out_async_uf", "recgen_chunk_ut_async_uf_o16_s16",
                               "recgen_chunk_out_async_yt", "recgen_chunk_out_async_ml_zm_yt"}}.get(frame, set())
    assert any("_pv_metal" in c for c in calls) == (frame == "products")
    # the forward pairs a whole chunk a threadgroup (single, dual; the quad form a block of rows), the gradients a
    # block of rows
    assert {c.split("_metal")[0] for c in calls if "_whole" in c} == {
        "pairs": {"recgen_chunk_pair_dual_whole", "recgen_chunk_pair_whole_xs"}
    }.get(frame, set())
    assert any("_s16_" in c for c in calls) == (frame in ("s16", "wide"))  # "wide": GDN's UT transform with a bf16 Tm


def test_probe_of_the_wide_multiply_add(monkeypatch, fresh_probe):
    """The "wide" frame in CUDA's lane layout (``metal_ptx``, which has the wide multiply-add; Metal has none, so
    there it runs the TF32 forms twice): the readout, the UT transform, both scans and the backward's pass forming its
    pair cotangents (``Tuning.bwd_scores``), and its products over values too, on it (the scans' and the pass's
    operands read 16 bytes a load; simple GLA's in the model's layout; GDN's forward scan also loading a step ahead)
    against their TF32 forms pass, and a wide kernel that lies fails."""
    calls = []
    monkeypatch.setattr(ck, "mlx_call",
                        lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    assert pr._probe("metal_ptx", "wide", SMALL) is None
    assert {c.split("_metal")[0] for c in calls} == {"recgen_chunk_out_async_uf", "recgen_chunk_out_async_uf_w16",
                                                     "recgen_chunk_ut_async_uf_o16_s16",
                                                     "recgen_chunk_ut_async_uf_o16_s16_w16",
                                                     "recgen_chunk_scan_mma_q_ho_s16",
                                                     "recgen_chunk_scan_mma_q_ho_s16_w16_wl",
                                                     "recgen_chunk_scan_mma_q_ho_s16_w16_wl_nx",
                                                     "recgen_chunk_scan_mma_aq_p_pq_ho_dg_s16_rev",
                                                     "recgen_chunk_scan_mma_aq_p_pq_ho_dg_s16_w16_wl_rev",
                                                     "recgen_chunk_scan_mma_nob_aq_p_pq_ho_dg_s16_rev",
                                                     "recgen_chunk_scan_mma_nob_aq_p_pq_ho_dg_s16_w16_wl_rev",
                                                     "recgen_chunk_scan_mma_noa_q_ho_s16",
                                                     "recgen_chunk_scan_mma_noa_q_ho_s16_w16_wl",
                                                     # GLA's (u ⊙ Q given, a decay per key; r ⊙ P too in reverse)
                                                     "recgen_chunk_scan_mma_noa_ho_s16",
                                                     "recgen_chunk_scan_mma_noa_ho_s16_w16_wl",
                                                     "recgen_chunk_scan_mma_nob_p_pq_ho_dg_s16_rev",
                                                     "recgen_chunk_scan_mma_nob_p_pq_ho_dg_s16_w16_wl_rev",
                                                     "recgen_chunk_scan_mma_noa_q_ho_ml_s16_w16_wl_xm",
                                                     "recgen_chunk_out_async_ml_zm_yt_w16",
                                                     "recgen_chunk_out_async_yt",
                                                     "recgen_chunk_bwd_mma_delta_uf",
                                                     "recgen_chunk_bwd_mma_delta_uf_sc_wl",
                                                     "recgen_chunk_bwd_mma_delta_uf_pv",
                                                     "recgen_chunk_bwd_mma_delta_uf_pv_sc_wl",
                                                     # simple GLA's backward reading q and k in the model's layout
                                                     "recgen_chunk_scan_mma_nob_aq_p_pq_ho_dg_ml_s16_w16_wl_rev",
                                                     "recgen_chunk_bwd_mma_ml_pv_sc_wl", "recgen_chunk_bwd_mma"}
    pr._probe.cache_clear()

    for wide in ("_w16", "_sc"):  # a wide kernel's first output doubled
        def lying(launch, *a):
            out = _emulated_call(launch, *a)
            return [out[0] * 2, *out[1:]] if wide in launch.source.name else out

        pr._probe.cache_clear()
        monkeypatch.setattr(ck, "mlx_call", lying)
        assert "off by" in pr._probe("metal_ptx", "wide", SMALL)


def test_probe_rejects_kernels_that_fail_or_lie(monkeypatch, fresh_probe):
    """A kernel that fails to build (the error is kept) or returns wrong numbers is not used, with one warning."""
    def broken(launch, *a):
        raise RuntimeError("nvrtc: error: mma.sync needs sm_80")

    monkeypatch.setattr(ck, "mlx_call", broken)
    with pytest.warns(RuntimeWarning, match="fragment scan .* failed a self-test .*sm_80"):
        assert not pr.usable("cuda", "mma", SMALL)
    assert not pr.usable("cuda", "mma", SMALL)  # cached; warned once
    mx = pytest.importorskip("mlx.core")
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: [mx.zeros(s) for s, _ in launch.outputs])
    assert "off by" in pr._probe("cuda", "base", SMALL)


def test_the_probe_keeps_its_kernels_where_the_tuning_keeps_them(monkeypatch, fresh_probe):
    """A frame's kernels are the model's (the common case's constants), so the self-test compiles them into the
    tuning's kernel cache too: ``checked`` hands its directory to each probe, and the probe to each kernel call."""
    caches, probes = [], []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, dialect, user, extra, debug=False, kernel_cache="":
                        caches.append(kernel_cache) or _emulated_call(launch, dialect, user, extra, debug))
    assert pr._probe("metal", "sympow", SMALL, "/kept") is None and caches == ["/kept"]
    monkeypatch.setattr(pr, "_probe", lambda dialect, f, sizes=pr.PROBE, kernel_cache="": probes.append(kernel_cache))
    prefetched = []
    monkeypatch.setattr(pr, "prefetch_frames", lambda *a: prefetched.append(a))
    pr.checked(tuning.resolve("gpu", "cuda", environ={"RECGEN_KERNEL_CACHE": "/kept"}), pr.PROBE, pr.FEATURE_FRAMES)
    assert probes and set(probes) == {"/kept"}
    # first, the frames' kernels made side by side (test_kernel_binary), those the probes then run: every feature
    # frame is on in CUDA's table
    assert prefetched == [("cuda", pr.FEATURE_FRAMES, pr.PROBE, "/kept")]
    pr.checked(tuning.resolve("gpu", "cuda", environ={"RECGEN_KERNEL_CACHE": "/kept"}), pr.PROBE, pr.CHUNK_FRAMES)
    # what CUDA's table asks for: "mma" only where "hoist" fails, "scan" never, KDA's factor reads and the product-free
    # scans' hoisting not (off), the backward's staged products not (its products are wide: "wide" checks them); the
    # UT transform's 16-bit outputs and 16-bit states, the wide multiply-add (on)
    assert prefetched[1][1] == pr.CHUNK_FRAMES - {"scan", "mma", "keyfactor", "hoist_e", "products"}, \
        prefetched[1][1]
    pr.checked(tuning.resolve("gpu", "cuda", environ={"RECGEN_KERNEL_CACHE": "off"}))
    assert len(prefetched) == 2  # no cache, nothing made ahead


def failing_probe(*frames):
    """A stand-in for ``probe._probe`` under which ``frames`` fail their self-test and the others pass."""
    return lambda dialect, frame, sizes=pr.PROBE, kernel_cache="": "RuntimeError: no" if frame in frames else None


def test_checked_tuning_follows_the_probe(monkeypatch, fresh_probe):
    """On a GPU the dispatcher's tuning keeps the measured table's choices unless their self-test fails there:
    a failing fragment frame falls back to the FMA scan, a failing base frame to MLX ops, each with a warning."""
    t = tuning.resolve("gpu", "cuda", environ={})
    monkeypatch.setattr(pr, "_probe", lambda dialect, frame, sizes=pr.PROBE, kernel_cache="": None)
    assert pr.checked(t) == t and t.chunk_kernels and t.mma_scan
    pr.checked.cache_clear()
    failing = ("hoist", "mma")  # the fragment kernels, with hoisted scans (as CUDA's table runs them) and without
    monkeypatch.setattr(pr, "_probe", failing_probe(*failing))
    with pytest.warns(RuntimeWarning, match="fragment scan"):
        c = pr.checked(t)
    assert c.chunk_kernels and not c.mma_scan and not c.scan_hoist  # the FMA scan passed
    pr.checked.cache_clear()
    monkeypatch.setattr(pr, "_probe", failing_probe("tail"))
    with pytest.warns(RuntimeWarning, match="fused backward"):
        c = pr.checked(t)
    assert c.chunk_kernels and c.mma_scan and not c.fused_bwd  # only the backward's tail falls back
    pr.checked.cache_clear()
    pr._failed.clear()
    monkeypatch.setattr(pr, "_probe", failing_probe("base"))
    with pytest.warns(RuntimeWarning, match="chunk kernels"):
        assert not pr.checked(t).chunk_kernels
    # the environment states an intention (Metal has no measurement); the self-test still applies to it
    assert tuning.resolve("gpu", "metal", environ={"RECGEN_CHUNK_KERNELS": "1"}).chunk_kernels


@pytest.mark.parametrize("frame,variable,flag,warning", [
    ("pairs", "RECGEN_MMA_PAIRS", "mma_pairs", "pair kernels on fragments"),
    ("ut16", "RECGEN_UT_16BIT", "ut_16bit", "16-bit outputs"),
    ("s16", "RECGEN_STATES_16BIT", "states_16bit", "16-bit chunk states"),
    ("wide", "RECGEN_WIDE_FRAGMENTS,RECGEN_BWD_SCORES", "wide_fragments", "wide multiply-add"),
    ("keyfactor", "RECGEN_KEY_FACTOR_READS", "key_factor_reads", "KDA's factor reads"),
    ("rows", "RECGEN_MODEL_ROWS", "model_rows", "model-layout reads"),
    ("decode", "RECGEN_FEATURE_DECODE", "feature_decode", "feature decode"),
    ("features", "RECGEN_FEATURE_KERNELS", "feature_kernels", "feature product"),
    ("hoist", "RECGEN_SCAN_HOIST,RECGEN_REVERSE_SCAN_HOIST", "scan_hoist", "hoisted loads"),
    ("hoist_e", "RECGEN_SCAN_HOIST_E", "scan_hoist_e", "product-free scans' hoisted")])
def test_an_opt_in_frame_that_fails_turns_only_itself_off(frame, variable, flag, warning, monkeypatch, fresh_probe):
    """A frame probed only where the tuning asks for it (CUDA's measured defaults or the environment): not asked, it
    stays off unprobed; asked and failing, only its own choice falls back (with a warning), the chunk kernels and
    the fragment scan stay ("hoist" stands for "mma" where hoisting is asked for: "mma" is then probed only after it
    fails)."""
    probed = []
    monkeypatch.setattr(pr, "_probe", lambda dialect, f, sizes=pr.PROBE, kernel_cache="": probed.append(f) or
                        ("RuntimeError: no" if f == frame else None))
    assert getattr(pr.checked(tuning.resolve("gpu", "cuda", environ=dict.fromkeys(variable.split(","), "0"))),
                   flag) is False
    assert frame not in probed
    probed.clear()
    with pytest.warns(RuntimeWarning, match=warning):
        c = pr.checked(tuning.resolve("gpu", "cuda", environ=dict.fromkeys(variable.split(","), "1")))
    assert c.chunk_kernels and c.mma_scan and not getattr(c, flag)
    assert not any(getattr(c, f) for f in pr.FRAME_RIDERS.get(frame, ()))  # its wide loads go off with it
    if frame == "hoist":
        assert probed.index("hoist") < probed.index("mma")


def test_hoisted_kernels_are_the_ones_probed(monkeypatch, fresh_probe):
    """Where the tuning hoists the scans (CUDA's table), the self-test runs the fragment kernels as the model then
    runs them ("hoist") and no unhoisted scan ("mma"), so a first call compiles nothing it will not use."""
    probed = []
    monkeypatch.setattr(pr, "_probe", lambda dialect, f, sizes=pr.PROBE, kernel_cache="": probed.append(f) or None)
    c = pr.checked(tuning.resolve("gpu", "cuda", environ={}))
    assert c.scan_hoist and c.reverse_scan_hoist and c.mma_scan
    assert "hoist" in probed and "mma" not in probed, probed


def test_a_spec_probes_only_the_frames_its_path_runs(monkeypatch, fresh_probe):
    """MLX keeps no compiled custom kernel across processes, so every frame probed costs its compile in each new
    process: power retention (kernel identity) probes φ's frames and no chunk scan; GDN the chunk algebra's and none
    of φ's nor a key-vector decay's (KDA's are probed for KDA). A frame left unprobed leaves its choice as the tuning
    has it; the dispatcher passes the spec's frames."""
    from recgen.spec.analysis import analyze

    probed = []
    monkeypatch.setattr(pr, "_probe", lambda dialect, f, sizes=pr.PROBE, kernel_cache="": probed.append(f) or None)
    t = tuning.resolve("gpu", "cuda", environ={})
    assert t.feature_identity and t.feature_kernels and t.chunk_kernels
    power, gdn = analyze(specs.power_retention), analyze(specs.gated_delta_net)
    assert pr.frames_for(power, t) == pr.FEATURE_FRAMES
    # a scalar decay runs none of a key-vector decay's pair kernels, factor reads or backward tails
    assert pr.frames_for(gdn, t) == pr.CHUNK_FRAMES - {"pairs", "keyfactor", "tail"}
    for key in (specs.kda, specs.gla, specs.rwkv7):
        assert pr.frames_for(analyze(key), t) == pr.CHUNK_FRAMES, key.name
    # without the kernel identity power retention's φ is formed in memory and runs the chunk algebra
    assert pr.frames_for(power, dataclasses.replace(t, feature_identity=False)) == pr.CHUNK_FRAMES - pr.KEY_DECAY_FRAMES
    assert pr.checked_for(power, t) == t
    assert set(probed) <= pr.FEATURE_FRAMES and {"sympow", "features", "scores"} <= set(probed), probed
    probed.clear()
    assert pr.checked_for(gdn, t) == t
    assert set(probed) <= pr.CHUNK_FRAMES - pr.KEY_DECAY_FRAMES and {"base", "hoist"} <= set(probed), probed
    probed.clear()
    assert pr.checked_for(analyze(specs.kda), t) == t and "pairs" in probed, probed
    # a failing feature frame turns off only φ's choice, and only where power retention asked
    pr.checked.cache_clear()
    monkeypatch.setattr(pr, "_probe", failing_probe("features"))
    assert pr.checked_for(gdn, t).feature_kernels
    with pytest.warns(RuntimeWarning, match="feature product"):
        assert not pr.checked_for(power, t).feature_kernels


def test_probe_inside_a_transformation(monkeypatch, fresh_probe):
    """Inside mx.compile the self-test still runs (its arrays do not depend on the traced inputs); where
    MLX refuses to evaluate during a transformation, it assumes a pass and caches nothing."""
    mx = pytest.importorskip("mlx.core")
    monkeypatch.setattr(ck, "mlx_call", _emulated_call)
    seen = []

    def f(x):
        seen.append(pr.usable("metal", "mma", SMALL))
        return x * 2

    mx.eval(mx.compile(f)(mx.array(1.0)))
    assert seen == [True] and pr._probe.cache_info().currsize == 1
    pr._probe.cache_clear()

    def refuse(launch, *a):
        raise ValueError("[eval] Attempting to eval an array during function transformations like compile")

    monkeypatch.setattr(ck, "mlx_call", refuse)
    assert pr.usable("cuda", "mma", SMALL) and pr._probe.cache_info().currsize == 0 and not pr._failed


@pytest.mark.parametrize("roles16", ["1", None, "0"])
@pytest.mark.parametrize("name,typed,bare", [
    ("gated_delta_net", {"ut_mma_uf": {"U", "W"}, "scan_mma_q": {"Bm"}, "out_mma_uf_yt": {"R", "U"},
                         "scan_mma_aq_p_pq_dg_rev": {"A", "Pa"}, "bwd_mma_delta_uf": {"R", "U"}},
     {"ut_mma_uf": {"U", "W"}, "scan_mma_q": {"Bm"}, "out_mma_uf_yt": {"R", "U"},
      "scan_mma_aq_p_pq_dg_rev": {"A", "Pa"}, "bwd_mma_delta_uf": {"R", "U"}}),
    ("gated_delta_net/ut16", {"ut_mma_uf_o16": {"U", "W"}, "scan_mma_q": {"A", "X", "Bm"}, "out_mma_uf_yt": {"R", "U"},
                              "scan_mma_aq_p_pq_dg_rev": {"A", "Bm", "Pa"}, "bwd_mma_delta_uf": {"R", "U"}},
     {"ut_mma_uf_o16": {"U", "W"}, "scan_mma_q": {"A", "X", "Bm"}, "out_mma_uf_yt": {"R", "U"},
      "scan_mma_aq_p_pq_dg_rev": {"A", "Bm", "Pa"}, "bwd_mma_delta_uf": {"R", "U"}}),
    ("gated_delta_net/s16", {"ut_mma_uf_o16_s16": {"U", "W"}, "scan_mma_q_s16": {"A", "X", "Bm"},
                             "out_mma_uf_yt_s16": {"R", "U", "Z", "St"},
                             "scan_mma_aq_p_pq_dg_s16_rev": {"A", "X", "Bm", "Pa", "Pb", "St"},
                             "bwd_mma_delta_uf": {"R", "U", "dMA", "dMR", "DUQ", "DRP", "DR"}},
     {"ut_mma_uf_o16_s16": {"U", "W"}, "scan_mma_q_s16": {"A", "X", "Bm"}, "out_mma_uf_yt_s16": {"R", "U", "Z", "St"},
      "scan_mma_aq_p_pq_dg_s16_rev": {"A", "X", "Bm", "Pa", "Pb", "St"},
      "bwd_mma_delta_uf": {"R", "U", "dMA", "dMR", "DUQ", "DRP", "DR"}}),
    ("gated_delta_net/formed", {"ut_mma": {"Bt", "U", "W"}, "scan_mma_q": {"Bm"}, "out_mma_yt": {"R", "U"},
                         "scan_mma_aq_p_pq_dg_rev": {"A", "Pa"}, "bwd_mma_delta": {"R", "U", "Bt"}},
     {"ut_mma": {"Bt", "W"}, "out_mma_yt": {"R"}, "scan_mma_aq_p_pq_dg_rev": {"Pa"}, "bwd_mma_delta": {"R", "Bt"}}),
    ("simple_gla/s16", {"scan_mma_noa_q_s16": {"X", "Bm"}, "out_mma_yt_s16": {"R", "U", "Z", "St"},
                        "scan_mma_nob_aq_e_s16_rev": {"A", "X"}, "bwd_mma": {"R", "U", "dMR", "DUQ", "DRP"}},
     {"scan_mma_noa_q_s16": {"X", "Bm"}, "out_mma_yt_s16": {"R", "U", "Z", "St"},
      "scan_mma_nob_aq_e_s16_rev": {"A", "X"}, "bwd_mma": {"R", "U", "dMR", "DUQ", "DRP"}}),
    ("simple_gla", {"scan_mma_noa_q": {"X", "Bm"}, "out_mma_yt": {"R", "U", "Z"}, "scan_mma_nob_aq_e_rev": {"A"},
                    "bwd_mma": {"R", "U"}},
     {"scan_mma_noa_q": {"X", "Bm"}, "out_mma_yt": {"R", "U", "Z"}, "scan_mma_nob_aq_e_rev": {"A"},
      "bwd_mma": {"R", "U"}})])
def test_chunked_core_takes_bf16_roles_on_the_fragment_frames(name, typed, bare, roles16, monkeypatch):
    """bf16 inputs on the fragment frames, the readout writing o in bf16 in the model's layout, the reverse scan
    (u and r with their row scales) and the backward's fragment pass reading the 16-bit roles, the pass writing
    their gradients in bf16. With
    ``RECGEN_16BIT_ROLES=1`` the roles reach the fused kernels in bf16 (``parallel.role_dtype``; they convert
    on load) and MLX's products and the backward in float32; by default only the roles exact in bf16: inputs
    verbatim (GDN's w = v, simple GLA's u = k and w = v), GDN's b̃ = -k, and q for r = scale·q (the readout
    kernel applies the scale, ``chunked._readout_role``); with ``=0`` every kernel reads
    float32 (asserted per kernel buffer). End to end
    against the float64 reference at the same bf16-rounded inputs: forward, final state and every gradient
    within 1e-2 (o and the input gradients are rounded to bf16, and with 16-bit roles r = q / sqrt(K) and
    b̃ = β k once; a wrong conversion or a product in bf16 gives O(1) or ~1e-1). GDN with factor reads (the
    default) hands every kernel k itself, bf16 unless ``=0``; "/formed": with them off, the roles formed first;
    "/ut16": the UT transform writes U and W in bf16 too (``Tuning.ut_16bit``), which both scans read; "/s16": and
    T, the states, Z, M, dS_next and dZ (``Tuning.states_16bit``), the backward's MLX products then in bf16 too
    (simple GLA's: its states and M, dS_next and dZ)."""
    mx = pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare

    name, _, variant = name.partition("/")
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True,
                       roles_16bit={"1": "all", None: "bare", "0": "none"}[roles16], factor_reads=variant != "formed",
                       ut_16bit=variant in ("ut16", "s16"), states_16bit=variant == "s16")
    seen = _emulate_noting_bf16(monkeypatch)
    assert_close(compare(specs.BUILTINS[name], 40, chunk=16, K=16, V=8, seed=4, in_dtype=mx.bfloat16, tuning=t),
                 1e-2, 1e-2)
    assert seen == {"1": typed, None: bare, "0": {}}[roles16], seen


def test_role_dtype_is_16_bit_only_where_fused_kernels_read_the_roles():
    mx = pytest.importorskip("mlx.core")
    from recgen.chunked import parallel

    bf, f32 = mx.bfloat16, mx.float32
    cuda = tuning.resolve("gpu", "cuda", environ={})  # fragment frames on; only bare roles in 16 bits
    every = tuning.with_changes(cuda, roles_16bit="all")
    assert parallel.role_dtype(cuda, False, True, 64, 128, 128, bf, f32) == f32      # off by default (backward cost)
    assert parallel.role_dtype(cuda, False, True, 64, 128, 128, bf, f32, bare=True) == bf  # but an input verbatim: exact
    assert parallel.role_dtype(None, False, True, 64, 128, 128, bf, f32, bare=True) == f32
    none = tuning.with_changes(cuda, roles_16bit="none")
    assert parallel.role_dtype(none, False, True, 64, 128, 128, bf, f32, bare=True) == f32
    assert parallel.role_dtype(every, False, True, 64, 128, 128, bf, f32) == bf
    assert parallel.role_dtype(every, False, False, 64, 128, 128, mx.float16, f32) == mx.float16
    assert parallel.role_dtype(every, False, True, 64, 128, 128, f32, f32) == f32     # float32 inputs
    assert parallel.role_dtype(None, False, True, 64, 128, 128, bf, f32) == f32        # no chunk kernels (CPU)
    assert parallel.role_dtype(every, True, False, 64, 128, 128, bf, f32) == f32      # key-vector decay: MLX and pair kernels
    metal = tuning.resolve("gpu", "metal", environ={}, chunk_kernels=True, mma_scan=True, roles_16bit="all")
    assert parallel.role_dtype(metal, False, True, 64, 128, 128, bf, f32) == f32     # no UT layout in 32 KiB at C = 64
    assert parallel.role_dtype(every, False, True, 64, 128, 12, bf, f32) == f32       # V = 12: no fragment scan
    off = tuning.with_changes(every, mma_scan=False)
    assert parallel.role_dtype(off, False, False, 64, 128, 128, bf, f32) == f32     # fragment frames off


def test_a_bare_role_keeps_its_own_inputs_type():
    """``chunked._role_as``: a role that is an input verbatim is that input's row-major copy where the kernels take
    its type (bf16 k for simple GLA's u, even when the values are float32), and stays float32 when k is float32
    though the values are bf16 (no rounding of an exact role); a computed role (r) follows the values' rule."""
    mx = pytest.importorskip("mlx.core")
    from recgen import specs
    from recgen import chunked
    from recgen.chunked import parallel
    from recgen.chunked.terms import plan

    cuda = tuning.resolve("gpu", "cuda", environ={})
    p = plan(specs.simple_gla)
    k = dict(p.bare_roles)["u"]
    pick = lambda dtype, bare: parallel.role_dtype(cuda, False, False, 64, 128, 128, dtype, mx.float32, bare=bare)  # noqa: E731
    x = mx.random.normal((1, 2, 64, 128))
    for own, values in ((mx.bfloat16, mx.float32), (mx.float32, mx.bfloat16)):
        raw = {k: x[..., None].astype(own)}
        u = chunked._role_as(p, "u", x, raw, pick, values)
        assert u.dtype == own and mx.array_equal(u, raw[k][..., 0])
    assert chunked._role_as(p, "r", x, raw, pick, mx.bfloat16).dtype == mx.float32


def test_readout_role_is_the_input_and_its_constant_where_kernels_run():
    """``Plan.r_scaled``: r = c·x for an input x and a constant c (every built-in's r = scale·q; power retention's
    r = scale²·φ(q) is a feature, not an input, so it has no row-major copy and keeps r). ``chunked._readout_role``
    then hands the core x (its row-major copy, in the type an input verbatim takes) and c, where chunk kernels run;
    without them r itself."""
    mx = pytest.importorskip("mlx.core")
    from recgen import chunked, specs
    from recgen.chunked import parallel
    from recgen.chunked.terms import plan

    for name in ("gated_delta_net", "delta_net", "gla", "simple_gla"):
        x, c = plan(specs.BUILTINS[name]).r_scaled
        assert str(x) == "q" and c(0.25) == 0.25
    assert plan(specs.selective_scan).r_scaled is None  # r = C verbatim: a bare role
    cuda = tuning.resolve("gpu", "cuda", environ={})
    p = plan(specs.simple_gla)
    q = mx.random.normal((1, 2, 64, 128, 1)).astype(mx.bfloat16)
    r = 0.5 * q[..., 0].astype(mx.float32)
    pick = lambda dtype, bare: parallel.role_dtype(cuda, False, False, 64, 128, 128, dtype, mx.float32, bare=bare)  # noqa: E731
    x, c = chunked._readout_role(p, r, {p.r_scaled[0]: q}, pick, cuda, 0.5)
    assert c == 0.5 and x.dtype == mx.bfloat16 and mx.array_equal(x, q[..., 0])
    assert chunked._readout_role(p, r, {p.r_scaled[0]: q}, pick, None, 0.5) == (r, None)
    prt = plan(specs.power_retention)
    assert prt.r_scaled is not None and chunked._readout_role(prt, r, {}, pick, cuda, 0.5) == (r, None)


def _factor_specs():
    """Delta rules for factor reads: u's factor an expression of a scalar input (σ(a)), a per-head parameter times
    one (its gradient reaches the parameter), and b not the key u is read from (the roles are formed then)."""
    import recgen as rg

    @rg.recurrence
    def sigmoid_beta(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar, a: rg.Scalar):
        return rg.Step(decay=rg.exp(g), transition=rg.rank1(-rg.sigmoid(a) * k, k),
                       update=rg.outer(rg.sigmoid(a) * k, v), readout=rg.scale * q)

    @rg.recurrence
    def head_beta(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar, a: rg.Scalar, c: rg.Param[()]):
        return rg.Step(decay=rg.exp(g), transition=rg.rank1(-c * a * k, k), update=rg.outer(c * a * k, v),
                       readout=rg.scale * q)

    @rg.recurrence
    def other_b(q: rg.Key, k: rg.Key, kk: rg.Key, v: rg.Value, g: rg.Scalar, a: rg.Scalar):
        return rg.Step(decay=rg.exp(g), transition=rg.rank1(-a * k, kk), update=rg.outer(a * k, v),
                       readout=rg.scale * q)

    return sigmoid_beta, head_beta, other_b


def test_analysis_finds_the_update_keys_factor():
    """``Analysis.u_factor``: u = f·x for a key input x and a factor free of the key and value indices (β, σ(a), a
    per-head parameter times a scalar input, mLSTM's e^{ig}), none where u is a key verbatim, a feature or a
    product with another key."""
    from recgen import specs
    from recgen.spec.analysis import analyze

    got = {n: analyze(r).u_factor for n, r in specs.BUILTINS.items()}
    assert {n for n, f in got.items() if f} == {"gated_delta_net", "delta_net", "kda", "mlstm", "mlstm_sigmoid"}
    assert all(str(got[n][0]) == "k" and str(got[n][1]) == "beta" for n in ("gated_delta_net", "delta_net", "kda"))
    sigmoid_beta, head_beta, other_b = _factor_specs()
    assert str(analyze(sigmoid_beta).u_factor[1]) == "sigmoid(a)"
    assert str(analyze(head_beta).u_factor[1]) == "a*c"
    assert analyze(other_b).u_factor is not None and dict(analyze(other_b).bare_roles).get("b") != analyze(other_b).u_factor[0]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_factor_reads_serve_custom_delta_rules(which, monkeypatch):
    """A researcher's delta rule through the fused kernels: σ(a) as u's factor (its gradient through the sigmoid by
    MLX's autodiff of the factor), a per-head parameter times a scalar input (its gradient summed over tokens), both
    read from k by the factor-read kernels; with b a second key the roles are formed and the plain kernels run. End
    to end against the float64 reference: forward, final state and every gradient, GQA, a partial last chunk."""
    pytest.importorskip("mlx.core")
    from test_chunked import assert_close, compare

    rec = _factor_specs()[which]
    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True)
    assert_close(compare(rec, 40, chunk=16, K=16, V=8, seed=11, tuning=t))
    kinds = {c.split("_metal")[0] for c in calls}
    reads = {"recgen_chunk_ut_mma_uf", "recgen_chunk_out_mma_uf_yt", "recgen_chunk_bwd_mma_delta_uf"}
    assert (reads <= kinds) == (which != 2), kinds
    if which == 2:
        assert {"recgen_chunk_ut_mma", "recgen_chunk_out_mma_yt", "recgen_chunk_bwd_mma_delta"} <= kinds, kinds


@pytest.mark.parametrize("roles16", [None, "0", "l"])
def test_general_rank1_core_reads_16bit_roles(roles16, monkeypatch):
    """RWKV-7 with bf16 inputs on the kernels (mma frames, pairs on fragments): its roles that are inputs verbatim
    (k, v, a, b, and q under the readout scale) reach the quad pair kernels, the UT transform, the scans and the
    backward tail in bf16, which convert on load (``rank1.roles_16bit``; ``roles_16bit = "none"``: float32, no bf16
    operand anywhere; "l": the log-decay w too, ``Tuning.logdecay_16bit``, read by the decay geometry's kernels
    and the tail alone), against the float64 reference at the same bf16-rounded inputs: forward, final state and
    every gradient within 1e-2 (a product rounded to bf16 would be ~1e-1 off)."""
    mx = pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunked import assert_close, compare

    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True, mma_pairs=True,
                       roles_16bit={None: "bare", "0": "none", "l": "bare"}[roles16], logdecay_16bit=roles16 == "l")
    seen = _emulate_noting_bf16(monkeypatch)
    assert_close(compare(specs.BUILTINS["rwkv7"], 40, chunk=16, B=1, H=2, Hk=1, K=32, V=8, seed=3,
                         in_dtype=mx.bfloat16, tuning=t), 1e-2, 1e-2)
    want = {"pair_quad_nonstrict_mma": {"X", "X2", "Y", "Yb"}, "pair_grad_quad_nonstrict_mma": {"X", "X2", "Y", "Yb"},
            "ut_mma_key": {"Bt"}, "scan_mma_p": {"Pb"}, "decays_g_pe_q_q_p": {"X0", "X1", "X2"},
            "decays_g_q_q_p": {"X0", "X1", "X2"}, "bwd_key_rank1_before": {"R", "U", "A", "B"}}
    if roles16 == "l":
        want = want | {k: want[k] | {"l"} for k in ("decays_g_pe_q_q_p", "decays_g_q_q_p")}
        want["bwd_key_rank1_before"] = want["bwd_key_rank1_before"] | {"L"}
    assert seen == ({} if roles16 == "0" else want), seen


def test_general_rank1_core_after_the_decay_reads_16bit_roles(monkeypatch):
    """The rank-1 transition after a key-vector decay (``dplr_key``) with bf16 inputs on the kernels: its roles that are
    inputs verbatim (b, and q under the readout scale) reach the quad pair kernels, the UT transform and the backward
    tail in bf16; forward, final state and every gradient against the float64 reference within 1e-2."""
    mx = pytest.importorskip("mlx.core")
    from test_chunked import assert_close, compare, dplr_key

    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True, mma_pairs=True)
    seen = _emulate_noting_bf16(monkeypatch)
    assert_close(compare(dplr_key, 40, chunk=16, B=1, H=2, Hk=1, K=32, V=8, seed=3, in_dtype=mx.bfloat16, tuning=t),
                 1e-2, 1e-2)
    assert seen["pair_quad_mma"] == {"X", "X2"} and seen["bwd_key_rank1"] == {"R", "B"}, seen


def test_l2_hints_render_only_where_the_dialect_has_a_prefetch():
    """``Tuning.l2_prefetch``: CUDA's readout and UT transform hint their next blocks (one hint per staging step, in
    guarded branches); Metal, which has no prefetch, renders the very kernels it renders without the switch."""
    for dialect in ("metal", "cuda"):
        out = [cs.out_mma_source(dialect, True, uf=True, ml=True, l2=l2) for l2 in (False, True)]
        ut = [cs.ut_mma_source(dialect, uf=True, ml=True, l2=l2) for l2 in (False, True)]
        for plain, hinted in (out, ut):
            if dialect == "metal":
                assert hinted == plain
            else:
                assert hinted.name != plain.name and "prefetch" not in plain.source
                assert hinted.source.count("prefetch.global.L2") >= 3
    t = tuning.resolve("gpu", "cuda", environ={})
    assert t.l2_prefetch and not tuning.resolve("gpu", "metal", environ={}).l2_prefetch
