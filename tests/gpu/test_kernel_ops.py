"""The generated CUDA kernels as ops (backend "cuda") against the float64 reference: every built-in with a
recurrent kernel, float32 and bfloat16, forward, final state and every gradient (the
initial state's included, with a cotangent on the final state), at ``op_check.CASES``; and the same ops with
the chunked form's backward (``backward="chunked"``, the default from T = 1024 on CUDA)."""
from __future__ import annotations

import pytest
from op_check import CASES, KERNEL_SPECS, MLSTM, assert_close, load_spec, norm_skip, op_errors, params

pytestmark = pytest.mark.gpu

# the specs of the fast chunked form (scalar or key-vector decays), where the kernel op defaults to it
CHUNKED_BACKWARD_SPECS = ("gated_delta_net", "kda", "delta_net", "gla", "simple_gla", "retnet", "hgrn2", "mamba2",
                          "mamba2_linear_dt", MLSTM, "rwkv6")


@pytest.mark.parametrize("name,case,dtype", params(KERNEL_SPECS))
def test_kernel_op(name, case, dtype, rng):
    assert_close(op_errors(load_spec(name), case, dtype, rng, backend="cuda", backward="recurrent"), dtype)


@pytest.mark.parametrize("name,case,dtype", params(CHUNKED_BACKWARD_SPECS))
def test_kernel_op_chunked_backward(name, case, dtype, rng):
    assert_close(op_errors(load_spec(name), case, dtype, rng, backend="cuda", backward="chunked"), dtype)


@pytest.mark.parametrize("name,case,dtype", params(["rwkv7"]))
def test_kernel_op_general_chunked_backward(name, case, dtype, rng):
    """RWKV-7's transition before the decay: ``backward="chunked"`` runs the general rank-1 core's written VJP
    (``chunked.rank1``) on the GPU."""
    assert_close(op_errors(load_spec(name), case, dtype, rng, backend="cuda", backward="chunked"), dtype)



@pytest.mark.parametrize("before_decay", [False, True])
@pytest.mark.parametrize("name,case,dtype", params(["full_decay_delta"], cases=CASES[:2]))
def test_kernel_op_full_decay_with_transition(before_decay, name, case, dtype, rng):
    """A delta rule with a full (i, j) decay (``test_full_decay_delta.spec``): the recurrent kernels, forward and
    backward, either order of the transition and the decay; its chunked form does not exist."""
    from test_full_decay_delta import spec

    assert_close(op_errors(spec(before_decay), case, dtype, rng, backend="cuda", backward="recurrent"), dtype)


@pytest.mark.parametrize("name,case,dtype", params(["norm_skip"], cases=CASES[:2]))
def test_kernel_op_normalizer_with_skip(name, case, dtype, rng):
    """A normalizer beside a skip term (``op_check.norm_skip``): the recurrent kernels, forward and backward."""
    assert_close(op_errors(norm_skip(), case, dtype, rng, backend="cuda", backward="recurrent"), dtype)


@pytest.mark.parametrize("name,case,dtype", params(["power_retention"], cases=CASES[:2]))
def test_power_retention_on_kernels_by_key_blocks(name, case, dtype, rng):
    """Power retention through ``ops.PowerRetention`` on CUDA: simple_gla's kernels over blocks of φ's rows (at T = 1
    the feature decode kernel, reached through the chunked form with the backend asked for by name)."""
    from recgen.ops import PowerRetention

    rec = load_spec(name)
    assert_close(op_errors(rec, case, dtype, rng, backend="cuda", op=PowerRetention(backend="cuda")), dtype)


@pytest.mark.parametrize("T", [1, 37])
def test_power_retention_key_blocks_at_d32_match_the_chunked_form(T, rng):
    """d = 32: K' = 528 rows, over the kernels' budget, so three blocks; against the spec's chunked form on the GPU
    (float32, TF32 off in this suite), forward and every gradient, from a reachable state (the chunked form's
    final state after 5 tokens: without one, T = 1's decay gradient is exactly 0 and only roundoff compares)."""
    import mlx.core as mx
    import numpy as np

    from recgen import ops

    a = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    decays = lambda T: mx.array(-rng.uniform(0, 3, (2, T, 2)).astype(np.float32))  # noqa: E731
    chunked = ops.Op(ops.specs.power_retention, backend="mlx")
    _, h0 = chunked(a(2, 5, 2, 32), a(2, 5, 2, 32), a(2, 5, 2, 16), decays(5), output_final_state=True)
    q, k, v, g = a(2, T, 2, 32), a(2, T, 2, 32), a(2, T, 2, 16), decays(T)
    do = a(2, T, 2, 16)
    outs = []
    for op in (ops.PowerRetention(backend="cuda"), chunked):
        o, vjps = mx.vjp(lambda *x: [op(*x, initial_state=h0)[0]], [q, k, v, g], [do])
        outs.append([o[0], *vjps])
    for name, x, y in zip(("o", "dq", "dk", "dv", "dg"), *outs):
        err = float(mx.abs(x - y).max()) / float(mx.abs(y).max())
        assert err <= 1e-4, (name, err)
