"""Where the chunked core's time goes: each stage evaluated on its own (one eval per stage, so the
numbers include one sync each), at B=4, T=4096, H=16, D=128 by default, on the default device.

    python benchmarks/profile_chunked.py [--shape B,T,H,D] [--chunk C] [--key]

Also times 64 tiny chained matmuls (the per-launch floor of a sequential scan step) and prints the
op counts of the core's forward and backward graphs."""
from __future__ import annotations

import collections
import io
import re
import sys
import time

import mlx.core as mx

from recgen.chunked import core, parallel


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def t(label, fn, reps=5):
    mx.eval(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    ts.sort()
    print(f"  {label:34s} {ts[len(ts) // 2] * 1e3:8.3f} ms", flush=True)


def ops(*outs):
    f = io.StringIO()
    mx.export_to_dot(f, *outs)
    c = collections.Counter(re.findall(r'label ="([A-Za-z]+)', f.getvalue()))
    views = sum(c[k] for k in ("Slice", "Squeeze", "ExpandDims", "Reshape", "Broadcast", "Transpose", "Split"))
    return f"{sum(c.values())} ops ({sum(c.values()) - views} not views)"


def main():
    B, T, H, D = map(int, arg("--shape", "4,4096,16,128").split(","))
    C = int(arg("--chunk", "64"))
    key = "--key" in sys.argv
    n, K, V = T // C, D, D
    F = K if key else 1
    mx.random.seed(0)
    r = mx.random.normal((B, H, n, C, K)) * K ** -0.5
    u = mx.random.normal((B, H, n, C, K)) * K ** -0.5
    w = mx.random.normal((B, H, n, C, V))
    bt = -u * 0.5
    l = -mx.random.uniform(shape=(B, H, n, C, F)) * 0.5
    S0 = mx.zeros((B, H, K, V))
    dy, dS = mx.random.normal((B, H, n, C, V)), mx.random.normal((B, H, K, V))
    mx.eval(r, u, w, bt, l, S0, dy, dS)
    compose = 2 * C >= K
    print(f"device {mx.default_device()}, B={B} T={T} H={H} D={D} C={C} n={n} key={key} compose={compose}")
    Geo = parallel.KeyDecay if key else parallel.ScalarDecay
    geo = Geo(l)
    mx.eval(geo.P, geo.Q, geo.g)
    t("geometry", lambda: [Geo(l).P, Geo(l).Q])
    A = geo.pair(bt, u, strict=True)
    t("pair (C×C per chunk)", lambda: geo.pair(bt, u, strict=True))
    for base in sorted({b for b in (1, 8, 16, 32) if b < C} | {C}):
        t(f"unit_lower_inv, base {base}", lambda: core.unit_lower_inv(A, base))
    Tm = core.unit_lower_inv(A, parallel.inverse_base())
    mx.eval(Tm)
    t("U, W", lambda: [Tm @ w, Tm @ (bt * geo.P)])
    U, W = Tm @ w, Tm @ (bt * geo.P)
    uQ = u * geo.Q
    mx.eval(U, W, uQ)
    t("scan with rank-1 (delta), loop", lambda: parallel._scan_forward(geo, S0, uQ, U, W, compose, False)[:2])
    t("scan diagonal, loop", lambda: parallel._scan_forward(geo, S0, uQ, w, None, compose, False)[:2])
    t("scan diagonal, matrix", lambda: parallel._scan_forward(geo, S0, uQ, w, None, compose, True)[:2])
    st, Z, _ = parallel._scan_forward(geo, S0, uQ, U, W, compose, False)
    mx.eval(st, Z)
    t("readout y", lambda: (r * geo.P) @ st + geo.pair(r, u, strict=False) @ Z)
    for delta in (True, False):
        for comp in (False, True):
            fn = parallel.core_fn(key, delta, compose, True, comp)
            args = [S0, r, u, w, l] + ([bt] if delta else [])
            name = f"{'delta' if delta else 'diag'} {'compiled' if comp else 'eager'}"
            t(f"core fwd   {name}", lambda: fn(*args)[:2])
            t(f"core fwd+bwd {name}", lambda: mx.vjp(lambda *a: tuple(fn(*a)[:2]), args, [dy, dS])[1])
        fn = parallel.core_fn(key, delta, compose, True, False)
        args = [S0, r, u, w, l] + ([bt] if delta else [])
        print(f"  graph {'delta' if delta else 'diag'}: fwd {ops(*fn(*args)[:2])}, "
              f"fwd+bwd {ops(*mx.vjp(lambda *a: tuple(fn(*a)[:2]), args, [dy, dS])[1])}")
    x = mx.random.normal((B * H, 8, 8))
    mx.eval(x)

    def chain():
        y = x
        for _ in range(64):
            y = y @ x
        return y
    t("64 chained tiny matmuls", chain)


if __name__ == "__main__":
    main()
