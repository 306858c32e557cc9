"""The chunked MLX fallback (backend='mlx') on the GPU through MLX's CUDA backend.

    python benchmarks/bench_chunked_gpu.py [--out DIR]
B=4, T=4096, H=16, D=128, bf16: forward and forward+backward with peak memory, per spec."""
from __future__ import annotations

import json
import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu import GiB, inputs, timeit  # noqa: E402

from recgen import specs  # noqa: E402
from recgen.ops import Op  # noqa: E402


def main():
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."
    res = {}
    B, T, H, D = 4, 4096, 16, 128
    for name in sys.argv[sys.argv.index("--specs") + 1].split(",") if "--specs" in sys.argv else \
            ("simple_gla", "gla", "gated_delta_net"):
        op = Op(specs.BUILTINS[name], backend="mlx")
        xs = inputs(name, B, T, H, D)
        mx.reset_peak_memory()
        t_f = timeit(lambda: op(*xs, check_finite=False)[0], reps=3, warm=1)
        peak_f = mx.get_peak_memory() / GiB
        do = mx.random.normal((B, T, H, D)).astype(mx.bfloat16)
        gfn = mx.grad(lambda *a: (op(*a, check_finite=False)[0].astype(mx.float32) * do).sum(),
                      argnums=tuple(range(len(xs))))
        mx.reset_peak_memory()
        t_fb = timeit(lambda: gfn(*xs), reps=2, warm=1)
        peak = mx.get_peak_memory() / GiB
        res[name] = {"fwd_ms": t_f, "fwd_peak_GiB": peak_f, "fwdbwd_ms": t_fb, "fwdbwd_peak_GiB": peak}
        print(f"chunked {name:16s} fwd {t_f:8.2f} ms (peak {peak_f:.2f} GiB)  fwd+bwd {t_fb:8.2f} ms "
              f"(peak {peak:.2f} GiB)", flush=True)
    json.dump(res, open(f"{out}/bench_chunked_gpu.json", "w"), indent=1)


if __name__ == "__main__":
    main()
