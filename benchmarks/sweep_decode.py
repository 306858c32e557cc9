"""Decode (T=1) layout sweep: the state is read and written once, so the lane mapping decides how
well the loads coalesce. python benchmarks/sweep_decode.py [layouts...]"""
from __future__ import annotations

import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu import inputs, timeit  # noqa: E402

from recgen.codegen import lower

from recgen import specs  # noqa: E402
from recgen.ops import Op  # noqa: E402

B, H, D = 64, 32, 128
big = mx.random.normal((B, H, D, D))
t_copy = timeit(lambda: big * 1.0, reps=10, queue=20)
nbytes = B * H * D * D * 4 * 2
print(f"copy {nbytes / t_copy / 1e6:.0f} GB/s", flush=True)
for lay in sys.argv[1:] or ["", "1,1,4", "2,2,4", "4,4,4", "4,1,4", "8,1,4", "2,4,4", "1,4,4"]:
    if lay:
        os.environ["RECGEN_FWD_LAYOUT"] = lay
    else:
        os.environ.pop("RECGEN_FWD_LAYOUT", None)
    lower._plan.cache_clear()
    op = Op(specs.gated_delta_net, backend="cuda")
    q, k, v, g, beta = inputs("gated_delta_net", B, 1, H, D)
    h0 = mx.random.normal((B, H, D, D))
    try:
        t = timeit(lambda: op(q, k, v, g, beta, initial_state=h0, output_final_state=True, check_finite=False),
                   reps=10, queue=20)
        print(f"decode layout {lay or 'default'}: {t:.4f} ms = {nbytes / t / 1e6:.0f} GB/s = {t_copy / t:.0%} of copy",
              flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"decode layout {lay}: failed {repr(e)[:150]}", flush=True)
