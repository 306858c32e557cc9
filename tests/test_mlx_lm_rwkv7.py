"""recgen's drop-in for mlx-lm's RWKV-7 WKV (``Rwkv7TimeMixing._wkv7``) against mlx-lm itself (skipped without
mlx-lm).

Unit level: against mlx-lm's own ``_wkv7`` (its per-token ``_wkv7_step_ops`` loop off Metal): output, final state
and the gradients of every input and the state by MLX autodiff, T = 1, odd T, a state or none, under
``mx.compile``. Model level: a tiny random-config rwkv7 (every parameter random: mlx-lm initializes k_k, the token
shifts and the per-head norm to zero, which would leave the transition and the output at zero), patched against
unpatched: logits, gradients of every parameter, and mlx-lm's generation loop with its cache.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm.models import rwkv7 as M  # noqa: E402

from helpers import rel_err  # noqa: E402
from recgen.integrations import mlx_lm as R  # noqa: E402
from recgen.spec.layouts import InputError  # noqa: E402

ARGS = ("r", "w", "k", "v", "a", "b")


def f32(x):
    return mx.array(np.asarray(x, dtype=np.float32))


def inputs(rng, B=2, T=9, H=3, D=8, state=True):
    """The model's own distributions: w = exp(-0.606531 σ(·)), a = -kk, b = kk·iclr with kk a unit direction."""
    n = rng.standard_normal
    kk = n((B, T, H, D))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    x = dict(r=n((B, T, H, D)), w=np.exp(-0.606531 / (1 + np.exp(-n((B, T, H, D))))), k=0.5 * n((B, T, H, D)),
             v=n((B, T, H, D)), a=-kk, b=kk * rng.uniform(0.05, 0.95, (B, T, H, D)))
    x = {k: f32(v) for k, v in x.items()}
    x["state"] = f32(n((B, H, D, D))) if state else None
    return x


def own(H, D):
    """mlx-lm's method on a stand-in ``self`` (it reads num_heads and head_dim for a None state)."""
    me = types.SimpleNamespace(num_heads=H, head_dim=D)
    return lambda *a: M.Rwkv7TimeMixing._wkv7(me, *a)


@pytest.mark.parametrize("B,T,H,D,state", [(2, 9, 3, 8, True), (2, 1, 3, 8, True), (1, 33, 2, 16, False)])
def test_matches_mlx_lm_wkv7(rng, B, T, H, D, state):
    x = inputs(rng, B, T, H, D, state)
    names = [n for n in (*ARGS, "state") if x[n] is not None]
    ref = own(H, D)

    def run(fn):
        return lambda *arrays: fn(*[dict(x, **dict(zip(names, arrays)))[n] for n in (*ARGS, "state")])

    y, s = run(lambda *a: R.wkv7(None, *a))(*[x[n] for n in names])
    y0, s0 = run(ref)(*[x[n] for n in names])
    assert y.shape == (B, T, H, D) and y.dtype == y0.dtype and s.dtype == s0.dtype
    assert rel_err(y, y0.reshape(y.shape)) < 2e-6 and rel_err(s, s0) < 2e-6
    dy, ds = f32(rng.standard_normal(y.shape)), f32(rng.standard_normal(s.shape))

    def loss(fn):
        return lambda *a: (run(fn)(*a)[0].reshape(dy.shape) * dy).sum() + (run(fn)(*a)[1] * ds).sum()

    argnums = tuple(range(len(names)))
    g = mx.grad(loss(lambda *a: R.wkv7(None, *a)), argnums=argnums)(*[x[n] for n in names])
    g0 = mx.grad(loss(ref), argnums=argnums)(*[x[n] for n in names])
    for n, gi, g0i in zip(names, g, g0):
        assert float(mx.abs(g0i).max()) > 0, n
        assert rel_err(gi, g0i) < 2e-5, (n, rel_err(gi, g0i))


def test_under_mx_compile(rng):
    x = inputs(rng, T=13)
    xs = [x[n] for n in (*ARGS, "state")]
    y, s = mx.compile(lambda *a: R.wkv7(None, *a))(*xs)
    y1, s1 = R.wkv7(None, *xs)
    assert rel_err(y, y1) < 1e-6 and rel_err(s, s1) < 1e-6
    grad = mx.grad(lambda *a: R.wkv7(None, *a)[0].square().sum(), argnums=tuple(range(7)))
    for gc, ge in zip(mx.compile(grad)(*xs), grad(*xs)):
        assert rel_err(gc, ge) < 1e-6


def test_bad_input_names_the_argument(rng):
    x = inputs(rng, T=5)

    def call(**over):
        a = dict(x, **over)
        return R.wkv7(None, *[a[n] for n in (*ARGS, "state")])

    with pytest.raises(InputError, match="'a'"):
        call(a=mx.zeros((2, 5, 3, 4)))
    with pytest.raises(InputError, match="'state'"):
        call(state=mx.zeros((2, 3, 8, 4)))
    with pytest.raises(InputError, match="'v'"):
        call(v=mx.zeros((2, 4, 3, 8)))


def test_patch_sets_the_method_and_unpatch_restores():
    original = M.Rwkv7TimeMixing.__dict__["_wkv7"]
    assert not R.patched()
    with R.patch() as p:
        assert M.Rwkv7TimeMixing._wkv7 is R.wkv7
        assert ("mlx_lm.models.rwkv7.Rwkv7TimeMixing", "_wkv7") in {(r.module, r.name) for r in p.rebindings}
    assert M.Rwkv7TimeMixing.__dict__["_wkv7"] is original and not R.patched()
    with R.patch(rwkv7=False):
        assert M.Rwkv7TimeMixing.__dict__["_wkv7"] is original
    assert M.Rwkv7TimeMixing.__dict__["_wkv7"] is original


# -- model level ---------------------------------------------------------------------------------------

V = 67


def tiny_rwkv7(seed=0):
    mx.random.seed(seed)
    args = M.ModelArgs(model_type="rwkv7", vocab_size=V, hidden_size=32, intermediate_size=64, norm_eps=1e-5,
                       head_dim=8, num_hidden_layers=2, a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8,
                       decay_low_rank_dim=8)
    model = M.Model(args)
    rng = np.random.default_rng(seed)
    model.update(tree_map(lambda p: f32(0.3 * rng.standard_normal(p.shape)), model.parameters()))
    mx.eval(model.parameters())
    return model


def both(fn):
    """fn() unpatched, then patched; checks that recgen's rwkv7 op ran in the patched call only."""
    from recgen import ops

    calls = []

    def evaluated():
        real = ops.rwkv7
        ops.rwkv7 = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
        try:
            out = fn()
            mx.eval([v for _, v in tree_flatten(out) if isinstance(v, mx.array)])
        finally:
            ops.rwkv7 = real
        return out

    ref = evaluated()
    assert not calls
    with R.patch():
        got = evaluated()
    assert calls
    return ref, got


def test_model_logits_and_gradients(rng):
    model = tiny_rwkv7()
    tokens = mx.array(rng.integers(0, V, (2, 37)))
    ref, got = both(lambda: model(tokens))
    assert rel_err(got, ref) < 1e-5

    def loss(mdl, x):
        return nn.losses.cross_entropy(mdl(x[:, :-1]), x[:, 1:], reduction="mean")

    step = nn.value_and_grad(model, loss)
    (l0, g0), (l1, g1) = both(lambda: step(model, tokens))
    assert abs(float(l1) - float(l0)) < 1e-5 * abs(float(l0))
    flat0, flat1 = dict(tree_flatten(g0)), dict(tree_flatten(g1))
    assert flat0.keys() == flat1.keys() and any("k_a" in k for k in flat0) and any("w_lora" in k for k in flat0)
    for k in flat0:
        assert float(mx.abs(flat0[k]).max()) > 0, k
        assert rel_err(flat1[k], flat0[k]) < 1e-4, (k, rel_err(flat1[k], flat0[k]))


def test_generate_with_cache():
    """mlx-lm's own generation loop (``generate_step``: prefill in steps, then decode with the cache's state):
    token ids and log-probabilities agree patched and unpatched."""
    from mlx_lm.generate import generate_step

    model = tiny_rwkv7(seed=3)
    prompt = mx.array(np.random.default_rng(7).integers(0, V, 29))

    def run():
        out = list(generate_step(prompt, model, max_tokens=6, prefill_step_size=16))
        return [int(t) for t, _ in out], mx.stack([lp for _, lp in out])

    (ids0, lp0), (ids1, lp1) = both(run)
    assert ids0 == ids1 and len(ids0) == 6
    assert rel_err(lp1, lp0) < 1e-5
