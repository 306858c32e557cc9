"""Decode (T=1, B=64, H=32, D=128, float32 state read once and written once) against a copy of the same
bytes, timed three ways in one process:

- queued: 20 calls built, one mx.eval (host graph building is not overlapped with the GPU);
- pipelined: one mx.async_eval per call, 200 calls (the host builds call i+1 while the GPU runs call i,
  as a CUDA stream does for FLA's launches);
- sync: one mx.eval per call.

    python benchmarks/bench_decode.py        (kernel-only times: benchmarks/ncu_decode.sh)
"""
from __future__ import annotations

import os
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu import inputs, timeit  # noqa: E402

from recgen import specs  # noqa: E402
from recgen.ops import Op  # noqa: E402


def pipelined(fn, n=200, warm=20):
    for _ in range(warm):
        mx.async_eval(fn())
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn()
        mx.async_eval(out)
    mx.eval(out)
    mx.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main():
    B, H, D = 64, 32, 128
    op = Op(specs.gated_delta_net, backend="cuda")
    q, k, v, g, beta = inputs("gated_delta_net", B, 1, H, D)
    h0 = mx.random.normal((B, H, D, D))
    big = mx.random.normal((B, H, D, D))
    mx.eval(h0, big)
    nbytes = B * H * D * D * 4 * 2
    dec = lambda: op(q, k, v, g, beta, initial_state=h0, output_final_state=True, check_finite=False)  # noqa: E731
    cp = lambda: big * 1.0  # noqa: E731
    for name, how in (("queued", lambda f: timeit(f, reps=10, queue=20)), ("pipelined", pipelined),
                      ("sync", lambda f: timeit(f, reps=20))):
        t_d, t_c = how(dec), how(cp)
        print(f"decode {name:9s}: {t_d:.4f} ms = {nbytes / t_d / 1e6:5.0f} GB/s; copy {t_c:.4f} ms = "
              f"{nbytes / t_c / 1e6:5.0f} GB/s; decode/copy bandwidth {t_c / t_d:.0%}", flush=True)


if __name__ == "__main__":
    main()
