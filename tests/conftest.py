"""Shared fixtures: a per-test random generator (fresh data per test, reproducible by node id).

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


@pytest.fixture
def rng(request) -> np.random.Generator:
    base = int(os.environ.get("RECGEN_TEST_SEED", "0"))
    return np.random.default_rng([base, zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture
def repo_root() -> Path:
    return ROOT
