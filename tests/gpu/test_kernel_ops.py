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
    """A spec without the fast chunked form (RWKV-7's transition before the decay): ``backward="chunked"`` runs the
    general WY form's autodiff on the GPU."""
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
