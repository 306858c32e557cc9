"""Packed sequences (``cu_seqlens``, FLA's convention: B = 1, offsets on the host, one initial and one final state
per sequence) against the float64 reference run sequence by sequence: outputs, final states and every gradient,
an empty sequence and a one-token one included, GQA, a normalizer spec; bad offsets name the argument."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import random_inputs, random_state

from recgen import ops, specs
from recgen.errors import InputError
from recgen.math import reference
from recgen.testing import rel_err

OFFSETS = [0, 5, 5, 6, 13]  # four sequences: 5 tokens, none, 1, 7


def _spec(name):
    return specs.BUILTINS[name]


def _pieces(x, rec_input, a, b):
    return x[:, a:b] if rec_input.per_token else x


@pytest.mark.parametrize("name", ["gated_delta_net", "gla", "mlstm_sigmoid"])
def test_packed_sequences_match_the_reference_one_by_one(name, rng):
    rec = _spec(name)
    N, T = len(OFFSETS) - 1, OFFSETS[-1]
    xs = random_inputs(rec, rng, B=1, T=T, H=4, Hk=2, K=5, V=3)
    h0 = random_state(rec, rng, B=N, H=4, K=5, V=3)
    do = rng.standard_normal((1, T, 4, 3))
    parts = lambda s: [s] if not isinstance(s, tuple) else list(s)  # noqa: E731
    dht = random_state(rec, rng, B=N, H=4, K=5, V=3)
    f32 = lambda a: mx.array(np.asarray(a, np.float32))  # noqa: E731
    names = [x.name for x in rec.inputs]
    op = ops.Op(rec, backend="mlx")

    def loss(*args):
        arrays, state = args[:len(names)], args[len(names):]
        o, ht = op(*arrays, initial_state=tuple(state) if rec.has_normalizer else state[0],
                   output_final_state=True, cu_seqlens=OFFSETS)
        return (o * f32(do)).sum() + sum((a * f32(d)).sum() for a, d in zip(parts(ht), parts(dht))), (o, ht)

    prim = [f32(xs[n]) for n in names] + [f32(p) for p in parts(h0)]
    (val, (o, ht)), grads = mx.value_and_grad(loss, argnums=list(range(len(prim))))(*prim)
    for i, (a, b) in enumerate(zip(OFFSETS, OFFSETS[1:])):
        xi = {x.name: _pieces(xs[x.name], x, a, b) for x in rec.inputs}
        h0i = tuple(p[i:i + 1] for p in parts(h0))
        h0i = h0i if rec.has_normalizer else h0i[0]
        dhti = tuple(p[i:i + 1] for p in parts(dht))
        dhti = dhti if rec.has_normalizer else dhti[0]
        o_r, ht_r = reference.run(rec, initial_state=h0i, **xi)
        assert rel_err(np.array(o)[:, a:b], o_r) < 1e-5 if b > a else np.array(o)[:, a:b].size == 0
        for got, want in zip(parts(ht), parts(ht_r)):
            assert rel_err(np.array(got)[i:i + 1], want) < 1e-5
        g_r = reference.grad(rec, do=do[:, a:b], dht=dhti, initial_state=h0i, **xi)
        for j, x in enumerate(rec.inputs):
            got = np.array(grads[j])
            got = got[:, a:b] if x.per_token else None
            if got is not None and b > a:
                assert rel_err(got, g_r[x.name]) < 1e-4, (i, x.name)
        for k, want in enumerate(parts(g_r["initial_state"])):
            assert rel_err(np.array(grads[len(names) + k])[i:i + 1], want) < 1e-4, (i, "initial_state")


def test_packed_sequences_are_lazy_and_compile():
    rec = specs.simple_gla
    rng = np.random.default_rng(0)
    xs = [mx.array(v.astype(np.float32)) for v in random_inputs(rec, rng, B=1, T=13, H=4, Hk=2, K=5, V=3).values()]
    f = lambda *a: ops.simple_gla(*a, cu_seqlens=OFFSETS, backend="mlx")[0]  # noqa: E731
    assert rel_err(mx.compile(f)(*xs), f(*xs)) < 1e-6


@pytest.mark.parametrize("offsets, match", [([0, 5, 14], "from 0 to T=13"), ([0, 7, 5, 13], "nondecreasing"),
                                            ([1, 13], "from 0"), ("0,13", "ints"), ([0, 6.5, 13], "ints")])
def test_bad_offsets_name_cu_seqlens(offsets, match):
    rng = np.random.default_rng(1)
    xs = [mx.array(v.astype(np.float32)) for v in random_inputs(specs.gla, rng, B=1, T=13, H=4, Hk=2, K=5, V=3).values()]
    with pytest.raises(InputError, match="cu_seqlens"):
        ops.gla(*xs, cu_seqlens=offsets, backend="mlx")


def test_packing_needs_one_row_and_host_offsets():
    rng = np.random.default_rng(2)
    xs = [mx.array(v.astype(np.float32)) for v in random_inputs(specs.gla, rng, B=2, T=13, H=4, Hk=2, K=5, V=3).values()]
    with pytest.raises(InputError, match="B = 1"):
        ops.gla(*xs, cu_seqlens=OFFSETS, backend="mlx")
    one = [x[:1] for x in xs]
    with pytest.raises(InputError, match="tolist"):
        ops.gla(*one, cu_seqlens=mx.array(OFFSETS), backend="mlx")
    with pytest.raises(InputError, match="initial_state"):  # one state per sequence: [N, H, K, V]
        ops.gla(*one, cu_seqlens=OFFSETS, initial_state=mx.zeros((1, 4, 5, 3)), backend="mlx")
