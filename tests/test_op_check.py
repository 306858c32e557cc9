"""The GPU suite's harness (``op_check``) on the CPU, backend "mlx": a harness broken by a change fails here in
CI, not first on the GPU. One spec of each branch of the harness: a plain state (GDN, with GQA), the normalizer
state of mlstm_sigmoid, power retention's conditioned inputs; and a deliberately
wrong op, which the harness must flag in the forward and in the gradients."""
from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

import op_check  # noqa: E402
from op_check import CASES, assert_close, load_spec, op_errors, over_tolerance  # noqa: E402

from recgen.ops import Op  # noqa: E402


@pytest.mark.parametrize("name,case,dtype", [
    ("gated_delta_net", CASES[1], "float32"),
    ("mlstm_sigmoid", CASES[0], "bfloat16"),
    ("power_retention", CASES[1], "float32"),
    ("rwkv6", CASES[0], "bfloat16"),  # T = 1: the one-step form; the pre-update readout and the bonus
    ("rwkv6", CASES[1], "float32"),
    ("rwkv7", CASES[0], "bfloat16"),  # T = 1: the one-step form of the transition before the decay
    ("rwkv7", CASES[1], "float32"),
])
def test_harness_on_the_cpu(name, case, dtype, rng):
    rec = load_spec(name)
    errs = op_errors(rec, case, dtype, rng, backend="mlx")
    names = [x.name for x in rec.inputs]
    expected = {"o", "ht0", "dinitial_state"} | {"d" + n for n in names}
    if rec.has_normalizer:
        expected |= {"ht1", "dinitial_z"}
    assert set(errs) == expected
    assert_close(errs, dtype)


def test_harness_flags_a_wrong_op(rng):
    """An op whose output is 0.1% off: the harness reports o and every gradient that flows through o above the
    float32 tolerance, and leaves the final state (untouched) within it."""
    rec = load_spec("simple_gla")
    right = Op(rec, backend="mlx")

    def wrong(*args, **kwargs):
        o, ht = right(*args, **kwargs)
        return o * 1.001, ht

    errs = op_errors(rec, CASES[1], "float32", rng, backend="mlx", op=wrong)
    bad = over_tolerance(errs, "float32")
    assert "o" in bad and "ht0" not in bad
    assert {"dq", "dv"} <= set(bad), errs


def test_cases_cover_what_the_gpu_suite_claims():
    """T = 1, odd T, K != V, GQA, and several chunks of 64 with a partial last one."""
    assert any(c.T == 1 for c in CASES)
    assert any(c.T % 2 == 1 and c.T > 1 for c in CASES)
    assert all(c.K != c.V and c.Hk < c.H for c in CASES)
    assert any(c.T > 2 * 64 and c.T % 64 for c in CASES)
    assert set(op_check.TOL) == set(op_check.DTYPES)


def test_decay_parameter_gradients_get_the_summed_tolerance():
    """Only the gradients of parameters inside the decay (sums over B·T tokens) get the looser float32 bound."""
    from op_check import over_tolerance

    assert over_tolerance({"dA": 5e-4, "dx": 5e-4, "o": 1e-6}, "float32") == {"dx": 5e-4}
    assert over_tolerance({"dA": 2e-3}, "float32") == {"dA": 2e-3}
