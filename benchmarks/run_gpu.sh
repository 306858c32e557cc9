#!/usr/bin/env bash
# One device call: the stages named as arguments, each with its own time limit, logs and JSON under $OUT.
#   bash benchmarks/run_gpu.sh check bench bench-extra decode mlx-lm
#   GPU_TESTS=tests/gpu/test_mlx_lm_gpu.py GPU_TEST_SHARDS=4 bash benchmarks/run_gpu.sh check
#   GPU_TEST_K="delta_net or probe" bash benchmarks/run_gpu.sh check   # the tests a -k expression selects
#   SPECS="gla simple_gla" bash benchmarks/run_gpu.sh bench-fla:4,4096,16,128
#   THRESHOLD_TS="256 512" bash benchmarks/run_gpu.sh threshold:8,T,8,64   # chunked form from T=1 vs never
#   SPECS="kda gla" bash benchmarks/run_gpu.sh ab:RECGEN_FUSED_BWD:4,4096,16,128  # a switch off, then on, one call
#   AB_VALUES="32 16" bash benchmarks/run_gpu.sh ab:RECGEN_SCAN_BV:4,4096,16,128  # or any values of a variable
#   SPECS=rwkv7 AB_VALUES="0 1 0 1" bash benchmarks/run_gpu.sh ab:RECGEN_PAIR_FOLD,RECGEN_UT_PRODUCTS:4,4096,16,128
#                                                        # several switches together: all off, then all on, ...
#   SPECS=rwkv7 AB_VALUES="cuda mlx" bash benchmarks/run_gpu.sh ab:RECGEN_BACKEND:4,4096,16,128  # kernels / chunked
#   SPECS=power_retention bash benchmarks/run_gpu.sh ab-tree:.ab_base:2,4096,8,64  # an earlier commit, then this tree:
#     stage it first (git archive REV recgen | tar -x -C .ab_base, after mkdir .ab_base; git-ignored), and name
#     .ab_base in the call's carry beside .gpu-bundle; AB_ROUNDS=2 alternates base and this tree twice
#   SPECS="kda gla rwkv7" bash benchmarks/run_gpu.sh ab:RECGEN_MMA_PAIRS:4,4096,16,128  # pair kernels on fragments
#   SPECS=power_retention AB_VALUES="8 4 2" bash benchmarks/run_gpu.sh ab-in:feature_jac_groups:2,4096,8,64
#                                # a Tuning field's values in one process, rounds interleaved (benchmarks/ab_tuning.py)
#   bash benchmarks/run_gpu.sh first-call:power_retention:1,300,2,64   # a process's first call: cold kernel cache,
#                                # warm, none (benchmarks/first_call.py; each checked against the CPU)
#   bash benchmarks/run_gpu.sh retention   # the retention package's power_retention (its autotuning: minutes)
#   bash benchmarks/run_gpu.sh profile:rwkv7:4,4096,16,128:fwdbwd   # every kernel of one call, the table in $OUT
#   PROFILE_ARGS=--timeline bash benchmarks/run_gpu.sh profile:rwkv7:4,4096,16,128:fwdbwd   # and in launch order
#   bash benchmarks/run_gpu.sh profile-fla:gated_delta_net:4,4096,16,128   # FLA's kernels (torch.profiler), both passes
#   PROFILE_ARGS=--host bash benchmarks/run_gpu.sh profile:power_retention:2,4096,8,64:fwdbwd  # the host's share
#   NCU_KERNELS="pair|dg_rev" bash benchmarks/run_gpu.sh ncu:rwkv7:4,4096,16,128:fwdbwd   # Nsight Compute, one call
# Timings are `recgen bench` (chained calls, the op's defaults; recgen/bench.py says how) and FLA in the same call.
# `check` is the GPU test suite (python -m pytest -m gpu, in shards). Expects the offline bundle (.gpu-bundle,
# built outside the repo) to be carried along.
source .gpu-bundle/install.sh || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
SHAPES=${SHAPES:-"4,4096,16,128 8,1024,8,64 1,32768,16,128"}  # the issue's shapes (bf16)
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
    check) n=${GPU_TEST_SHARDS:-8}; logs=$(mktemp -d); pids=  # the gpu tests (tests/gpu) as n processes, --shard k/n:
           for k in $(seq 0 $((n - 1))); do          # most of their time is kernel compilation, one core a process
             timeout ${CHECK_TIMEOUT:-540} python -m pytest -m gpu $GPU_TESTS ${GPU_TEST_K:+-k "$GPU_TEST_K"} \
               --shard $k/$n -rs --durations=5 > "$logs/$k.log" 2>&1 & pids="$pids $!"  # GPU_TESTS: files to check
                                                     # (default: every gpu test); GPU_TEST_K: a -k expression
           done
           rc=0; for p in $pids; do wait $p; r=$?; [ $r = 0 ] || [ $r = 5 ] || rc=$r; done  # 5: a part with no tests
           for k in $(seq 0 $((n - 1))); do echo "=== shard $k/$n"; cat "$logs/$k.log"; done > "$OUT/check_gpu.log"
           echo "python -m pytest -m gpu ($n shards): exit $rc"; grep -E "^(FAILED|ERROR)|(passed|failed|skipped).* in " "$OUT/check_gpu.log" ;;
    bench) for shape in $SHAPES; do bench bench $shape; done ;;             # recgen alone, every spec and shape
    bench:*) bench bench ${stage#bench:} ;;                                  # recgen alone at one shape
    bench-compiled:*) bench bench_compiled ${stage#bench-compiled:} --compiled ;;  # each call compiled
    bench-fla:*) BENCH_TIMEOUT=${BENCH_TIMEOUT:-330} bench bench_fla ${stage#bench-fla:} --baseline fla $BENCH_ARGS ;;  # + FLA
    bench-extra) SPECS=selective_scan bench bench_extra 4,4096,24,16,64     # 1536 channels, 16 state rows
                 SPECS=power_retention bench bench_extra 2,4096,8,64 ;;  # the kernel identity's chunk kernels
    mlx-lm) timeout 300 python benchmarks/bench_mlx_lm.py --T 2048 --layers 4 --reps 3 --dtype bfloat16 --floor \
              2>&1 | tee "$OUT/mlx_lm_bf16.log"                       # train step, prefill, decode against mlx-lm
            MLX_ENABLE_TF32=0 timeout 120 python benchmarks/bench_mlx_lm.py --skip-train --dtype float32 \
              2>&1 | tee "$OUT/mlx_lm_f32_generate.log" ;;            # do the greedy ids agree in exact float32?
    retention) timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/bench_retention.py --shape ${RETENTION_SHAPE:-2,4096,8,64} \
                 --json "$OUT/retention.json" 2>&1 | tee "$OUT/retention.log" ;;  # the paper's kernels (wheels in the bundle)
    profile:*) p=${stage#profile:}; sp=${p%%:*}; p=${p#*:}; shape=${p%%:*}; pass=${p#*:}  # profile:SPEC:SHAPE:PASS
               timeout ${BENCH_TIMEOUT:-150} python benchmarks/profile_kernels.py $sp --shape $shape --pass $pass $PROFILE_ARGS \
                 --top 40 2>&1 | grep -v Warn | tee "$OUT/profile_${sp}_${shape//,/x}_$pass.txt" ;;  # whole, in $OUT
    profile-fla:*) p=${stage#profile-fla:}; sp=${p%%:*}; shape=${p#*:}     # profile-fla:SPEC:SHAPE: FLA's job as
          job=$(python -c "import json; from recgen.bench import Shape, fla_job; print(json.dumps(fla_job('$sp', Shape.parse('$shape'), profile=True)))")
          timeout ${BENCH_TIMEOUT:-400} python3 recgen/fla_worker.py "$job" 2>&1 | grep -v Warn \
            | tee "$OUT/profile_fla_${sp}_${shape//,/x}.txt" ;;              # bench-fla runs it, profiled
    ncu:*) p=${stage#ncu:}; sp=${p%%:*}; p=${p#*:}; shape=${p%%:*}; pass=${p#*:}  # ncu:SPEC:SHAPE:PASS, the kernels
           f="$OUT/ncu_${sp}_${shape//,/x}_$pass.txt"                     # matching NCU_KERNELS (a regex) of one call
           timeout ${BENCH_TIMEOUT:-300} ncu --clock-control none --profile-from-start off \
             --kernel-name regex:"${NCU_KERNELS:-.}" --section SpeedOfLight --section Occupancy --section LaunchStats \
             --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
             --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
             python benchmarks/profile_kernels.py $sp --shape $shape --pass $pass --cuda-profiler-range > "$f" 2>&1
           grep -E "^  [a-z_]+custom_kernel|^  [a-z_].*\(|Duration|Throughput  |Achieved Occupancy|Registers Per" "$f" ;;
    first-call:*) p=${stage#first-call:}; sp=${p%%:*}; shape=${p#*:}; kc=$(mktemp -d)  # a cold process, then a
          for n in cold warm off; do                              # warm one (the kernel cache filled), then none
            RECGEN_KERNEL_CACHE=$([ $n = off ] && echo off || echo $kc) timeout ${BENCH_TIMEOUT:-300} python \
              benchmarks/first_call.py $sp --shape $shape 2>&1 | grep -v Warn | sed "s/^/$n: /" | tee -a "$OUT/first_call.log"
          done; echo "kept: $(find $kc -name '*.cubin' | wc -l) binaries, $(du -sh $kc | cut -f1)" ;;
    decode) timeout 120 python benchmarks/bench_decode.py --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" ;;
    threshold:*) for T in ${THRESHOLD_TS:-256 512 1024}; do                 # where the chunked form starts (per T):
           for f in 1 1000000; do for c in "" --compiled; do              # the chunked form from T=1 / never,
             shape=${stage#threshold:}; shape=${shape/,T,/,$T,}           # eager and compiled (SHAPE: B,T,H,D)
             RECGEN_CHUNKED_FORWARD_MIN_T=$f timeout 150 python -m recgen.cli bench ${SPECS%% *} --shape $shape \
               --passes fwd,fwdbwd $c --json "$OUT/threshold_${T}_min${f}${c:+_compiled}.json" 2>&1 \
               | grep -E "ms " | sed "s/^/T=$T chunked-from=$f $c /" | tee -a "$OUT/threshold.log"
           done; done; done ;;
    ab:*) var=${stage#ab:}; shape=${var#*:}; var=${var%%:*}               # VAR=0 then VAR=1, every spec of $SPECS;
          for sp in $SPECS; do for v in ${AB_VALUES:-0 1}; do              # VAR1,VAR2,...: each set to the value
            env $(for x in ${var//,/ }; do echo "$x=$v"; done) timeout ${BENCH_TIMEOUT:-150} python -m recgen.cli \
              bench $sp --shape $shape --passes ${PASSES:-fwdbwd,peak} $BENCH_ARGS \
              --json "$OUT/ab_${var//,/_}${v}_${sp}_${shape//,/x}.json" 2>&1 \
              | grep -E " ms | GiB " | sed "s/^/$sp $var=$v /" | tee -a "$OUT/ab.log"
          done; done ;;
    ab-in:*) p=${stage#ab-in:}; field=${p%%:*}; shape=${p#*:}         # ab-in:FIELD:SHAPE: a Tuning field's AB_VALUES
          for sp in $SPECS; do                                      # in one process, rounds interleaved (AB_ROUNDS)
            timeout ${BENCH_TIMEOUT:-300} python benchmarks/ab_tuning.py $sp --shape $shape --field $field \
              --values ${AB_VALUES:-0 1} --rounds ${AB_ROUNDS:-6} --pass ${PASS:-fwdbwd} \
              --json "$OUT/ab_in_${field}_${sp}_${shape//,/x}.json" 2>&1 | grep -v Warn | tee -a "$OUT/ab_in.log"
          done ;;
    ab-tree:*) p=${stage#ab-tree:}; base=${p%%:*}; shape=${p#*:}   # ab-tree:DIR:SHAPE: the code in DIR, then this
          for sp in $SPECS; do for round in $(seq ${AB_ROUNDS:-1}); do  # tree's, every spec of $SPECS, AB_ROUNDS
          for tree in "$base" .; do                                  # times in turn (processes spread about ±5%);
            tag=$([ "$tree" = . ] && echo this || basename "$tree")  # each in its own process from its tree (its
            log="$OUT/ab_tree_${sp}_${tag}_$round.log"                # recgen first on the
            (cd "$tree" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout ${BENCH_TIMEOUT:-300} python -m recgen.cli \
              bench $sp --shape $shape --passes ${PASSES:-fwd,fwdbwd,peak} $BENCH_ARGS) > "$log" 2>&1 \
              || { echo "$sp $tree: exit $?"; tail -5 "$log"; }       # path); a failure shows its log's tail
            grep -E " ms | GiB " "$log" | sed "s|^|$sp $tag $round |" | tee -a "$OUT/ab_tree.log"
          done; done; done ;;
    *) echo "unknown stage $stage" ;;
  esac
done
