"""CUDA chunk kernels through nvcc and ptxas without a GPU: where nvcc is, a launch's body as the templated
``__global__`` function MLX's ``cuda_kernel`` builds around it, and what ptxas reports of each (registers a lane,
spilled bytes, static shared memory) with the threadgroups an SM those leave on sm_90.

Why: the fused chunk kernels are latency-bound at four or fewer threadgroups an SM, and a change that adds a few
registers can cost a threadgroup; ptxas says so in seconds, before any device time. The kernels are built as MLX
builds them: no ``__restrict__`` (with it the compiler may sink loads back to their uses: a hoisted scan read 102
registers so, 236 as MLX runs it), as ``recgen emit`` writes them too.
nvcc is found on PATH or in NVIDIA's pip wheels (``nvidia-cuda-nvcc`` and its companions, which CI installs:
``.ci/run``).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

from ..codegen.cuda_unit import CTYPES, INCLUDES, launch_bounds

# sm_90 (H100, H200): what one SM holds
SM90 = dict(registers=65536, shared_bytes=228 * 1024, shared_reserved=1024, threads=2048, blocks=32)


def find_nvcc() -> str | None:
    """nvcc on PATH, else the one NVIDIA's pip wheels install (site-packages/nvidia/cu*/bin/nvcc)."""
    found = shutil.which("nvcc")
    spec = importlib.util.find_spec("nvidia") if found is None else None
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = found or next((str(p) for p in sorted(Path(root).glob("cu*/bin/nvcc"), reverse=True)), None)
    return found


def as_kernel(i: int, launch, dtypes: dict | None = None) -> str:
    """The launch's body as a templated __global__ function (inputs const T*, outputs T*, its template constants)
    and its instantiation at the launch's constants, as MLX's cuda_kernel builds it, in namespace n<i>. ``dtypes``:
    the dtype names of input buffers (default float32; runtime values as the launch says)."""
    src, tmpl = launch.source, dict(launch.template)
    kind = lambda v: "typename" if isinstance(v, str) else "bool" if isinstance(v, bool) else "int"  # noqa: E731
    spell = lambda v: CTYPES[v] if isinstance(v, str) else str(v).lower()  # noqa: E731
    types = {**(dtypes or {}), **{n: dt for n, _, dt in launch.runtime}}
    sig = ", ".join([f"const {CTYPES[types.get(n, 'float32')]}* {n}" for n in src.inputs]
                    + [f"{CTYPES[dt]}* {n}" for n, (_, dt) in zip(src.outputs, launch.outputs)])
    params = ", ".join(f"{kind(v)} {n}" for n, v in tmpl.items())
    args = ", ".join(spell(v) for v in tmpl.values())
    bounds = launch_bounds(launch.bounds)  # on the definition: the instantiation inherits it
    return (f"namespace n{i} {{\n{src.header}\ntemplate <{params}>\n__global__ void {bounds}k({sig}) {{\n"
            f"{src.source}\n}}\ntemplate __global__ void k<{args}>({sig});\n}}\n")


def translation_unit(kernels: list[str]) -> str:
    """``as_kernel`` sources as one .cu file."""
    return INCLUDES + "".join(kernels)


@dataclasses.dataclass(frozen=True)
class Usage:
    """What ptxas reports of one kernel, and the threadgroups of ``threads`` an SM that it leaves (sm_90)."""

    registers: int
    spill_bytes: int  # stored (the loads mirror them)
    shared_bytes: int
    threads: int

    @property
    def blocks_per_sm(self) -> int:
        warps = -(-self.threads // 32)
        per_warp = -(-self.registers * 32 // 256) * 256  # registers are allocated 256 a warp at a time
        by_regs = SM90["registers"] // (per_warp * warps) if self.registers else SM90["blocks"]
        by_smem = SM90["shared_bytes"] // (self.shared_bytes + SM90["shared_reserved"])
        return min(by_regs, by_smem, SM90["threads"] // self.threads, SM90["blocks"])


_ENTRY = re.compile(r"Compiling entry function '_ZN2n(\d+)1k")
_SPILL = re.compile(r"(\d+) bytes spill stores")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def usage(unit: Path, threads: list[int], nvcc: str, arch: str = "sm_90") -> dict[int, Usage]:
    """Compile ``unit`` (``translation_unit`` of kernels n0, n1, ..., of ``threads[i]`` threads each) for ``arch``:
    ptxas's report of each, by its index."""
    r = subprocess.run([nvcc, f"-arch={arch}", "-std=c++17", "--cubin", "-Xptxas", "-v", str(unit), "-o",
                        str(unit.with_suffix(".cubin"))], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed on {unit.name}:\n{r.stderr[-4000:]}")
    out, idx, spill = {}, None, 0
    for line in r.stderr.splitlines():
        if m := _ENTRY.search(line):
            idx, spill = int(m.group(1)), 0
        elif m := _SPILL.search(line):
            spill = int(m.group(1))
        elif (m := _USED.search(line)) and idx is not None:
            out[idx] = Usage(int(m.group(1)), spill, int(m.group(2) or 0), threads[idx])
            idx = None
    return out
