#!/usr/bin/env bash
# One device call: the stages named as arguments, each with its own time limit, logs and JSON under $OUT.
#   bash benchmarks/run_gpu.sh bench bench-extra decode
#   SPECS="gla simple_gla" bash benchmarks/run_gpu.sh bench-fla:4,4096,16,128
# Timings are `recgen bench` (chained calls, the op's defaults; recgen/bench.py says how) and FLA in the same call.
# Expects the offline bundle (.gpu-bundle, see DESIGN/BENCHMARKS) to be carried along.
source .gpu-bundle/install.sh || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
SHAPES=${SHAPES:-"4,4096,16,128 8,1024,8,64 1,32768,16,128"}  # the shapes (bf16)
SPECS=${SPECS:-"gated_delta_net delta_net gla simple_gla"}
bench() {  # bench DIR SHAPE EXTRA-ARGS...: every spec of $SPECS at SHAPE, one process each
  local dir=$1 shape=$2; shift 2; mkdir -p "$OUT/$dir"
  for sp in $SPECS; do SECONDS=0
    timeout ${BENCH_TIMEOUT:-150} python -m recgen.cli bench $sp --shape $shape "$@" \
      --json "$OUT/$dir/${sp}_${shape//,/x}.json" 2>&1 | tee -a "$OUT/$dir.log"
    echo "($sp $shape: ${SECONDS}s)" | tee -a "$OUT/$dir.log"; done
}
for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    check-cuda) timeout 240 python benchmarks/cuda_check.py --out "$OUT" > "$OUT/check_cuda.log" 2>&1
             grep -E "FAIL|passed" "$OUT/check_cuda.log" ;;
    check-chunked-bwd) MLX_ENABLE_TF32=0 timeout 150 python benchmarks/cuda_check.py --backend cuda --backward chunked \
               --specs gated_delta_net,delta_net,gla,simple_gla,examples/mlstm.py:mlstm --out "$OUT" > "$OUT/check_cuda_chunkedbwd.log" 2>&1
             grep -E "FAIL|passed" "$OUT/check_cuda_chunkedbwd.log" ;;
    check-mlx) MLX_ENABLE_TF32=0 timeout 150 python benchmarks/cuda_check.py --backend mlx --dtypes float32 --out "$OUT" > "$OUT/check_mlx_f32.log" 2>&1
             grep -E "FAIL|passed" "$OUT/check_mlx_f32.log"
             timeout 100 python benchmarks/cuda_check.py --backend mlx --dtypes bfloat16 --out "$OUT" > "$OUT/check_mlx_bf16.log" 2>&1
             grep -E "FAIL|passed" "$OUT/check_mlx_bf16.log" ;;
    check-kernels) RECGEN_CHUNK_KERNELS=1 MLX_ENABLE_TF32=0 timeout 150 python benchmarks/cuda_check.py --backend mlx --dtypes float32 \
               --out "$OUT" > "$OUT/check_kernels_f32.log" 2>&1
             grep -E "FAIL|passed" "$OUT/check_kernels_f32.log"
             RECGEN_CHUNK_KERNELS=1 timeout 100 python benchmarks/cuda_check.py --backend mlx --dtypes bfloat16 --out "$OUT" \
               > "$OUT/check_kernels_bf16.log" 2>&1
             grep -E "FAIL|passed" "$OUT/check_kernels_bf16.log" ;;
    check-mma) RECGEN_CHUNK_KERNELS=1 RECGEN_MMA_SCAN=1 timeout 150 python benchmarks/cuda_check.py --backend mlx --dtypes float32 \
               --out "$OUT" > "$OUT/check_mma_f32_tf32.log" 2>&1
             grep -E "FAIL|passed" "$OUT/check_mma_f32_tf32.log" ;;
    bench) for shape in $SHAPES; do bench bench $shape; done ;;             # recgen alone, every spec and shape
    bench:*) bench bench ${stage#bench:} ;;                                  # recgen alone at one shape
    bench-fla:*) BENCH_TIMEOUT=${BENCH_TIMEOUT:-330} bench bench_fla ${stage#bench-fla:} --baseline fla ;;  # + FLA
    bench-extra) SPECS=selective_scan bench bench_extra 4,4096,24,16,64     # 1536 channels, 16 state rows
                 SPECS=power_retention bench bench_extra 2,4096,8,64 --backend mlx ;;  # no kernel for feature maps
    decode) timeout 120 python benchmarks/bench_decode.py --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
