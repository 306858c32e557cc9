"""The GPU checks: every test here is marked ``gpu`` and skipped (tests/conftest.py) where MLX has no CUDA GPU.

    python -m pytest -m gpu                   # on the GPU machine: the whole GPU check, one process
    python -m pytest -m gpu --shard K/N       # part K of N (tests/sharding.py): benchmarks/run_gpu.sh check
                                              # runs N of them at once, as compiling kernels is most of the time

Each test belongs to an ``xdist_group`` of one spec and dtype: the tests of a group share the kernels their
shapes compile (a first call's cost), and a part (or a pytest-xdist worker, --dist loadgroup) takes whole groups.

MLX runs float32 matmuls on CUDA in TF32 unless ``MLX_ENABLE_TF32=0``, which MLX reads from the environment
(outside recgen). The float32 tolerances (1e-5 / 1e-4) assume exact float32, so it is set here, when pytest
collects this folder: before any test runs an MLX op. With it the chunked form's scans run on FMAs; the
``fragment_scan`` fixture turns the tensor-core scans (TF32 operands) back on for one bfloat16 check, as a model
gets them by default.
"""
from __future__ import annotations

import os

import pytest

os.environ["MLX_ENABLE_TF32"] = "0"

from recgen import tuning  # noqa: E402

tuning.reload_environment()  # in case an op ran before this folder was collected: recgen reads it once


@pytest.fixture
def fragment_scan():
    """The chunk scan on tensor-core fragments whatever MLX_ENABLE_TF32 says (an explicit override of the tuning,
    which caches key on: the traced chunked form of this tuning is its own)."""
    from recgen import tuning

    with tuning.override(mma_scan=True):
        yield
