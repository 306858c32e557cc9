"""FLA baselines on the same GPU (separate process: torch and MLX keep their own CUDA allocators).

    python benchmarks/bench_fla.py --out DIR
"""
from __future__ import annotations

import json
import sys

import torch
import triton

import fla.ops.common.chunk_o as chunk_o

chunk_o.IS_NVIDIA_HOPPER = False  # FLA #640: gated chunk backward refused on Hopper with Triton < 3.7.1 (timing only)
from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.gla import chunk_gla, fused_recurrent_gla  # noqa: E402
from fla.ops.simple_gla import chunk_simple_gla  # noqa: E402


def make(B, T, H, D):
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, H, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dt).requires_grad_()
    v = torch.randn(B, T, H, D, device=dev, dtype=dt, requires_grad=True)
    g = (-torch.rand(B, T, H, device=dev) * 0.5).to(dt).requires_grad_()
    beta = torch.rand(B, T, H, device=dev, dtype=dt).sigmoid().requires_grad_()
    gk = (-torch.rand(B, T, H, D, device=dev) * 0.5).to(dt).requires_grad_()
    return q, k, v, g, beta, gk


def bench(fn, grad_inputs):
    t_f = triton.testing.do_bench(lambda: fn(), return_mode="median")
    o = fn()
    do = torch.randn_like(o)

    def fb():
        for x in grad_inputs:
            x.grad = None
        fn().backward(do)
    try:
        t_fb = triton.testing.do_bench(fb, return_mode="median")
    except Exception as e:  # noqa: BLE001
        print("  backward failed:", repr(e)[:160])
        t_fb = float("nan")
    return t_f, t_fb


def main():
    """Each (op, shape) in its own process: one illegal memory access must not poison the rest."""
    import subprocess

    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."
    res = {}
    # the op that crashes (illegal address) runs alone and last, so it cannot poison the others
    only = sys.argv[sys.argv.index("--ops") + 1].split(",") if "--ops" in sys.argv else OPS
    shapes = sys.argv[sys.argv.index("--shapes") + 1].split(";") if "--shapes" in sys.argv else \
        ["4,4096,16,128", "8,1024,8,64"]
    groups = [[n] for n in only]  # one process each: Triton autotuning is per process anyway
    for shape in shapes:
        for group in groups:
            try:
                p = subprocess.run([sys.executable, __file__, "--one", ",".join(group), shape], capture_output=True,
                                   text=True, timeout=int(sys.argv[sys.argv.index("--timeout") + 1])
                                   if "--timeout" in sys.argv else 200)
                stdout, stderr = p.stdout, p.stderr
            except subprocess.TimeoutExpired as e:
                stdout, stderr = (e.stdout or b"").decode(), "timeout"
            got = {x.split()[1]: tuple(map(float, x.split()[2:])) for x in stdout.splitlines() if x.startswith("RESULT")}
            for name in group:
                t_f, t_fb = got.get(name, (float("nan"), float("nan")))
                if name not in got:
                    print(f"FLA {name} {shape} failed: {stderr[-300:]}")
                res[f"{name}/{shape}"] = {"fwd_ms": t_f, "fwdbwd_ms": t_fb}
                print(f"FLA {name:34s} ({shape}): fwd {t_f:8.3f} ms  fwd+bwd {t_fb:8.3f} ms", flush=True)
    json.dump(res, open(f"{out}/bench_fla.json", "w"), indent=1)


OPS = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_delta_rule", "fused_recurrent_delta_rule",
       "chunk_gla", "fused_recurrent_gla", "chunk_simple_gla"]


def one(name, shape):
    B, T, H, D = map(int, shape.split(","))
    q, k, v, g, beta, gk = make(B, T, H, D)
    g32 = g.detach().float().requires_grad_()
    runs = {
        "chunk_gated_delta_rule": (lambda: chunk_gated_delta_rule(q, k, v, g, beta)[0], (q, k, v, g, beta)),
        "fused_recurrent_gated_delta_rule": (lambda: fused_recurrent_gated_delta_rule(q, k, v, g32, beta)[0], (q, k, v, g32, beta)),
        "chunk_delta_rule": (lambda: chunk_delta_rule(q, k, v, beta)[0], (q, k, v, beta)),
        "fused_recurrent_delta_rule": (lambda: fused_recurrent_delta_rule(q, k, v, beta)[0], (q, k, v, beta)),
        "chunk_gla": (lambda: chunk_gla(q, k, v, gk)[0], (q, k, v, gk)),
        "fused_recurrent_gla": (lambda: fused_recurrent_gla(q, k, v, gk)[0], (q, k, v, gk)),
        "chunk_simple_gla": (lambda: chunk_simple_gla(q, k, v, g)[0], (q, k, v, g)),
    }
    for n in name.split(","):
        fn, gi = runs[n]
        t_f, t_fb = bench(fn, gi)
        print(f"RESULT {n} {t_f} {t_fb}", flush=True)


if __name__ == "__main__":
    if "--one" in sys.argv:
        i = sys.argv.index("--one")
        one(sys.argv[i + 1], sys.argv[i + 2])
    else:
        main()
