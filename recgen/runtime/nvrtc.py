"""NVRTC through ctypes: a CUDA translation unit to a cubin for one GPU architecture.

MLX compiles a ``cuda_kernel`` with NVRTC on its first call in each process and keeps nothing on disk for custom
kernels, so every new process compiles every kernel again (minutes for the chunk kernels' self-tests alone on
an H100). Compiling here gives the binary to ``recgen.runtime.kernel_binary``, which keeps it. The library is the one
MLX's CUDA backend loaded where it is loaded (the same compiler MLX would use), else one on the loader's path, in a
CUDA toolkit under /usr/local or in NVIDIA's pip wheels; the CUDA headers are those beside it (``cuda_bf16.h``,
``cuda_fp16.h``)."""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


class NvrtcError(RuntimeError):
    """NVRTC is missing or rejected a translation unit (its log in the message)."""


@dataclass(frozen=True)
class Compiler:
    lib: ctypes.CDLL
    path: str
    includes: tuple      # --include-path directories holding cuda_bf16.h
    version: str         # "13.0": part of a kept binary's key


def _loaded_paths() -> list[str]:
    """libnvrtc already mapped into this process (MLX's CUDA backend links it)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({ln.split()[-1] for ln in lines if "/libnvrtc.so" in ln and "builtins" not in ln})


def _installed_paths() -> list[str]:
    """libnvrtc in a CUDA toolkit's usual places, then in NVIDIA's pip wheels (nvidia-cuda-nvrtc:
    site-packages/nvidia/cu*/lib or nvidia/cuda_nvrtc/lib)."""
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(r) for r in (spec.submodule_search_locations or [])] if spec else []
    found = [*sorted(Path("/usr/local").glob("cuda*/lib64/libnvrtc.so*"), reverse=True),
             *(p for r in roots for p in sorted(r.glob("*/lib/libnvrtc.so*"), reverse=True))]
    return [str(p) for p in found if "builtins" not in p.name and ".alt." not in p.name]


def _includes(lib_path: str) -> tuple:
    """The CUDA header directory of the library's own release (a toolkit's lib64/../include, a wheel's
    lib/../include), else the toolkit's usual place: one only, so headers of two releases never mix."""
    here = Path(lib_path).resolve().parent
    dirs = [here.parent / "include", here.parent.parent / "include", Path("/usr/local/cuda/include")]
    return tuple(str(d) for d in dirs if (d / "cuda_bf16.h").exists())[:1]


@lru_cache(maxsize=1)
def compiler() -> Compiler | None:
    """The NVRTC to use, or None where there is none (or none with the CUDA headers)."""
    for path in [*_loaded_paths(), ctypes.util.find_library("nvrtc"), *_installed_paths()]:
        if not path:
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        real = path if "/" in path else next(iter(_loaded_paths()), path)
        for builtins in sorted(Path(real).resolve().parent.glob("libnvrtc-builtins.so*")):
            try:  # NVRTC dlopens its builtins by name: loaded first, they are found wherever the library lives
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                continue
        major, minor = ctypes.c_int(), ctypes.c_int()
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
            continue
        includes = _includes(real) if "/" in real else ()
        if includes:
            return Compiler(lib, real, includes, f"{major.value}.{minor.value}")
    return None


def _check(lib, result: int, what: str) -> None:
    if result != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(result).decode()}")


def compile_cubin(source: str, name: str, arch: str) -> bytes:
    """``source`` compiled for ``arch`` ("sm_90a") to a cubin, with the options MLX compiles custom kernels with.
    Raises ``NvrtcError`` with the compiler's log where it fails. Releases the GIL while compiling (ctypes)."""
    nv = compiler()
    if nv is None:
        raise NvrtcError("NVRTC not found (neither loaded by MLX nor on the loader's path nor in NVIDIA's wheels)")
    lib, prog = nv.lib, ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", "--device-as-default-execution-space",
                *(f"--include-path={d}" for d in nv.includes)]
        argv = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        result = lib.nvrtcCompileProgram(prog, len(opts), argv)
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"{name} failed to compile for {arch}:\n{log.value.decode(errors='replace')[:4000]}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
