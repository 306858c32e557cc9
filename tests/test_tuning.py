"""The tuning object: resolution order, hashing, overrides, and the machine checks applied to it."""
from __future__ import annotations

import pytest

from recgen import tuning
from recgen.errors import InputError
from recgen.runtime import probe


def test_resolution_order_defaults_table_environment_overrides():
    cpu = tuning.resolve("cpu", environ={})
    assert (cpu.chunk_size, cpu.gpu_forms, cpu.pow2_exp, cpu.chunk_kernels) == (16, False, True, False)
    gpu = tuning.resolve("gpu", "cuda", environ={})  # device defaults, then CUDA's measured table
    assert (gpu.chunk_size, gpu.gpu_forms, gpu.inverse_base) == (64, True, 16)
    assert (gpu.chunk_kernels, gpu.mma_scan, gpu.chunked_backward_min_t) == (True, True, 1024)
    metal = tuning.resolve("gpu", "metal", environ={})  # nothing measured on Apple hardware yet
    assert (metal.chunk_kernels, metal.mma_scan, metal.chunked_backward_min_t) == (False, False, None)
    env = {"RECGEN_CHUNK_KERNELS": "0", "RECGEN_INVERSE_BASE": "8", "RECGEN_BACKEND": "mlx"}
    t = tuning.resolve("gpu", "cuda", environ=env)
    assert (t.chunk_kernels, t.inverse_base, t.backend) == (False, 8, "mlx")
    assert tuning.resolve("gpu", "cuda", environ=env, inverse_base=32).inverse_base == 32  # overrides win
    # MLX's exact-float32 switch keeps the scan off TF32 fragments; "1" does not turn them on where unmeasured
    assert tuning.resolve("gpu", "cuda", environ={"MLX_ENABLE_TF32": "0"}).mma_scan is False
    assert tuning.resolve("gpu", "metal", environ={"MLX_ENABLE_TF32": "1"}).mma_scan is False


def test_tuning_is_hashable_and_frozen():
    a, b = tuning.resolve("cpu", environ={}), tuning.resolve("cpu", environ={})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(Exception):
        a.chunk_size = 8


def test_bad_environment_and_fields_name_themselves():
    with pytest.raises(InputError, match="RECGEN_BACKWARD"):
        tuning.resolve("cpu", environ={"RECGEN_BACKWARD": "sideways"})
    with pytest.raises(InputError, match="RECGEN_FWD_LAYOUT"):
        tuning.resolve("cpu", environ={"RECGEN_FWD_LAYOUT": "8,4"})
    with pytest.raises(InputError, match="RECGEN_FEATURE_JAC_GROUPS"):
        tuning.resolve("cpu", environ={"RECGEN_FEATURE_JAC_GROUPS": "3"})
    assert tuning.resolve("cpu", environ={"RECGEN_FEATURE_JAC_GROUPS": "4"}).feature_jac_groups == 4
    with pytest.raises(InputError, match="chunk_sise"):
        tuning.resolve("cpu", environ={}, chunk_sise=4)
    with pytest.raises(InputError, match="chunk_sise"):
        with tuning.override(chunk_sise=4):
            pass
    with pytest.raises(InputError, match="device"):
        tuning.resolve("tpu")


def test_override_nests_and_restores(monkeypatch):
    monkeypatch.delenv("RECGEN_DEBUG", raising=False)
    base = tuning.current()
    with tuning.override(chunk_size=8, debug=True):
        assert (tuning.current().chunk_size, tuning.current().debug) == (8, True)
        with tuning.override(chunk_size=4):
            assert (tuning.current().chunk_size, tuning.current().debug) == (4, True)
        assert tuning.current().chunk_size == 8
    assert tuning.current() == base


def test_environment_is_read_once_and_on_reload(recgen_env, monkeypatch):
    recgen_env(RECGEN_DEBUG="1")
    assert tuning.current().debug
    monkeypatch.setenv("RECGEN_DEBUG", "0")  # not read again on every call (it cost host time on every op)
    assert tuning.current().debug
    tuning.reload_environment()
    assert not tuning.current().debug


def test_checked_applies_the_blas_choice():
    ref = probe.checked(tuning.resolve("cpu", environ={"RECGEN_CPU_BLAS": "reference"}))
    fast = probe.checked(tuning.resolve("cpu", environ={"RECGEN_CPU_BLAS": "fast"}))
    assert (ref.copy_transposes, ref.key_chunk_size) == (True, 16)
    assert (fast.copy_transposes, fast.key_chunk_size) == (False, 32)
