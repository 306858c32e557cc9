"""recgen's drop-in for mlx-lm's Mamba-2 ``ssm_update`` against mlx-lm itself (skipped without mlx-lm).

Unit level: against mlx-lm's ``ssm_attn`` (forward, final state, gradients of every input by MLX autodiff:
A_log, dt_bias and D included) over groups, masks with lengths, a state or none, T = 1, odd T and T beyond
mlx-lm's 256-token blocks, and under ``mx.compile``. Model level: a tiny random-config mamba2, patched
against unpatched: logits, gradients, a right-padded batch, and mlx-lm's generation loop.
"""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import ssm as S  # noqa: E402

from helpers import rel_err  # noqa: E402
from recgen.integrations import mlx_lm as R  # noqa: E402
from recgen.spec.layouts import InputError  # noqa: E402

ARGS = ("x", "A_log", "B", "C", "D", "dt", "dt_bias", "state")
LIMIT = (0.001, 100.0)


def f32(x):
    return mx.array(np.asarray(x, dtype=np.float32))


def inputs(rng, b=2, l=21, H=4, P=8, G=2, N=16, state=True):
    n = rng.standard_normal
    x = dict(x=n((b, l, H, P)), A_log=rng.uniform(-1.0, 2.5, H), B=n((b, l, G, N)), C=n((b, l, G, N)), D=n(H),
             dt=n((b, l, H)), dt_bias=0.5 * n(H), state=n((b, H, P, N)) if state else None)
    return {k: (None if v is None else f32(v)) for k, v in x.items()}


CASES = [  # (b, l, H, P, G, N, state, padding)
    (2, 21, 4, 8, 2, 16, True, None),
    (2, 1, 4, 8, 1, 16, True, None),
    (1, 300, 2, 8, 1, 8, False, None),
    (2, 33, 4, 8, 2, 16, True, "left"),
    (2, 33, 4, 8, 4, 16, False, "right"),
]


@pytest.mark.parametrize("b,l,H,P,G,N,state,padding", CASES)
def test_matches_mlx_lm_ssm_attn(rng, b, l, H, P, G, N, state, padding):
    x = inputs(rng, b, l, H, P, G, N, state)
    mask = lengths = None
    keep = np.ones((b, l), bool)
    if padding == "left":
        keep[1, :9] = False
        mask = mx.array(keep)
    elif padding == "right":  # mlx-lm's models pass the cache's mask and lengths together
        keep[1, 20:] = False
        mask, lengths = mx.array(keep), mx.array([l, 20])
    names = [n for n in ARGS if x[n] is not None]

    def run(fn):
        def f(*arrays):
            a = dict(x, **dict(zip(names, arrays)))
            return fn(*[a[n] for n in ARGS], LIMIT, mask=mask, lengths=lengths)
        return f

    y, s = run(R.ssm_update)(*[x[n] for n in names])
    y0, s0 = run(S.ssm_attn)(*[x[n] for n in names])
    w = keep[:, :, None, None]
    assert y.dtype == y0.dtype and s.dtype == s0.dtype
    assert rel_err(np.asarray(y) * w, np.asarray(y0) * w) < 2e-6 and rel_err(s, s0) < 2e-6
    dy, ds = f32(rng.standard_normal(y.shape) * w), f32(rng.standard_normal(s.shape))

    def loss(fn):
        return lambda *a: (run(fn)(*a)[0] * dy).sum() + (run(fn)(*a)[1] * ds).sum()

    argnums = tuple(range(len(names)))
    g = mx.grad(loss(R.ssm_update), argnums=argnums)(*[x[n] for n in names])
    g0 = mx.grad(loss(S.ssm_attn), argnums=argnums)(*[x[n] for n in names])
    for n, gi, g0i in zip(names, g, g0):
        # A_log's, dt_bias's and D's gradients sum terms of both signs over every token
        assert rel_err(gi, g0i) < (2e-4 if n in ("A_log", "dt_bias", "D") else 2e-5), n


def test_under_mx_compile(rng):
    x = inputs(rng, l=13)
    xs = [x[n] for n in ARGS]
    mask = mx.array(np.arange(13)[None, :] >= np.array([[0], [4]]))
    y, s = mx.compile(lambda *a: R.ssm_update(*a, LIMIT, mask))(*xs)
    y1, s1 = R.ssm_update(*xs, LIMIT, mask)
    assert rel_err(y, y1) < 1e-6 and rel_err(s, s1) < 1e-6
    grad = mx.grad(lambda *a: R.ssm_update(*a, LIMIT, mask)[0].square().sum(), argnums=tuple(range(8)))
    for gc, ge in zip(mx.compile(grad)(*xs), grad(*xs)):
        assert rel_err(gc, ge) < 1e-6


def test_bad_input_names_the_argument(rng):
    x = inputs(rng, l=5)

    def call(**over):
        a = dict(x, **over)
        return R.ssm_update(*[a.pop(n) for n in ARGS], LIMIT, **a)

    with pytest.raises(InputError, match="'B'"):
        call(B=mx.zeros((2, 5, 3, 16)))
    with pytest.raises(InputError, match="'state'"):
        call(state=x["state"].swapaxes(-1, -2))
    with pytest.raises(InputError, match="'lengths'"):
        call(lengths=mx.array([1, 2, 3]))
    with pytest.raises(InputError, match="'dt'"):
        call(dt=mx.zeros((2, 5, 3)))


V = 61


def tiny_mamba2(seed=0):
    from mlx_lm.models import mamba2

    mx.random.seed(seed)
    args = mamba2.ModelArgs(model_type="mamba2", num_heads=8, head_dim=8, vocab_size=V, hidden_size=32,
                            intermediate_size=64, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
                            conv_kernel=4, n_groups=2, use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
                            time_step_limit=(0.001, 100.0), time_step_rank="auto")
    model = mamba2.Model(args)
    mx.eval(model.parameters())
    return model


def both(fn):
    """fn() unpatched, then patched; checks that recgen's simple_gla ran in the patched call only."""
    from recgen import ops

    calls = []

    def evaluated():
        real = ops.simple_gla
        ops.simple_gla = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
        try:
            out = fn()
            mx.eval([v for _, v in tree_flatten(out) if isinstance(v, mx.array)])
        finally:
            ops.simple_gla = real
        return out

    ref = evaluated()
    assert not calls
    with R.patch():
        got = evaluated()
    assert calls
    return ref, got


def test_mamba2_model_logits_gradients_padding_and_generation(rng):
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import ArraysCache

    model = tiny_mamba2()
    tokens = mx.array(rng.integers(0, V, (2, 37)))
    l0, l1 = both(lambda: model(tokens))
    assert rel_err(l1, l0) < 1e-5

    def loss(m, x):
        return nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:], reduction="mean")

    (_, g0), (_, g1) = both(lambda: nn.value_and_grad(model, loss)(model, tokens))
    f0, f1 = dict(tree_flatten(g0)), dict(tree_flatten(g1))
    assert any(k.endswith("A_log") for k in f0)
    for k in f0:
        tol = 5e-4 if k.endswith(("A_log", "dt_bias", ".D")) else 1e-4
        assert rel_err(f1[k], f0[k]) < tol, k

    lengths = [37, 20]

    def right_padded():
        caches = [ArraysCache(2) for _ in model.layers]
        for c in caches:
            c.prepare(lengths=lengths)
        return model(tokens, cache=caches), [c[1] for c in caches]

    (p0, s0), (p1, s1) = both(right_padded)
    real = np.arange(37)[None, :, None] < np.array(lengths)[:, None, None]
    assert rel_err(np.asarray(p1) * real, np.asarray(p0) * real) < 1e-5
    for a, b in zip(s1, s0):
        assert rel_err(a, b) < 1e-5

    prompt = mx.array(rng.integers(0, V, 23))

    def gen():
        out = list(generate_step(prompt, model, max_tokens=5, prefill_step_size=8))
        return [int(t) for t, _ in out], mx.stack([lp for _, lp in out])

    (ids0, lp0), (ids1, lp1) = both(gen)
    assert ids0 == ids1 and rel_err(lp1, lp0) < 1e-5
