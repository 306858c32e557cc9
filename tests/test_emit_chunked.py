"""``recgen emit --chunked``: the chunked form's generated kernels as standalone files with their call order. The
Metal files type-check with full signatures, the CUDA files compile with nvcc for sm_90 where it is installed, a
standalone Metal kernel run on the CPU emulator returns what its MLX form returns, and the manifest's calls are the
kernels the chunked form launches (forward, then backward)."""
import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from recgen import specs
from recgen.errors import UnsupportedKernel
from recgen.verify.typecheck import clang_problem

pytestmark = pytest.mark.skipif(clang_problem() is not None, reason=clang_problem() or "")

SIZES = dict(K=32, V=16, H=2, HK=1)  # K = 32: a slab of the pair kernels (kda)


def _emit(name, target, tmp_path, C=16):
    from recgen.emit_chunked import emit_chunked

    paths = emit_chunked(specs.BUILTINS[name], target, tmp_path, C=C, **SIZES)
    return paths, json.loads((tmp_path / f"{name}.{target}.chunked.manifest.json").read_text())


@pytest.mark.parametrize("name,kinds", [
    ("gated_delta_net", {"ut_mma", "scan_mma", "out_mma", "bwd_mma"}),       # a scalar decay's delta rule
    ("kda", {"pair_dual", "ut_mma", "out_mma", "bwd_key_delta"}),            # a key-vector decay's
    ("power_retention", {"sympow", "sympow_grad"}),                          # φ's rows
])
def test_chunked_kernels_typecheck_and_list_their_calls(name, kinds, tmp_path):
    from recgen.verify.typecheck import typecheck

    paths, manifest = _emit(name, "metal", tmp_path)
    entries = {k["entry"] for k in manifest["kernels"]}
    assert manifest["calls"] and {c["entry"] for c in manifest["calls"]} == entries
    assert all(any(kind in e for e in entries) for kind in kinds), entries
    for k in manifest["kernels"]:
        assert [b["index"] for b in k["buffers"]] == list(range(len(k["buffers"])))
    for p in paths:
        if p.suffix == ".metal" and ".mlx." not in p.name:
            r = typecheck(p.read_text())
            assert r.ok, f"{p.name}:\n{r}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_chunked_cuda_kernels_compile(tmp_path):
    """float32 inputs, and bf16 ones (whose roles kept in 16 bits take other variants: bf16 buffers)."""
    from recgen.emit_chunked import emit_chunked

    paths = [p for name in ("gated_delta_net", "kda") for p in _emit(name, "cuda", tmp_path / name)[0]]
    paths += emit_chunked(specs.gated_delta_net, "cuda", tmp_path / "bf16", dtype="bfloat16", **SIZES)
    paths = [p for p in paths if p.suffix == ".cu" and ".mlx." not in p.name]
    assert any("__nv_bfloat16" in p.read_text() for p in paths)
    r = subprocess.run(["nvcc", "-arch=sm_90", "-c", *map(str, paths)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_standalone_chunk_kernel_runs_as_its_mlx_form(tmp_path):
    """The emitted sympow kernel (a runtime pair table, the user's buffer, its output) on the CPU emulator against
    the launch MLX would run: the standalone signature binds the same buffers."""
    from recgen.runtime import chunk_kernels as ck
    from recgen.verify import kernels as verify
    from recgen.verify.cpu_exec import run_msl

    _, manifest = _emit("power_retention", "metal", tmp_path)
    k = next(k for k in manifest["kernels"] if "sympow" in k["entry"] and "grad" not in k["entry"])
    xb = next(b for b in k["buffers"] if b["name"] == "x")
    shape = json.loads(xb["shape"])
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    B, T, Hk, D = shape
    launch = ck.sympow_launch("metal", B, T, k["template"]["H"], Hk, D, bool(k["template"]["BLOCK"]))
    (want,) = verify.run_launch(launch, {"x": x})
    ins = {"x": x} | {n: np.array(v, np.int32) for n, v in k["runtime"].items()}  # the tables as the manifest gives them
    out = next(b for b in k["buffers"] if not b["input"])
    got = run_msl((tmp_path / k["file"]).read_text(), k["entry"], ins,
                  {out["name"]: (tuple(json.loads(out["shape"])), np.float32)},
                  tuple(g * t for g, t in zip(k["grid_threadgroups"], k["threadgroup"])), tuple(k["threadgroup"]))
    np.testing.assert_array_equal(got[out["name"]], want)


def test_a_spec_without_chunk_kernels_is_refused(tmp_path):
    from recgen.emit_chunked import emit_chunked

    with pytest.raises(UnsupportedKernel, match="selective_scan.*no generated kernel"):
        emit_chunked(specs.selective_scan, "metal", tmp_path, **SIZES)


def test_standalone_cuda_kernels_keep_the_launch_bounds_they_run_with(tmp_path):
    """Power retention at its GPU shape (chunks of 256): the gradient kernel through φ is written with the launch
    bound CUDA's table runs it with (two threadgroups of 256 an SM), the others with their threads alone; where
    NVRTC is installed the standalone file compiles so."""
    from recgen.emit_chunked import emit_chunked
    from recgen.runtime import nvrtc

    paths = emit_chunked(specs.power_retention, "cuda", tmp_path, C=256, K=64, V=64, H=8, HK=8)
    sources = {p.name: p.read_text() for p in paths if p.suffix == ".cu" and ".mlx." not in p.name}
    jac = next(name for name in sources if "feature_jac" in name)
    assert "__launch_bounds__(256, 2)" in sources[jac]
    assert all(re.search(r"__launch_bounds__\(\d+\) ", text) for name, text in sources.items() if name != jac)
    if nvrtc.compiler() is not None:
        entry = jac.removesuffix(".cu")
        assert nvrtc.compile_cubin(sources[jac], entry, "sm_90a").startswith(b"\x7fELF")
