"""Execute MSL kernels on the CPU (optionally under ASan+UBSan or TSan) and return the outputs.

Why: it is the only check of what an MSL kernel *does* that needs no Apple GPU.  The source
(MLX-wrapped, from `capture.wrapped_source`, or a standalone .metal file) is compiled with
`msl_cpu_runtime.h` into a small driver executable: one std::thread per GPU thread of a
threadgroup, threadgroups one after another, emulated barriers and SIMD-group operations.
The driver always runs as a subprocess -- a sanitizer runtime cannot be loaded into an
unsanitized Python, and a crashing kernel must not take the test process down.

Buffers are bound by parameter *name*: inputs and outputs by their names, and MLX's
``<name>_shape`` / ``<name>_strides`` / ``<name>_ndim`` are synthesised from the input
array (row-contiguous, strides in elements), as MLX does.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from .msl_source import ATTRIBUTE_TYPES, Kernel, pick_kernel, rewrite_for_clang
from ..tuning import child_environment, verify_cache
from .typecheck import clang_problem, find_clang

HERE = Path(__file__).resolve().parent
RUNTIME = HERE / "msl_cpu_runtime.h"
EMULATOR = HERE / "msl_cpu_emu.h"  # included by RUNTIME: both are part of a build's cache key
BF16 = "bfloat16"  # numpy has no bfloat16: stored as uint16 bits, converted from/to float32

_DTYPES = {
    "float": np.float32, "half": np.float16, "float16_t": np.float16, "bfloat": BF16, "bfloat16_t": BF16,
    "int": np.int32, "int32_t": np.int32, "uint": np.uint32, "uint32_t": np.uint32, "unsigned int": np.uint32,
    "int64_t": np.int64, "long": np.int64, "uint64_t": np.uint64, "ulong": np.uint64, "size_t": np.uint64,
    "short": np.int16, "int16_t": np.int16, "ushort": np.uint16, "uint16_t": np.uint16,
    "char": np.int8, "int8_t": np.int8, "uchar": np.uint8, "uint8_t": np.uint8, "bool": np.bool_,
}
_SANITIZE = {  # sanitizers watch real threads: one std::thread per GPU thread there, fibers otherwise (msl_cpu_emu.h)
    None: [],
    "address": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-DMSL_EMU_THREADS"],
    "thread": ["-fsanitize=thread", "-DMSL_EMU_THREADS"],
}
_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0",
}


class MSLRuntimeError(RuntimeError):
    """The kernel crashed, a sanitizer reported an error, or the emulator found a barrier problem."""

    def __init__(self, message: str, returncode: int, log: str):
        super().__init__(message)
        self.returncode, self.log = returncode, log


class MSLCompileError(RuntimeError):
    """clang could not compile the kernel for the CPU."""


def _dtype_of(ctype: str):
    t = ctype.replace("metal::", "").strip()
    if t not in _DTYPES:
        raise ValueError(f"unsupported buffer element type {ctype!r}")
    return _DTYPES[t]


def _to_bytes(arr, dtype) -> bytes:
    if dtype == BF16:
        u = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32).astype(np.uint64)
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        bits = np.where(np.isnan(np.asarray(arr, np.float32)), np.uint16(0x7FC0), bits)
        return bits.tobytes()
    return np.ascontiguousarray(arr, dtype=dtype).tobytes()


def _from_bytes(data: bytes, dtype, shape):
    if dtype == BF16:
        return (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return np.frombuffer(data, dtype).reshape(shape).copy()


def _launcher(k: Kernel, ntg: int) -> str:
    """C++ that calls the kernel with each parameter bound to its buffer, slot or thread attribute."""
    args, outs = [], []
    nbuf = 1 + max([p.index for p in k.params if p.attr == "buffer"], default=-1)
    is_out = [0] * nbuf
    for p in k.params:
        if p.attr == "buffer":
            if p.is_ref:
                args.append(f"*({p.decl[:-1].strip()}*)msl_bufs[{p.index}]")
            else:
                args.append(f"({p.decl})msl_bufs[{p.index}]")
            is_out[p.index] = int(not p.is_const)
        elif p.attr == "tg_slot":
            args.append(f"({p.decl})msl_tgs[{p.index}]")
        elif p.attr in ATTRIBUTE_TYPES:
            args.append(f"msl_emu::attr_cast<{p.decl}>(c.{p.attr})")
        else:
            raise ValueError(f"unsupported parameter attribute [[{p.attr}]] on {p.name!r}")
    outs = ", ".join(map(str, is_out)) or "0"
    return f"""
static void* msl_bufs[{max(nbuf, 1)}]; static const int msl_is_out[] = {{{outs}}};
static void* msl_tgs[{max(ntg, 1)}]; static size_t msl_tg_sizes[{max(ntg, 1)}];
static void msl_run(uint3 grid, uint3 tg) {{
  msl_emu::dispatch(grid, tg, [](const msl_emu::Ctx& c) {{
    {k.call}({', '.join(args)});
  }}, [] {{ for (int t = 0; t < {ntg}; ++t) std::memset(msl_tgs[t], 0xFF, msl_tg_sizes[t]); }});
}}
int main(int argc, char** argv) {{
  return msl_emu::driver_main(argc, argv, {nbuf}, msl_bufs, msl_is_out, {ntg}, msl_tgs, msl_tg_sizes, msl_run);
}}
"""


def cache_dir() -> Path:
    d = Path(verify_cache() or Path(tempfile.gettempdir()) / "recgen_msl_cache")
    d.mkdir(parents=True, exist_ok=True)
    return d


def poison_threadgroup(src: str) -> str:
    """Fill every kernel-scope threadgroup array with 0xFF bytes (NaN for floats) before each threadgroup: a
    static local starts zeroed on the CPU and keeps the previous threadgroup's values, while a GPU's threadgroup
    memory holds whatever ran before, so a read of memory the threadgroup did not write would pass here and fail
    there (as the UT transform's upper blocks once did on the H100). The rewrite registers each array at its
    first use (C++'s guarded static initialisation: once, every thread of the first threadgroup waiting for it;
    ``msl_emu::register_tg_array``), and the dispatcher refills the registered arrays before every later
    threadgroup. Same line: diagnostics keep their line numbers."""
    return re.sub(r"(?m)^([ \t]*static\s+threadgroup\s+[^;*&=(]*?(\w+)\s*(?:\[[^\]]*\]\s*)+;)",
                  r"\1 static const bool \2_rg_poisoned_ = msl_emu::register_tg_array(\2, sizeof(\2));", src)


@lru_cache(maxsize=1)
def _headers() -> str:
    """The runtime headers' text, part of every build's cache key: read once per process, not per build."""
    return RUNTIME.read_text() + "\0" + EMULATOR.read_text()


def build(source: str, kernel_name: str | None = None, sanitizer: str | None = None,
          clang: str | None = None) -> tuple[Path, Kernel]:
    """Compile `source` into a driver executable (cached by content hash); returns (path, kernel)."""
    if sanitizer not in _SANITIZE:
        raise ValueError(f"sanitizer must be None, 'address' or 'thread', not {sanitizer!r}")
    clang = clang or find_clang()
    if clang is None:
        raise MSLCompileError(clang_problem())
    rewritten = poison_threadgroup(rewrite_for_clang(source))
    # names and template arguments come from the original (the rewrite drops host_name instantiations),
    # parameters from the rewritten source (whose attributes the launcher understands)
    orig = pick_kernel(source, kernel_name)
    kernel = replace(pick_kernel(rewritten, orig.function), name=orig.name, call=orig.call)
    ntg = 1 + max([p.index for p in kernel.params if p.attr == "tg_slot"], default=-1)
    tu = (f'#include "{RUNTIME}"\n#line 1 "kernel.metal"\n{rewritten}\n#line 1 "launcher.cpp"\n'
          f"{_launcher(kernel, ntg)}")
    flags = ["-std=c++20", "-O1", "-g", "-fno-omit-frame-pointer", "-pthread", "-Wno-unknown-attributes",
             "-Wno-vla-cxx-extension", "-Wno-unused-value", *_SANITIZE[sanitizer]]
    key = hashlib.sha256("\0".join([tu, clang, *flags, _headers()]).encode()).hexdigest()[:24]
    exe = cache_dir() / f"k_{key}"
    if not exe.exists():
        with tempfile.TemporaryDirectory(prefix="recgen_build_") as tmp:
            cpp = Path(tmp) / "kernel.cpp"
            cpp.write_text(tu)
            out = Path(tmp) / "a.out"
            p = subprocess.run([clang, *flags, str(cpp), "-o", str(out)], capture_output=True, text=True, timeout=300)
            if p.returncode != 0:
                raise MSLCompileError(f"CPU build of {kernel.name} failed:\n{p.stderr[-4000:]}")
            os.replace(out, exe)  # atomic: concurrent builders of the same key are fine
    return exe, kernel


def _pad3(v) -> tuple[int, int, int]:
    v = tuple(int(x) for x in (v if hasattr(v, "__len__") else (v,)))
    return (v + (1, 1, 1))[:3]


def run_msl(source: str, kernel_name: str | None, inputs: dict, outputs: dict, grid, threadgroup,
            sanitizer: str | None = None, init_value=None, *, threadgroup_memory: dict[int, int] | None = None,
            timeout: float = 300) -> dict[str, np.ndarray]:
    """Run the kernel on the CPU and return {output name: array}.

    inputs: name -> array-like (converted to the declared element type; bfloat as float32).
    outputs: name -> (shape, dtype); filled with `init_value`, else with 0xFF bytes (NaN for
    floats) so that unwritten elements show up.  grid counts threads (dispatchThreads).
    threadgroup_memory: bytes for each ``[[threadgroup(n)]]`` parameter (standalone kernels).
    Raises MSLRuntimeError on a crash, sanitizer report, deadlock or non-uniform barrier.
    """
    exe, k = build(source, kernel_name, sanitizer)
    inputs = {n: np.asarray(v) for n, v in inputs.items()}
    tgm = threadgroup_memory or {}
    files, result_spec = {}, {}
    for p in k.params:
        if p.attr != "buffer":
            continue
        base, _, suffix = p.name.rpartition("_")
        if p.name in inputs:
            dt = _dtype_of(p.element_type)
            files[p.index] = _to_bytes(inputs[p.name], dt)
        elif p.name in outputs:
            shape, odt = outputs[p.name]
            dt = _dtype_of(p.element_type)
            n = int(np.prod(shape))
            if init_value is None:
                files[p.index] = b"\xff" * (n * (2 if dt == BF16 else np.dtype(dt).itemsize))
            else:
                files[p.index] = _to_bytes(np.full(n, init_value, np.float64 if dt != BF16 else np.float32), dt)
            result_spec[p.index] = (p.name, dt, tuple(shape), odt)
        elif base in inputs and suffix in ("shape", "strides", "ndim"):
            a = inputs[base]
            if suffix == "shape":
                files[p.index] = np.array(a.shape, np.int32).tobytes()
            elif suffix == "strides":
                st = [int(np.prod(a.shape[i + 1:])) for i in range(a.ndim)]
                files[p.index] = np.array(st, np.int64).tobytes()
            else:
                files[p.index] = np.array(a.ndim, np.int32).tobytes()
        else:
            raise ValueError(f"buffer parameter {p.name!r} [[buffer({p.index})]] has no input or output")
    ntg = 1 + max([p.index for p in k.params if p.attr == "tg_slot"], default=-1)
    missing = [i for i in range(ntg) if i not in tgm]
    if missing:
        raise ValueError(f"threadgroup_memory needs a byte size for [[threadgroup({missing[0]})]]")
    with tempfile.TemporaryDirectory(prefix="recgen_run_") as tmp:
        for i in range(max(files, default=-1) + 1):
            Path(tmp, f"b{i}.bin").write_bytes(files.get(i, b""))
        argv = [str(exe), tmp, *map(str, _pad3(grid)), *map(str, _pad3(threadgroup)),
                *(str(tgm[i]) for i in range(ntg))]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_environment(**_ENV))
        log = p.stdout + p.stderr
        if p.returncode != 0 or "runtime error:" in log or "WARNING: ThreadSanitizer" in log:
            raise MSLRuntimeError(_summary(k.name, sanitizer, p.returncode, log), p.returncode, log)
        res = {}
        for i, (name, dt, shape, odt) in result_spec.items():
            arr = _from_bytes(Path(tmp, f"o{i}.bin").read_bytes(), dt, shape)
            res[name] = arr if dt == BF16 or odt is None else arr.astype(np.dtype(odt), copy=False)
    return res


def _summary(name: str, sanitizer, rc: int, log: str) -> str:
    keys = ("msl_emu error", "ThreadSanitizer: data race", "AddressSanitizer", "runtime error:", "SUMMARY:")
    lines = [ln for ln in log.splitlines() if any(x in ln for x in keys)]
    head = "\n".join(lines[:6]) or log[-1500:]
    return f"kernel {name} failed on the CPU emulator (sanitizer={sanitizer}, exit {rc}):\n{head}"
