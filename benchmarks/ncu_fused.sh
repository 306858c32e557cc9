#!/bin/bash
# Nsight Compute sections (speed of light, occupancy, launch, warp stall reasons, memory) of the fused
# fragment kernels alone at GDN's shapes (B=4, T=4096, H=16, D=128, chunk 64, float32): the UT transform
# (chunk_ut_mma) and the readout (chunk_out_mma), one launch each.
ncu --clock-control none --kernel-name regex:"ut_mma|out_mma" --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
  python3 -c "
import mlx.core as mx
from recgen.chunked import kernels as ck
B, H, n, C, K, V = 4, 16, 64, 64, 128, 128
nrm = lambda *s, a=1.0: a * mx.random.normal(s)
bt, u, w, st = nrm(B, H, n, C, K, a=K ** -0.5), nrm(B, H, n, C, K, a=K ** -0.5), nrm(B, H, n, C, V), nrm(B, H, n, K, V)
l = -0.5 * mx.random.uniform(shape=(B, H, n, C, 1))
mx.eval(ck.chunk_ut(bt, u, w, l, 'cuda'))
mx.eval(ck.chunk_out(bt, u, w, st, l, 'cuda'))
" 2>&1 | grep -v "^==PROF==" | grep -v "^ *$"
