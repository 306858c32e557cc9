#!/bin/bash
# Kernel-only time of the GDN decode step (T=1, B=64, H=32, D=128) from Nsight Compute.
ncu --kernel-name regex:recgen --launch-skip 2 --launch-count 1 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
  python3 -c "
import mlx.core as mx
from recgen import specs
from recgen.ops import Op
op = Op(specs.gated_delta_net, backend='cuda')
B, H, D = 64, 32, 128
q = mx.random.normal((B, 1, H, D)).astype(mx.bfloat16); v = q
g = -mx.random.uniform(shape=(B, 1, H)).astype(mx.bfloat16); beta = mx.sigmoid(g)
h0 = mx.random.normal((B, H, D, D))
for _ in range(4):
    mx.eval(op(q, q, v, g, beta, initial_state=h0, output_final_state=True, check_finite=False))
"
