#!/usr/bin/env bash
# One device call: the stages named as arguments, each with its own time limit, logs under $OUT.
#   bash benchmarks/run_gpu.sh check profile bench chunked-small fla ...
# Expects the offline bundle (.gpu-bundle, built outside the repo) to be carried along.
source .gpu-bundle/install.sh || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    profile) timeout 120 python benchmarks/profile_chunked.py 2>&1 | tee "$OUT/profile_scalar.log"
             timeout 90 python benchmarks/profile_chunked.py --key 2>&1 | tee "$OUT/profile_key.log" ;;
    check) n=${GPU_TEST_SHARDS:-8}; logs=$(mktemp -d); pids=  # the gpu tests (tests/gpu) as n processes, --shard k/n:
           for k in $(seq 0 $((n - 1))); do          # most of their time is kernel compilation, one core a process
             timeout 540 python -m pytest -m gpu --shard $k/$n -rs --durations=5 > "$logs/$k.log" 2>&1 & pids="$pids $!"
           done
           rc=0; for p in $pids; do wait $p; r=$?; [ $r = 0 ] || [ $r = 5 ] || rc=$r; done  # 5: a part with no tests
           for k in $(seq 0 $((n - 1))); do echo "=== shard $k/$n"; cat "$logs/$k.log"; done > "$OUT/check_gpu.log"
           echo "python -m pytest -m gpu ($n shards): exit $rc"; grep -E "^(FAILED|ERROR)|(passed|failed|skipped).* in " "$OUT/check_gpu.log" ;;
    ncu-gdn) timeout 200 bash benchmarks/ncu_chunked.sh gated_delta_net > "$OUT/ncu_chunked_gdn.log" 2>&1
             python benchmarks/ncu_summary.py "$OUT/ncu_chunked_gdn.log" | tee "$OUT/ncu_chunked_gdn.summary.txt" | head -24 ;;
    ncu-chunked) for sp in gated_delta_net simple_gla; do timeout 200 bash benchmarks/ncu_chunked.sh $sp > "$OUT/ncu_chunked_$sp.log" 2>&1
               python benchmarks/ncu_summary.py "$OUT/ncu_chunked_$sp.log" | tee "$OUT/ncu_chunked_$sp.summary.txt" | head -16; done
             tail -c 3000 "$OUT/ncu_chunked_gated_delta_net.log" ;;
    ncu-fused) timeout 200 bash benchmarks/ncu_fused.sh > "$OUT/ncu_fused.log" 2>&1
             grep -E "chunk_|Duration|Stall|Occupancy|Registers|Issued|Eligible|Throughput|Shared Memory Config|Block Limit" "$OUT/ncu_fused.log" | head -80 ;;
    ncu-scan) timeout 200 bash benchmarks/ncu_scan.sh > "$OUT/ncu_scan.log" 2>&1; grep -E "Duration|Stall|Occupancy|Registers|Issued|Eligible" "$OUT/ncu_scan.log" | head -60 ;;
    kernels) timeout 200 python benchmarks/bench_chunk_kernels.py 2>&1 | tee "$OUT/chunk_kernels.log" ;;
    readout) timeout 100 python benchmarks/bench_chunk_kernels.py --readout-only 2>&1 | tee "$OUT/readout.log" ;;
    diag) timeout 150 python benchmarks/bench_chunk_kernels.py --diag-only --diag-layouts ${DIAG:-32/4,32/8,16/4,16/8,8/4,8/8,64/8,32/4} 2>&1 | tee "$OUT/diag.log" ;;
    ab-kernels) for v in 0 1; do echo "RECGEN_CHUNK_KERNELS=$v"
             RECGEN_CHUNK_KERNELS=$v timeout 120 python benchmarks/bench_chunked_gpu.py --variants compiled \
               --specs gated_delta_net,delta_net,gla,simple_gla --tag kern$v --out "$OUT" 2>&1 | tee -a "$OUT/ab_kernels.log"; done ;;
    ab-mma) for v in 0 1; do echo "RECGEN_MMA_SCAN=$v"
             RECGEN_MMA_SCAN=$v timeout 120 python benchmarks/bench_chunked_gpu.py --variants compiled \
               --specs gated_delta_net,delta_net,gla,simple_gla --tag mma$v --out "$OUT" 2>&1 | tee -a "$OUT/ab_mma.log"; done ;;
    ab-readout) for v in 0 1; do echo "RECGEN_FUSED_READOUT=$v"
             RECGEN_FUSED_READOUT=$v timeout 120 python benchmarks/bench_chunked_gpu.py --variants compiled \
               --specs gated_delta_net,simple_gla,delta_net --tag readout$v --out "$OUT" 2>&1 | tee -a "$OUT/ab_readout.log"; done ;;
    ab-ut) for v in 0 1; do echo "RECGEN_FUSED_UT=$v"
             RECGEN_FUSED_UT=$v timeout 120 python benchmarks/bench_chunked_gpu.py --variants compiled \
               --specs gated_delta_net,delta_net --tag ut$v --out "$OUT" 2>&1 | tee -a "$OUT/ab_ut.log"; done ;;
    ab-roles) for v in 0 1; do echo "RECGEN_16BIT_ROLES=$v"
             RECGEN_16BIT_ROLES=$v timeout 120 python benchmarks/bench_chunked_gpu.py --variants compiled \
               --specs gated_delta_net,simple_gla --tag roles$v --out "$OUT" 2>&1 | tee -a "$OUT/ab_roles.log"; done ;;
    ab-knobs) for k in ${KNOBS:-RECGEN_PREFETCH=0 RECGEN_PREFETCH=1}; do echo "knobs: $k"  # KNOBS: entries of comma-joined VAR=value
             env $(echo "$k" | tr , ' ') timeout 120 python benchmarks/bench_chunked_gpu.py --variants compiled \
               --specs ${SPECS:-gated_delta_net,simple_gla} --tag "$(echo "$k" | tr ,= _-)" --out "$OUT" 2>&1 | tee -a "$OUT/ab_knobs.log"; done ;;
    ab-prev) for v in prev cur prev cur; do echo "recgen: $v"  # bench_prev/: an earlier commit's recgen/ (git archive)
             P=$PWD; [ $v = prev ] && P=$PWD/bench_prev
             PYTHONPATH=$P:$PYTHONPATH timeout 120 python benchmarks/bench_chunked_gpu.py --variants compiled \
               --specs gated_delta_net,simple_gla --tag $v --out "$OUT" 2>&1 | tee -a "$OUT/ab_prev.log"; done ;;
    bench) timeout 300 python benchmarks/bench_gpu.py --out "$OUT" 2>&1 | tee "$OUT/bench_gpu.log" ;;
    chunked) timeout 200 python benchmarks/bench_chunked_gpu.py --variants compiled --gdu --out "$OUT" 2>&1 | tee "$OUT/chunked.log" ;;
    knobs) for n in 20 80 250; do  # MLX's CUDA graph size (ops per committed graph; default 20)
             echo "MLX_MAX_OPS_PER_BUFFER=$n"
             MLX_MAX_OPS_PER_BUFFER=$n timeout 150 python benchmarks/bench_chunked_gpu.py --variants compiled \
               --specs gated_delta_net,simple_gla,gla --tag ops$n --out "$OUT" 2>&1 | tee -a "$OUT/knobs.log"; done ;;
    one-segment) RECGEN_CHUNKED_BUDGET=$((60<<30)) timeout 100 python benchmarks/bench_chunked_gpu.py --variants compiled \
               --specs gla --tag oneseg --out "$OUT" 2>&1 | tee "$OUT/one_segment.log" ;;
    memlimit) for g in 4 6; do echo "mx.set_memory_limit($g GiB)"
             timeout 100 python benchmarks/bench_chunked_gpu.py --variants compiled --memory-limit $g \
               --specs gated_delta_net,simple_gla,gla --tag mem$g --out "$OUT" 2>&1 | tee -a "$OUT/memlimit.log"; done ;;
    chunks) for c in 32 128; do echo "chunk $c"
             timeout 100 python benchmarks/bench_chunked_gpu.py --variants compiled --chunk $c \
               --specs gated_delta_net,simple_gla,gla --tag c$c --out "$OUT" 2>&1 | tee -a "$OUT/chunks.log"; done ;;
    inv-base) for b in 64 16 8 32; do echo "RECGEN_INVERSE_BASE=$b"
             RECGEN_INVERSE_BASE=$b timeout 100 python benchmarks/bench_chunked_gpu.py --variants compiled \
               --specs gated_delta_net,delta_net --tag inv$b --out "$OUT" 2>&1 | tee -a "$OUT/inv_base.log"; done ;;
    gla) timeout 100 python benchmarks/bench_chunked_gpu.py --variants compiled --specs gla --tag gla --out "$OUT" 2>&1 | tee "$OUT/gla.log"
         timeout 100 python benchmarks/bench_chunked_gpu.py --variants compiled --specs gla --memory-limit 4 --tag gla_mem4 \
           --out "$OUT" 2>&1 | tee -a "$OUT/gla.log" ;;
    sweep-backward) timeout 300 python benchmarks/sweep_backward.py --out "$OUT" 2>&1 | tee "$OUT/sweep_backward.log" ;;
    chunked-gdn-sgla) timeout 150 python benchmarks/bench_chunked_gpu.py --variants compiled --specs gated_delta_net,simple_gla \
               --out "$OUT" 2>&1 | tee -a "$OUT/chunked.log" ;;
    chunked-small) timeout 100 python benchmarks/bench_chunked_gpu.py --shape 8,1024,8,64 --variants compiled --out "$OUT" 2>&1 | tee "$OUT/chunked_small.log" ;;
    fla-*) timeout 290 python benchmarks/bench_fla.py --out "$OUT" --ops "${stage#fla-}" --shapes "4,4096,16,128" --timeout 285 2>&1 | tee -a "$OUT/fla.log"
           cp "$OUT/bench_fla.json" "$OUT/bench_fla_${stage#fla-}.json" ;;
    decode) timeout 120 python benchmarks/bench_decode.py 2>&1 | tee "$OUT/decode.log"
            timeout 150 bash benchmarks/ncu_decode.sh > "$OUT/ncu_decode.log" 2>&1
            grep -E "custom_kernel|Kernel|kernel|gpu__time|dram__bytes" "$OUT/ncu_decode.log" | cut -c1-150 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
