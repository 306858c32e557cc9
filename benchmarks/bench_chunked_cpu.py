"""CPU benchmark of the pure-MLX chunked fallback (recgen.chunked) against the naive per-token loop.

    python benchmarks/bench_chunked_cpu.py [--T 2048] [--long 8192] [--specs gated_delta_net,gla,...]

Both run the same spec through MLX ops on the CPU device, float32, B=2, H=4, D=64 (K=V=64; the
selective scan uses N=16 state rows, V=64 channels). Forward: the op evaluated; fwd+bwd: the
gradient of sum(o * do) + sum(S_T * dht) with respect to every input and the initial state.
Peak memory is ``mx.get_peak_memory()`` after a reset before each measured run. Times are the
median of ``--reps`` runs after one warm-up (the naive loop is timed once after warm-up when it
takes more than a few seconds).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import mlx.core as mx
import numpy as np

from recgen import specs
from recgen.chunked import forward, naive_loop
from recgen.spec.layouts import infer_sizes


def make_inputs(rec, B, T, H, D, seed=0):
    rng = np.random.default_rng(seed)
    K = 16 if rec.name.startswith("selective_scan") else D
    out = {}
    for x in rec.inputs:
        if x.kind == "scalar":
            a = (-rng.uniform(0, 1, (B, T, H)) if x.name == "g" else
                 1 / (1 + np.exp(-rng.normal(size=(B, T, H)))))
        elif x.kind == "key":
            a = rng.normal(size=(B, T, H, K))
            if rec.step.transition is not None and x.name == "k":
                a /= np.linalg.norm(a, axis=-1, keepdims=True)
            if rec.features:
                a *= 0.5
        elif x.kind == "key_gate":
            a = np.log(1 / (1 + np.exp(-rng.normal(size=(B, T, H, K))))) / 16
        elif x.kind == "value":
            a = rng.normal(size=(B, T, H, D))
            if x.name == "dt":
                a = a - 2.0
        else:
            shp = (H,) + tuple({"i": K, "j": D}[c] for c in x.index)
            a = -np.exp(rng.normal(size=shp)) if x.name == "A" else rng.normal(size=shp)
        out[x.name] = mx.array(a.astype(np.float32))
    return out


def run_case(rec, fn, ins, mode, reps):
    names = list(ins)
    sizes = infer_sizes(rec, {k: tuple(v.shape) for k, v in ins.items()})
    scale = sizes.Kin ** -0.5 if rec.default_scale == "key" else 1.0
    rng = np.random.default_rng(1)
    h0 = mx.array(rng.normal(size=sizes.state_shape).astype(np.float32) * 0.1)
    if rec.has_normalizer:
        h0 = (h0, mx.ones(sizes.state_shape[:3]))
    do = mx.array(rng.normal(size=(sizes.B, sizes.T, sizes.H, sizes.V)).astype(np.float32))

    def loss(*args):
        st = (tuple(args[len(names):]) if rec.has_normalizer else args[len(names)])
        o, s = fn(rec, dict(zip(names, args[:len(names)])), scale=scale, initial_state=st)
        S = s[0] if rec.has_normalizer else s
        return (o * do).sum() + S.sum()

    prim = [ins[n] for n in names] + (list(h0) if rec.has_normalizer else [h0])
    if mode == "fwd":
        def once():
            st = tuple(prim[len(names):]) if rec.has_normalizer else prim[len(names)]
            o, s = fn(rec, ins, scale=scale, initial_state=st)
            mx.eval(o, s)
    else:
        g = mx.grad(loss, argnums=list(range(len(prim))))

        def once():
            mx.eval(g(*prim))
    once()  # warm-up
    times, peak = [], 0
    for r in range(reps):
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
        peak = max(peak, mx.get_peak_memory())
        if times[-1] > 5.0:
            break
    return statistics.median(times), peak


def chunked_fn(chunk):
    return lambda rec, ins, **kw: forward(rec, ins, chunk_size=chunk, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=None, help="chunk size (default: recgen's, 16 on the CPU)")
    ap.add_argument("--cache-gib", type=float, default=None,
                    help="mx.set_cache_limit for both sides (MLX's CPU default is 32 MiB: every larger "
                         "buffer is returned to the OS and faulted in again)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", choices=["default", "on", "off"], default="default",
                    help="run the chunk core and the stretch through mx.compile (recgen.chunked.parallel.COMPILE)")
    ap.add_argument("--long", type=int, default=8192, help="T of the bounded-memory fwd+bwd check (0: skip)")
    ap.add_argument("--long-spec", default="gated_delta_net")
    ap.add_argument("--specs", default="gated_delta_net,gla,simple_gla,delta_net,selective_scan")
    ap.add_argument("--no-naive", action="store_true", help="time the chunked side only (quick comparisons)")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    if a.compile != "default":
        from recgen.chunked import parallel

        parallel.COMPILE = a.compile == "on"
    if a.cache_gib is not None:
        mx.set_cache_limit(int(a.cache_gib * 2**30))
    print(f"# recgen.chunked vs naive MLX loop, CPU ({platform.processor() or platform.machine()}), "
          f"mlx {mx.__version__}, float32, B={a.B} T={a.T} H={a.H} D={a.D}, chunk={a.chunk or 'default'}, "
          f"cache limit {'MLX default' if a.cache_gib is None else f'{a.cache_gib} GiB'}, compile {a.compile}\n")
    print("| spec | mode | chunked ms | naive ms | speedup | chunked peak MiB | naive peak MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in a.specs.split(","):
        rec = specs.BUILTINS[name]
        ins = make_inputs(rec, a.B, a.T, a.H, a.D)
        for mode in ("fwd", "fwd+bwd"):
            tc, pc = run_case(rec, chunked_fn(a.chunk), ins, mode, a.reps)
            tn, pn = (float("nan"), float("nan")) if a.no_naive else run_case(rec, naive_loop, ins, mode, a.reps)
            print(f"| {name} | {mode} | {tc * 1e3:.1f} | {tn * 1e3:.1f} | {tn / tc:.1f}x | "
                  f"{pc / 2**20:.0f} | {pn / 2**20:.0f} |", flush=True)
    if a.long:
        rec = specs.BUILTINS[a.long_spec]
        from recgen.chunked import segment_budget

        print(f"\n## Bounded memory: {a.long_spec} fwd+bwd, chunked, B={a.B} H={a.H} D={a.D}, "
              f"segment budget {segment_budget() / 2**20:.0f} MiB\n")
        print("| T | ms | peak MiB | inputs+grads MiB |")
        print("|---:|---:|---:|---:|")
        for T in (a.long // 4, a.long // 2, a.long, 2 * a.long):
            ins = make_inputs(rec, a.B, T, a.H, a.D)
            t, p = run_case(rec, chunked_fn(a.chunk), ins, "fwd+bwd", 1)
            io = 2 * sum(v.nbytes for v in ins.values())
            print(f"| {T} | {t * 1e3:.0f} | {p / 2**20:.0f} | {io / 2**20:.0f} |", flush=True)


if __name__ == "__main__":
    main()
