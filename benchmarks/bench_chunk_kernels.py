"""The generated chunk kernels alone on a GPU, against the MLX-op forms they replace, same inputs.

    python benchmarks/bench_chunk_kernels.py [--shape B,T,H,D] [--chunk C] [--layouts BV/NR,...] [--mma-layouts BV/NW,...]

At B=4, T=4096, H=16, D=128 and chunk 64 (the GDN forward's operands, float32): the triangular
inverse (kernel vs ``core.unit_lower_inv`` from 16×16 blocks, both compiled), the forward delta-rule
scan (kernel vs the composed MLX loop the GPU form runs) and the backward scan (kernel vs its MLX
loop), each checked against the other (max relative difference) and timed (median of 10 queued
calls, ms); each scan in both frames (FMA, fragment multiply-adds). ``--mma-layouts BV/NW,..`` times the fragment
scan at other layouts (columns / SIMD groups per threadgroup). ``--layouts`` times the scan kernel at other threadgroup layouts (columns BV / most row groups MAX_NR).
The scalar-decay readout: the fragment kernel at column blocks ``--out-bv`` (default 32,64,128) against
MLX's products.
"""
from __future__ import annotations

import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu import timeit  # noqa: E402

from recgen.chunked import kernels as ck  # noqa: E402
from recgen.chunked import parallel  # noqa: E402
from recgen.chunked.core import unit_lower_inv  # noqa: E402


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


class Geo:  # the two fields the scans read
    def __init__(self, g):
        self.g, self.l, self.key = g, None, g.shape[-1] > 1


def maxrel(a, b):
    return float(mx.abs(a - b).max() / mx.abs(b).max())


def diag_layouts(dialect, B, H, n, C, K, V, S0, U, uQ, F, E):
    """The diagonal scans of a scalar decay without a delta rule (simple GLA), as the core runs them: forward
    (no A; B = u in bf16, its rows scaled by Q as read) and backward (no B; A = u ⊙ Q, E), at the fragment
    layouts ``--diag-layouts BV/NW,..``, each forward checked against the default layout's scan of u ⊙ Q formed
    by MLX (no row scales)."""
    k16, v16 = uQ.astype(mx.bfloat16), U.astype(mx.bfloat16)
    Qd = mx.exp(-0.01 * mx.random.uniform(shape=(B, H, n, C, 1)))
    g1 = mx.exp(-0.5 * mx.random.uniform(shape=(B, H, n, 1)))
    saved = ck.MMA_BV, ck.MMA_NW
    ck.MMA_SCAN = True
    want = ck.chunk_scan(S0, None, v16, (Qd * k16).astype(mx.float32), g1, None, dialect, reverse=False)[0]
    mx.eval(want)
    for bv, nw in ((int(a), int(b)) for a, b in (x.split("/") for x in arg("--diag-layouts", "").split(",") if x)):
        ck.MMA_BV, ck.MMA_NW = bv, nw
        ck.scan_mma_layout.cache_clear()
        ck.scan_mma_launch.cache_clear()
        dfw = mx.compile(lambda s0, x, b, q, g: ck.chunk_scan(s0, None, x, b, g, None, dialect, reverse=False, Bq=q))
        dbw = mx.compile(lambda s0, a, x, g, e: ck.chunk_scan(s0, a, x, None, g, e, dialect, reverse=True))
        print(f"  diagonal scans at {ck.scan_mma_layout(C, K, V)}: forward (bf16 u, v; Q on read) "
              f"{timeit(lambda: dfw(S0, v16, k16, Qd, g1), queue=10):.3f} ms, backward "
              f"{timeit(lambda: dbw(S0, uQ, F, g1, E), queue=10):.3f} ms; forward states max rel diff to the default "
              f"layout {maxrel(dfw(S0, v16, k16, Qd, g1)[0], want):.1e}")
    ck.MMA_BV, ck.MMA_NW = saved
    ck.MMA_SCAN = None
    ck.scan_mma_layout.cache_clear()
    ck.scan_mma_launch.cache_clear()


def main():
    B, T, H, D = map(int, arg("--shape", "4,4096,16,128").split(","))
    C = int(arg("--chunk", "64"))
    n, K, V = T // C, D, D
    dialect = "cuda" if mx.cuda.is_available() else "metal"
    mx.random.seed(0)
    nrm = lambda *s, a=1.0: a * mx.random.normal(s)  # noqa: E731
    k = nrm(B, H, n, C, K)
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    L = mx.tril(0.3 * (k @ k.swapaxes(-1, -2)), -1)
    inv_k = mx.compile(lambda x: ck.tril_inverse(x, dialect))
    inv_m = mx.compile(lambda x: unit_lower_inv(x, 16))
    print(f"tril inverse [{B},{H},{n},{C},{C}]: max rel diff {maxrel(inv_k(L), inv_m(L)):.2e}; "
          f"kernel {timeit(lambda: inv_k(L), queue=10):.3f} ms, MLX ops {timeit(lambda: inv_m(L), queue=10):.3f} ms")

    S0, U, W, uQ = nrm(B, H, K, V), nrm(B, H, n, C, V), nrm(B, H, n, C, K, a=0.05), nrm(B, H, n, C, K, a=0.05)
    F, E = nrm(B, H, n, C, V), nrm(B, H, n, K, V)
    if "--diag-only" in sys.argv:
        return diag_layouts(dialect, B, H, n, C, K, V, S0, U, uQ, F, E)
    for key in (() if "--readout-only" in sys.argv else (False, True)):
        g = mx.exp(-0.5 * mx.random.uniform(shape=(B, H, n, K if key else 1)))
        geo = Geo(g)
        fa, ba = (S0, uQ, U, W, True, True), (S0, uQ, W, F, E, False, True)
        fm = mx.compile(lambda *a: parallel._scan_forward(geo, *a))
        bm = mx.compile(lambda *a: parallel._scan_backward(geo, *a))
        for mma in (False, True):  # the FMA frame, then the fragment frame (traced with the switch set)
            ck.MMA_SCAN = mma
            fk = mx.compile(lambda *a: parallel._scan_forward(geo, *a, kern=dialect))
            bk = mx.compile(lambda *a: parallel._scan_backward(geo, *a, kern=dialect))
            dk = [maxrel(x, y) for x, y in zip(fk(*fa), fm(*fa))] + [maxrel(x, y) for x, y in zip(bk(*ba), bm(*ba))]
            ck.MMA_SCAN = None
            frame = "fragment (mma)" if mma else "FMA"
            print(f"scan decay={'key' if key else 'scalar'}, {frame} frame: max rel diff to the MLX loop, fwd "
                  "(states, Z, S_end) / bwd (dS, dZ, dS0) " + " ".join(f"{d:.1e}" for d in dk))
            print(f"  forward  kernel {timeit(lambda: fk(*fa), queue=10):.3f} ms, MLX loop (composed) "
                  f"{timeit(lambda: fm(*fa), queue=10):.3f} ms")
            print(f"  backward kernel {timeit(lambda: bk(*ba), queue=10):.3f} ms, MLX loop "
                  f"{timeit(lambda: bm(*ba), queue=10):.3f} ms")
        # the backward with E = Paᵀ Pb given as its factors (the core's (r ⊙ P, dy)), fragment frame: read as
        # factors by the kernel, against multiplied out by MLX first
        ck.MMA_SCAN = True
        bp = mx.compile(lambda s0, uq, w, f, pa, pb: parallel._scan_backward(geo, s0, uq, w, f, (pa, pb), False, True,
                                                                             kern=dialect))
        bo = mx.compile(lambda s0, uq, w, f, pa, pb: parallel._scan_backward(geo, s0, uq, w, f, pa.swapaxes(-1, -2) @ pb,
                                                                             False, True, kern=dialect))
        pargs = (S0, uQ, W, F, uQ, U)
        d = [maxrel(x, y) for x, y in zip(bp(*pargs), bo(*pargs))]
        ck.MMA_SCAN = None
        print(f"  backward, E as factors: kernel {timeit(lambda: bp(*pargs), queue=10):.3f} ms; multiplied out first "
              f"{timeit(lambda: bo(*pargs), queue=10):.3f} ms; max rel diff " + " ".join(f"{x:.1e}" for x in d))
    # the scalar-decay readout y = (r ⊙ P) S_c + M_ru Z: the fragment kernel (at several column blocks) against
    # the MLX products it replaces (M_ru = (r uᵀ) ⊙ Γ, two GEMMs), GDN's operand sizes
    r, u = nrm(B, H, n, C, K, a=K ** -0.5), nrm(B, H, n, C, K, a=K ** -0.5)
    st, lg = nrm(B, H, n, K, V), -0.5 * mx.random.uniform(shape=(B, H, n, C, 1))
    def out_ops(r, u, z, st, lg):
        geo = parallel.ScalarDecay(lg)
        return (r * geo.P) @ st + geo.pair(r, u, strict=False) @ z
    om = mx.compile(out_ops)
    want = om(r, u, U, st, lg)
    print(f"readout [{B},{H},{n},{C},{K}|{V}]: MLX ops {timeit(lambda: om(r, u, U, st, lg), queue=10):.3f} ms")
    for bv in (int(x) for x in arg("--out-bv", "32,64,128").split(",")):
        ck.OUT_BV = bv
        ck.out_mma_layout.cache_clear()
        ck.out_mma_launch.cache_clear()
        ok = mx.compile(lambda *a: ck.chunk_out(*a, dialect))
        print(f"  fragment kernel {ck.out_mma_layout(dialect, C, K, V)}: {timeit(lambda: ok(r, u, U, st, lg), queue=10):.3f} ms, "
              f"max rel diff {maxrel(ok(r, u, U, st, lg)[0], want):.1e}")
    ck.OUT_BV = 128
    ck.out_mma_layout.cache_clear()
    ck.out_mma_launch.cache_clear()
    # the delta rule's UT transform (A = M_b̃u, Tm = (I − A)^{-1}, Tm w, Tm (b̃ ⊙ P)): the fragment kernel at two
    # column passes against the MLX products and the inverse kernel it replaces
    bt = -0.5 * r
    def ut_ops(bt, u, w, lg):
        geo = parallel.ScalarDecay(lg)
        Tm = ck.tril_inverse(geo.pair(bt, u, strict=True), dialect)
        return Tm, Tm @ w, Tm @ (bt * geo.P)
    um = mx.compile(ut_ops)
    want = um(bt, u, U, lg)
    print(f"UT transform: MLX products and the inverse kernel {timeit(lambda: um(bt, u, U, lg), queue=10):.3f} ms")
    for bw in (64, 128):
        ck.UT_BW = bw
        ck.ut_mma_layout.cache_clear()
        ck.ut_mma_launch.cache_clear()
        uk = mx.compile(lambda *a: ck.chunk_ut(*a, dialect))
        got = uk(bt, u, U, lg)
        print(f"  fragment kernel {ck.ut_mma_layout(dialect, C, K, V)}: {timeit(lambda: uk(bt, u, U, lg), queue=10):.3f} ms, "
              "max rel diff (Tm, U, W) " + " ".join(f"{maxrel(a, b):.1e}" for a, b in zip(got, want)))
    ck.UT_BW = 128
    ck.ut_mma_layout.cache_clear()
    ck.ut_mma_launch.cache_clear()
    for bv, nw in ((int(a), int(b)) for a, b in (x.split("/") for x in arg("--mma-layouts", "").split(",") if x)):
        ck.MMA_BV, ck.MMA_NW, ck.MMA_SCAN = bv, nw, True
        ck.scan_mma_layout.cache_clear()
        ck.scan_mma_launch.cache_clear()
        geo = Geo(mx.exp(-0.5 * mx.random.uniform(shape=(B, H, n, 1))))
        fk = mx.compile(lambda *a: parallel._scan_forward(geo, *a, kern=dialect))
        bk = mx.compile(lambda *a: parallel._scan_backward(geo, *a, kern=dialect))
        print(f"  fragment layout {ck.scan_mma_layout(C, K, V)}: forward {timeit(lambda: fk(*fa), queue=10):.3f} ms, "
              f"backward {timeit(lambda: bk(*ba), queue=10):.3f} ms")
    diag_layouts(dialect, B, H, n, C, K, V, S0, U, uQ, F, E)
    ck.MMA_SCAN = None
    for lay in arg("--layouts", "").split(","):
        if not lay:
            continue
        ck.BV, ck.MAX_NR = map(int, lay.split("/"))
        ck.scan_launch.cache_clear()
        ck.scan_layout.cache_clear()
        try:
            ck.scan_layout(dialect, C, K)
        except ValueError as e:
            print(f"  layout BV={ck.BV} MAX_NR={ck.MAX_NR}: {e}")
            continue
        geo = Geo(mx.exp(-0.5 * mx.random.uniform(shape=(B, H, n, 1))))
        fk = mx.compile(lambda *a: parallel._scan_forward(geo, *a, kern=dialect))
        ref = mx.compile(lambda *a: parallel._scan_forward(geo, *a))(S0, uQ, U, W, True, True)[1]
        d = maxrel(fk(S0, uQ, U, W, True, True)[1], ref)
        print(f"  layout BV={ck.BV} MAX_NR={ck.MAX_NR} {ck.scan_layout(dialect, C, K)}: forward kernel "
              f"{timeit(lambda: fk(S0, uQ, U, W, True, True), queue=10):.3f} ms (Z max rel diff {d:.1e})")


if __name__ == "__main__":
    main()
