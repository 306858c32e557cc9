"""Shared fixtures: a per-test random generator (fresh data per test, reproducible by node id); and the
``gpu`` marker: tests marked so (tests/gpu) are skipped, with the reason, where MLX has no CUDA GPU, so
``python -m pytest`` runs everywhere and ``python -m pytest -m gpu`` is the GPU check.

Set RECGEN_TEST_SEED to shift every test's seed (e.g. to draw new data in a soak run).
"""
from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import helpers`
pytest_plugins = ["sharding"]  # --shard K/N (tests/sharding.py)


@pytest.fixture
def rng(request) -> np.random.Generator:
    base = int(os.environ.get("RECGEN_TEST_SEED", "0"))
    return np.random.default_rng([base, zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def _no_cuda() -> str | None:
    """Why the ``gpu`` tests cannot run here, or None where they can."""
    try:
        import mlx.core as mx
    except ImportError:
        return "needs MLX with its CUDA backend (MLX is not installed)"
    if not mx.cuda.is_available():
        return "needs a CUDA GPU through MLX (mx.cuda.is_available() is False)"
    return None


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    reason = _no_cuda() if gpu else None
    if reason:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def recgen_env(monkeypatch):
    """``recgen_env(NAME=value, ...)`` sets environment variables and has recgen read its environment again (it
    reads it once per process); on teardown both are undone."""
    from recgen import tuning

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        tuning.reload_environment()

    yield set_env
    monkeypatch.undo()
    tuning.reload_environment()
