"""The chunked MLX fallback (backend='mlx') on the GPU through MLX's CUDA backend.

    python benchmarks/bench_chunked_gpu.py [--out DIR] [--shape B,T,H,D] [--specs a,b] [--variants compiled,eager] [--gdu] [--tag X] [--memory-limit GiB] [--chunk C]

B=4, T=4096, H=16, D=128 (default), bf16: forward (queued: 10 calls per eval, as bench_gpu.py; and sync: one
call per eval) and forward+backward (one call per eval) with peak memory, per spec and variant:
``compiled`` runs the chunk core through mx.compile (the GPU default), ``eager`` without.
``--memory-limit`` sets ``mx.set_memory_limit`` first: MLX's evaluation then waits for queued GPU work
whenever active memory exceeds it, which bounds the buffers held for in-flight kernels.
``--gdu`` also times mx.fast.gated_delta_update's forward on the same inputs (the ratio target).
"""
from __future__ import annotations

import json
import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu import GiB, inputs, timeit  # noqa: E402

from recgen import specs  # noqa: E402
from recgen.chunked import parallel  # noqa: E402
from recgen.ops import Op  # noqa: E402


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main():
    out = arg("--out", ".")
    if "--memory-limit" in sys.argv:
        mx.set_memory_limit(int(float(arg("--memory-limit", "0")) * GiB))
    res = {}
    B, T, H, D = map(int, arg("--shape", "4,4096,16,128").split(","))
    for name in arg("--specs", "gated_delta_net,delta_net,gla,simple_gla").split(","):
        for variant in arg("--variants", "compiled,eager").split(","):
            parallel.COMPILE = variant == "compiled"
            op = Op(specs.BUILTINS[name], backend="mlx", chunk_size=int(arg("--chunk", "0")) or None)
            xs = inputs(name, B, T, H, D)
            fwd = lambda: op(*xs, check_finite=False)[0]  # noqa: E731
            t_f = timeit(fwd, reps=5, warm=2, queue=10)
            mx.reset_peak_memory()
            t_fs = timeit(fwd, reps=5, warm=1)
            peak_f = mx.get_peak_memory() / GiB
            do = mx.random.normal((B, T, H, D)).astype(mx.bfloat16)
            gfn = mx.grad(lambda *a: (op(*a, check_finite=False)[0].astype(mx.float32) * do).sum(),
                          argnums=tuple(range(len(xs))))
            mx.eval(gfn(*xs))
            mx.reset_peak_memory()
            t_fb = timeit(lambda: gfn(*xs), reps=3, warm=1)
            peak = mx.get_peak_memory() / GiB
            res[f"{name}/{variant}/{B},{T},{H},{D}"] = {"fwd_ms": t_f, "fwd_sync_ms": t_fs, "fwd_peak_GiB": peak_f,
                                        "fwdbwd_ms": t_fb, "fwdbwd_peak_GiB": peak}
            print(f"chunked {name:16s} {variant:8s} fwd {t_f:7.3f} ms (sync {t_fs:7.3f}, peak {peak_f:.2f} GiB)  "
                  f"fwd+bwd {t_fb:8.3f} ms (peak {peak:.2f} GiB)", flush=True)
    if "--gdu" in sys.argv:
        q, k, v, g, beta = inputs("gated_delta_net", B, T, H, D)
        t = timeit(lambda: mx.fast.gated_delta_update(q, k, v, mx.exp(g), beta)[0], reps=2, warm=1)
        res["mx.fast.gated_delta_update/fwd_ms"] = t
        print(f"mx.fast.gated_delta_update fwd {t:.1f} ms", flush=True)
    tag = arg("--tag", "")
    json.dump(res, open(f"{out}/bench_chunked_gpu_{B}_{T}_{H}_{D}{tag and '_' + tag}.json", "w"), indent=1)


if __name__ == "__main__":
    main()
