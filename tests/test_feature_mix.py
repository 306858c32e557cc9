"""The backward's products over chunks of the feature-map form (``features_mix_grad.j2``: the entry states LL X,
their cotangents LLᵀ F and the decays' gradient F Xᵀ in one pass) on the Metal CPU emulator against float64, and
the form end to end with it. (The CUDA form is checked on a GPU: ``tests/gpu``.)"""
import numpy as np
import pytest

from recgen import tuning
from recgen.codegen import chunk_sources as cs
from recgen.runtime import chunk_kernels as ck

verify = pytest.importorskip("recgen.verify.kernels")
from recgen.verify.typecheck import clang_problem  # noqa: E402

pytestmark = pytest.mark.skipif(clang_problem() is not None, reason=clang_problem() or "")


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / (np.abs(b).max() + 1e-30))


@pytest.mark.parametrize("N,M,K,sanitizer", [(2, 17, 1100, None), (1, 2, 5, None), (3, 5, 512, None),
                                             (1, 32, 300, None), (2, 9, 700, "address"), (1, 6, 600, "thread")])
def test_products_over_chunks_match_numpy(N, M, K, sanitizer):
    """Sh = LL X, dX = LLᵀ F and each block's part of F Xᵀ against float64: 17 states (T = 4096 at chunks of 256),
    one chunk (2 states), M not a multiple of 4, 32 states (Metal's 64-thread layout), K not a multiple of a
    threadgroup's columns or of a stage's, fewer entries than one stage."""
    rng = np.random.default_rng(M + K)
    LL = rng.normal(size=(N, M, M)).astype(np.float32)
    X, F = rng.normal(size=(2, N, M, K)).astype(np.float32)
    launch = ck.feature_mix_launch("metal", N, M, K)
    Sh, dX, part = verify.run_launch(launch, {"LL": LL, "X": X, "F": F}, sanitizer=sanitizer)
    LL64, X64, F64 = (a.astype(np.float64) for a in (LL, X, F))
    assert _rel(Sh, LL64 @ X64) < 1e-6
    assert _rel(dX, LL64.swapaxes(-1, -2) @ F64) < 1e-6
    cols = launch.template[2][1] * launch.template[3][1]  # NT SB entries a block
    assert part.shape == (N, -(-K // cols), M, M)
    for b in range(part.shape[1]):
        s = slice(b * cols, (b + 1) * cols)
        assert _rel(part[:, b], F64[..., s] @ X64[..., s].swapaxes(-1, -2)) < 1e-6


def test_layouts_cover_the_states_that_fit():
    """MP = M rounded up to 4; 128 threads where the tiles and staging fit, else 64; none past the threadgroup memory
    (36 states on CUDA's 48 KB, 32 on Metal's 32 KB)."""
    assert cs.feature_mix_layout("cuda", 17) == {"MP": 20, "XP": 20, "NT": 128, "SB": 4}
    assert cs.feature_mix_layout("cuda", 3) == {"MP": 4, "XP": 16, "NT": 128, "SB": 4}
    assert cs.feature_mix_layout("metal", 30)["NT"] == 64
    assert cs.feature_mix_layout("cuda", 36) is not None and cs.feature_mix_layout("cuda", 37) is None
    assert cs.feature_mix_layout("metal", 32) is not None and cs.feature_mix_layout("metal", 33) is None
    with pytest.raises(ValueError, match="37 chunk states"):
        ck.feature_mix_launch("cuda", 1, 37, 100)
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, feature_mix=True)
    assert ck.mixes(t, 32) and not ck.mixes(t, 33)
    assert not ck.mixes(tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=False, feature_mix=True), 17)


def test_feature_mix_grad_takes_any_trailing_axes_and_rejects_mismatches(monkeypatch):
    """The call flattens [B, H, M, R, V'] states to K entries a state and sums the blocks' parts; mismatched shapes
    are refused before any launch."""
    mx = pytest.importorskip("mlx.core")
    from test_chunk_kernels import _emulated_call

    monkeypatch.setattr(ck, "mlx_call", _emulated_call)
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, feature_mix=True)
    rng = np.random.default_rng(3)
    LL = rng.normal(size=(1, 2, 5, 5))
    X, F = rng.normal(size=(2, 1, 2, 5, 130, 9))  # K = 1170: three blocks of 512
    Sh, dX, dLL = ck.feature_mix_grad(*(mx.array(a.astype(np.float32)) for a in (LL, X, F)), t)
    Xf, Ff = X.reshape(1, 2, 5, -1), F.reshape(1, 2, 5, -1)
    assert _rel(Sh, np.einsum("bhnm,bhmrv->bhnrv", LL, X)) < 1e-6
    assert _rel(dX, np.einsum("bhmn,bhmrv->bhnrv", LL, F)) < 1e-6
    assert _rel(dLL, Ff @ Xf.swapaxes(-1, -2)) < 1e-6
    with pytest.raises(ValueError, match="feature_mix_grad"):
        ck.feature_mix_grad(mx.array(LL), mx.array(X), mx.array(F[..., :8]), t)


@pytest.mark.parametrize("feature_kernels,keep", [(True, False), (False, False), (True, True)])  # φ formed as read,
# or MLX's products over formed rows; the chunks' states kept from the forward (``Tuning.feature_keep_states``), with
# the decay factors on their kernels (``Tuning.decay_factor_kernels``)
def test_power_retention_with_the_products_over_chunks_on_the_kernel(monkeypatch, feature_kernels, keep):
    """The kernel-identity form with the backward's products over chunks on the kernel (``Tuning.feature_mix``), end
    to end against the float64 reference: forward, final state, every gradient; GQA, a partial last chunk."""
    pytest.importorskip("mlx.core")
    from recgen import specs
    from test_chunk_kernels import _emulated_call
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call",
                        lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True,
                       feature_kernels=feature_kernels, feature_mix=True, feature_keep_states=keep,
                       decay_factor_kernels=keep)
    assert_close(compare(specs.power_retention, 40, chunk=16, V=6, seed=5, tuning=t))
    assert any(c.startswith("recgen_chunk_feature_mix_grad") for c in calls), calls
    factors = {c.split("_metal")[0] for c in calls if "decay_factors" in c}
    assert factors == ({"recgen_chunk_decay_factors", "recgen_chunk_decay_factors_grad"} if keep else set()), factors
    if feature_kernels:  # the chunks' states: formed in the forward, and again in the backward unless kept
        states = sum(c.startswith("recgen_chunk_feature_states_tail") for c in calls)
        assert states == (2 if keep else 3), calls


@pytest.mark.parametrize("N,n,C,sanitizer", [(2, 5, 24, None), (1, 1, 7, None), (3, 17, 16, None),
                                             (1, 40, 4, None), (1, 3, 300, None), (2, 6, 8, "address"),
                                             (1, 3, 8, "thread")])
def test_decay_factor_kernels_match_mlx_autodiff_in_float64(N, n, C, sanitizer):
    """The decay factors (``features_decay_factors.j2``: to_t, to_end, [L | l0]) and their gradient against
    ``features.decay_factors`` and MLX's autodiff of it in float64: strong decays, a reset (log-decay -inf), one
    chunk, C not a multiple of a SIMD group, more chunks than a SIMD group, several tokens a thread (C = 300)."""
    mx = pytest.importorskip("mlx.core")
    from recgen.chunked.features import decay_factors

    rng = np.random.default_rng(n * C)
    l = -rng.exponential(2.0, size=(N, n, C)) * (rng.uniform(size=(N, n, C)) < 0.7)  # zeros, mild and strong
    l[0, n // 2, C // 3] = -np.inf
    l32 = l.astype(np.float32)
    outs = verify.run_launch(ck.decay_factors_launch("metal", N, n, C), {"l": l32.reshape(N, n * C)},
                             sanitizer=sanitizer)
    with mx.stream(mx.cpu):
        want = [np.array(a) for a in decay_factors(mx.array(l32.astype(np.float64)))]
    for got, w in zip(outs, want):
        got = got.reshape(w.shape)
        # e^s's relative error is s's absolute one: float32 sums of up to C log-decays, |s| up to ~87 where e^s is
        # not 0, reach 1e-5 (9e-6 at C = 16, 1.1e-5 at C = 300); a wrong span or order is off by O(1)
        assert np.all(np.abs(got - w) <= 3e-5 * np.abs(w) + 1e-30), float(np.abs(got - w).max())
    cots = [rng.normal(size=w.shape) for w in want]
    (dl,) = verify.run_launch(ck.decay_factors_launch("metal", N, n, C, grad=True),
                              {"to_t": outs[0], "to_end": outs[1], "LL": outs[2],
                               "dto_t": cots[0].reshape(N, -1).astype(np.float32),
                               "dto_end": cots[1].reshape(N, -1).astype(np.float32),
                               "dLL": cots[2].astype(np.float32)}, sanitizer=sanitizer)
    with mx.stream(mx.cpu):
        _, (dwant,) = mx.vjp(decay_factors, [mx.array(l32.astype(np.float64))], [mx.array(c) for c in cots])
    dwant = np.array(dwant)
    assert _rel(dl.reshape(dwant.shape), dwant) < 1e-5


def test_decay_factors_fn_runs_the_kernels_and_their_gradient(monkeypatch):
    """``decay_factors_fn`` (the kernels on the emulator) and its VJP against MLX's autodiff of the MLX ops."""
    mx = pytest.importorskip("mlx.core")
    from recgen.chunked.features import decay_factors
    from test_chunk_kernels import _emulated_call

    monkeypatch.setattr(ck, "mlx_call", _emulated_call)
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, decay_factor_kernels=True)
    assert ck.factors_on_kernels(t, 256) and not ck.factors_on_kernels(t, 257)
    rng = np.random.default_rng(4)
    l = mx.array((-rng.exponential(1.0, size=(2, 3, 4, 16))).astype(np.float32))
    cots = [mx.array(rng.normal(size=s).astype(np.float32)) for s in ((2, 3, 4, 16), (2, 3, 4, 16), (2, 3, 5, 5))]
    outs, (dl,) = mx.vjp(ck.decay_factors_fn(t), [l], cots)
    want, (dwant,) = mx.vjp(decay_factors, [l], cots)
    for a, b in zip([*outs, dl], [*want, dwant]):
        assert _rel(a, np.array(b)) < 1e-5
    with pytest.raises(ValueError, match="257 chunks"):
        ck.decay_factors_launch("metal", 1, 257, 8)


def test_the_float64_decay_factors_match_mlx_autodiff_of_the_chunked_form():
    """``recgen.spec.features.decay_factors`` and its VJP (products of the spanned decays, the self-test's reference)
    against ``recgen.chunked.features.decay_factors`` and MLX's autodiff of it in float64: a reset, strong decays."""
    mx = pytest.importorskip("mlx.core")
    from recgen.chunked.features import decay_factors
    from recgen.spec.features import decay_factors as product_form
    from recgen.spec.features import decay_factors_vjp

    rng = np.random.default_rng(11)
    l = -rng.exponential(3.0, size=(2, 6, 9))
    l[1, 2, 4] = -np.inf
    with mx.stream(mx.cpu):
        outs = decay_factors(mx.array(l))
        cots = [rng.normal(size=o.shape) for o in outs]
        _, (dl,) = mx.vjp(decay_factors, [mx.array(l)], [mx.array(c) for c in cots])
    for a, b in zip(outs, product_form(l)):
        assert _rel(np.array(a), b) < 1e-6
    assert _rel(np.array(dl), decay_factors_vjp(l, *cots)) < 1e-6
