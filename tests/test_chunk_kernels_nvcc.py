"""Every CUDA chunk kernel compiles with nvcc for sm_90, where nvcc is installed (the GPU tests run them; this
catches a CUDA spelling error on a machine without a GPU). nvcc is found on PATH or in NVIDIA's pip wheels
(``nvidia-cuda-nvcc`` and its companions, which CI installs: ``.ci/run``)."""
import subprocess

import pytest

from helpers import chunk_launches

from recgen.verify.ptxas import Usage, as_kernel, find_nvcc, translation_unit, usage


def test_every_cuda_chunk_kernel_compiles(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    launches = chunk_launches("cuda")
    text = translation_unit([as_kernel(i, x) for i, x in enumerate(launches)])
    path = tmp_path / "chunk_kernels.cu"
    path.write_text(text)
    r = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-c", str(path), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]


def test_the_wide_multiply_add_compiles_for_bf16_and_f16(tmp_path):
    """The readout on the wide multiply-add (``Tuning.wide_fragments``) in both 16-bit types: one kernel source, the
    type a template constant, so each instantiation is compiled (m16n8k16 .bf16 and .f16)."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    from recgen.runtime import chunk_kernels as ck

    launches = [ck.out_async_launch("cuda", 8, 64, 128, 128, (t,) * 4, (2, 2, t), uf=True, wide=True)
                for t in ("bfloat16", "float16")]
    assert all("_w16" in x.source.name for x in launches)
    path = tmp_path / "wide.cu"
    path.write_text(translation_unit([as_kernel(i, x) for i, x in enumerate(launches)]))
    r = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-c", str(path), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]


def test_threadgroups_an_sm_from_registers_and_shared_memory():
    """sm_90's limits as Nsight Compute reported them for these kernels on the H100: registers are allocated 256 a
    warp at a time, so 168 registers leave three threadgroups of 128 threads an SM and 171 two."""
    assert Usage(118, 0, 45 * 1024, 128).blocks_per_sm == 4  # the UT transform: registers and shared memory
    assert Usage(168, 0, 48 * 1024, 128).blocks_per_sm == 3
    assert Usage(171, 0, 48 * 1024, 128).blocks_per_sm == 2
    assert Usage(254, 0, 30 * 1024, 128).blocks_per_sm == 2  # a hoisted scan
    assert Usage(26, 0, 0, 128).blocks_per_sm == 16  # threads bound it: 2048 an SM


def test_ptxas_reports_the_scans_hoisted_operands_in_registers(tmp_path):
    """Built as MLX builds it, a hoisted scan holds a chunk's operands in registers (ptxas: well over the unhoisted
    scan's); each kernel of the unit gets its report."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    from recgen.codegen.chunk_sources import ScanVariant
    from recgen.runtime import chunk_kernels as ck

    launches = [ck.scan_launch("cuda", ScanVariant(mma=True, q=True, hoist=h), 16, 3, 64, 128, 128, 1) for h in (0, 1)]
    launches.append(ck.out_mma_launch("cuda", 48, 64, 128, 128, (16, 3, "bfloat16"), uf=True, l2=True))
    unit = tmp_path / "k.cu"
    unit.write_text(translation_unit([as_kernel(i, x, {"A": "bfloat16", "X": "bfloat16", "Bm": "bfloat16"})
                                      for i, x in enumerate(launches)]))
    plain, hoisted, readout = (usage(unit, [x.threadgroup[0] for x in launches], nvcc)[i] for i in range(3))
    assert hoisted.registers > plain.registers + 64, (plain, hoisted)
    assert hoisted.blocks_per_sm < plain.blocks_per_sm
    assert readout.shared_bytes > 32 * 1024 and readout.threads == 128


def test_ptxas_keeps_the_wide_scans_in_registers(tmp_path):
    """GDN's scans on the wide multiply-add (``ScanVariant.w16``) as the H100 runs them (K = V = 128, four groups,
    the model's layout, bf16 states): the forward one fits three threadgroups an SM, where its TF32 form fits two;
    the reverse one spills nothing, where its TF32 form spills."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    from recgen.codegen.chunk_sources import ScanVariant
    from recgen.runtime import chunk_kernels as ck

    fwd = dict(q=True)
    rev = dict(reverse=True, p=True, dg=True, aq=True, pq=True)
    launches = [ck.scan_launch("cuda", ScanVariant(mma=True, hoist=True, ml=True, s16=True, w16=w, **terms), 64, 64,
                               64, 128, 128, 1, 32, 4, (16, 16, 64, True), "bfloat16")
                for terms in (fwd, rev) for w in (False, True)]
    types = dict.fromkeys(("A", "X", "Bm", "Pa", "Pb", "St"), "bfloat16")
    unit = tmp_path / "k.cu"
    unit.write_text(translation_unit([as_kernel(i, x, types) for i, x in enumerate(launches)]))
    fwd32, fwd16, rev32, rev16 = (usage(unit, [128] * 4, nvcc)[i] for i in range(4))
    assert fwd16.blocks_per_sm >= 3 > fwd32.blocks_per_sm, (fwd32, fwd16)
    assert rev16.spill_bytes == 0 and rev16.registers < rev32.registers, (rev32, rev16)


def test_launch_bounds_leave_the_gradient_kernel_two_threadgroups_an_sm(tmp_path):
    """``Tuning.feature_jac_min_blocks`` = 2: the feature map's gradient kernel (power retention's shape) is held to
    128 registers, so two threadgroups of 256 share an SM where its own choice leaves one."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    from recgen.runtime import chunk_kernels as ck

    launches = [ck.feature_jac_launch("cuda", 256, 256, 64, 65, min_blocks=m) for m in (0, 2)]
    unit = tmp_path / "k.cu"
    unit.write_text(translation_unit([as_kernel(i, x) for i, x in enumerate(launches)]))
    free, bounded = (usage(unit, [256, 256], nvcc)[i] for i in range(2))
    assert free.blocks_per_sm == 1 and bounded.blocks_per_sm == 2 and bounded.registers <= 128, (free, bounded)


@pytest.mark.parametrize("names,options", [(("gated_delta_net", "delta_net", "simple_gla", "gla", "kda", "rwkv7"), {}),
                                           (("gla", "kda", "hgrn2", "rwkv6"), {"key_roles_16bit": True})])
def test_a_specs_calls_compile_with_the_dtypes_they_pass(names, options, tmp_path):
    """Each chunk kernel a spec's CUDA call runs (forward and backward, recorded on the CPU:
    ``chunk_kernels.recording``), compiled with the dtypes of the buffers it is handed, as MLX instantiates it: a
    kernel reading a role in bf16 where an option keeps it so (``Tuning.key_roles_16bit``: the key-vector decays'
    bare roles) must compile that way too, not only with the float32 buffers ``chunk_launches`` assumes; the
    defaults' calls as well."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    import dataclasses

    import mlx.core as mx
    from recgen import chunked, specs
    from recgen.bench import Shape, make_inputs
    from recgen.runtime import chunk_kernels as ck
    from recgen.tuning import resolve

    t = dataclasses.replace(resolve("gpu", "cuda", environ={}), compile=False, **options)
    seen = {}
    with ck.recording() as calls:  # each call returns zeros of its outputs: the algebra around it runs on
        for name in names:
            rec = specs.BUILTINS[name]
            xs, do = make_inputs(rec, Shape(1, 128, 2, 128, 128), "bfloat16")
            out = lambda *a, rec=rec, xs=xs: chunked.forward(rec, dict(zip(xs, a)), scale=0.1, tuning=t)[0]  # noqa: E731
            mx.eval(mx.vjp(out, list(xs.values()), [do]))
    for launch, buffers in calls:
        runtime = {r[0] for r in launch.runtime}
        dtypes = {n: dt for n, (_, dt) in zip([n for n in launch.source.inputs if n not in runtime], buffers)}
        seen[(launch.source.name, tuple(sorted(dtypes.items())))] = (launch, dtypes)
    assert any("bfloat16" in d.values() for _, d in seen.values())
    path = tmp_path / "calls.cu"
    path.write_text(translation_unit([as_kernel(i, launch, d) for i, (launch, d) in enumerate(seen.values())]))
    r = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-c", str(path), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
