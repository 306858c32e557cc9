"""The schema of a backend: names, spellings and capabilities only, no logic and no tuning (``recgen.tuning``).

Shared code never asks which backend it renders for; it reads these fields. A field holding
``{x}``-style placeholders is a spelling with holes, filled by ``str.format``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)  # one table per backend: identity is equality, and it hashes for caches
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
    standalone_dtypes: dict       # dtype name -> buffer element type in a standalone source (``recgen emit``)
    constant_space: str = ""      # address space of small read-only buffers in a standalone signature
    restrict: str = ""            # pointer qualifier of buffers in a standalone signature
    float_suffix: str = "f"       # float literal suffix
