#!/bin/bash
# Nsight Compute sections (speed of light, occupancy, launch, warp stall reasons) of the forward chunk
# scan alone at GDN's shapes (B=4, T=4096, H=16, D=128, chunk 64, float32), one launch per frame:
# the fragment frame (RECGEN_MMA_SCAN=1) and the FMA frame (=0).
for mma in 1 0; do
RECGEN_MMA_SCAN=$mma ncu --clock-control none --kernel-name regex:chunk_scan --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import mlx.core as mx
from bench_chunk_kernels import Geo
from recgen.chunked import parallel
B, H, n, C, K, V = 4, 16, 64, 64, 128, 128
nrm = lambda *s, a=1.0: a * mx.random.normal(s)
S0, U, W, uQ = nrm(B, H, K, V), nrm(B, H, n, C, V), nrm(B, H, n, C, K, a=0.05), nrm(B, H, n, C, K, a=0.05)
geo = Geo(mx.exp(-0.5 * mx.random.uniform(shape=(B, H, n, 1))))
mx.eval(parallel._scan_forward(geo, S0, uQ, U, W, True, True, kern='cuda'))
" 2>&1 | grep -v "^==PROF==" | grep -v "^ *$"
done
