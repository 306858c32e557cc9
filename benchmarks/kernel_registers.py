"""Registers, spills, shared memory and threadgroups an SM (sm_90) of a spec's CUDA chunk kernels, from ptxas, with
no GPU: the distinct kernels its chunked form calls forward and backward (as ``recgen emit --chunked`` records them,
with CUDA's measured tuning), built as MLX builds them (``recgen.verify.ptxas``), by nvcc on PATH or from NVIDIA's
pip wheels. Check a kernel change here before timing it: a few registers more can cost a threadgroup an SM.

    python benchmarks/kernel_registers.py gated_delta_net
    python benchmarks/kernel_registers.py kda --sizes K=64,V=64,H=8,HK=8 --dtype float32
    python benchmarks/kernel_registers.py power_retention --sizes K=64,V=64,H=8,HK=8 --chunk 256 --tune feature_kernels=1
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from recgen.cli_kernels import parse_sizes
from recgen.emit_chunked import record
from recgen.spec.layouts import Sizes
from recgen.spec.resolve import resolve_spec
from recgen.verify.ptxas import as_kernel, find_nvcc, translation_unit, usage


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("spec", help="a built-in name or path/to/file.py:function")
    p.add_argument("--sizes", default="K=128,V=128,H=16,HK=16", help="as recgen emit's --sizes")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--tune", action="append", default=[], metavar="FIELD=INT",
                   help="a Tuning field over CUDA's measured table (repeatable), e.g. feature_kernels=1")
    a = p.parse_args(argv)
    tune = {}
    for item in a.tune:
        name, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            sys.exit(f"kernel_registers: --tune {item!r}: expected FIELD=INT")
        tune[name] = int(value)
    nvcc = find_nvcc()
    if nvcc is None:
        sys.exit("kernel_registers: nvcc not found (PATH, or pip install nvidia-cuda-nvcc and its companions: .ci/run)")
    rec, sz = resolve_spec(a.spec), parse_sizes(a.sizes)
    kf = rec.features[0].width(sz["K"]) if rec.features else sz["K"]
    kernels: dict = {}  # the distinct kernels (source and template constants), as first called
    for launch, buffers in record(rec, "cuda", Sizes(1, 1, sz["H"], sz["HK"], sz["K"], kf, sz["V"]), a.chunk, a.dtype,
                                **tune):
        dtypes = {n: dt for n, (_, dt) in zip(launch.source.inputs, buffers)}
        kernels.setdefault((launch.source.name, launch.template), (launch, dtypes))
    listed = list(kernels.values())
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "kernels.cu"
        unit.write_text(translation_unit([as_kernel(i, x, dt) for i, (x, dt) in enumerate(listed)]))
        reports = usage(unit, [x.threadgroup[0] for x, _ in listed], nvcc, a.arch)
    table = Table(title=f"{a.spec} ({a.dtype}, {a.sizes}, chunks of {a.chunk}): ptxas for {a.arch}")
    for col in ("kernel", "threads", "registers", "spilled B", "shared KB", "threadgroups / SM"):
        table.add_column(col, justify="left" if col == "kernel" else "right", no_wrap=col == "kernel")
    for i, (x, _) in enumerate(listed):
        u = reports[i]
        table.add_row(x.source.name.removeprefix("recgen_chunk_").rsplit("_cuda_", 1)[0], str(u.threads),
                      str(u.registers), str(u.spill_bytes), f"{u.shared_bytes / 1024:.1f}", str(u.blocks_per_sm))
    Console(width=120).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
