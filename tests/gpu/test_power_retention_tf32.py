"""Power retention in bfloat16 at MLX's default float32 matmuls (TF32 on CUDA), as a model runs it: within bf16's
tolerance against the float64 reference (issue 19's stabilized readout; an earlier floor of 1e-6 left bf16
gradients wrong by O(1) there). The rest of tests/gpu runs with TF32 off (conftest), which MLX reads once per
process, so the check runs in a child process with it on: the spec's chunked form and the key-block composition
on the CUDA kernels, at T = 1, a prime T with GQA, and several chunks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.gpu

CHILD = """
import json, sys
sys.path.insert(0, "tests")
import numpy as np
from op_check import CASES, load_spec, op_errors
from recgen import ops
rec = load_spec("power_retention")
out = {}
for i, case in enumerate((CASES[0], CASES[1], CASES[3])):
    for path, kw in (("chunked", dict(backend="mlx")),
                     ("key_blocks", dict(backend="cuda", op=ops.PowerRetention(backend="cuda")))):
        out[f"{path} case {i}"] = op_errors(rec, case, "bfloat16", np.random.default_rng(i), **kw)
print("RESULT " + json.dumps(out))
"""


def test_power_retention_bf16_with_tf32_matmuls():
    from op_check import over_tolerance

    env = {**os.environ, "MLX_ENABLE_TF32": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "RECGEN_KEY_BLOCKS_MAX_T": "1024"}  # the composition at T = 300 too (its default stops at 256)
    res = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(row for row in res.stdout.splitlines() if row.startswith("RESULT "))
    errs = json.loads(line[len("RESULT "):])
    bad = {where: over_tolerance(e, "bfloat16") for where, e in errs.items()}
    assert not any(bad.values()), f"above bf16 tolerance with TF32: {bad} (all: {errs})"
