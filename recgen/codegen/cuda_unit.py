"""A kernel body as a whole CUDA translation unit, the ``__global__`` function MLX's ``cuda_kernel`` wraps around it
(inputs ``const T*`` in source order, then outputs ``T*``, the template values as compile-time constants), for a
compiler outside MLX: NVRTC at run time (``recgen.runtime.kernel_binary``: a compiled kernel kept across processes,
which MLX's ``cuda_kernel`` does not keep). The function is ``extern "C"``, so its symbol is its name."""
from __future__ import annotations

from .render import KernelSource

# MLX dtype names as plain C spellings (NVRTC defines no <cstdint> types without headers)
CTYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "float64": "double",
          "int32": "int", "uint32": "unsigned int", "int64": "long long", "uint64": "unsigned long long",
          "int16": "short", "uint16": "unsigned short", "int8": "signed char", "uint8": "unsigned char",
          "bool": "bool"}
INCLUDES = "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"


def spells(dtypes) -> bool:
    """Whether every dtype name has a C spelling here."""
    return all(dt in CTYPES for dt in dtypes)


def constant(name: str, value) -> str:
    """A template value as MLX declares it in the kernel's body."""
    if isinstance(value, bool):
        return f"  constexpr bool {name} = {str(value).lower()};\n"
    if isinstance(value, str):
        return f"  using {name} = {CTYPES[value]};\n"
    return f"  constexpr int {name} = {value};\n"


def launch_bounds(bounds: tuple) -> str:
    """``__launch_bounds__`` of (threads a threadgroup, threadgroups an SM), or nothing for ()."""
    return f"__launch_bounds__({bounds[0]}, {bounds[1]}) " if bounds else ""


def global_function(src: KernelSource, symbol: str, input_dtypes: tuple, output_dtypes: tuple,
                    template: tuple, bounds: tuple = ()) -> str:
    """The translation unit of ``src`` as one ``extern "C" __global__`` function named ``symbol``; ``input_dtypes``
    and ``output_dtypes`` (dtype names) in ``src.inputs`` / ``src.outputs`` order, ``template`` as a launch carries
    it ((name, int | bool | dtype name), ...), ``bounds`` as ``Launch.bounds``."""
    params = ([f"const {CTYPES[dt]}* {n}" for n, dt in zip(src.inputs, input_dtypes, strict=True)]
              + [f"{CTYPES[dt]}* {n}" for n, dt in zip(src.outputs, output_dtypes, strict=True)])
    body = "".join(constant(n, v) for n, v in template)
    signature = f"extern \"C\" __global__ void {launch_bounds(bounds)}{symbol}(\n    " + ",\n    ".join(params)
    return f"{INCLUDES}{src.header}\n{signature}) {{\n{body}{src.source}\n}}\n"
