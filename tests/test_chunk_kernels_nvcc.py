"""Every CUDA chunk kernel compiles with nvcc for sm_90, where nvcc is installed (the GPU tests run them; this
catches a CUDA spelling error on a machine without a GPU). nvcc is found on PATH or in NVIDIA's pip wheels
(``nvidia-cuda-nvcc`` and its companions, which CI installs: ``.ci/run``)."""
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import chunk_launches

CTYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "int32": "int"}


def _as_kernel(i: int, launch) -> str:
    """The launch's body as a templated __global__ function (inputs const T*, outputs T*, its template constants)
    and its instantiation at the launch's constants, as MLX's cuda_kernel builds it, in namespace n<i>."""
    src, tmpl = launch.source, dict(launch.template)
    kind = lambda v: "typename" if isinstance(v, str) else "bool" if isinstance(v, bool) else "int"  # noqa: E731
    spell = lambda v: CTYPES[v] if isinstance(v, str) else str(v).lower()  # noqa: E731
    runtime = {n: dt for n, _, dt in launch.runtime}
    sig = ", ".join([f"const {CTYPES[runtime.get(n, 'float32')]}* {n}" for n in src.inputs]
                    + [f"{CTYPES[dt]}* {n}" for n, (_, dt) in zip(src.outputs, launch.outputs)])
    params = ", ".join(f"{kind(v)} {n}" for n, v in tmpl.items())
    args = ", ".join(spell(v) for v in tmpl.values())
    return (f"namespace n{i} {{\n{src.header}\ntemplate <{params}>\n__global__ void k({sig}) {{\n{src.source}\n}}\n"
            f"template __global__ void k<{args}>({sig});\n}}\n")


def _nvcc() -> str | None:
    """nvcc on PATH, else the one NVIDIA's pip wheels install (site-packages/nvidia/cu*/bin/nvcc)."""
    found = shutil.which("nvcc")
    spec = importlib.util.find_spec("nvidia") if found is None else None
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = found or next((str(p) for p in sorted(Path(root).glob("cu*/bin/nvcc"), reverse=True)), None)
    return found


def test_every_cuda_chunk_kernel_compiles(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    launches = chunk_launches("cuda")
    text = "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n" + "".join(_as_kernel(i, x) for i, x in enumerate(launches))
    path = tmp_path / "chunk_kernels.cu"
    path.write_text(text)
    r = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-c", str(path), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
