"""The built-ins whose op is more than ``Op(spec)``, in their upstream conventions, against the handwritten float64
references (``tests/references``): ``ops.retnet`` (FLA's ``chunk_retention``: the op supplies RetNet's decays) and
``ops.mamba2`` (mamba_ssm's ``mamba_chunk_scan_combined``: layouts, the state transposed, D [H] or [H,P], z,
dt_bias, dt_softplus, dt_limit); forward, final state and every gradient, on the CPU (backend "mlx"). Fresh
random data, strong decays (log-decay to -20), K != V, odd T, T = 1, GQA. And the argument errors: each names
its argument, before any compute."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from recgen import ops
from recgen.errors import InputError
from recgen.testing import rel_err
from references.hgrn2 import hgrn2 as hgrn2_ref
from references.hgrn2 import hgrn2_bwd, hgrn2_gate
from references.mamba2 import mamba2 as mamba2_ref
from references.mamba2 import mamba2_bwd
from references.retnet import retnet as retnet_ref
from references.retnet import retnet_bwd

FWD, GRAD = 1e-5, 1e-4


def f32(a):
    return None if a is None else mx.array(np.asarray(a, np.float32))


def r32(a):
    return None if a is None else np.asarray(a, np.float32).astype(np.float64)


@pytest.fixture(autouse=True)
def _cpu():
    mx.set_default_device(mx.cpu)


@pytest.mark.parametrize("T,Hk,H", [(1, 2, 4), (9, 2, 4), (33, 3, 3)])
def test_retnet_is_fla_chunk_retention(T, Hk, H, rng):
    B, K, V = 2, 8, 6
    q, k = r32(rng.standard_normal((B, T, Hk, K))), r32(rng.standard_normal((B, T, Hk, K)))
    v, h0 = r32(rng.standard_normal((B, T, H, V))), r32(rng.standard_normal((B, H, K, V)))
    do, dht = r32(rng.standard_normal((B, T, H, V))), r32(rng.standard_normal((B, H, K, V)))

    def f(q_, k_, v_, s_):
        return ops.retnet(q_, k_, v_, initial_state=s_, output_final_state=True, backend="mlx")

    (o, ht), grads = mx.vjp(f, [f32(q), f32(k), f32(v), f32(h0)], [f32(do), f32(dht)])
    o_r, ht_r = retnet_ref(q, k, v, initial_state=h0)   # log_gamma None: RetNet's 1 - 2^(-5-h)
    assert rel_err(o, o_r) <= FWD and rel_err(ht, ht_r) <= FWD
    g_r = retnet_bwd(q, k, v, None, do, dht, initial_state=h0)
    for name, g in zip(("q", "k", "v", "initial_state"), grads):
        assert rel_err(g, g_r[name]) <= GRAD, name


def test_hgrn2_from_fla_gates(rng):
    """The gate of FLA's layer (logsigmoid(f), lower-bounded) in MLX ops, then ops.hgrn2; gradients to q, v, g."""
    B, T, H, Hk, K, V = 2, 11, 4, 2, 8, 6
    q, v = r32(rng.standard_normal((B, T, Hk, K))), r32(rng.standard_normal((B, T, H, V)))
    f, lb = r32(3 * rng.standard_normal((B, T, H, K))), r32(rng.uniform(0, 0.9, (H, K)))
    f[0, 0, 0, 0] = -20.0
    g = r32(hgrn2_gate(f, lb))
    do = r32(rng.standard_normal((B, T, H, V)))
    g_mx = mx.logaddexp(mx.log(f32(lb)), mx.log1p(-f32(lb)) - mx.logaddexp(0.0, -f32(f)))  # FLA's lower bound
    assert rel_err(g_mx, g) <= FWD
    (o,), grads = mx.vjp(lambda a, b, c: ops.hgrn2(a, b, c, backend="mlx")[0], [f32(q), f32(v), f32(g)], [f32(do)])
    assert rel_err(o, hgrn2_ref(q, v, g)[0]) <= FWD
    g_r = hgrn2_bwd(q, v, g, do, None)
    for name, gr in zip(("q", "v", "g"), grads):
        assert rel_err(gr, g_r[name]) <= GRAD, name


# (T, G, H, dt_softplus, dt_bias, D shape, z, dt_limit, initial state)
MAMBA2 = [(1, 1, 2, True, True, "H", True, (0.0, float("inf")), True),       # fused gate, T = 1
          (37, 2, 4, True, True, "HP", False, (0.0, float("inf")), True),    # fused gate, GQA
          (9, 2, 4, True, False, "H", True, (0.3, 1.5), False),              # softplus then clip (MLX ops)
          (8, 1, 2, False, True, None, False, (0.0, float("inf")), True),    # raw dt + bias, clipped at 0
          (17, 2, 2, False, False, "HP", True, (0.2, 2.0), True)]            # raw dt, a limit


@pytest.mark.parametrize("T,G,H,softplus,bias,dshape,z,limit,init", MAMBA2)
def test_mamba2_is_mamba_chunk_scan_combined(T, G, H, softplus, bias, dshape, z, limit, init, rng):
    B, P, N = 2, 5, 4
    A = -np.exp(rng.uniform(np.log(0.5), np.log(20.0), H))
    x = dict(x=rng.standard_normal((B, T, H, P)),
             dt=rng.standard_normal((B, T, H)) if softplus else rng.uniform(-0.2, 1.5, (B, T, H)),
             A=A, B=rng.standard_normal((B, T, G, N)), C=rng.standard_normal((B, T, G, N)),
             D=None if dshape is None else rng.standard_normal(H if dshape == "H" else (H, P)),
             z=rng.standard_normal((B, T, H, P)) if z else None,
             dt_bias=0.5 * rng.standard_normal(H) if bias else None,
             initial_states=rng.standard_normal((B, H, P, N)) if init else None)
    x = {n: r32(a) for n, a in x.items()}
    names = [n for n, a in x.items() if a is not None]
    dout, dht = r32(rng.standard_normal((B, T, H, P))), r32(rng.standard_normal((B, H, P, N)))
    flags = dict(dt_softplus=softplus, dt_limit=limit)

    def f(*arrays):
        return ops.mamba2(**dict(zip(names, arrays)), **flags, return_final_states=True, backend="mlx")

    (out, final), grads = mx.vjp(f, [f32(x[n]) for n in names], [f32(dout), f32(dht)])
    out_r, final_r = mamba2_ref(**x, **flags)
    assert rel_err(out, out_r) <= FWD and rel_err(final, final_r) <= FWD
    g_r = mamba2_bwd(**x, **flags, dout=dout, dht=dht)
    for n, g in zip(names, grads):
        assert rel_err(g, g_r[n]) <= GRAD, (n, rel_err(g, g_r[n]))
    assert ops.mamba2(*[f32(x[n]) for n in ("x", "dt", "A", "B", "C")], backend="mlx").shape == (B, T, H, P)


def test_mamba2_chunk_size_is_the_chunked_forms(rng):
    args = [f32(rng.standard_normal(s)) for s in ((1, 20, 2, 3), (1, 20, 2))] + [f32(-np.ones(2))] \
        + [f32(rng.standard_normal((1, 20, 1, 4))) for _ in range(2)]
    a = ops.mamba2(*args, dt_softplus=True, backend="mlx")
    b = ops.mamba2(*args, 8, dt_softplus=True, backend="mlx")   # mamba's positional chunk_size
    assert rel_err(a, b) <= FWD


def test_mamba2_argument_errors():
    x, dt, A, BC = mx.zeros((1, 5, 4, 3)), mx.zeros((1, 5, 4)), mx.zeros((4,)), mx.zeros((1, 5, 2, 6))
    cases = [(dict(dt=mx.zeros((1, 4, 5))), "'dt': expected \\[B,T,H\\]"),
             (dict(A=mx.zeros((4, 3))), "'A': expected \\[H\\]"),
             (dict(B=mx.zeros((1, 5, 3, 6))), "'B': expected \\[B,T,G,N\\]"),
             (dict(C=mx.zeros((1, 5, 2, 5))), "'C'"),
             (dict(D=mx.zeros((3,))), "'D': expected \\[H\\]"),
             (dict(z=mx.zeros((1, 5, 4, 2))), "'z'"),
             (dict(dt_bias=mx.zeros((1, 4))), "'dt_bias'"),
             (dict(initial_states=mx.zeros((1, 4, 6, 3))), "'initial_states': expected \\[B,H,P,N\\] = \\[1, 4, 3, 6\\]"),
             (dict(dt_limit=(1.0, 0.5)), "'dt_limit'"),
             (dict(seq_idx=mx.zeros((1, 5))), "'seq_idx': not supported"),
             (dict(return_varlen_states=True), "'return_varlen_states'"),
             (dict(x=np.zeros((1, 5, 4, 3))), "'x': expected an mx.array"),
             (dict(A=mx.zeros((4,), dtype=mx.int32)), "'A': expected float32"),
             (dict(chunk_size=0), "'chunk_size'")]
    for change, match in cases:
        kw = dict(x=x, dt=dt, A=A, B=BC, C=BC) | change
        with pytest.raises(InputError, match=match):
            ops.mamba2(**kw)


def test_retnet_argument_errors():
    q = mx.zeros((1, 5, 2, 4))
    with pytest.raises(InputError, match="'v': expected \\[B,T,H,V\\]"):
        ops.retnet(q, q, mx.zeros((1, 5, 2)))
    with pytest.raises(InputError, match="'v': expected an mx.array"):
        ops.retnet(q, q, np.zeros((1, 5, 2, 3)))
    with pytest.raises(InputError, match="given twice"):
        ops.retnet(q, q, mx.zeros((1, 5, 2, 3)), log_gamma=mx.zeros((2,)))
    with pytest.raises(InputError, match="'k'"):
        ops.retnet(q, mx.zeros((1, 5, 2, 3)), mx.zeros((1, 5, 2, 3)))
