"""The kernel cache (``Tuning.kernel_cache``, ``recgen.runtime.kernel_binary``) on the GPU: kernels compiled by
NVRTC outside MLX and run through ``precompiled_cuda_kernel`` give what MLX's own compile of the same bodies gives,
forward and every gradient, for the feature map's kernels (power retention), the chunk algebra's (GDN from T = 1024)
and the recurrent kernels (GDN, short T); a later process reads them and compiles nothing."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from recgen import load, tuning
from recgen.bench import Shape, make_inputs
from recgen.runtime import kernel_binary, nvrtc

pytestmark = pytest.mark.gpu


def outputs_and_grads(spec: str, shape: str) -> list[np.ndarray]:
    op = load(spec)
    inputs, do = make_inputs(op.rec, Shape.parse(shape), "float32", seed=2)
    names = list(inputs)
    (o,), grads = mx.vjp(lambda *p: [op(**dict(zip(names, p)))[0]], [inputs[n] for n in names], [do])
    mx.eval(o, grads)
    return [np.array(a, np.float64) for a in (o, *grads)]


@pytest.mark.parametrize("spec,shape", [("power_retention", "1,300,2,64"), ("gated_delta_net", "1,1100,2,64"),
                                        ("gated_delta_net", "2,9,2,64")])
def test_kept_binaries_compute_what_mlx_compiles(spec, shape, tmp_path, monkeypatch):
    if nvrtc.compiler() is None or kernel_binary.architecture() is None:
        pytest.skip("no NVRTC with CUDA headers, or MLX does not say the architecture")
    with tuning.override(kernel_cache=""):
        mlx_compiled = outputs_and_grads(spec, shape)
    kernel_binary.binary.cache_clear()
    with tuning.override(kernel_cache=str(tmp_path)):
        kept = outputs_and_grads(spec, shape)
        assert kernel_binary.binary.cache_info().currsize > 0
        assert list(tmp_path.glob("sm_*/*.cubin"))
        for a, b in zip(kept, mlx_compiled):
            assert np.abs(a - b).max() <= 1e-5 * (np.abs(b).max() + 1e-30)
        # a later process: every binary read from the directory, none compiled
        kernel_binary.binary.cache_clear()
        monkeypatch.setattr(nvrtc, "compile_cubin", lambda *a: pytest.fail("compiled again"))
        again = outputs_and_grads(spec, shape)
        for a, b in zip(again, kept):
            assert np.array_equal(a, b)
