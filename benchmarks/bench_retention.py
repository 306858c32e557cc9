"""The power-retention paper's own kernels (the ``retention`` package on PyPI, Triton through torch), timed the way
issue 19 compares against: forward, forward+backward and peak memory of ``retention.power_retention`` at one shape,
degree 2, gated, bf16, for each chunk size asked.

    python benchmarks/bench_retention.py --shape 2,4096,8,64 --chunks 128,1024 [--json out.json]

Run it in its own process (torch's CUDA allocator and MLX's are kept apart, as for FLA). Times are
``triton.testing.do_bench`` medians (one call at a time, synchronized); peak is ``torch.cuda.max_memory_allocated``
around one call after a reset (inputs included, as ``recgen bench`` counts them). The first call of each chunk
size autotunes (minutes on a cold cache), so the script warms each up once before timing. The GPU host has no
package index: ``pip download --no-deps retention einops -d .gpu-bundle`` here puts the wheels into the bundle.
"""
from __future__ import annotations

import argparse
import json
import math
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="2,4096,8,64", help="B,T,H,D")
    p.add_argument("--chunks", default="128,1024", help="chunk sizes, comma separated")
    p.add_argument("--deg", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from retention import power_retention

    b, t, h, d = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16

    def leaf(x):
        return x.detach().requires_grad_(True)

    q = leaf(torch.randn(b, t, h, d, device=dev, dtype=dt) / math.sqrt(d))
    k = leaf(torch.randn(b, t, h, d, device=dev, dtype=dt) / math.sqrt(d))
    v = leaf(torch.randn(b, t, h, d, device=dev, dtype=dt) / math.sqrt(d))
    log_g = leaf(F.logsigmoid(torch.randn(b, t, h, device=dev, dtype=torch.float32)))
    do = torch.randn(b, t, h, d, device=dev, dtype=dt)
    rows = []
    for c in (int(x) for x in args.chunks.split(",")):
        def fwd(c=c):
            with torch.no_grad():
                return power_retention(q, k, v, log_g, deg=args.deg, chunk_size=c)

        def fwdbwd(c=c):
            y = power_retention(q, k, v, log_g, deg=args.deg, chunk_size=c)
            torch.autograd.grad(y, (q, k, v, log_g), do)

        start = time.time()
        fwd(), fwdbwd()  # autotuning, once per chunk size
        torch.cuda.synchronize()
        tuned = time.time() - start
        row = {"chunk_size": c, "autotune_s": round(tuned, 1)}
        for name, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            row[f"{name}_ms"] = do_bench(fn, quantiles=None, return_mode="median")
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rows.append(row)
        print(f"retention.power_retention {args.shape} deg={args.deg} chunk={c}: fwd {row['fwd_ms']:.3f} ms, "
              f"fwd+bwd {row['fwdbwd_ms']:.3f} ms, peak {row['fwd_peak_gib']:.2f} / {row['fwdbwd_peak_gib']:.2f} "
              f"GiB (autotune {tuned:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "deg": args.deg, "device": torch.cuda.get_device_name(), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
