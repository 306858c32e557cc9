#!/bin/bash
# Kernel-only times of the chunked forward (backend='mlx', kernels as the device defaults) from Nsight
# Compute, per kernel name (sum over calls / calls): SPEC (default gated_delta_net) at B=4, T=4096, H=16,
# D=128, bf16; three forwards after one warm-up, so each per-call time is the summary's total / 3.
SPEC=${1:-gated_delta_net}
ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import mlx.core as mx
from bench_gpu import inputs
from recgen import specs
from recgen.ops import Op
op = Op(specs.BUILTINS['$SPEC'], backend='mlx')
xs = inputs('$SPEC', 4, 4096, 16, 128)
mx.eval(xs)
mx.eval(op(*xs, check_finite=False)[0])
for _ in range(3):
    mx.eval(op(*xs, check_finite=False)[0])
" 2>&1
