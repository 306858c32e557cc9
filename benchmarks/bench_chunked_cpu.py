"""CPU benchmark of the pure-MLX chunked form (the ``mlx`` backend) against the naive per-token MLX loop, through
``recgen.bench`` (chained calls, the op's defaults; see its docstring for the method).

    python benchmarks/bench_chunked_cpu.py [--shape 2,2048,4,64] [--specs gated_delta_net,gla,...] [--long 8192]
                                           [--json-dir DIR]

float32 on the CPU device. The selective scan runs with 16 state rows (K=16, V=D). ``--long``: forward+backward
of ``--long-spec`` at T/4 ... 2T, chunked only, to show the memory bound of its segments.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import mlx.core as mx

from recgen import bench
from recgen.chunked import segment_budget
from recgen.specs import BUILTINS
from recgen.tuning import current

SPECS = "gated_delta_net,gla,simple_gla,delta_net,selective_scan"


def spec_shape(name: str, shape: bench.Shape) -> bench.Shape:
    return bench.Shape(shape.B, shape.T, shape.H, 16, shape.V) if name.startswith("selective_scan") else shape


def value(r, impl, kind, scale=1.0):
    m = r.get(impl, kind)
    return "-" if m is None else ("skipped" if m.value is None else f"{m.value * scale:.1f}")


def save(r, json_dir, tag):
    if json_dir:
        path = Path(json_dir) / f"{r.spec}_{tag}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r.to_json(), indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2,2048,4,64", help="B,T,H,D")
    ap.add_argument("--specs", default=SPECS)
    ap.add_argument("--no-naive", action="store_true", help="the chunked side only")
    ap.add_argument("--long", type=int, default=8192, help="T of the bounded-memory check (0: skip)")
    ap.add_argument("--long-spec", default="gated_delta_net")
    ap.add_argument("--json-dir", help="write each run's JSON here")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    shape = bench.Shape.parse(a.shape)
    baselines = () if a.no_naive else ("naive",)
    print(f"# recgen.chunked vs the naive MLX loop, CPU ({platform.processor() or platform.machine()}), mlx "
          f"{mx.__version__}, float32, shape {shape.text()}, chained calls (recgen.bench)\n")
    print("| spec | mode | chunked ms | naive ms | speedup | chunked peak MiB | naive peak MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in a.specs.split(","):
        r = bench.run(BUILTINS[name], spec_shape(name, shape), dtype="float32", baselines=baselines)
        save(r, a.json_dir, shape.text().replace(",", "x"))
        for kind, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
            ratio = r.ratio(kind, "naive")
            print(f"| {name} | {label} | {value(r, 'recgen', kind)} | {value(r, 'naive', kind)} | "
                  f"{'-' if ratio is None else f'{1 / ratio:.1f}x'} | {value(r, 'recgen', 'peak_' + kind, 1024)} | "
                  f"{value(r, 'naive', 'peak_' + kind, 1024)} |", flush=True)
    if a.long:
        rec = BUILTINS[a.long_spec]
        print(f"\n## Bounded memory: {a.long_spec} fwd+bwd, chunked, B={shape.B} H={shape.H} D={shape.V}, "
              f"segment budget {segment_budget(current()) / 2**20:.0f} MiB\n")
        print("| T | ms | peak MiB |")
        print("|---:|---:|---:|")
        for T in (a.long // 4, a.long // 2, a.long, 2 * a.long):
            r = bench.run(rec, shape.with_t(T), dtype="float32", passes=("fwdbwd", "peak"), repeat=1)
            save(r, a.json_dir, f"long{T}")
            print(f"| {T} | {value(r, 'recgen', 'fwdbwd')} | {value(r, 'recgen', 'peak_fwdbwd', 1024)} |", flush=True)


if __name__ == "__main__":
    main()
