#!/bin/bash
# Nsight Compute sections (speed of light, memory workload, occupancy, launch, warp stall reasons) of the
# chunked forward's fused kernels as a model runs them: SPEC (default simple_gla) at B=4, T=4096, H=16, D=128,
# bf16; COUNT launches (3) of the kernels whose names match KERNELS (default: the scans, the readout and the
# UT transform) after SKIP (0; the self-test launches one scan, two readouts and one UT transform first).
SPEC=${1:-simple_gla}
KERNELS=${2:-chunk_scan|chunk_out|chunk_ut}
ncu --clock-control none --kernel-name "regex:$KERNELS" --launch-skip ${4:-0} --launch-count ${3:-3} \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import mlx.core as mx
from bench_gpu import inputs
from recgen import specs
from recgen.ops import Op
op = Op(specs.BUILTINS['$SPEC'], backend='mlx')
xs = inputs('$SPEC', 4, 4096, 16, 128)
mx.eval(xs)
mx.eval(op(*xs, check_finite=False)[0])
" 2>&1 | grep -v "^==PROF==" | grep -v "^ *$"
