"""GPU benchmark: recgen's generated CUDA kernels vs a naive MLX loop and mx.fast.gated_delta_update,
in one MLX process; FLA runs in a separate torch process (bench_fla.py) on the same GPU in the same call.

    python benchmarks/bench_gpu.py --out DIR
"""
from __future__ import annotations

import json
import sys
import time

import mlx.core as mx
import numpy as np

from recgen import specs
from recgen.ops import Op

GiB = 1024 ** 3


def timeit(fn, reps=10, warm=2, queue=1):
    """Median ms per call. queue > 1 builds that many calls before one eval, as FLA's do_bench keeps
    the GPU fed: Python overhead then overlaps device work (the 'queued' numbers); queue = 1 is one
    synchronous call per eval (the 'sync' numbers, which include all per-call host overhead)."""
    for _ in range(warm):
        mx.eval(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        # NOTE: mx.async_eval per call was tried (run 8) and made every number worse (GDN 4.4 vs 1.9 ms)
        mx.eval([fn() for _ in range(queue)])
        ts.append((time.perf_counter() - t0) / queue)
    return float(np.median(ts)) * 1e3


def inputs(name, B, T, H, D, dtype=mx.bfloat16, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, H, D)).astype(dtype)
    k = mx.random.normal((B, T, H, D))
    k = (k / mx.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = mx.random.normal((B, T, H, D)).astype(dtype)
    g = (-mx.random.uniform(shape=(B, T, H)) * 0.5).astype(dtype)
    beta = mx.sigmoid(mx.random.normal((B, T, H))).astype(dtype)
    gk = (-mx.random.uniform(shape=(B, T, H, D)) * 0.5).astype(dtype)
    return {"gated_delta_net": (q, k, v, g, beta), "delta_net": (q, k, v, beta), "gla": (q, k, v, gk),
            "simple_gla": (q, k, v, g)}[name]


def naive_gdn(q, k, v, g, beta):
    """Per-token MLX loop of gated delta net (the baseline users write today)."""
    B, T, H, D = q.shape
    S = mx.zeros((B, H, D, v.shape[-1]), dtype=mx.float32)
    outs = []
    scale = D ** -0.5
    for t in range(T):
        kt, vt, qt = k[:, t].astype(mx.float32), v[:, t].astype(mx.float32), q[:, t].astype(mx.float32) * scale
        S = S * mx.exp(g[:, t].astype(mx.float32))[..., None, None]
        pred = (kt[..., None] * S).sum(-2)
        S = S + kt[..., None] * (beta[:, t].astype(mx.float32)[..., None] * (vt - pred))[..., None, :]
        outs.append((qt[..., None] * S).sum(-2))
    return mx.stack(outs, axis=1)


def bench_recgen(name, B, T, H, D, backward="recurrent"):
    op = Op(specs.BUILTINS[name], backend="cuda", backward=backward)
    xs = inputs(name, B, T, H, D)
    fwd = lambda: op(*xs, check_finite=False)[0]  # noqa: E731
    t_f = timeit(fwd, reps=5, queue=10)
    t_f_sync = timeit(fwd, reps=10)
    do = mx.random.normal((B, T, H, D)).astype(mx.bfloat16)
    loss = lambda *a: (op(*a, check_finite=False)[0].astype(mx.float32) * do).sum()  # noqa: E731
    gfn = mx.grad(loss, argnums=tuple(range(len(xs))))
    mx.eval(gfn(*xs))
    mx.reset_peak_memory()
    t_fb = timeit(lambda: gfn(*xs), reps=3, queue=1)
    peak = mx.get_peak_memory() / GiB
    return t_f, t_f_sync, t_fb, peak


def main():
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."
    res = {}
    for shape in [(4, 4096, 16, 128), (8, 1024, 8, 64)]:
        for name in ("gated_delta_net", "delta_net", "gla", "simple_gla"):
            for bw in ("recurrent", "chunked"):
                t_f, t_fs, t_fb, peak = bench_recgen(name, *shape, backward=bw)
                res[f"recgen/{name}/{shape}/{bw}"] = {"fwd_ms": t_f, "fwd_sync_ms": t_fs, "fwdbwd_ms": t_fb,
                                                      "peak_GiB": peak}
                print(f"recgen {name:16s} {shape} backward={bw:9s}: fwd {t_f:8.3f} ms (sync {t_fs:.3f})  "
                      f"fwd+bwd {t_fb:8.3f} ms  peak {peak:.2f} GiB", flush=True)
    # baselines at the large shape: naive loop and mx.fast.gated_delta_update (forward only: its backward OOMs)
    B, T, H, D = 4, 4096, 16, 128
    q, k, v, g, beta = inputs("gated_delta_net", B, T, H, D)
    t_naive = timeit(lambda: naive_gdn(q, k, v, g, beta), reps=1, warm=1)
    print(f"naive MLX loop GDN fwd {t_naive:.1f} ms", flush=True)
    try:
        t_fast = timeit(lambda: mx.fast.gated_delta_update(q, k, v, mx.exp(g), beta)[0], reps=2, warm=1)
    except Exception as e:  # noqa: BLE001
        t_fast = float("nan")
        print("mx.fast.gated_delta_update failed:", repr(e)[:200])
    print(f"mx.fast.gated_delta_update fwd {t_fast:.1f} ms", flush=True)
    res["naive/gated_delta_net/fwd_ms"] = t_naive
    res["mx.fast.gated_delta_update/fwd_ms"] = t_fast
    # decode: T=1, B=64, H=32, D=128, float32 state read and written once
    B, H, D = 64, 32, 128
    op = Op(specs.gated_delta_net, backend="cuda")
    q, k, v, g, beta = inputs("gated_delta_net", B, 1, H, D)
    h0 = mx.random.normal((B, H, D, D))
    t_dec = timeit(lambda: op(q, k, v, g, beta, initial_state=h0, output_final_state=True, check_finite=False),
                   reps=10, queue=20)
    big = mx.random.normal((B, H, D, D))
    t_copy = timeit(lambda: big * 1.0, reps=10, queue=20)
    state_bytes = B * H * D * D * 4 * 2
    res["decode"] = {"ms": t_dec, "copy_ms": t_copy, "GBps": state_bytes / t_dec / 1e6,
                     "copy_GBps": state_bytes / t_copy / 1e6}
    print(f"decode GDN T=1 B=64 H=32 D=128: {t_dec:.3f} ms = {state_bytes / t_dec / 1e6:.0f} GB/s; "
          f"copy {state_bytes / t_copy / 1e6:.0f} GB/s -> {t_copy / t_dec:.0%} of copy bandwidth", flush=True)
    json.dump(res, open(f"{out}/bench_gpu.json", "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
