"""recgen.ops on this machine (the `mlx` backend): argument checks, dispatch, outputs, gradients.

The generated kernels themselves are checked on the CPU emulator (tests/test_kernels_metal.py) and on a GPU
(tests/gpu, marked gpu); here the op layer around them is tested where every machine can run it."""
import mlx.core as mx
import numpy as np
import pytest

import recgen as rg
from recgen import ops, specs, tuning
from recgen.math import reference
from recgen.spec.layouts import InputError


def _gla_inputs(B=1, T=5, H=2, Hk=1, K=4, V=3, dtype=mx.float32):
    rng = np.random.default_rng(3)
    a = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)  # noqa: E731
    gk = mx.array(-rng.uniform(0, 2, (B, T, H, K)).astype(np.float32)).astype(dtype)
    return a(B, T, Hk, K), a(B, T, Hk, K), a(B, T, H, V), gk


def test_outputs_and_final_state():
    q, k, v, gk = _gla_inputs()
    o, st = ops.gla(q, k, v, gk, backend="mlx")
    assert o.shape == (1, 5, 2, 3) and st is None
    o, st = ops.gla(q, k, v, gk, backend="mlx", output_final_state=True)
    o_r, st_r = reference.run(specs.gla, q=np.array(q), k=np.array(k), v=np.array(v), gk=np.array(gk))
    assert np.allclose(np.array(o), o_r, atol=1e-5) and np.allclose(np.array(st), st_r, atol=1e-5)


def test_keyword_arguments_and_scale():
    q, k, v, gk = _gla_inputs()
    o1, _ = ops.gla(q=q, k=k, v=v, gk=gk, scale=0.3, backend="mlx")
    o_r, _ = reference.run(specs.gla, q=np.array(q), k=np.array(k), v=np.array(v), gk=np.array(gk), scale=0.3)
    assert np.allclose(np.array(o1), o_r, atol=1e-5)


@pytest.mark.parametrize("bad, match", [
    (lambda a: a[:3] + (a[3].astype(mx.int32),), "'gk'.*float32"),
    (lambda a: (a[0], a[1], a[2][:, :, :1], a[3]), "'v'|'gk'"),
    (lambda a: (a[0][..., :3], a[1], a[2], a[3]), "'q'|'k'"),
    (lambda a: a[:3] + (a[3] * float("nan"),), "'gk'.*NaN"),
])
def test_bad_inputs_name_the_argument(bad, match):
    with pytest.raises(InputError, match=match):
        ops.gla(*bad(_gla_inputs()), backend="mlx", check_finite=True)


def test_finite_check_is_a_debug_mode():
    """By default no value is read on the host: a NaN input is not looked at and flows through lazily."""
    q, k, v, gk = _gla_inputs()
    o, _ = ops.gla(q, k, v, gk * float("nan"), backend="mlx")
    assert np.isnan(np.array(o)).any()
    with pytest.raises(InputError, match="'gk'.*NaN"):
        ops.gla(q, k, v, gk * float("nan"), backend="mlx", check_finite=True)


def test_bad_initial_state_backend_and_arity():
    q, k, v, gk = _gla_inputs()
    with pytest.raises(InputError, match="initial_state"):
        ops.gla(q, k, v, gk, initial_state=mx.zeros((1, 2, 3, 3)), backend="mlx")
    with pytest.raises(InputError, match="backend"):
        ops.gla(q, k, v, gk, backend="opencl")
    with pytest.raises(InputError, match="takes 4 inputs"):
        ops.gla(q, k, v, gk, gk)
    with pytest.raises(InputError, match="given twice"):
        ops.gla(q, k, v, gk, q=q)


def test_environment_forces_the_backend(recgen_env):
    recgen_env(RECGEN_BACKEND="mlx")
    assert ops.choose_backend(tuning.current()) == "mlx"
    assert ops.choose_backend(tuning.current(), "mlx") == "mlx"
    with pytest.raises(InputError, match="backends here"):  # an explicit choice wins, if this machine has it
        ops.choose_backend(tuning.current(), "cuda")
    recgen_env(RECGEN_BACKEND="vulkan")
    with pytest.raises(InputError, match="RECGEN_BACKEND"):
        tuning.current()


def test_gradients_reach_inputs_and_initial_state_from_final_state():
    q, k, v, gk = _gla_inputs()
    h0 = mx.array(np.random.default_rng(4).standard_normal((1, 2, 4, 3)).astype(np.float32))
    dht = np.random.default_rng(5).standard_normal((1, 2, 4, 3))

    def loss(q, gk, h0):
        _, st = ops.gla(q, k, v, gk, initial_state=h0, output_final_state=True, backend="mlx")
        return (st * mx.array(dht.astype(np.float32))).sum()

    gq, ggk, gh0 = mx.grad(loss, argnums=(0, 1, 2))(q, gk, h0)
    g = reference.grad(specs.gla, do=np.zeros((1, 5, 2, 3)), dht=dht, initial_state=np.array(h0),
                       q=np.array(q), k=np.array(k), v=np.array(v), gk=np.array(gk))
    for a, b in ((gq, g["q"]), (ggk, g["gk"]), (gh0, g["initial_state"])):
        assert np.linalg.norm(np.array(a) - b) <= 1e-4 * np.linalg.norm(b)


def test_bf16_inputs_give_bf16_output():
    o, _ = ops.gla(*_gla_inputs(dtype=mx.bfloat16), backend="mlx")
    assert o.dtype == mx.bfloat16


def test_load_by_name_and_path():
    assert rg.load("gla").rec is specs.gla
    assert rg.load("examples/retnet.py:retnet").rec.name == "retnet"
    with pytest.raises(InputError, match="spec"):
        rg.load(42)


def test_kernel_op_is_built_once_per_call_signature():
    """Decode calls the op per token: the custom function is cached, not rebuilt (no GPU needed to build it)."""
    from recgen.codegen.backends import get
    from recgen.codegen.lower import plan
    from recgen.runtime.recurrent import kernel_op
    from recgen.spec.layouts import Sizes

    s = Sizes(2, 1, 4, 4, 32, 32, 32)
    p = plan(specs.gated_delta_net, s)
    t = tuning.resolve("gpu", "cuda", environ={})
    vjp = ops.chunked_vjp(specs.gated_delta_net, 0.1, None, t)
    assert vjp is ops.chunked_vjp(specs.gated_delta_net, 0.1, None, t)  # the dispatcher's backward is cached too
    a = kernel_op(p, get("cuda"), s, 0.1, "float32")
    assert a is kernel_op(p, get("cuda"), s, 0.1, "float32")
    assert a is not kernel_op(p, get("cuda"), s, 0.1, "float32", vjp)
    assert a is not kernel_op(p, get("metal"), s, 0.1, "float32")


def test_backward_choice_follows_the_tuning():
    """The default gradient path of a kernel op: chunked from the tuning's measured T, recurrent below
    it, recurrent where the table has no measurement (Metal), and an explicit choice always wins."""
    cuda, metal = tuning.resolve("gpu", "cuda", environ={}), tuning.resolve("gpu", "metal", environ={})
    gdn = specs.gated_delta_net
    assert cuda.chunked_backward_min_t == 1024 and metal.chunked_backward_min_t is None
    assert ops.choose_backward(gdn, cuda, 4096, None) == "chunked"
    assert ops.choose_backward(gdn, cuda, 100, None) == "recurrent"
    assert ops.choose_backward(gdn, metal, 4096, None) == "recurrent"
    assert ops.choose_backward(specs.selective_scan, cuda, 4096, None) == "recurrent"  # no fast chunked form
    assert ops.choose_backward(specs.rwkv7, cuda, 4096, None) == "chunked"  # the general rank-1 core
    assert ops.choose_backward(gdn, cuda, 4096, "recurrent") == "recurrent"
    forced = tuning.resolve("gpu", "metal", environ={"RECGEN_BACKWARD": "chunked"})
    assert ops.choose_backward(gdn, forced, 100, None) == "chunked"
    with pytest.raises(InputError, match="RECGEN_BACKWARD"):
        tuning.resolve("gpu", "cuda", environ={"RECGEN_BACKWARD": "sideways"})
    with pytest.raises(InputError, match="backward="):
        ops.Op(specs.gla, backward="sideways")


def test_chunked_forward_follows_the_tuning():
    """From ``chunked_forward_min_t`` a kernel op with the chunked backward runs as the chunked form (forward and
    backward), for specs with the fast chunked form only, unless its backward is forced recurrent; the
    environment sets the threshold."""
    cuda, metal = tuning.resolve("gpu", "cuda", environ={}), tuning.resolve("gpu", "metal", environ={})
    gdn = ops.Op(specs.gated_delta_net)
    assert cuda.chunked_forward_min_t == 1024 and metal.chunked_forward_min_t is None
    assert gdn.runs_chunked(cuda, 1024) and not gdn.runs_chunked(cuda, 1023) and not gdn.runs_chunked(metal, 1 << 20)
    assert not ops.Op(specs.gated_delta_net, backward="recurrent").runs_chunked(cuda, 4096)
    assert not ops.Op(specs.selective_scan).runs_chunked(cuda, 1 << 20)  # no fast chunked form
    assert ops.Op(specs.rwkv7).runs_chunked(cuda, 4096) and not ops.Op(specs.rwkv7).runs_chunked(cuda, 1023)
    t = tuning.resolve("gpu", "cuda", environ={"RECGEN_CHUNKED_FORWARD_MIN_T": "2048"})
    assert ops.chunked_forward(specs.gated_delta_net, t, 2048)
    assert not ops.chunked_forward(specs.gated_delta_net, t, 1024)


def test_checked_signatures_still_check_what_varies():
    """An op remembers the argument metadata it has checked (decode repeats one signature), and still checks what
    that key does not cover: a bad initial state or scale on a remembered signature, a new dtype, a wrong
    keyword; positional and keyword calls map their arrays to the right inputs."""
    q, k, v, gk = _gla_inputs()
    op = ops.gla
    o1 = op(q, k, v, gk)[0]
    o2 = op(q, k, v, gk)[0]                           # the remembered path
    o3 = op(q, k, v=v, gk=gk)[0]                      # another signature, the same call
    np.testing.assert_array_equal(np.array(o1), np.array(o2))
    np.testing.assert_array_equal(np.array(o1), np.array(o3))
    with pytest.raises(InputError, match="initial_state"):
        op(q, k, v, gk, initial_state=mx.zeros((1, 2, 3, 3)))
    with pytest.raises(InputError, match="scale"):
        op(q, k, v, gk, scale="big")
    with pytest.raises(InputError, match="'q'"):
        op(q.astype(mx.int32), k, v, gk)
    with pytest.raises(InputError, match="unexpected"):
        op(q, k, v, gk=gk, gate=gk)


def test_default_backend_runs_the_chunked_form_where_the_spec_has_no_kernel(monkeypatch):
    """On a GPU a spec without recurrent kernels (feature maps) runs the chunked form by default (checked with a
    CUDA tuning on this machine, the chunk kernels off so that the chunked form runs here; an explicit kernel backend's error: test_kernels_metal)."""
    from recgen import chunked
    from recgen.spec.layouts import Sizes

    t = tuning.resolve("gpu", "cuda", environ={}, chunk_kernels=False, mma_scan=False)
    monkeypatch.setattr(ops, "checked_for", lambda _p, _t: t)
    rng = np.random.default_rng(5)
    a = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    q, k, v = a(1, 6, 2, 4), a(1, 6, 2, 4), a(1, 6, 2, 3)
    g = mx.array(-rng.uniform(0, 2, (1, 6, 2)).astype(np.float32))
    assert not ops.has_kernel(specs.power_retention, Sizes(1, 6, 2, 2, 4, 10, 3), t)
    assert ops.has_kernel(specs.gla, Sizes(1, 6, 2, 2, 4, 4, 3), t)
    o = ops.Op(specs.power_retention)(q, k, v, g)[0]  # the spec's plain op (the built-in composes kernels)
    assert isinstance(rg.load("power_retention"), ops.PowerRetention)
    o_ref = chunked.forward(specs.power_retention, dict(q=q, k=k, v=v, g=g), scale=0.5, tuning=t)[0]
    np.testing.assert_allclose(np.array(o), np.array(o_ref), rtol=1e-6, atol=1e-7)


def test_the_self_test_runs_only_where_the_chunked_form_does(monkeypatch):
    """The chunk kernels' self-test compiles their frames (minutes on a GPU, each new process): a call on the
    recurrent kernels alone (decode, short prefill, their backward) does not run it; one whose backward is the
    chunked form's does, over the spec's frames. (CUDA's tuning here; the kernel op and the chunked VJP are stubs.)"""
    t = tuning.resolve("gpu", "cuda", environ={}, chunked_forward_min_t=None)
    monkeypatch.setattr(ops, "current", lambda: t)
    monkeypatch.setattr(ops, "check_backend", lambda *a: None)
    checks, vjps = [], []
    monkeypatch.setattr(ops, "checked_for", lambda p, tt: checks.append(p.rec.name) or tt)
    monkeypatch.setattr(ops, "chunked_vjp", lambda *a: "the chunked backward")

    def kernel_op(p, dialect, sizes, scale, out_dtype, vjp, debug, cache):
        vjps.append(vjp)
        return lambda *a: (mx.zeros((sizes.B, sizes.T, sizes.H, sizes.V)), mx.zeros(sizes.state_shape))

    monkeypatch.setattr(ops, "kernel_op", kernel_op)
    op = ops.Op(specs.gated_delta_net, backend="cuda")

    def call(T):
        rng = np.random.default_rng(T)
        a = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
        return op(a(1, T, 2, 8), a(1, T, 2, 8), a(1, T, 2, 8), -mx.abs(a(1, T, 2)), mx.sigmoid(a(1, T, 2)))

    for T in (1, 7):  # decode and a short prefill: the recurrent kernels, forward and backward
        call(T)
    assert checks == [] and vjps == [None, None]
    call(t.chunked_backward_min_t)  # a long one: its backward is the chunked form's, checked first
    assert checks == ["gated_delta_net"] and vjps[-1] == "the chunked backward"
