"""``recgen.ops.gated_delta_product`` on the GPU against the handwritten float64 reference
(``tests/delta_product_check.py``): the CUDA kernels of gated DeltaNet / DeltaNet over the T·n micro-steps with the
recurrent and the chunked backward, and the chunked form with its chunk kernels; float32 and bfloat16, forward,
final state and every gradient; n = 2, 3, gated and g=None, T = 1, prime T, GQA, K != V; and the kernel op's VJP
under ``mx.compile``."""
from __future__ import annotations

import pytest
from delta_product_check import Case, delta_product_errors
from op_check import DTYPES, assert_close, group

pytestmark = pytest.mark.gpu

# op_check.CASES' shapes (K = 64, V = 40, H = 4, Hk = 2 share the gated_delta_net kernels of tests/gpu)
CASES = (
    Case(2, 1, 4, 2, 64, 40, 2, True),       # decode: one token, two micro-steps
    Case(2, 37, 4, 2, 64, 40, 3, True),      # prime T, GQA, three micro-steps
    Case(1, 67, 2, 1, 128, 72, 2, False),    # ungated (delta_net's kernels), K = 128, V = 72
    Case(1, 300, 4, 2, 64, 40, 2, True),     # T·n = 600: several chunks of 64
)
PATHS = (("cuda", "recurrent"), ("cuda", "chunked"), ("mlx", None))


def _params():
    return [pytest.param(c, d, b, bw, id=f"{c.id}-{d}-{b}-{bw}",
                         marks=pytest.mark.xdist_group(group("gated_delta_net" if c.gated else "delta_net", d)))
            for c in CASES for d in DTYPES for b, bw in PATHS]


@pytest.mark.parametrize("case,dtype,backend,backward", _params())
def test_gated_delta_product(case, dtype, backend, backward, rng):
    assert_close(delta_product_errors(case, dtype, rng, backend=backend, backward=backward), dtype)


@pytest.mark.xdist_group(group("gated_delta_net", "float32"))
def test_gated_delta_product_compiled(rng):
    assert_close(delta_product_errors(CASES[1], "float32", rng, backend="cuda", compiled=True), "float32")
