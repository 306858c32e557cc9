"""Where an op's GPU time goes: every kernel MLX launches for one call, by total time, on an NVIDIA GPU.

    python benchmarks/profile_kernels.py gated_delta_net --shape 4,4096,16,128 --pass fwdbwd [--compiled]
    python benchmarks/profile_kernels.py power_retention --shape 2,4096,8,64 --pass fwdbwd --host   # host's share

MLX's CUDA kernels are recorded through CUPTI by ``torch.profiler`` in the same process (torch only records;
nothing runs in torch). The call is the one ``recgen bench`` times (``recgen.bench.steps``: the op's defaults,
the output and every gradient evaluated), warmed up first, then ``--reps`` calls recorded, each synchronized.
"""
from __future__ import annotations

import argparse
from collections import defaultdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec")
    p.add_argument("--shape", default="4,4096,16,128")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--pass", dest="kind", choices=("fwd", "fwdbwd"), default="fwd")
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--timeline", action="store_true", help="also every kernel of the last call, in launch order")
    p.add_argument("--host", action="store_true",
                   help="instead: the host's share of a call, the graph's build alone (then dropped unevaluated) "
                        "against a synchronized call (build, launch and GPU), medians of --reps; no torch")
    p.add_argument("--cuda-profiler-range", action="store_true",
                   help="only one call between cudaProfilerStart and Stop, for `ncu --profile-from-start off` "
                        "(the warm-up and the once-a-process self-tests outside it); no table")
    args = p.parse_args()

    import mlx.core as mx

    from recgen import bench, load

    rec = load(args.spec).rec
    xs, do = bench.make_inputs(rec, bench.Shape.parse(args.shape), args.dtype)
    s = bench.steps(bench.recgen_forward(rec, "auto"), xs, do, args.compiled)
    call = s.fwd if args.kind == "fwd" else s.fwdbwd
    for _ in range(2):
        mx.eval(call())
    mx.synchronize()
    if args.host:
        host_share(call, args)
        return

    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.init()
    if args.cuda_profiler_range:
        torch.cuda.cudart().cudaProfilerStart()
        mx.eval(call())
        mx.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.reps):
            mx.eval(call())
            mx.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.name and not e.name.startswith("cuda"):
            dur = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
            total[e.name] += dur / 1e3 / args.reps
            count[e.name] += 1
    ms = sum(total.values())
    launches = sum(count.values()) // args.reps
    print(f"{args.spec} {args.shape} {args.dtype} {args.kind}{' compiled' if args.compiled else ''}: "
          f"{ms:.3f} ms of GPU kernels a call, {launches} launches")
    for name, t in sorted(total.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{t:8.3f} ms {count[name] // args.reps:4d}x  {name[:110]}")
    if args.timeline:  # which op a copy or cast belongs to shows in what runs beside it
        kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA") and e.name
                   and not e.name.startswith("cuda")]
        kernels.sort(key=lambda e: e.time_range.start)
        last = kernels[-launches:]
        t0 = last[0].time_range.start
        print("timeline of the last call (start, end from its first kernel's start; kernels of a CUDA graph may "
              "overlap, so the end of the last is the call's span):")
        for e in last:
            print(f"{(e.time_range.start - t0) / 1e3:8.3f} {(e.time_range.end - t0) / 1e3:8.3f} ms  "
                  f"{e.name.replace('mlx::core::cu::', '')[:110]}")


def host_share(call, args) -> None:
    """Medians of ``args.reps`` (at least 5): building a call's graph (dropped unevaluated), and one synchronized
    call (``bench.time_sync``). Under ``mx.vjp`` nothing is compiled, so a training call re-runs the op's Python
    every time, and the GPU waits for the graph."""
    import statistics
    import time

    from recgen import bench

    reps, build = max(5, args.reps), []
    for _ in range(reps):
        t0 = time.perf_counter()
        graph = call()
        build.append((time.perf_counter() - t0) * 1e3)
        del graph
    whole = bench.time_sync(call, reps)
    print(f"{args.spec} {args.shape} {args.dtype} {args.kind}{' compiled' if args.compiled else ''}: "
          f"graph build {statistics.median(build):.3f} ms, synchronized call {statistics.median(whole):.3f} ms")

if __name__ == "__main__":
    main()
