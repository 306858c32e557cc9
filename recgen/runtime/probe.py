"""Checks of this machine, once per process: whether the generated chunk kernels build and compute right on
this GPU, and whether MLX's CPU matmuls run on a fast BLAS. ``checked(t)`` applies them to a ``Tuning``: a
choice that fails here is turned off (with a warning for the kernels), so a GPU whose compiler rejects a frame
still gets the chunked form. Only the frames a spec's path can run are probed (``frames_for``): each frame
compiles its kernels on first use, and without the kernel cache MLX keeps no compiled custom kernel across
processes (every frame probed costs seconds to a minute of compiling on an H100), so power retention does not pay
for the delta rule's kernels, nor GDN for the feature map's."""
from __future__ import annotations

import time
import warnings
from dataclasses import replace
from functools import lru_cache

from ..codegen.backends import get
from ..codegen.chunk_sources import pair_supported
from ..spec.analysis import Analysis
from ..spec.features import (decay_factors, decay_factors_vjp, decayed_scores, decayed_scores_vjp, sympow,
                             sympow_vjp)
from ..tuning import Tuning, current, resolve
from . import chunk_kernels as ck
from . import kernel_binary

PROBE = (2, 64, 128, 128)  # n, C, K, V of the self-test: the common case's template constants (compiled once)
# The frames of the chunk algebra's kernels, and of a feature map's kernel identity (φ's products, its decode step,
# the decayed scores); "base" holds the inverse, the pairs and the sympow map, "sympow" the sympow map alone (φ formed
# in memory where the products' kernels are off): the frame that turns the chunk kernels off where it fails
CHUNK_FRAMES = frozenset({"base", "scan", "mma", "hoist", "tail", "pairs", "ut16", "rows", "hoist_e", "keyfactor",
                          "async", "products", "s16", "wide"})
FEATURE_FRAMES = frozenset({"sympow", "features", "decode", "scores", "mix", "factors"})
# ... and those of a key-vector decay only: its pair kernels on fragments, KDA's factor reads, its backward tails
KEY_DECAY_FRAMES = frozenset({"pairs", "keyfactor", "tail"})
EVERY_FRAME = CHUNK_FRAMES | FEATURE_FRAMES
# The choices each opt-in frame stands for: probed only where the tuning asks for one of them, and turned off where
# it fails (then: the backward's tail in MLX ops; the pairs' FMA form; U and W in float32; the chunk states and
# residuals in float32; q, k, v copied to the chunks' layout; each operand loaded where used; KDA's roles formed;
# synchronous staging; the backward pass's products over values, the decode step, φ's products, the in-chunk
# scores, the backward's products over chunks and the decay factors in MLX ops)
FRAME_FLAGS = {"tail": ("fused_bwd",), "pairs": ("mma_pairs",), "ut16": ("ut_16bit",), "s16": ("states_16bit",),
               "wide": ("wide_fragments", "bwd_scores"),
               "rows": ("model_rows",),
               "hoist": ("scan_hoist", "reverse_scan_hoist"), "hoist_e": ("scan_hoist_e",),
               "keyfactor": ("key_factor_reads",), "async": ("async_staging",), "products": ("bwd_products",),
               "decode": ("feature_decode",),
               "features": ("feature_kernels",), "scores": ("decayed_scores",), "mix": ("feature_mix",),
               "factors": ("decay_factor_kernels",)}
# Choices that act only with a frame's own, checked by it: they ask for no probe, and go off where it fails
FRAME_RIDERS = {"wide": ("scan_wide_loads", "bwd_wide_loads")}
FAST_BLAS_GFLOPS = 30.0  # between the reference BLAS's 6 GFLOP/s and OpenBLAS's 77-95 (2 cores), measured


def frames_for(p: Analysis, t: Tuning) -> frozenset:
    """The self-test frames whose kernels ``p``'s spec can run under ``t``: a feature map with a kernel identity
    (where the tuning takes it) runs φ's own kernels and no chunk scan; every other spec the chunk algebra's, those
    of a key-vector decay (of the state or of the normalizer) only where it has one."""
    if p.feature_identity is not None and t.feature_identity:
        return FEATURE_FRAMES
    if p.decay_class == "scalar" and p.zdecay_class in (None, "scalar"):
        return CHUNK_FRAMES - KEY_DECAY_FRAMES
    return CHUNK_FRAMES


def checked_for(p: Analysis, t: Tuning | None = None) -> Tuning:
    """``checked(t)`` (default: the current tuning) over the frames ``p``'s spec can run."""
    t = current() if t is None else t
    return checked(t, PROBE, frames_for(p, t))


@lru_cache(maxsize=64)
def checked(t: Tuning, sizes: tuple = PROBE, frames: frozenset = EVERY_FRAME) -> Tuning:
    """``t`` with the choices this machine cannot honour turned off: chunk kernels whose self-test fails (the
    fragment scan falls back to the FMA scan, a failing FMA scan or base frame to MLX ops), and on the CPU
    the BLAS-dependent choices set from ``cpu_blas`` (measured when the tuning does not say). ``frames``: those
    probed; a choice whose frame is not among them is left as it is (the caller's spec runs none of its kernels)."""
    changes: dict = {}
    ok = lambda frame: usable(t.dialect, frame, sizes, t.kernel_cache)  # noqa: E731
    if t.chunk_kernels and t.kernel_cache and t.dialect and get(t.dialect).binary_factory:
        prefetch_frames(t.dialect, first_probed(t, frames), sizes, t.kernel_cache)
    if t.device == "cpu" and (t.cpu_blas == "fast" or (t.cpu_blas is None and cpu_blas_fast())):
        # OpenBLAS takes transposed views as they are; there the elementwise passes over the chunk-entry
        # states cost more than flops, so key-vector decays take chunks of 32
        changes.update(copy_transposes=False, key_chunk_size=32)
    if t.chunk_kernels:
        if t.dialect is None or not ok("base" if "base" in frames else "sympow"):
            changes.update(chunk_kernels=False)
        elif "scan" not in frames:
            pass  # a path with no chunk scan: the scans' frames are not probed
        elif t.mma_scan and (t.scan_hoist or t.reverse_scan_hoist) and ok("hoist"):
            pass  # the fragment kernels as this tuning runs them, hoisted scans included
        elif t.mma_scan and ok("mma"):
            pass  # hoisting, if asked for, failed: turned off below
        elif ok("scan"):
            changes.update(mma_scan=False)
        else:
            changes.update(chunk_kernels=False)
        if changes.get("chunk_kernels", True) and t.fused_bwd and "tail" in frames and not ok("tail"):
            changes.update(fused_bwd=False)  # the backward's tail in MLX ops; the rest of the kernels stay
        if (changes.get("chunk_kernels", True) and changes.get("mma_scan", t.mma_scan) and t.mma_pairs
                and "pairs" in frames and not ok("pairs")):
            changes.update(mma_pairs=False)  # the pair kernels' FMA form
    # Choices that exist only on the fragment kernels, each with its own frame: without those kernels they do nothing
    # (so they go off unprobed); with them a failing frame turns off only its own choice
    fragments = t.chunk_kernels and changes.get("chunk_kernels", True) and changes.get("mma_scan", t.mma_scan)
    for frame in ("ut16", "s16", "wide", "rows", "hoist", "hoist_e", "keyfactor", "async", "products"):
        flags = FRAME_FLAGS[frame]
        if frame == "products" and wide_products(t) and changes.get("wide_fragments", True):
            continue  # the backward's products on the wide multiply-add: "wide" checked them
        if frame in frames and any(getattr(t, f) for f in flags) and not (fragments and ok(frame)):
            changes.update(dict.fromkeys(flags + FRAME_RIDERS.get(frame, ()), False))
    if t.feature_decode and "decode" in frames and (t.dialect is None or not ok("decode")):
        changes.update(feature_decode=False)  # a feature map's decode step in MLX ops
    if t.feature_kernels and "features" in frames and (t.dialect is None or not ok("features")):
        changes.update(feature_kernels=False)  # φ formed in memory, its products MLX matmuls
    # A feature map's chunk kernels beside φ's: its in-chunk scores, the backward's products over chunks and the
    # decay factors, each back to MLX ops where its frame fails (or the chunk kernels are off)
    kernels = t.chunk_kernels and changes.get("chunk_kernels", True)
    for frame in ("scores", "mix", "factors"):
        flags = FRAME_FLAGS[frame]
        if frame in frames and any(getattr(t, f) for f in flags) and not (kernels and ok(frame)):
            changes.update(dict.fromkeys(flags, False))
    return replace(t, **changes) if changes else t


@lru_cache(maxsize=None)
def cpu_blas_fast() -> bool:
    """Whether MLX's CPU matmuls run on an optimised BLAS: a 256×256 float32 product, best of three (~20 ms with
    the reference BLAS). The ``mlx[cpu]`` Linux wheel links netlib's reference BLAS (~6 GFLOP/s on 2 cores);
    OpenBLAS preloaded runs 77-95."""
    import mlx.core as mx

    a = mx.random.normal((256, 256), stream=mx.cpu)
    mx.eval(a)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        mx.eval(mx.matmul(a, a, stream=mx.cpu))
        best = min(best, time.perf_counter() - t0)
    return 2 * 256**3 / best / 1e9 > FAST_BLAS_GFLOPS


class _InTransform(Exception):
    """MLX refused to evaluate the probe inside a transformation (its arrays are constants, which MLX
    evaluates even inside mx.compile, so this is a safety net): try again later."""


@lru_cache(maxsize=None)
def _probe(dialect: str, frame: str, sizes: tuple = PROBE, kernel_cache: str = "") -> str | None:
    """Build and run one small instance of a frame's kernels on this machine's GPU, at the template
    constants of the common case (C = 64, K = V = 128: the very kernels a model then uses, so nothing is
    compiled twice) and check it against float64 numpy: None where it passes, else what went wrong.
    ``frame``: "base" (the inverse, the key-decay pair, the sympow feature map), "sympow" (the feature map alone,
    a feature map's kernel identity's base frame), "tail" (the key-decay backward
    tail), "pairs" (the key-decay pair kernels on fragments, probed where the tuning asks for it), "scan"
    (the FMA scan) or "mma" (the fragment scan as the forward runs it, B in bf16 with its rows scaled as read; the
    readout in both output layouts, bf16 in the model's; the UT transform; a key-vector decay's UT transform and
    readout; the backward's pass after the scan; their factor-read forms, as GDN calls them), "decode" (the feature
    decode kernel at d = V = 64), "features" (the feature product and gradient kernels at C = 64, d = 64, V = 65),
    "scores" (a scalar decay's decayed scores between a chunk's tokens and their gradients, a reset among them),
    "mix" (the products over chunks of a feature map's backward at 17 states), "factors" (a scalar decay's factors
    in that form and their gradient, a reset among the log-decays),
    "ut16" (the factor-read UT transform writing bf16), "s16" (GDN's kernels and simple GLA's scans writing their
    residuals and reading products in bf16, against their float32 forms), "wide" (the readout, UT transform
    and both scans on the wide multiply-add, every operand bf16, and the backward's pass forming its pair cotangents
    and its products over values on it, against their TF32 forms), "keyfactor" (KDA's
    factor-read UT transform and tail) and
    "rows" (the factor-read kernels reading q, k, v in the model's layout, GQA's key head shared, against their
    chunk-layout forms, which "mma" checks against float64) and "hoist" (the kernels of "mma" with the scans'
    state-free operands loaded at each step's start, as the tuning then runs them: where it asks for hoisting this
    frame stands for "mma", which is probed only if it fails), "hoist_e" (a product-free reverse scan hoisted: A
    with Aq, E), "async" (the scalar decay's readout and UT transform staged by asynchronous copies, float32 and as GDN calls
    them; a key-vector decay's readout as GLA calls it), "products" (the kernels of "mma" with the backward's pass
    forming its products over values), each probed
    where the tuning asks for it. A GPU
    whose compiler rejects a frame (an old CUDA architecture without TF32 fragments, say) then keeps MLX ops, or
    the FMA scan, instead of raising from inside every chunked call; a failing "tail" turns only the fused backward
    off, a failing "pairs" only the pairs' fragments, a failing "hoist" or "hoist_e" only that hoisting."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)

    def ut_expected(b, u, w, G):
        """The UT transform in float64 at cumulative log-decays G: A = (b uᵀ) ⊙ Γ below the diagonal, and [T, T w,
        T (b e^G)] with T = (I − A)^{-1}."""
        A = np.tril((b @ u.swapaxes(-1, -2)) * np.exp(G[:, None] - G[None, :]), -1)
        T = np.linalg.inv(np.eye(len(G)) - A)
        return A, [T, T @ w, T @ (b * np.exp(G)[:, None])]

    def scan_expected(S, A, X, B=None, E=None, reverse=False):
        """The chunk scan in float64 at decay 0.5 a chunk over chunks [n, ..]: carried_c = S, Y_c = X_c + A_c S,
        S <- 0.5 S + B_cᵀ Y_c (+ E_c). Returns (carried [n, K, V], Y [n, C, V], S_end)."""
        carried, Y = [None] * len(X), [None] * len(X)
        for c in (reversed(range(len(X))) if reverse else range(len(X))):
            carried[c], Y[c] = S, X[c] + A[c] @ S
            S = 0.5 * S + (0 if B is None else B[c].T @ Y[c]) + (0 if E is None else E[c])
        return np.stack(carried), np.stack(Y), S
    # "s16" and "wide" as CUDA's table runs them (hoisted scans, staged readout and UT transform): the kernels a model
    # then uses
    t = resolve("gpu", dialect, environ={}, chunk_kernels=True, kernel_cache=kernel_cache,
                mma_scan=frame in ("mma", "pairs", "ut16", "keyfactor", "rows", "hoist", "hoist_e", "async",
                                   "products", "s16", "wide"),
                mma_pairs=frame == "pairs", pair_whole=frame == "pairs", scan_hoist=frame in ("hoist", "s16", "wide"),
                reverse_scan_hoist=frame in ("hoist", "s16", "wide"), scan_hoist_e=frame == "hoist_e",
                async_staging=frame in ("async", "s16", "wide"), bwd_products=frame == "products",
                wide_fragments=frame == "wide", bwd_scores=frame == "wide", scan_wide_loads=frame == "wide",
                bwd_wide_loads=frame == "wide", **({"scan_products_alone": True} if frame == "wide" else {}))
    n, C, K, V = sizes
    f32 = lambda a: mx.array(a.astype(np.float32))  # noqa: E731
    try:
        if frame == "sympow":  # the feature map alone, degree 2 at d = 16
            Xp = rng.normal(size=(1, 2, 16))
            got, ref = [ck.sympow_fn(t, 1, "block")(f32(Xp[:, :, None, :]))[0, 0]], [sympow(Xp[0])]
        elif frame == "base":
            L = np.tril(0.3 * rng.normal(size=(1, C, C)) / np.sqrt(C), -1)
            Xp, Yp = rng.normal(size=(1, C, K)), rng.normal(size=(1, C, K))
            lk = -rng.uniform(size=(1, C, K))  # and the key-vector decay geometry
            got = [ck.tril_inverse(f32(L), t), ck.pair(f32(Xp), f32(Yp), f32(np.ones((1, C, K))), False, t),
                   ck.sympow_fn(t, 1, "block")(f32(Xp[:, :2, None, :16]))[0, 0],
                   # with P one token earlier (RWKV-7's) and roles scaled by Q and P, one in bf16
                   *ck.key_decays(f32(lk), t, True, ((f32(Xp).astype(mx.bfloat16), "Q"), (f32(Yp), "P"))).written()]
            Pk, Qk = np.exp(np.cumsum(lk, 1)), np.exp(np.cumsum(lk[:, ::-1], 1)[:, ::-1] - lk)
            ref = [np.linalg.inv(np.eye(C) - L), np.tril(Xp[0] @ Yp[0].T)[None], sympow(Xp[0, :2, :16]), np.exp(lk),
                   Pk, Qk, Pk[:, -1], np.exp(np.cumsum(lk, 1) - lk), Xp * Qk, Yp * Pk]
            # and the form that writes the chunk's decay g in place of P and Q (RWKV-7's)
            got += ck.key_decays(f32(lk), t, False, ((f32(Yp), "P"),), pq=False).written()
            ref += [np.exp(lk), Pk[:, -1], Yp * Pk]
            # a scalar decay's (a SIMD group a chunk, its lanes' sums joined by shuffles), with GDN's f ⊙ Q
            ls, fs = lk[..., :1], Yp[..., :1]
            Ps, Qs = np.exp(np.cumsum(ls, 1)), np.exp(np.cumsum(ls[:, ::-1], 1)[:, ::-1] - ls)
            got += ck.key_decays(f32(ls), t, scaled=((f32(fs), "Q"),), d=False).written()
            ref += [Ps, Qs, Ps[:, -1], fs * Qs]
        elif frame == "scores":  # a scalar decay's scores between a chunk's tokens and their gradients (the feature-map
            ls = np.log(rng.uniform(0.05, 1.0, size=(2, C)))  # form's at degree 2), a reset among the decays
            ls[1, C // 2] = -np.inf
            P, dA = rng.normal(size=(2, 2, C, C))
            (A,), (dP, dl) = mx.vjp(ck.decayed_scores_fn(t, 2), [f32(P), f32(ls)], [f32(dA)])
            got, ref = [A, dP, dl], [decayed_scores(P, ls), *decayed_scores_vjp(P, ls, dA)]
        elif frame == "mix":  # the products over chunks of power retention's backward at T = 4096 (17 states), K
            LL, X, F = rng.normal(size=(2, 17, 17)), rng.normal(size=(2, 17, 700)), rng.normal(size=(2, 17, 700))
            got = list(ck.feature_mix_grad(f32(LL), f32(X), f32(F), t))  # past a threadgroup's columns (512)
            ref = [LL @ X, LL.swapaxes(-1, -2) @ F, F @ X.swapaxes(-1, -2)]
        elif frame == "factors":  # a scalar decay's factors over 16 chunks of C and their gradient, a reset among them
            l = np.log(rng.uniform(0.05, 1.0, size=(2, 16, C)))
            l[1, 5, C // 2] = -np.inf
            cots = [rng.normal(size=s) for s in ((2, 16, C), (2, 16, C), (2, 17, 17))]
            factors = ck.decay_factors_fn(t)
            got = [*factors(f32(l)), *mx.vjp(factors, [f32(l)], [f32(c) for c in cots])[1]]
            ref = [*decay_factors(l), decay_factors_vjp(l, *cots)]
        elif frame == "pairs":  # the key-decay pair kernels on fragments (dual: A strict, M_ru) and their gradients
            X, X2, Y = rng.normal(size=(3, 1, C, K))
            dk = np.exp(-0.5 * rng.uniform(size=(1, C, K)))
            G = np.cumsum(np.log(dk[0]), 0)
            ts = np.arange(C)[:, None, None] - np.arange(C)[None, :, None]  # t - s
            gam = np.exp(G[:, None, :] - G[None, :, :]) * (ts >= 0)
            ref = [np.einsum("ti,si,tsi->ts", X[0], Y[0], gam * (ts > 0))[None],
                   np.einsum("ti,si,tsi->ts", X2[0], Y[0], gam)[None]]
            got = list(ck.pair_dual(f32(X), f32(X2), f32(Y), f32(dk), t, strict=True))
            dM, dM2 = rng.normal(size=(2, 1, C, C))  # and the gradients: dX = (dM ⊙ Γ) Y, dY = (dM ⊙ Γ)ᵀ X + ...
            E, E2 = dM[0][:, :, None] * gam * (ts > 0), dM2[0][:, :, None] * gam
            ref += [np.einsum("tsi,si->ti", E, Y[0])[None], np.einsum("tsi,si->ti", E2, Y[0])[None],
                    (np.einsum("tsi,ti->si", E, X[0]) + np.einsum("tsi,ti->si", E2, X2[0]))[None]]
            got += list(ck.pair_dual_grad(f32(dM), f32(dM2), f32(X), f32(X2), f32(Y), f32(dk), t, strict=True))
            ref.append(0.5 * ref[1])  # GLA's single pair, X read times the readout's scale
            got.append(ck.pair(f32(X2), f32(Y), f32(dk), False, t, scale=0.5))
            if pair_supported(dialect, C, K, dual=True, quad=True):  # and the quad form: Yb beside Y (RWKV-7)
                Yb, dMb, dM2b = rng.normal(size=(1, C, K)), rng.normal(size=(1, C, C)), rng.normal(size=(1, C, C))
                Eb, E2b = dMb[0][:, :, None] * gam * (ts > 0), dM2b[0][:, :, None] * gam
                ref += [ref[0], ref[1], np.einsum("ti,si,tsi->ts", X[0], Yb[0], gam * (ts > 0))[None],
                        np.einsum("ti,si,tsi->ts", X2[0], Yb[0], gam)[None],
                        np.einsum("tsi,si->ti", E, Y[0])[None] + np.einsum("tsi,si->ti", Eb, Yb[0])[None],
                        np.einsum("tsi,si->ti", E2, Y[0])[None] + np.einsum("tsi,si->ti", E2b, Yb[0])[None], ref[4],
                        (np.einsum("tsi,ti->si", Eb, X[0]) + np.einsum("tsi,ti->si", E2b, X2[0]))[None]]
                got += list(ck.pair_quad(f32(X), f32(X2), f32(Y), f32(Yb), f32(dk), t, strict=True))
                got += list(ck.pair_quad_grad(f32(dM), f32(dM2), f32(dMb), f32(dM2b), f32(X), f32(X2), f32(Y), f32(Yb),
                                              f32(dk), t, strict=True))
        elif frame == "decode":  # one step of a feature map's state (power retention's at d = 64), with z
            q, k, w = rng.normal(size=(2, 64)), rng.normal(size=(2, 64)), rng.normal(size=(2, 64))
            S, z, dec = rng.normal(size=(2, 2080, 64)), rng.normal(size=(2, 2080)), np.array([0.9, 0.5])
            pq, pk = sympow(q), sympow(k)
            S1, z1 = dec[:, None, None] * S + pk[:, :, None] * w[:, None, :], dec[:, None] * z + pk
            got = list(ck.feature_decode(*(f32(x) for x in (q, k, w, dec, S, z)), t))
            ref = [S1, z1, np.einsum("bf,bfv->bv", pq, S1), (pq * z1).sum(-1)]
        elif frame == "features":  # φ(X)ᵀY and φ(X)S with φ formed as read, power retention's d = 64 and V + 1:
            X, Y = rng.normal(size=(2, 64, 64)) / 8, rng.normal(size=(2, 64, 65))  # a sequence of two chunks,
            S = rng.normal(size=(3, 2080, 65))  # its three states (the products read the first two in place)
            phi = sympow(X)
            got = [ck.feature_states(f32(X), f32(Y), t), ck.feature_states(f32(X), f32(Y), t, f32(S[0])),
                   ck.feature_out(f32(X), f32(S), t), ck.feature_jac(f32(X), f32(S), f32(Y), t)]
            dS = np.einsum("ncf,ncv->nfv", phi, Y)
            ref = [dS, np.concatenate([dS, S[:1]]), np.einsum("ncf,nfv->ncv", phi, S[:2]),
                   sympow_vjp(X, np.einsum("nfv,ncv->ncf", S[:2], Y))]
        elif frame == "ut16":  # the factor-read UT transform writing U and W in bf16 (``Tuning.ut_16bit``)
            got, ref = [], []
            if ck.fuses_ut(t, C, K, V):
                x16 = f32(rng.normal(size=(n, C, K)) / np.sqrt(K)).astype(mx.bfloat16)
                w16 = f32(rng.normal(size=(n, C, V))).astype(mx.bfloat16)
                x, w_ = (np.array(a.astype(mx.float32), np.float64) for a in (x16, w16))
                fx = rng.uniform(size=(n, C, 1))
                got = list(ck.chunk_ut(None, x16, w16, f32(np.full((n, C, 1), -0.1)), t, f32(fx), -1.0, mx.bfloat16))
                ref = ut_expected(-x, fx * x, w_, -0.1 * np.arange(1, C + 1))[1]
        elif frame == "s16":  # GDN's kernels with 16-bit states (``Tuning.states_16bit``) against their float32 forms,
            got, ref = [], []  # which "mma" checks against float64: each within bf16 rounding
            if ck.fuses_ut(t, C, K, V) and ck.fuses_bwd(t, C, K, True):
                x16, q16 = (f32(rng.normal(size=(1, n, C, K)) / np.sqrt(K)).astype(mx.bfloat16) for _ in range(2))
                w16 = f32(rng.normal(size=(1, n, C, V))).astype(mx.bfloat16)
                l, g = f32(np.full((1, n, C, 1), -0.1)), f32(np.full((1, n, 1), 0.5))
                fx = f32(rng.uniform(size=(1, n, C, 1)))
                S0, Fs, Pb = f32(rng.normal(size=(1, K, V))), *(f32(rng.normal(size=(1, n, C, V))) for _ in range(2))
                prods = [f32(rng.normal(size=s)).astype(mx.bfloat16) for s in [(1, n, C, C)] * 2 + [(1, n, C, K)] * 3]
                DG, E = f32(rng.normal(size=(1, n))), f32(rng.normal(size=(1, n, K, V)))

                def run(st, up):
                    Tm, U, W = ck.chunk_ut(None, x16, w16, l, t, uf=fx, bf=-1.0, out=mx.bfloat16, st=st)
                    carried, Z, S_end = ck.chunk_scan(S0, W, U, x16, g, None, t, reverse=False, Bq=fx, st=st)
                    y, M = ck.chunk_out(q16, x16, Z, carried, l, t, uf=fx)
                    rev = ck.chunk_scan(S0, x16, up(Fs), W, g, None, t, reverse=True, P=(q16, up(Pb)), St=carried,
                                        Aq=fx, Pq=fx, st=st)
                    grads = ck.chunk_bwd(*(up(a) for a in prods[:2]), q16, x16, None, *(up(a) for a in prods[2:]), l,
                                         DG, t, uf=fx, bf=-1.0)
                    # and simple GLA's two scans (no delta rule: Y = X forward, no B term in reverse)
                    diag = ck.chunk_scan(S0, None, w16, x16, g, None, t, reverse=False, Bq=fx, st=st)
                    erev = ck.chunk_scan(S0, x16, up(Fs), None, g, E, t, reverse=True, Aq=fx, st=st)
                    # ... its E as the factors the backward has (``Tuning.scan_products_alone``), dg with them
                    prev = ck.chunk_scan(S0, x16, up(Fs), None, g, None, t, reverse=True, P=(q16, up(Pb)), St=carried,
                                         Aq=fx, Pq=fx, st=st)
                    return [Tm, U, W, carried, Z, S_end, y, M, *rev, *grads, diag[0], diag[2], *erev, *prev]
                got = run(mx.bfloat16, lambda a: a.astype(mx.bfloat16))
                ref = [np.array(a.astype(mx.float32), np.float64) for a in run(None, lambda a: a.astype(mx.float32))]
        elif frame == "wide":  # the readout, UT transform and both scans on the wide multiply-add
            got, ref = [], []  # against their TF32 forms, which "async" checks against float64: GDN's bf16 operands
            if ck.fuses_readout(t, C, K, V) and ck.fuses_ut(t, C, K, V):
                q16, x16 = (f32(rng.normal(size=(1, n, C, K)) / np.sqrt(K)).astype(mx.bfloat16) for _ in range(2))
                Z16, St16, w16 = (f32(rng.normal(size=s)).astype(mx.bfloat16)
                                  for s in ((1, n, C, V), (1, n, K, V), (1, n, C, V)))
                l, fx = f32(np.full((1, n, C, 1), -0.1)), f32(rng.uniform(size=(1, n, C, 1)))
                S0, g = f32(rng.normal(size=(1, K, V))), f32(np.full((1, n, 1), 0.5))
                gk = f32(rng.uniform(0.3, 1.0, size=(1, n, K)))
                # the backward's pass forming its pair cotangents from Z, dy and Δ (``Tuning.bwd_scores``)
                rows = (Z16, w16, f32(rng.normal(size=(1, n, C, V))).astype(mx.bfloat16))
                DUQ, DRP, DR = (f32(rng.normal(size=(1, n, C, K))) for _ in range(3))
                DG = f32(rng.normal(size=(1, n)))
                states = (St16, f32(rng.normal(size=(1, n, K, V))).astype(mx.bfloat16))  # S_c and dS_next
                bwd = ck.fuses_bwd(t, C, K, True)
                products = bwd and ck.scores_in_pass(t, rows + states)  # its products over values on it too

                def run(tt):
                    _, U, W = ck.chunk_ut(None, x16, w16, l, tt, uf=fx, bf=-1.0, out=mx.bfloat16, st=mx.bfloat16)
                    fwd = ck.chunk_scan(S0, W, U, x16, g, None, replace(tt, scan_ahead_most=0), reverse=False, Bq=fx,
                                        st=mx.bfloat16)
                    # ... and loading a step ahead (``Tuning.scan_ahead_most``; a probe's few threadgroups would
                    # always take it under CUDA's table, so each form is asked for by name)
                    fwd_ahead = ck.chunk_scan(S0, W, U, x16, g, None, replace(tt, scan_ahead_most=1 << 30),
                                              reverse=False, Bq=fx, st=mx.bfloat16)
                    rev = ck.chunk_scan(S0, x16, Z16, W, g, None, tt, reverse=True, P=(q16, Z16), St=fwd[0], Aq=fx,
                                        Pq=fx, st=mx.bfloat16)
                    # ... and simple GLA's, B-free in reverse, A-free forward (Y = X: carried and S_end)
                    rev += ck.chunk_scan(S0, x16, Z16, None, g, None, tt, reverse=True, P=(q16, Z16), St=fwd[0],
                                         Aq=fx, Pq=fx, st=mx.bfloat16)
                    rev += ck.chunk_scan(S0, None, w16, x16, g, None, tt, reverse=False, Bq=fx, st=mx.bfloat16)[::2]
                    # ... and GLA's, A-free with u ⊙ Q given in bf16 and a decay per key row (no row scales), and its
                    # reverse one with u ⊙ Q and r ⊙ P given in bf16 (``Tuning.key_scaled_16bit``)
                    rev += ck.chunk_scan(S0, None, w16, x16, gk, None, tt, reverse=False, st=mx.bfloat16)[::2]
                    rev += ck.chunk_scan(S0, x16, Z16, None, gk, None, tt, reverse=True, P=(q16, Z16), St=fwd[0],
                                         Pq=fx, st=mx.bfloat16)
                    sc = rows if bwd and ck.scores_in_pass(tt, rows) else None
                    zt = rows[0].astype(mx.float32).swapaxes(-1, -2)
                    dm = (None, None) if sc else tuple(a.astype(mx.float32) @ zt for a in (rows[2], rows[1]))
                    grads = (ck.chunk_bwd(*dm, q16, x16, None, DUQ, DRP, DR, l, DG, tt, uf=fx, bf=-1.0, scores=sc)
                             if bwd else [])
                    if products:  # the TF32 form staged from float32 copies
                        prods = rows + states if sc else tuple(a.astype(mx.float32) for a in rows + states)
                        grads = [*grads, *ck.chunk_bwd(*dm, q16, x16, None, None, None, None, l, DG, tt, uf=fx, bf=-1.0,
                                                       prods=prods, scores=sc)]
                    return [*ck.chunk_out(q16, x16, Z16, St16, l, tt, uf=fx), U, W, *fwd, *fwd_ahead, *rev, *grads]
                # simple GLA's forward with q, k and v in the model's layout (two value heads over one key head): the
                # A-free scan reading k and v so (``ScanVariant.xm``) and the staged readout q, k and v (``zm``),
                # against the TF32 forms on the chunks' layout
                ml = (2, 1, n, True)
                qm, km = (f32(rng.normal(size=(1, n * C, 1, K)) / np.sqrt(K)).astype(mx.bfloat16) for _ in range(2))
                vm = f32(rng.normal(size=(1, n * C, 2, V))).astype(mx.bfloat16)
                lh, fh = f32(np.full((1, 2, n, C, 1), -0.1)), f32(rng.uniform(size=(1, 2, n, C, 1)))
                S0h, gh = f32(rng.normal(size=(1, 2, K, V))), f32(np.full((1, 2, n, 1), 0.5))
                # ... and its backward reading q and k so (``parallel.reads_model_rows``): the B-free reverse scan and
                # the pass without a delta rule, dq and dk per value head in the model's layout
                Fh, dyh = (f32(rng.normal(size=(1, 2, n, C, V))).astype(mx.bfloat16) for _ in range(2))
                DGh = f32(rng.normal(size=(1, 2, n)))
                back = ck.fuses_bwd(t, C, K, False) and ck.scan_fuses_products(t, C, K, V, False)

                def simple(tt, m):
                    qx, kx, vx = (qm, km, vm) if m else (ck.model_chunks(x, n, ml) for x in (qm, km, vm))
                    carried, _, S_end = ck.chunk_scan(S0h, None, vx, kx, gh, None, tt, reverse=False, Bq=fh,
                                                      ml=ml if m else None, st=mx.bfloat16, x_model=m)
                    out = [carried, S_end, *ck.chunk_out(qx, kx, vx, carried, lh, tt, mx.bfloat16, 0.5,
                                                         ml=ml if m else None, z_model=m)]
                    if not back:
                        return out
                    rev = ck.chunk_scan(S0h, kx, Fh, None, gh, None, tt, reverse=True, P=(qx, dyh), St=carried,
                                        Aq=fh, Pq=fh, ml=ml if m else None, st=mx.bfloat16)
                    rows = (ck.model_chunks(vm, n), dyh, carried, rev[0])  # Z, dy, S_c, dS_next
                    if ck.scores_in_pass(tt, rows):  # the pair cotangents and the products over values in the pass
                        Z, dy, S, dSn = rows
                        pass_in = dict(prods=(Z, dy, None, S, dSn), scores=(Z, dy, None))
                        dr, du, _, dl = ck.chunk_bwd(None, None, qx, kx, None, None, None, None, lh, DGh, tt, 0.5,
                                                     ml=ml if m else None, **pass_in)
                    else:  # the TF32 form: those from MLX, in float32
                        Z, dy, S, dSn = (a.astype(mx.float32) for a in rows)
                        T_ = lambda a: a.swapaxes(-1, -2)  # noqa: E731
                        dr, du, _, dl = ck.chunk_bwd(None, dy @ T_(Z), qx, kx, None, Z @ T_(dSn), dy @ T_(S), None,
                                                     lh, DGh, tt, 0.5, ml=ml if m else None)
                    if not m:  # per value head in the model's layout, as the model-layout pass writes them
                        dr, du = (a.reshape(1, 2, n * C, K).transpose(0, 2, 1, 3) for a in (dr, du))
                    return [*out, *rev, dr, du, dl]
                got = run(t) + simple(t, True)
                tf32 = replace(t, wide_fragments=False, bwd_scores=False)
                ref = [np.array(a.astype(mx.float32), np.float64) for a in run(tf32) + simple(tf32, False)]
        elif frame == "rows":  # GDN's five kernels in the model's layout: B = 1, H = 2 over one key head, bf16 inputs
            got, ref = [], []
            if ck.fuses_ut(t, C, K, V) and ck.fuses_bwd(t, C, K, True):
                H, T = 2, n * C
                q, k, v = (f32(rng.normal(size=(1, T, h, d)) / np.sqrt(d)).astype(mx.bfloat16)
                           for h, d in ((1, K), (1, K), (H, V)))
                l, fx = f32(np.full((1, H, n, C, 1), -0.1)), f32(rng.uniform(size=(1, H, n, C, 1)))
                S0, Fs, Pb, St = (f32(rng.normal(size=s)) for s in ((1, H, K, V), (1, H, n, C, V), (1, H, n, C, V),
                                                                     (1, H, n, K, V)))
                dMA, dMR = (f32(rng.normal(size=(1, H, n, C, C))) for _ in range(2))
                DUQ, DRP, DR = (f32(rng.normal(size=(1, H, n, C, K))) for _ in range(3))
                DG, g = f32(rng.normal(size=(1, H, n))), f32(np.full((1, H, n, 1), 0.5))

                def run(qx, kx, vx, ml):
                    Tm, U, W = ck.chunk_ut(None, kx, vx, l, t, uf=fx, bf=-1.0, ml=ml)
                    carried, Z, _ = ck.chunk_scan(S0, W, U, kx, g, None, t, reverse=False, Bq=fx, ml=ml)
                    y, M = ck.chunk_out(qx, kx, Z, carried, l, t, mx.bfloat16, 0.5, uf=fx, ml=ml)
                    rev = ck.chunk_scan(S0, kx, Fs, W, g, None, t, reverse=True, P=(qx, Pb), St=St, Aq=fx, Pq=fx, ml=ml)
                    dr, dx, df, dl = ck.chunk_bwd(dMA, dMR, qx, kx, None, DUQ, DRP, DR, l, DG, t, 0.5, uf=fx, bf=-1.0,
                                                  ml=ml)
                    if ml is None:  # per value head in the model's layout, as the model-layout pass writes them
                        dr, dx = (a.reshape(1, H, T, K).transpose(0, 2, 1, 3) for a in (dr, dx))
                    return [Tm, U, W, carried, Z, y, M, *rev, dr, dx, df, dl]
                got = run(q, k, v, (H, 1, n, True))
                chunked = (ck.model_chunks(x, n, (H, 1, n, True)) for x in (q, k, v))  # the key head expanded
                ref = [np.array(a.astype(mx.float32), np.float64) for a in run(*chunked, None)]
        elif frame == "async":  # the readout staged by asynchronous copies: float32 operands in the chunks' layout, and
            got, ref = [], []     # GDN's call (bf16 q and k in the model's layout, u = f ⊙ k read so, bf16 y)
            if ck.fuses_readout(t, C, K, V):
                R, U = rng.normal(size=(n, C, K)) / K, rng.normal(size=(n, C, K))
                Z, St = rng.normal(size=(n, C, V)), rng.normal(size=(n, K, V))
                G = -0.1 * np.arange(1, C + 1)
                gam = np.tril(np.exp(G[:, None] - G[None, :]))
                l = f32(np.full((n, C, 1), -0.1))
                M = (R @ U.swapaxes(-1, -2)) * gam
                got += list(ck.chunk_out(f32(R), f32(U), f32(Z), f32(St), l, t))
                ref += [np.exp(G)[:, None] * (R @ St) + M @ Z, M]
                q16, x16 = (f32(a.reshape(1, n * C, 1, K)).astype(mx.bfloat16) for a in (R, U / np.sqrt(K)))
                q, x = (np.array(a.astype(mx.float32), np.float64).reshape(n, C, K) for a in (q16, x16))
                fx = rng.uniform(size=(n, C, 1))
                y = ck.chunk_out(q16, x16, f32(Z)[None, None], f32(St)[None, None], l[None, None], t, mx.bfloat16, 0.5,
                                 uf=f32(fx)[None, None], ml=(1, 1, n, True))[0]
                got.append(y)
                y_ = 0.5 * (np.exp(G)[:, None] * (q @ St) + ((q @ (fx * x).swapaxes(-1, -2)) * gam) @ Z)
                ref.append(y_.reshape(1, n * C, 1, V))
                # a key-vector decay's (GLA's call): M given, bf16 r beside float32 P, bf16 values and states, bf16 y
                Pk = np.exp(np.cumsum(-0.2 * rng.uniform(size=(n, C, K)), 1))
                z16, s16 = (f32(a).astype(mx.bfloat16) for a in (Z, St))
                z, s = (np.array(a.astype(mx.float32), np.float64) for a in (z16, s16))
                got.append(ck.chunk_out_key(q16.reshape(1, 1, n, C, K), f32(M)[None, None], z16[None, None],
                                            s16[None, None], f32(Pk)[None, None], t, mx.bfloat16, 0.5))
                ref.append((0.5 * (q * Pk) @ s + M @ z).reshape(1, n * C, 1, V))
                if ck.fuses_ut(t, C, K, V):  # and the UT transform: float32 roles, and GDN's call (b̃ = −k, bf16 out)
                    got += list(ck.chunk_ut(f32(-R), f32(U / K), f32(Z), l, t))
                    ref += ut_expected(-R, U / K, Z, G)[1]
                    w16 = f32(Z.reshape(1, n * C, 1, V)).astype(mx.bfloat16)
                    w = np.array(w16.astype(mx.float32), np.float64).reshape(n, C, V)
                    got += list(ck.chunk_ut(None, x16, w16, l[None, None], t, f32(fx)[None, None], -1.0, mx.bfloat16,
                                            ml=(1, 1, n, True)))
                    ref += [a[None, None] for a in ut_expected(-x, fx * x, w, G)[1]]
        elif frame == "hoist_e":  # a product-free reverse scan hoisted (KDA's and simple GLA's backward: A with Aq, E)
            S0, X, A = rng.normal(size=(1, K, V)), rng.normal(size=(1, n, C, V)), rng.normal(size=(1, n, C, K)) / K
            E, Aq = rng.normal(size=(1, n, K, V)), np.exp(-0.1 * np.arange(C - 1, -1, -1.0))[None, None].repeat(n, 1)
            got = list(ck.chunk_scan(f32(S0), f32(A), f32(X), None, f32(np.full((1, n, 1), 0.5)), f32(E), t,
                                     reverse=True, Aq=f32(Aq)[..., None]))
            ref = [a[None] for a in scan_expected(S0[0], Aq[0][..., None] * A[0], X[0], E=E[0], reverse=True)]
        elif frame == "keyfactor":  # KDA's factor reads (``Tuning.key_factor_reads``), decay e^-0.1 a token
            Xp, Yp = rng.normal(size=(1, C, K)), rng.normal(size=(1, C, K))
            got, ref = [], []
            if ck.fuses_key_tail(t, C) and K % 32 == 0:  # the tail: the pairs' gradients are of x = Yp
                Lk = np.full((1, C, K), -0.1)
                D = rng.normal(size=(6, 1, C, K))  # DRX, DUX, DBX, DRP, DUQ, DR
                dgk, fx, rho = rng.normal(size=(1, K)), rng.uniform(size=(1, C, 1)), -1.0
                P, Q = np.exp(np.cumsum(Lk, 1)), np.exp(-0.1 * np.arange(C - 1, -1, -1.0))[None, :, None]
                dr = P * D[3] + D[0]
                dx = D[2] + D[1] + fx * Q * D[4] + rho * P * D[5]
                dG = Xp * dr - Yp * D[1] - fx * Yp * Q * D[4] + Yp * D[2] + rho * Yp * P * D[5]
                dG[:, -1] += (fx * Yp * Q * D[4]).sum(1) + P[:, -1] * dgk
                got += list(ck.chunk_bwd_key(f32(Xp), f32(Yp), None, f32(Lk), *(f32(x) for x in D), f32(dgk), t,
                                             uf=f32(fx), bf=rho))
                ref += [dr, dx, (Yp * Q * D[4]).sum(-1, keepdims=True), np.cumsum(dG[:, ::-1], 1)[:, ::-1]]
            if ck.fuses_ut(t, C, K, V):  # the UT transform reading b̃ = −x, A given
                A = np.tril(rng.normal(size=(1, C, C)), -1) * 0.5 / np.sqrt(C)
                W, Pk = rng.normal(size=(1, C, V)), np.exp(np.cumsum(-0.2 * rng.uniform(size=(1, C, K)), 1))
                T = np.linalg.inv(np.eye(C) - A)
                got.append(ck.chunk_ut_key(f32(A), f32(W), f32(Xp / K), f32(Pk), t, bf=-1.0)[2])
                ref.append(T @ (-Xp / K * Pk))
        elif frame == "tail":  # the key-decay backward tails (delta rule; rank-1), decay e^-0.1 a token
            Xp, Yp = rng.normal(size=(1, C, K)), rng.normal(size=(1, C, K))
            got, ref = [], []
            if ck.fuses_key_tail(t, C):
                Lk = np.full((1, C, K), -0.1)
                D = rng.normal(size=(7, 1, C, K))  # DRX, DUX, DBX, DRP, DUQ, DR, and b̃
                dgk = rng.normal(size=(1, K))
                P, Q = np.exp(np.cumsum(Lk, 1)), np.exp(-0.1 * np.arange(C - 1, -1, -1.0))[None, :, None]
                dr, du, db = P * D[3] + D[0], Q * D[4] + D[1], P * D[5] + D[2]
                dG = Xp * dr - Yp * du + D[6] * db
                dG[:, -1] += (Yp * Q * D[4]).sum(1) + P[:, -1] * dgk
                got += list(ck.chunk_bwd_key(f32(Xp), f32(Yp), f32(D[6]), f32(Lk), *(f32(x) for x in D[:6]), f32(dgk), t))
                ref += [dr, du, db, np.cumsum(dG[:, ::-1], 1)[:, ::-1]]
                # and the general rank-1 core's, the transition before the decay (RWKV-7): b's pairs one token earlier
                A_, B_, DAX, DBX, DAQ, DBP = rng.normal(size=(6, 1, C, K))
                da = Q * DAQ + DAX
                Pb = np.concatenate([np.ones((1, 1, K)), P[:, :-1]], 1)
                db = Pb * DBP + np.concatenate([np.zeros((1, 1, K)), DBX[:, :-1]], 1)
                dG = Xp * dr - Yp * du - A_ * da + np.concatenate([(B_ * db)[:, 1:], np.zeros((1, 1, K))], 1)
                dG[:, -1] += (Yp * Q * D[4] + A_ * Q * DAQ).sum(1) + P[:, -1] * dgk
                got += list(ck.chunk_bwd_rank1(*(f32(x) for x in (Xp, Yp, A_, B_, Lk, D[0], D[1], DAX, DBX, D[3], D[4],
                                                                  DAQ, DBP, dgk)), t, before=True))
                ref += [dr, du, da, db, np.cumsum(dG[:, ::-1], 1)[:, ::-1]]
        else:
            S0, X = rng.normal(size=(1, K, V)), rng.normal(size=(1, n, C, V))
            A, Bm = rng.normal(size=(1, n, C, K)) / K, rng.normal(size=(1, n, C, K)) / C
            # the fragment frame as the forward runs it: B (u) in bf16, its rows scaled by Bq (Q) as read
            Bq = np.exp(-0.1 * np.arange(C - 1, -1, -1.0))[None, None].repeat(n, 1)
            Bm16 = f32(Bm).astype(mx.bfloat16)
            # "hoist": the same kernels, the scans' state-free operands loaded first; "products": the backward's pass
            # forming its products over values too
            frag = frame in ("mma", "hoist", "products")
            Bs = np.array(Bm16.astype(mx.float32), np.float64) * Bq[..., None] if frag else Bm
            carried, Y, S = scan_expected(S0[0], A[0], X[0], Bs[0])
            g = f32(np.full((1, n, 1), 0.5))
            got = list(ck.chunk_scan(f32(S0), f32(A), f32(X), Bm16 if frag else f32(Bm), g, None,
                                     t, reverse=False, Bq=f32(Bq)[..., None] if frag else None))
            ref = [carried[None], Y[None], S[None]]
            if frag:  # and in reverse, as the backward runs it (its own group count: ``reverse_scan_nw``)
                rev_c, _, S = scan_expected(S0[0], A[0], X[0], Bs[0], reverse=True)
                got += list(ck.chunk_scan(f32(S0), f32(A), f32(X), Bm16, g, None, t, reverse=True,
                                          Bq=f32(Bq)[..., None]))[0::2]
                ref += [rev_c[None], S[None]]
            if frag:  # and the readout, at decay e^-0.1 a token: y = e^{G} R S_c + ((R Uᵀ) ⊙ Γ) X_c
                R, U = rng.normal(size=(n, C, K)) / K, rng.normal(size=(n, C, K))
                G = -0.1 * np.arange(1, C + 1)
                gam = np.tril(np.exp(G[:, None] - G[None, :]))
                M = (R @ U.swapaxes(-1, -2)) * gam
                outs = [f32(R), f32(U), f32(X[0]), f32(carried), f32(np.full((n, C, 1), -0.1))]
                yref = np.exp(G)[:, None] * (R @ carried) + M @ X[0]
                got = [*got, *ck.chunk_out(*outs, t)]
                # and in the model's layout and type (B = H = 1: [1, n C, 1, V] bf16)
                got.append(ck.chunk_out(*(x[None, None] for x in outs), t, mx.bfloat16)[0])
                ref += [yref, M, yref.reshape(1, n * C, 1, V)]
                # and the UT transform (A = (-R Uᵀ / K) ⊙ Γ strictly below the diagonal), where its tiles fit
                if ck.fuses_ut(t, C, K, V):
                    A, expected = ut_expected(-R / K, U, X[0], G)
                    T = expected[0]
                    got = [*got, *ck.chunk_ut(f32(-R / K), f32(U), f32(X[0]), f32(np.full((n, C, 1), -0.1)), t)]
                    ref += expected
                    # and a key-vector decay's: A given, its decays per key element
                    Pk = np.exp(np.cumsum(-0.2 * rng.uniform(size=(n, C, K)), 1))
                    got = [*got, *ck.chunk_ut_key(f32(A), f32(X[0]), f32(-R / K), f32(Pk), t)]
                    ref += [T, T @ X[0], T @ (-R / K * Pk)]
                    # and its readout: M given, r ⊙ P per key element, the readout role 0.5 r
                    got.append(ck.chunk_out_key(f32(R), f32(M), f32(X[0]), f32(carried), f32(Pk), t, rs=0.5))
                    ref.append(0.5 * (R * Pk) @ carried + M @ X[0])
                # and the backward's pass after the scan (the delta rule's form), where its tiles fit
                if ck.fuses_bwd(t, C, K, True):
                    dMA, dMR = rng.normal(size=(2, n, C, C))
                    DUQ, DRP, DR = rng.normal(size=(3, n, C, K))
                    Bt, DG = -U / K, rng.normal(size=n)
                    Ea, Er = dMA * np.tril(gam, -1), dMR * gam
                    P, Q = np.exp(G)[:, None], gam[-1][:, None]

                    # the pass in float64 for roles r = R, u and b̃ = b and its products over values: (dr, du, db̃, dl)
                    def bwd_expected(u, b, DUQ=DUQ, DRP=DRP, DR=DR):
                        dr, db = P * DRP + Er @ u, P * DR + Ea @ u
                        du = Q * DUQ + Er.swapaxes(-1, -2) @ R + Ea.swapaxes(-1, -2) @ b
                        dG = (R * dr - u * du + b * db).sum(-1)
                        dG[:, -1] += (u * Q * DUQ).sum((1, 2)) + P[-1, 0] * DG
                        return [dr, du, db, np.cumsum(dG[:, ::-1], 1)[:, ::-1, None]]

                    got = [*got, *ck.chunk_bwd(*(f32(x) for x in (dMA, dMR, R, U, Bt, DUQ, DRP, DR)),
                                               f32(np.full((n, C, 1), -0.1)), f32(DG), t)]
                    ref += bwd_expected(U, Bt)
                    # and with factor reads: u = f ⊙ x, b̃ = ρ x read from one key x in bf16 (GDN's β k and −k, as
                    # the model passes them: the readout in the model's layout and type)
                    x16 = f32(U / np.sqrt(K)).astype(mx.bfloat16)
                    x, fx, rho = np.array(x16.astype(mx.float32), np.float64), rng.uniform(size=(n, C, 1)), -1.0
                    u_, b_ = fx * x, rho * x
                    w16 = f32(X[0]).astype(mx.bfloat16)  # v in bf16 too, as the model passes it
                    w_ = np.array(w16.astype(mx.float32), np.float64)
                    got = [*got, *ck.chunk_ut(None, x16, w16, f32(np.full((n, C, 1), -0.1)), t, f32(fx), rho)]
                    ref += ut_expected(b_, u_, w_, G)[1]
                    outs = [f32(R), x16, f32(X[0]), f32(carried), f32(np.full((n, C, 1), -0.1))]
                    got.append(ck.chunk_out(*(v[None, None] for v in outs), t, mx.bfloat16, uf=f32(fx)[None, None])[0])
                    y_ = np.exp(G)[:, None] * (R @ carried) + ((R @ u_.swapaxes(-1, -2)) * gam) @ X[0]
                    ref.append(y_.reshape(1, n * C, 1, V))
                    dr, du, dbt, dl = bwd_expected(u_, b_)
                    got = [*got, *ck.chunk_bwd(*(f32(v) for v in (dMA, dMR, R)), x16, None, *(f32(v) for v in (DUQ, DRP, DR)),
                                               f32(np.full((n, C, 1), -0.1)), f32(DG), t, uf=f32(fx), bf=rho)]
                    ref += [dr, fx * du + rho * dbt, (du * x).sum(-1, keepdims=True), dl]
                    if ck.products_in_pass(t, C, K, V, True):  # and the products over values formed in the pass
                        Zv, dYv, Dv = rng.normal(size=(3, n, C, V))
                        Sv, dSv = rng.normal(size=(2, n, K, V)) / np.sqrt(V)
                        formed = (Zv @ dSv.swapaxes(-1, -2), dYv @ Sv.swapaxes(-1, -2), Dv @ Sv.swapaxes(-1, -2))
                        got = [*got, *ck.chunk_bwd(*(f32(v) for v in (dMA, dMR, R)), x16, None, None, None, None,
                                                   f32(np.full((n, C, 1), -0.1)), f32(DG), t, uf=f32(fx), bf=rho,
                                                   prods=tuple(f32(v) for v in (Zv, dYv, Dv, Sv, dSv)))]
                        dr, du, dbt, dl = bwd_expected(u_, b_, *formed)
                        ref += [dr, fx * du + rho * dbt, (du * x).sum(-1, keepdims=True), dl]
        mx.eval(got)
    except Exception as e:  # noqa: BLE001 -- any build or launch failure means: do not use this frame
        if "transformation" in str(e):  # MLX: "[eval] Attempting to eval an array during function transformations"
            raise _InTransform() from e
        return f"{type(e).__name__}: {e}"
    for a, b in zip(got, ref):
        err = float(np.abs(np.array(a.astype(mx.float32), np.float64) - b).max() / (np.abs(b).max() + 1e-30))
        if not err < 1e-2:  # TF32 fragments: ~1e-3; a bf16 output: ~4e-3
            return f"{frame} kernel output off by {err:.1e} relative"
    return None


def wide_products(t: Tuning) -> bool:
    """Whether the backward's products over values run on the wide multiply-add with its pair cotangents, which the
    "wide" frame checks (``Tuning.bwd_products`` with ``bwd_scores``): then "products" (their staged TF32 form, with
    the "mma" frame's kernels) is not probed."""
    return t.bwd_products and t.wide_fragments and t.bwd_scores


def first_probed(t: Tuning, frames: frozenset) -> frozenset:
    """The frames of ``frames`` that ``checked`` probes for ``t`` where every one passes: the base frames, and each
    opt-in frame where the tuning asks for its choice ("mma" only where no hoisting is asked for, "scan" never,
    "products" not where they are wide)."""
    hoisting = t.mma_scan and (t.scan_hoist or t.reverse_scan_hoist)
    asked = {f for f, flags in FRAME_FLAGS.items() if any(getattr(t, x) for x in flags)} - (
        {"products"} if wide_products(t) else set())
    return frozenset(f for f in frames if f in asked or f in ("base", "sympow") or (f == "mma" and not hoisting))


def prefetch_frames(dialect: str, frames, sizes: tuple, kernel_cache: str) -> int:
    """The kernels of ``frames``' self-tests made side by side in the kernel cache before they are probed one by one
    (``kernel_binary.prefetch``): each frame built once with its kernel calls recorded, not run. Returns how many."""
    calls: list = []
    for frame in sorted(frames):
        with ck.recording() as recorded:
            try:
                _probe.__wrapped__(dialect, frame, sizes, kernel_cache)  # outputs are zeros: its verdict is dropped
            except Exception:  # noqa: BLE001 -- a frame that fails to build fails again when probed, and says why
                pass
        calls += recorded
    return kernel_binary.prefetch(calls, kernel_cache)


def usable(dialect: str, frame: str = "base", sizes: tuple = PROBE, kernel_cache: str = "") -> bool:
    """Whether ``frame``'s kernels pass their self-test (``_probe``) on this machine's GPU, whose dialect
    ``dialect`` must be; a failure warns once and is remembered (``_failed``: the fragment frame's then
    keeps the scan on FMAs). Where MLX refuses to evaluate it (inside a transformation) it is assumed to pass.
    ``kernel_cache``: the tuning's (the frame's kernels are the ones its model then runs: kept with them)."""
    try:
        err = _probe(dialect, frame, sizes, kernel_cache)
    except _InTransform:
        return True
    if err is not None and (dialect, frame) not in _failed:
        _failed.add((dialect, frame))
        what = {"mma": "the fragment scan (the FMA scan is used)",
                "pairs": "the pair kernels on fragments (their FMA form is used)",
                "tail": "the fused backward (MLX ops are used for it)",
                "ut16": "the UT transform's 16-bit outputs (float32 is used)",
                "s16": "the 16-bit chunk states (float32 is used)",
                "wide": "the wide multiply-add on 16-bit operands (TF32 fragments are used)",
                "keyfactor": "KDA's factor reads (its roles are formed)",
                "rows": "the model-layout reads of q, k, v (they are copied to the chunks' layout)",
                "hoist": "the scans' hoisted loads (each operand is loaded where it is used)",
                "hoist_e": "the product-free scans' hoisted loads (each operand is loaded where it is used)",
                "async": "the readout's and UT transform's asynchronous staging (their synchronous frames are used)",
                "decode": "the feature decode kernel (MLX ops are used for the step)",
                "features": "the feature product kernels (φ is formed in memory)",
                "scores": "the decayed-scores kernels (MLX ops are used for them)",
                "mix": "the products over chunks (MLX products are used)",
                "factors": "the decay factors' kernels (MLX ops are used for them)",
                "products": "the backward pass's products over values (MLX products are used)"}.get(
                    frame, "the chunk kernels (MLX ops are used)")
        warnings.warn(f"recgen: {what} failed a self-test on this {dialect} GPU: {err}", RuntimeWarning, stacklevel=3)
    return err is None


_failed: set = set()  # (dialect, frame) that failed ``usable`` in this process
