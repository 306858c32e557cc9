"""The recipe of one kernel call, and the call through MLX.

A ``Launch`` (inputs beyond the user's, output shapes, grid, template values) is shared by MLX and by the
Metal CPU emulator (``recgen.verify.kernels``), so both run exactly the same thing. MLX is imported when a
kernel is called, never at import time (MLX raises off Apple silicon when a Metal kernel is built).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import lru_cache

from ..codegen.backends.dialect import Dialect
from ..codegen.render import KernelSource
from ..hashing import hash_once
from . import kernel_binary


@dataclass(frozen=True)
class Launch:
    """One kernel call: extra runtime inputs, outputs (shape, dtype name), grid, template values."""

    source: KernelSource
    runtime: tuple         # ((name, values, dtype name), ...): small device arrays made once per value
    outputs: tuple         # ((shape, dtype name), ...) in source.outputs order
    grid: tuple
    threadgroup: tuple
    template: tuple        # ((name, int | bool | dtype name), ...)
    min_blocks: int = 0    # threadgroups an SM the compiler must leave registers for (CUDA's __launch_bounds__),
    #                        where recgen compiles the kernel itself (the kernel cache); MLX's wrapper takes none

    __hash__ = hash_once  # each kernel call looks its launch up in caches

    @property
    def bounds(self) -> tuple:
        """(threads a threadgroup, threadgroups an SM) the compiler is held to, or () for its own choice."""
        return (math.prod(self.threadgroup), self.min_blocks) if self.min_blocks > 1 else ()


@lru_cache(maxsize=256)
def mlx_kernel(src: KernelSource, factory: str, debug: bool = False):
    """``mx.fast.<factory>`` for ``src``, built once; with ``debug`` its source is printed as MLX receives it."""
    import mlx.core as mx

    if debug:
        print(f"// ---- {src.name} ({factory})\n{src.text}", file=sys.stderr)
    return getattr(mx.fast, factory)(name=src.name, input_names=list(src.inputs), output_names=list(src.outputs),
                                     source=src.source, header=src.header)


def mlx_call(launch: Launch, dialect: Dialect, user: list, extra: list, debug: bool = False, kernel_cache: str = ""):
    """Buffers in source order: the user's arrays, the runtime values, then ``extra``. Where the dialect runs
    binaries and ``kernel_cache`` (the tuning's) names a directory, the kernel compiled once and kept there
    (``kernel_binary``); else MLX compiles the body (once a process)."""
    ins = list(user) + list(runtime_arrays(launch.runtime)) + list(extra)
    directory = kernel_cache if dialect.binary_factory else ""
    kept = directory and _kept(launch, tuple(dtype_name(a.dtype) for a in ins), directory)
    if kept:
        return binary_call(dialect, kept, ins, launch_arguments(launch), debug)
    return mlx_kernel(launch.source, dialect.mlx_factory, debug)(inputs=ins, **launch_arguments(launch))


@lru_cache(maxsize=512)
def _kept(launch: Launch, input_dtypes: tuple, directory: str):
    """``kernel_binary.binary`` for a launch at these input dtypes, looked up by the launch (whose hash is kept) and
    not by its source, outputs, template values and bounds hashed again on every kernel call."""
    return kernel_binary.binary(launch.source, input_dtypes, tuple(dt for _, dt in launch.outputs), launch.template,
                                launch.bounds, directory)


def binary_call(dialect: Dialect, kept: tuple, ins: list, args: dict, debug: bool = False):
    """A kept binary (symbol, bytes) run as MLX's ``cuda_kernel`` would run its body: inputs made row-contiguous
    (its default), outputs uninitialised, no template (the values are compiled in)."""
    import mlx.core as mx

    if debug:
        print(f"// ---- {kept[0]} (kept binary, {len(kept[1])} bytes)", file=sys.stderr)
    return getattr(mx.fast, dialect.binary_factory)(
        name=kept[0], compiled_source=kept[1], inputs=ins, output_shapes=args["output_shapes"],
        output_dtypes=args["output_dtypes"], scalars=[], grid=args["grid"], threadgroup=args["threadgroup"],
        ensure_row_contiguous=True)


_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """An mx dtype's name as launches carry it ("bfloat16"), kept per dtype: each kernel call names every input's
    (formatting a dtype is a microsecond, of a decode step's host work)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).split(".")[-1]
    return name


@lru_cache(maxsize=256)
def launch_arguments(launch: Launch) -> dict:
    """The kernel call's arguments but its inputs, as MLX takes them, made once per launch (a step calls each
    of its kernels every time, and its graph is built on the host before the GPU can start)."""
    import mlx.core as mx

    return dict(output_shapes=[s for s, _ in launch.outputs],
                output_dtypes=[getattr(mx, dt) for _, dt in launch.outputs], grid=launch.grid,
                threadgroup=launch.threadgroup,
                template=[(n, getattr(mx, v) if isinstance(v, str) else v) for n, v in launch.template])


@lru_cache(maxsize=256)
def runtime_arrays(runtime: tuple) -> tuple:
    """Runtime values (T, B, scale, chunk counts) as small device arrays, made once per distinct value: a
    host upload per call is not free."""
    import mlx.core as mx

    return tuple(mx.array(list(v), dtype=getattr(mx, dt)) for _, v, dt in runtime)
