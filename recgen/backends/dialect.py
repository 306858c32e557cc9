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
    float_suffix: str = "f"       # float literal suffix
    # From this sequence length on, a kernel op's VJP defaults to the chunked backward (recgen.ops);
    # a measured tuning constant per backend, None where it has not been measured (never by default).
    chunked_backward_min_t: int | None = None
    # Whether the chunked core uses the generated chunk kernels (recgen.chunked.kernels) on this
    # backend's GPUs by default: a measured choice, False where it has not been measured on hardware.
    chunk_kernels: bool = False
