"""Compiled kernels kept across processes, for dialects whose MLX factory runs a binary (``Dialect.binary_factory``;
CUDA's ``precompiled_cuda_kernel``).

MLX compiles a ``cuda_kernel`` on its first call in each process and keeps nothing for the next: every new process
compiles every kernel again (minutes for the chunk kernels' self-tests on an H100). Here a launch's translation unit
(``codegen.cuda_unit``: the function MLX would build, with the call's dtypes and template values) is compiled by
NVRTC once for this GPU's architecture and kept under ``Tuning.kernel_cache``, named by a hash of the unit, the
architecture and the compiler's version; later processes read it. A write goes to a temporary file first and is
renamed, so a reader never sees half a binary."""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

from ..codegen.cuda_unit import global_function, spells
from ..codegen.render import KernelSource
from . import nvrtc

ELF = b"\x7fELF"  # a cubin is an ELF image


@lru_cache(maxsize=1)
def architecture() -> str | None:
    """This GPU's NVRTC target as MLX compiles for it ("sm_90a": the arch-specific features from sm_90 on), or None
    where MLX does not say."""
    import mlx.core as mx

    info = mx.device_info()
    major, minor = info.get("compute_capability_major"), info.get("compute_capability_minor")
    if major is None or minor is None:
        arch = str(info.get("architecture", ""))
        digits = arch.removeprefix("sm_").rstrip("a")
        if not arch.startswith("sm_") or not digits.isdigit():
            return None
        major, minor = int(digits[:-1]), int(digits[-1])
    return f"sm_{major}{minor}{'a' if int(major) >= 9 else ''}"


@lru_cache(maxsize=512)
def binary(src: KernelSource, input_dtypes: tuple, output_dtypes: tuple, template: tuple, bounds: tuple,
           directory: str) -> tuple[str, bytes] | None:
    """(symbol, cubin) of ``src`` at these dtypes and template values (``bounds``: ``Launch.bounds``, its launch
    bounds or ()): read from ``directory`` where an earlier process kept it, else compiled and kept. None where this
    machine cannot (no NVRTC with CUDA headers, no known architecture, a dtype without a C spelling, a compile that
    fails: MLX then compiles it, as without a cache)."""
    arch, nv = architecture(), nvrtc.compiler()
    names = input_dtypes + output_dtypes + tuple(v for _, v in template if isinstance(v, str))
    if arch is None or nv is None or not spells(names):
        return None
    unit = global_function(src, "KERNEL", input_dtypes, output_dtypes, template, bounds)
    key = hashlib.sha256(f"{arch}\n{nv.version}\n{unit}".encode()).hexdigest()[:24]
    symbol = f"{src.name}_{key}"
    path = Path(directory).expanduser() / arch / f"{symbol}.cubin"
    try:
        data = path.read_bytes()
        if data.startswith(ELF):
            return symbol, data
    except OSError:
        pass
    try:
        data = nvrtc.compile_cubin(global_function(src, symbol, input_dtypes, output_dtypes, template, bounds),
                                   symbol, arch)
    except nvrtc.NvrtcError as e:
        warnings.warn(f"recgen: {src.name} could not be compiled for the kernel cache (MLX compiles it): {e}",
                      RuntimeWarning, stacklevel=3)
        return None
    keep(path, data)
    return symbol, data


def keep(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file renamed); a directory that cannot be written
    costs only the next process's compile, and a write cut short (a full disk) leaves no temporary file behind."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as f:
            tmp = f.name
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def recorded_key(launch, user: tuple) -> tuple:
    """``binary``'s arguments but the directory for a recorded kernel call (``chunk_kernels.recording``: the launch
    and the (shape, dtype name) of each user buffer; the runtime values follow them, as ``launch.mlx_call`` passes)."""
    return (launch.source, tuple(dt for _, dt in user) + tuple(dt for _, _, dt in launch.runtime),
            tuple(dt for _, dt in launch.outputs), launch.template, launch.bounds)


def prefetch(calls: list, directory: str, workers: int | None = None) -> int:
    """The binaries of recorded kernel calls ((launch, user buffers), ...: ``recorded_key``) made side by side, read
    or compiled: NVRTC runs outside the GIL, so a first process on a machine compiles on every core what its calls
    would compile one at a time. Returns how many distinct kernels."""
    keys = list(dict.fromkeys(recorded_key(launch, user) for launch, user in calls))
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        list(pool.map(lambda key: binary(*key, directory), keys))
    return len(keys)
