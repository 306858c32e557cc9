"""Forward-kernel layout sweep on the GPU: time the generated forward alone (20 launches per eval,
so Python overhead is amortized) for several lane mappings. Usage: python benchmarks/sweep_fwd.py"""
from __future__ import annotations

import os
import sys
import time

import mlx.core as mx

from recgen.codegen import lower

from recgen import specs
from recgen.codegen.backends import CUDA
from recgen.runtime.recurrent import forward_launch, mlx_call
from recgen.spec.layouts import Sizes

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu import inputs  # noqa: E402


def time_fwd(name, B, T, H, D, reps=20):
    rec = specs.BUILTINS[name]
    xs = inputs(name, B, T, H, D)
    sizes = Sizes(B, T, H, H, D, D, D)
    p = lower.plan(rec, sizes)
    launch = forward_launch(p, CUDA, sizes, D ** -0.5, "bfloat16", save=False)
    h0 = mx.zeros(sizes.state_shape)
    mx.eval(mlx_call(launch, CUDA, xs, [h0]))
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [mlx_call(launch, CUDA, xs, [h0])[0] for _ in range(reps)]
        mx.eval(outs)
        best = min(best, (time.perf_counter() - t0) / reps * 1e3)
    return best, p.fwd


if __name__ == "__main__":
    layouts = sys.argv[1:] or ["", "8,2,4", "8,1,4", "4,1,4", "4,2,4", "16,1,4", "16,2,4", "32,1,4", "8,4,4", "8,2,2", "8,2,8"]
    for shape in [(4, 4096, 16, 128), (8, 1024, 8, 64)]:
        for lay in layouts:
            if lay:
                os.environ["RECGEN_FWD_LAYOUT"] = lay
            else:
                os.environ.pop("RECGEN_FWD_LAYOUT", None)
            lower._plan.cache_clear()
            for name in ("gated_delta_net", "simple_gla"):
                try:
                    ms, fl = time_fwd(name, *shape)
                    print(f"{name:16s} {shape} layout {fl}: {ms:.3f} ms", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"{name:16s} {shape} layout {lay}: failed {repr(e)[:120]}", flush=True)
