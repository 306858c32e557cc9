#!/bin/bash
# Kernel-only times from Nsight Compute: the GDN decode step (T=1, B=64, H=32, D=128) and MLX's copy of
# the same state (big * 1.0), after warm-up. Prints each profiled kernel's time and DRAM bytes.
ncu --launch-skip 12 --launch-count 6 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
  python3 -c "
import mlx.core as mx
from recgen import specs
from recgen.ops import Op
op = Op(specs.gated_delta_net, backend='cuda')
B, H, D = 64, 32, 128
q = mx.random.normal((B, 1, H, D)).astype(mx.bfloat16); v = q
g = -mx.random.uniform(shape=(B, 1, H)).astype(mx.bfloat16); beta = mx.sigmoid(g)
h0 = mx.random.normal((B, H, D, D)); big = mx.random.normal((B, H, D, D))
mx.eval(q, v, g, beta, h0, big)
for _ in range(6):
    mx.eval(op(q, q, v, g, beta, initial_state=h0, output_final_state=True, check_finite=False))
    mx.eval(big * 1.0)
"
