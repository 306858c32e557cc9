"""Compiled kernels kept across processes (``recgen.runtime.kernel_binary``, CUDA): the translation unit, NVRTC
(where NVIDIA's ``nvidia-cuda-nvrtc`` wheel or a toolkit is installed: CI installs the wheel), the cache on disk, and
the call through MLX's ``precompiled_cuda_kernel`` (a recorder stands in for it here; the GPU tests run it)."""
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import mlx.core as mx
import pytest

from helpers import chunk_launches

from recgen import specs, tuning
from recgen.codegen.backends import get
from recgen.codegen.cuda_unit import global_function
from recgen.codegen.lower import has_kernel, plan
from recgen.runtime import chunk_kernels as ck
from recgen.runtime import kernel_binary as kb
from recgen.runtime import launch as L
from recgen.runtime import nvrtc
from recgen.runtime.recurrent import backward_launch, forward_launch
from recgen.spec.layouts import Sizes
from recgen.specs import BUILTINS

JAC = ck.feature_jac_launch("cuda", 4, 64, 64, 65, (2, 3))  # a runtime input (ns), a template
JAC_IN = ("float32", "float32", "float32", "int32")


def dtypes_of(launch, user="float32"):
    runtime = {n: dt for n, _, dt in launch.runtime}
    return tuple(runtime.get(n, user) for n in launch.source.inputs), tuple(dt for _, dt in launch.outputs)


def test_the_unit_is_the_function_mlx_builds_around_the_body():
    unit = global_function(JAC.source, "sym", JAC_IN, ("float32",), JAC.template)
    assert unit.startswith("#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n")
    assert 'extern "C" __global__ void sym(\n    const float* X,\n    const float* S,\n    const float* Y,\n' \
           '    const int* ns,\n    float* dX) {\n' in unit
    assert "  constexpr int C = 64;\n" in unit and "  constexpr int F = 2080;\n" in unit
    assert JAC.source.source in unit and JAC.source.header in unit
    bf = global_function(JAC.source, "sym", ("bfloat16",) + JAC_IN[1:], ("float32",), (("T", "bfloat16"),))
    assert "const __nv_bfloat16* X" in bf and "  using T = __nv_bfloat16;\n" in bf
    with pytest.raises(ValueError):  # a dtype per buffer, no fewer
        global_function(JAC.source, "sym", JAC_IN[:2], ("float32",), ())


def recurrent_launches() -> list:
    """Every built-in's recurrent forward and backward kernels (those that have them), small sizes."""
    sizes, cuda, out = Sizes(B=1, T=9, H=2, Hk=2, Kin=16, K=16, V=16), get("cuda"), []
    for name in BUILTINS:
        rec = getattr(specs, name)
        if has_kernel(rec, sizes):
            p = plan(rec, sizes)
            out += [forward_launch(p, cuda, sizes, 0.25, "bfloat16", True), backward_launch(p, cuda, sizes, 0.25)]
    return out


def test_every_cuda_kernel_compiles_with_nvrtc():
    """Each launch's unit on its own, as the cache compiles it: every chunk kernel and every built-in's recurrent
    pair (two at a time: NVRTC runs outside the GIL). MLX's own headers are not included, so a kernel that leaned on
    them would fail here."""
    if nvrtc.compiler() is None:
        pytest.skip("NVRTC is not installed")
    launches = [*chunk_launches("cuda"), *recurrent_launches(),
                ck.feature_jac_launch("cuda", 256, 256, 64, 65, min_blocks=2),  # with launch bounds
                ck.feature_states_launch("cuda", 256, 256, 64, 65, 16, 2),  # two fragments a SIMD group
                ck.feature_out_launch("cuda", 256, 256, 64, 65, (16, 17), 2)]
    assert len(launches) > 110

    def compiled(item):
        i, launch = item
        ins, outs = dtypes_of(launch)
        return nvrtc.compile_cubin(global_function(launch.source, f"k{i}", ins, outs, launch.template,
                                                   launch.bounds), f"k{i}", "sm_90a")

    with ThreadPoolExecutor(2) as pool:
        cubins = list(pool.map(compiled, enumerate(launches)))
    assert all(c.startswith(kb.ELF) and len(c) > 1000 for c in cubins)
    with pytest.raises(nvrtc.NvrtcError, match="undefined|identifier"):
        nvrtc.compile_cubin('extern "C" __global__ void k(float* y) { y[0] = not_declared; }', "k", "sm_90a")


@pytest.fixture
def binaries(monkeypatch, tmp_path):
    """kernel_binary on a pretend sm_90a with a counting compiler; yields (compiles, directory)."""
    compiles = []
    monkeypatch.setattr(kb, "architecture", lambda: "sm_90a")
    monkeypatch.setattr(nvrtc, "compiler", lambda: nvrtc.Compiler(None, "libnvrtc.so", ("/inc",), "13.0"))
    monkeypatch.setattr(nvrtc, "compile_cubin",
                        lambda source, name, arch: compiles.append((name, source)) or kb.ELF + name.encode())
    kb.binary.cache_clear()
    yield compiles, str(tmp_path)
    kb.binary.cache_clear()


def test_a_binary_is_compiled_once_and_read_by_later_processes(binaries, tmp_path):
    compiles, directory = binaries
    symbol, data = kb.binary(JAC.source, JAC_IN, ("float32",), JAC.template, (), directory)
    assert len(compiles) == 1 and compiles[0][0] == symbol and symbol.startswith(JAC.source.name + "_")
    assert f'void {symbol}(' in compiles[0][1]
    kept = tmp_path / "sm_90a" / f"{symbol}.cubin"
    assert kept.read_bytes() == data and not list(kept.parent.glob(".tmp-*"))
    kb.binary.cache_clear()  # a new process: read, not compiled
    assert kb.binary(JAC.source, JAC_IN, ("float32",), JAC.template, (), directory) == (symbol, data)
    assert len(compiles) == 1
    # another dtype, template value or architecture is another binary
    other = kb.binary(JAC.source, ("bfloat16",) + JAC_IN[1:], ("float32",), JAC.template, (), directory)
    assert other[0] != symbol and len(compiles) == 2
    # a file that is not a cubin (cut short by a crash of another writer's disk) is compiled again
    kb.binary.cache_clear()
    kept.write_bytes(b"\x00garbage")
    assert kb.binary(JAC.source, JAC_IN, ("float32",), JAC.template, (), directory) == (symbol, data)
    assert len(compiles) == 3 and kept.read_bytes() == data


def test_launch_bounds_are_part_of_the_unit_and_its_key(binaries):
    """A launch that asks for threadgroups an SM (``Launch.min_blocks``, the tuning's for the gradient kernel) is
    compiled with CUDA's launch bounds, as another binary than the unbounded one."""
    compiles, directory = binaries
    bounded = ck.feature_jac_launch("cuda", 4, 256, 64, 65, min_blocks=2)  # chunks of 256: eight SIMD groups
    assert bounded.bounds == (256, 2) and JAC.bounds == () and replace(bounded, min_blocks=1).bounds == ()
    plain = kb.binary(JAC.source, JAC_IN, ("float32",), JAC.template, (), directory)
    kept = kb.binary(bounded.source, JAC_IN, ("float32",), bounded.template, bounded.bounds, directory)
    assert kept[0] != plain[0] and "__launch_bounds__(256, 2)" in compiles[1][1]
    assert "__launch_bounds__" not in compiles[0][1]
    t = tuning.resolve("gpu", "cuda", environ={"RECGEN_FEATURE_JAC_MIN_BLOCKS": "2"})
    assert t.feature_jac_min_blocks == 2


def test_a_write_cut_short_leaves_nothing_behind(binaries, tmp_path, monkeypatch):
    """A full disk (the rename fails): the binary is still returned for this process, and neither a file nor a
    temporary is left in the directory, so a later process compiles it again."""
    compiles, directory = binaries

    def full(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kb.os, "replace", full)
    symbol, data = kb.binary(JAC.source, JAC_IN, ("float32",), JAC.template, (), directory)
    assert data.startswith(kb.ELF) and list((tmp_path / "sm_90a").iterdir()) == []
    kb.binary.cache_clear()
    kb.binary(JAC.source, JAC_IN, ("float32",), JAC.template, (), directory)
    assert len(compiles) == 2


def test_no_binary_where_it_cannot_be_made(binaries, monkeypatch):
    compiles, directory = binaries
    assert kb.binary(JAC.source, ("complex64",) + JAC_IN[1:], ("float32",), JAC.template, (), directory) is None

    def broken(source, name, arch):
        raise nvrtc.NvrtcError("k failed to compile for sm_90a: error: identifier undefined")

    monkeypatch.setattr(nvrtc, "compile_cubin", broken)
    with pytest.warns(RuntimeWarning, match="could not be compiled for the kernel cache .*identifier undefined"):
        assert kb.binary(JAC.source, JAC_IN, ("float32",), JAC.template, (), directory) is None
    monkeypatch.setattr(kb, "architecture", lambda: None)
    kb.binary.cache_clear()
    assert kb.binary(JAC.source, JAC_IN, ("float32",), JAC.template, (), directory) is None


def test_mlx_call_runs_the_kept_binary_where_the_tuning_keeps_them(monkeypatch):
    """The tuning's directory reaches ``mlx_call`` from the chunk kernels' and the recurrent op's callers (an
    argument: reading the tuning there cost 2 us a kernel call)."""
    seen = []
    monkeypatch.setattr(kb, "binary", lambda src, ins, outs, template, bounds, directory:
                        seen.append((ins, outs, directory)) or ("sym", kb.ELF + b"bytes"))

    def precompiled(**kw):
        seen.append(kw)
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled, raising=False)
    X, S, Y = mx.ones((4, 64, 64)), mx.ones((6, 2080, 65)), mx.ones((4, 64, 65), mx.bfloat16)
    (out,) = L.mlx_call(JAC, get("cuda"), [X, S, Y], [], kernel_cache="/kept")
    assert out.shape == (4, 64, 64)
    (ins, outs, directory), kw = seen
    assert ins == ("float32", "float32", "bfloat16", "int32") and outs == ("float32",) and directory == "/kept"
    assert kw["name"] == "sym" and kw["compiled_source"] == kb.ELF + b"bytes" and kw["scalars"] == []
    assert kw["inputs"][:3] == [X, S, Y] and kw["inputs"][3].tolist() == [2, 3]
    assert kw["grid"] == JAC.grid and kw["threadgroup"] == JAC.threadgroup and kw["ensure_row_contiguous"]
    # no cache (or a dialect MLX alone compiles): MLX's factory compiles the body
    seen.clear()
    monkeypatch.setattr(L, "mlx_kernel", lambda src, factory, debug=False: lambda **kw: seen.append(factory) or
                        [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])])
    L.mlx_call(JAC, get("cuda"), [X, S, Y], [])
    L.mlx_call(JAC, get("metal"), [X, S, Y], [], kernel_cache="/kept")
    assert seen == ["cuda_kernel", "metal_kernel"]


def test_the_cache_follows_the_environment():
    assert tuning.resolve("gpu", "cuda", environ={}).kernel_cache == "~/.cache/recgen/kernels"  # CUDA keeps them
    assert tuning.resolve("gpu", "metal", environ={}).kernel_cache == ""  # MLX's Metal factory takes no binary
    for on in ("1", "on", "true"):
        assert tuning.resolve("gpu", "cuda", environ={"RECGEN_KERNEL_CACHE": on}).kernel_cache == "~/.cache/recgen/kernels"
    assert tuning.resolve("gpu", "cuda", environ={"RECGEN_KERNEL_CACHE": "/scratch/k"}).kernel_cache == "/scratch/k"
    for off in ("0", "off", "false"):
        assert tuning.resolve("gpu", "cuda", environ={"RECGEN_KERNEL_CACHE": off}).kernel_cache == ""


def test_nvrtc_is_found_beside_its_headers():
    nv = nvrtc.compiler()
    if nv is None:
        pytest.skip("NVRTC is not installed")
    assert len(nv.includes) == 1 and nv.version.split(".")[0].isdigit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source = '#include <cuda_bf16.h>\nextern "C" __global__ void k(__nv_bfloat16* y) { y[0] = __float2bfloat16(1.f); }'
        assert nvrtc.compile_cubin(source, "k", "sm_80").startswith(kb.ELF)  # the header found beside the library


def test_the_tunings_directory_reaches_every_kernel_call(monkeypatch):
    """The chunk kernels pass their tuning's ``kernel_cache``; so does the recurrent op (through ``kernel_op``)."""
    from recgen.runtime import recurrent

    seen = []
    record = lambda launch, dialect, user, extra, debug=False, kernel_cache="": seen.append(kernel_cache) or [  # noqa: E731
        mx.zeros(s, getattr(mx, dt)) for s, dt in launch.outputs]
    monkeypatch.setattr(ck, "mlx_call", record)
    monkeypatch.setattr(recurrent, "mlx_call", record)
    t = tuning.resolve("gpu", "cuda", environ={"RECGEN_KERNEL_CACHE": "/kept"})
    ck.tril_inverse(mx.zeros((1, 64, 64)), t)
    sizes = Sizes(B=1, T=3, H=2, Hk=2, Kin=8, K=8, V=8)
    op = recurrent.kernel_op(plan(specs.gated_delta_net, sizes), get("cuda"), sizes, 0.5, "float32",
                             kernel_cache=t.kernel_cache)
    op(*[mx.zeros(s) for s in ((1, 3, 2, 8), (1, 3, 2, 8), (1, 3, 2, 8), (1, 3, 2), (1, 3, 2))], mx.zeros((1, 2, 8, 8)))
    assert seen == ["/kept", "/kept"]


def test_a_first_process_compiles_the_self_tests_kernels_side_by_side(monkeypatch, tmp_path):
    """Where the tuning keeps binaries, ``checked`` first records the frames' kernel calls (nothing runs) and
    compiles them on every core; the probes then find each one made. Real NVRTC (skipped where it is missing), on
    power retention's frames."""
    from recgen.runtime import probe

    if nvrtc.compiler() is None:
        pytest.skip("NVRTC is not installed")
    monkeypatch.setattr(kb, "architecture", lambda: "sm_90a")
    kb.binary.cache_clear()
    try:
        made = probe.prefetch_frames("cuda", probe.FEATURE_FRAMES, probe.PROBE, str(tmp_path))
        kept = list(tmp_path.glob("sm_90a/*.cubin"))
        assert made >= 4 and len(kept) == made and kb.binary.cache_info().currsize == made
        # the recorded calls are the probes' own: probing the "features" frame now compiles nothing
        monkeypatch.setattr(nvrtc, "compile_cubin", lambda *a: pytest.fail("compiled again"))
        with ck.recording() as calls:
            probe._probe.__wrapped__("cuda", "features", probe.PROBE, str(tmp_path))
        assert calls and all(kb.binary(*kb.recorded_key(launch, user), str(tmp_path)) for launch, user in calls)
    finally:
        kb.binary.cache_clear()
