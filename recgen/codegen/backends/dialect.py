"""The schema of a backend: names, spellings and measured tuning constants only, no logic.

Shared code never asks which backend it renders for; it reads these fields. A field holding
``{x}``-style placeholders is a spelling with holes, filled by ``str.format``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dialect:
    name: str
    ext: str                      # file extension of standalone sources
    mlx_factory: str              # mx.fast.<factory> that compiles the body
    lane: str                     # lane index within the SIMD group / warp
    thread_in_tg: str             # linear thread index within the threadgroup / block
    tg_x: str                     # threadgroup / block index, x and y
    tg_y: str
    shfl_xor: str                 # butterfly exchange: {x} value, {m} lane mask
    barrier: str                  # threadgroup-wide barrier with memory fence
    smem: str                     # declaration prefix of threadgroup / shared memory
    int64: str                    # 64-bit index type
    global_space: str             # address-space qualifier of kernel buffers in a pointer cast
    shared_space: str             # address-space qualifier of threadgroup / shared memory in a pointer cast
    smem_bytes: int               # threadgroup / static shared memory one kernel may declare
    fns: dict                     # sympy function name -> emitted function name
    dtypes: dict                  # numpy-style dtype name -> emitted type name
    prelude: str                  # helper functions (gates) pasted into the kernel header
    # One 16x8x8 fragment multiply-add D += A B across a SIMD group, every lane holding its part of
    # each fragment in the PTX m16n8k8 layout (chunk_scan_mma.j2 spells it out): {acc} float[4] of D,
    # {a} float[4] of A, {b} float[2] of B, {lane} the lane index. ``mma_prelude`` defines it.
    mma: str
    mma_prelude: str
    float_suffix: str = "f"       # float literal suffix
    # From this sequence length on, a kernel op's VJP defaults to the chunked backward (recgen.ops);
    # a measured tuning constant per backend, None where it has not been measured (never by default).
    chunked_backward_min_t: int | None = None
    # Whether the chunked core uses the generated chunk kernels (recgen.chunked.kernels) on this
    # backend's GPUs by default: a measured choice, False where it has not been measured on hardware.
    chunk_kernels: bool = False
    # Whether the chunk scan runs on ``mma`` (chunk_scan_mma.j2) rather than on FMAs (chunk_scan.j2)
    # where the sizes allow: a measured choice; False where ``mma`` is only a reference spelling.
    mma_scan: bool = False
    # An environment switch that, set to "0", keeps the scan on FMAs: CUDA's fragments round their
    # operands to TF32, so the scan follows MLX's own switch for TF32 in float32 GEMMs.
    mma_env: str | None = None
