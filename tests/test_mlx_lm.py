"""recgen.integrations.mlx_lm against mlx-lm itself (skipped without mlx-lm).

Unit level: ``gated_delta_update`` against mlx-lm's own per-token ``gated_delta_ops`` path (forward, final
state, gradients of every input by MLX autodiff, A_log and dt_bias included) and against recgen's float64
reference, over scalar and vector gates, masks, lower_bound, allow_neg_eigval, GQA, T = 1, odd T, strong
decays and decays of exactly 0; under ``mx.compile``; bad input. Model level: tiny random-config qwen3_5,
qwen3_next and kimi_linear (no weights), patched against unpatched: logits, a LoRA step's gradients,
left- and right-padded batches through their caches, and generation (prefill, then decode).
"""
from __future__ import annotations

import importlib
import subprocess
import sys

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import gated_delta as G  # noqa: E402

from helpers import rel_err  # noqa: E402
from recgen import specs  # noqa: E402
from recgen.integrations import mlx_lm as R  # noqa: E402
from recgen.math import reference  # noqa: E402
from recgen.spec.layouts import InputError  # noqa: E402

ARGS = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state")


def f32(x):
    return mx.array(np.asarray(x, dtype=np.float32))


def inputs(rng, B=2, T=9, Hk=2, Hv=4, Dk=16, Dv=8, vector=False, state=True, strong=True):
    """mlx-lm-layout inputs: L2-normalised keys, q carrying Dk^-1/2 (as ``normalize_qk`` leaves them), a gate
    whose log-decays reach -20 and beyond (``strong``), a random initial state."""
    n = rng.standard_normal
    q, k = n((B, T, Hk, Dk)), n((B, T, Hk, Dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * Dk ** -0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    gate = (B, T, Hv, Dk) if vector else (B, T, Hv)
    a = 2.0 * n(gate) + (np.where(rng.uniform(size=gate) < 0.15, 12.0, 0.0) if strong else 0.0)
    x = dict(q=q, k=k, v=n((B, T, Hv, Dv)), a=a, b=n((B, T, Hv)),
             A_log=rng.uniform(-1.0, 1.5, (Hv, 1) if vector else (Hv,)),
             dt_bias=0.5 * n((Hv, Dk) if vector else (Hv,)),
             state=n((B, Hv, Dv, Dk)) if state else None)
    return {key: (None if val is None else f32(val)) for key, val in x.items()}


def random_mask(rng, B, T, kind):
    if kind is None:
        return None
    m = rng.uniform(size=(B, T)) > 0.3 if kind == "random" else np.ones((B, T), bool)
    if kind == "left":
        for i, p in enumerate(rng.integers(0, T - 1, B)):
            m[i, :p] = False
    if kind == "right":
        for i, n in enumerate(rng.integers(1, T, B)):
            m[i, n:] = False
    return mx.array(m)


def keep(mask, y):
    """y at the unmasked tokens only (the others are not defined alike by mlx-lm's paths)."""
    return np.asarray(y) if mask is None else np.asarray(y) * np.asarray(mask)[:, :, None, None]


def mlx_lm_update(*xs, **kw):
    return G.gated_delta_update(*xs, use_kernel=False, **kw)


CASES = [  # (B, T, Hk, Hv, Dk, Dv, vector, mask, lower_bound, allow_neg_eigval, state)
    (2, 9, 2, 4, 16, 8, False, None, None, False, True),
    (2, 1, 2, 4, 16, 8, False, None, None, False, True),
    (1, 1, 1, 2, 8, 12, True, None, None, False, False),
    (2, 37, 1, 2, 16, 8, False, "random", None, False, True),
    (2, 37, 2, 4, 8, 12, True, "random", None, False, True),
    (2, 23, 2, 2, 16, 8, True, "left", -5.0, False, True),
    (2, 23, 1, 2, 16, 8, False, "right", -3.0, True, False),
    (1, 70, 2, 4, 16, 16, False, None, None, True, True),
]


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv,vector,mask,lb,neg,state", CASES)
def test_matches_mlx_lm_ops_forward_and_gradients(rng, B, T, Hk, Hv, Dk, Dv, vector, mask, lb, neg, state):
    x = inputs(rng, B, T, Hk, Hv, Dk, Dv, vector, state)
    m = random_mask(rng, B, T, mask)
    kw = dict(lower_bound=lb, allow_neg_eigval=neg)
    xs = [x[n] for n in ARGS]
    y, s = R.gated_delta_update(*xs, m, **kw)
    y0, s0 = mlx_lm_update(*xs, m, **kw)
    assert y.dtype == y0.dtype and s.dtype == s0.dtype and s.shape == s0.shape
    assert rel_err(keep(m, y), keep(m, y0)) < 2e-6
    assert rel_err(s, s0) < 2e-6

    dy = f32(keep(m, rng.standard_normal(y.shape)))
    ds = f32(rng.standard_normal(s.shape))
    names = [n for n in ARGS if x[n] is not None]

    def loss(fn):
        def f(*arrays):
            args = dict(x, **dict(zip(names, arrays)))
            yy, ss = fn(*[args[n] for n in ARGS], m, **kw)
            return (yy * dy).sum() + (ss * ds).sum()
        return f

    argnums = tuple(range(len(names)))
    g = mx.grad(loss(R.gated_delta_update), argnums=argnums)(*[x[n] for n in names])
    g0 = mx.grad(loss(mlx_lm_update), argnums=argnums)(*[x[n] for n in names])
    for n, gi, g0i in zip(names, g, g0):
        assert gi.shape == x[n].shape
        assert rel_err(gi, g0i) < 2e-5, n


def test_decay_of_exactly_zero(rng):
    """Where exp(A_log)·softplus(a + dt_bias) overflows float32's exp, mlx-lm's decay is exactly 0 (legal: the
    state restarts); the log-decay is taken from the parameters, never as log(0)."""
    x = inputs(rng, T=21, strong=False)
    x["A_log"] = f32([6.0, 0.0, 5.0, -2.0])
    x["a"] = x["a"] + f32(np.where(rng.uniform(size=x["a"].shape) < 0.3, 40.0, 0.0))
    g = G.compute_g(x["A_log"], x["a"], x["dt_bias"])
    assert int((g == 0).sum()) > 5
    y, s = R.gated_delta_update(*[x[n] for n in ARGS])
    y0, s0 = mlx_lm_update(*[x[n] for n in ARGS])
    assert rel_err(y, y0) < 2e-6 and rel_err(s, s0) < 2e-6
    grads = mx.grad(lambda A, dt: R.gated_delta_update(x["q"], x["k"], x["v"], x["a"], x["b"], A, dt,
                                                       x["state"])[0].sum(), argnums=(0, 1))(x["A_log"], x["dt_bias"])
    grads0 = mx.grad(lambda A, dt: mlx_lm_update(x["q"], x["k"], x["v"], x["a"], x["b"], A, dt,
                                                 x["state"])[0].sum(), argnums=(0, 1))(x["A_log"], x["dt_bias"])
    for gi, g0i in zip(grads, grads0):
        assert np.all(np.isfinite(np.asarray(gi))) and rel_err(gi, g0i) < 2e-5


def sum_to(x, shape):
    """x summed over the axes a broadcast to x's shape from ``shape`` added or stretched."""
    x = x.sum(tuple(range(x.ndim - len(shape))))
    return x.sum(tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)


def _softplus(x):
    return np.logaddexp(x, 0.0)


def _sigmoid(x):
    return 0.5 * (1 + np.tanh(0.5 * x))


@pytest.mark.parametrize("vector,T", [(False, 1), (False, 31), (True, 1), (True, 31)])
def test_matches_float64_reference(rng, vector, T):
    """Against recgen's float64 interpreter of gated_delta_net / kda, with mlx-lm's gate maps applied in
    float64 and their derivatives chained by hand: forward, state and every gradient, masks included."""
    B, Hk, Hv, Dk, Dv = 2, 2, 4, 16, 8
    x = inputs(rng, B, T, Hk, Hv, Dk, Dv, vector)
    m = random_mask(rng, B, T, "random" if T > 1 else None)
    d = {n: np.asarray(x[n], np.float64) for n in ARGS}
    keepm = np.ones((B, T)) if m is None else np.asarray(m, np.float64)
    z = d["a"] + d["dt_bias"]
    rate = np.exp(d["A_log"])
    lg = -rate * _softplus(z)
    beta = _sigmoid(d["b"])
    km = keepm[..., None, None] if vector else keepm[..., None]
    rec = specs.kda if vector else specs.gated_delta_net
    ins = dict(q=d["q"], k=d["k"], v=d["v"], g=lg * km, beta=beta * keepm[..., None])
    h0 = d["state"].swapaxes(-1, -2)
    y_r, s_r = reference.run(rec, initial_state=h0, scale=1.0, **ins)
    y, s = R.gated_delta_update(*[x[n] for n in ARGS], m)
    assert rel_err(keep(m, y), keep(m, y_r)) < 1e-5 and rel_err(s, s_r.swapaxes(-1, -2)) < 1e-5

    dy, ds = keep(m, rng.standard_normal(y.shape)), rng.standard_normal(s.shape)
    gr = reference.grad(rec, do=dy, dht=ds.swapaxes(-1, -2), initial_state=h0, scale=1.0, **ins)
    dlg = gr["g"] * km
    dz = dlg * (-rate) * _sigmoid(z)
    want = dict(q=gr["q"], k=gr["k"], v=gr["v"], a=dz, b=gr["beta"] * keepm[..., None] * beta * (1 - beta),
                A_log=sum_to(dlg * lg, d["A_log"].shape), dt_bias=sum_to(dz, d["dt_bias"].shape),
                state=gr["initial_state"].swapaxes(-1, -2))
    # A_log's and dt_bias's gradients sum per-token terms of both signs: the float32 error of the terms
    # (bounded like every other gradient's) is measured against the sum of their magnitudes
    size = dict(A_log=sum_to(np.abs(dlg * lg), d["A_log"].shape), dt_bias=sum_to(np.abs(dz), d["dt_bias"].shape))

    def loss(*arrays):
        yy, ss = R.gated_delta_update(*arrays, m)
        return (yy * f32(dy)).sum() + (ss * f32(ds)).sum()

    got = mx.grad(loss, argnums=tuple(range(len(ARGS))))(*[x[n] for n in ARGS])
    for n, gi in zip(ARGS, got):
        err = np.linalg.norm(np.asarray(gi) - want[n]) / np.linalg.norm(size.get(n, want[n]))
        assert err < 1e-4, (n, err)


@pytest.mark.parametrize("vector", [False, True])
def test_under_mx_compile(rng, vector):
    """Forward and gradients inside ``mx.compile`` (no host sync on the path) equal the eager call."""
    x = inputs(rng, T=13, vector=vector)
    m = random_mask(rng, 2, 13, "random")
    xs = [x[n] for n in ARGS]
    fwd = mx.compile(lambda *a: R.gated_delta_update(*a, m, lower_bound=-4.0 if vector else None))
    y, s = fwd(*xs)
    y1, s1 = R.gated_delta_update(*xs, m, lower_bound=-4.0 if vector else None)
    assert rel_err(y, y1) < 1e-6 and rel_err(s, s1) < 1e-6

    def loss(*a):
        yy, ss = R.gated_delta_update(*a, m)
        return (yy * yy).sum() + ss.sum()

    grad = mx.grad(loss, argnums=tuple(range(len(ARGS))))
    for gc, ge in zip(mx.compile(grad)(*xs), grad(*xs)):
        assert rel_err(gc, ge) < 1e-6


def test_bad_input_names_the_argument(rng):
    x = inputs(rng, T=5)
    xs = [x[n] for n in ARGS]

    def call(**over):
        args = dict(zip(ARGS, xs), **over)
        return R.gated_delta_update(*[args.pop(n) for n in ARGS], **args)

    with pytest.raises(InputError, match="'k'"):
        call(k=xs[1][:, :, :1])
    with pytest.raises(InputError, match="'v'.*multiple"):
        call(v=mx.zeros((2, 5, 3, 8)))
    with pytest.raises(InputError, match="'a'"):
        call(a=mx.zeros((2, 5, 4, 3)))
    with pytest.raises(InputError, match="'dt_bias'"):
        call(dt_bias=mx.zeros((3,)))
    with pytest.raises(InputError, match="'state'.*\\[B,Hv,Dv,Dk\\]"):
        call(state=xs[-1].swapaxes(-1, -2))
    with pytest.raises(InputError, match="'mask'"):
        call(mask=mx.ones((2, 4), dtype=mx.bool_))
    with pytest.raises(InputError, match="'b'.*mx.array"):
        call(b=np.zeros((2, 5, 4)))


def test_importing_the_integration_does_not_import_mlx_lm():
    code = "import sys, recgen.integrations.mlx_lm; assert 'mlx_lm' not in sys.modules, 'imported mlx_lm'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_patch_rebinds_every_importer_and_unpatch_restores():
    models = [importlib.import_module(f"mlx_lm.models.{n}") for n in ("qwen3_5", "qwen3_next", "kimi_linear")]
    original = G.gated_delta_update
    assert not R.patched()
    p = R.patch()
    try:
        assert p.applied and dict((t.name, f) for t, f in p.originals)["gated_delta_update"] is original
        assert G.gated_delta_update is R.gated_delta_update
        bound = {r.module for r in p.rebindings}
        assert {MODULE_GD, *(m.__name__ for m in models)} <= bound
        assert all(m.gated_delta_update is R.gated_delta_update for m in models)
        again = R.patch()  # idempotent: nothing wrapped twice, and its context leaves the patch in place
        with again:
            pass
        assert not again.applied and R.patched() and G.gated_delta_update is R.gated_delta_update
        # a model module imported while patched takes recgen's function, and unpatch restores it too
        late = "mlx_lm.models.olmo_hybrid"
        saved = sys.modules.pop(late, None)
        try:
            mod = importlib.import_module(late)
            assert mod.gated_delta_update is R.gated_delta_update
        finally:
            restored = R.unpatch()
            if saved is not None:
                sys.modules[late] = saved
        assert mod.gated_delta_update is original and late in {r.module for r in restored}
    finally:
        R.unpatch()
    assert not R.patched() and G.gated_delta_update is original
    assert all(m.gated_delta_update is original for m in models)
    with R.patch() as q:
        assert q.applied and models[0].gated_delta_update is R.gated_delta_update
    assert models[0].gated_delta_update is original and R.unpatch() == ()
    with R.patch(ssm=False) as q:  # one target alone
        ssm = importlib.import_module("mlx_lm.models.ssm")
        assert models[0].gated_delta_update is R.gated_delta_update and ssm.ssm_update is not R.ssm_update
    assert models[0].gated_delta_update is original


MODULE_GD = "mlx_lm.models.gated_delta"


# -- model level ---------------------------------------------------------------------------------------

V = 97


def tiny_model(name: str, seed: int = 0):
    """A tiny random-config mlx-lm model: 2 layers (one linear-attention, one full attention), GQA 2 -> 4 in
    the gated-delta layer of the Qwen models (Kimi Linear has Hk = Hv by design)."""
    mx.random.seed(seed)
    gdn = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
               linear_conv_kernel_dim=4, full_attention_interval=2)
    if name == "qwen3_5":
        m = importlib.import_module("mlx_lm.models.qwen3_5")
        args = m.ModelArgs.from_dict(dict(model_type="qwen3_5", text_config=dict(
            model_type="qwen3_5", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=V, rms_norm_eps=1e-6, **gdn)))
    elif name == "qwen3_next":
        m = importlib.import_module("mlx_lm.models.qwen3_next")
        args = m.ModelArgs(model_type="qwen3_next", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                           shared_expert_intermediate_size=32, mlp_only_layers=[], moe_intermediate_size=32,
                           rms_norm_eps=1e-6, vocab_size=V, num_key_value_heads=2, rope_theta=10000.0,
                           partial_rotary_factor=0.25, max_position_embeddings=512, head_dim=16, **gdn)
    else:
        m = importlib.import_module("mlx_lm.models.kimi_linear")
        args = m.ModelArgs(model_type="kimi_linear", vocab_size=V, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, intermediate_size=96, head_dim=16,
                           rope_theta=10000.0, rms_norm_eps=1e-6, model_max_length=512, num_experts=0,
                           moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                           v_head_dim=16, linear_attn_config=dict(num_heads=4, head_dim=16, short_conv_kernel_size=4,
                                                                  kda_layers=[1], full_attn_layers=[2]))
    model = m.Model(args)
    mx.eval(model.parameters())
    return model


MODELS = ["qwen3_5", "qwen3_next", "kimi_linear"]


def both(fn):
    """fn() unpatched, then patched (the patch undone afterwards); checks that recgen's ops ran in the
    patched call only, so that agreement is not that of mlx-lm with itself."""
    from recgen import ops

    calls = []

    def evaluated():
        real = {n: getattr(ops, n) for n in ("gated_delta_net", "kda")}
        for n, op in real.items():
            setattr(ops, n, lambda *a, _op=op, _n=n, **kw: (calls.append(_n), _op(*a, **kw))[1])
        try:
            out = fn()
            mx.eval([x for _, x in tree_flatten(out) if isinstance(x, mx.array)])
        finally:
            for n, op in real.items():
                setattr(ops, n, op)
        return out

    ref = evaluated()
    assert not calls
    with R.patch():
        got = evaluated()
    assert calls
    return ref, got


@pytest.mark.parametrize("name", MODELS)
def test_model_logits_and_lora_gradients(name, rng):
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = tiny_model(name)
    tokens = mx.array(rng.integers(0, V, (2, 41)))
    ref, got = both(lambda: model(tokens))
    assert rel_err(got, ref) < 1e-5

    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 2.0, "dropout": 0.0})
    # LoRA's B starts at zero, which would make every A gradient zero: give B values
    lora_b = [(k, f32(0.05 * rng.standard_normal(p.shape))) for k, p in tree_flatten(model.parameters())
              if k.endswith("lora_b")]
    assert lora_b
    model.load_weights(lora_b, strict=False)
    model.unfreeze(keys=["A_log", "dt_bias"], strict=False)  # the recurrence's own parameters train too
    model.train()

    def loss(mdl, x):
        logits = mdl(x[:, :-1])
        return nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")

    step = nn.value_and_grad(model, loss)
    (l0, g0), (l1, g1) = both(lambda: step(model, tokens))
    assert abs(float(l1) - float(l0)) < 1e-5 * abs(float(l0))
    flat0, flat1 = dict(tree_flatten(g0)), dict(tree_flatten(g1))
    assert flat0.keys() == flat1.keys()
    assert any(k.endswith("A_log") for k in flat0) and any(k.endswith("lora_a") for k in flat0)
    for k in flat0:
        assert float(mx.abs(flat0[k]).max()) > 0, k
        # A_log's and dt_bias's gradients are sums over every token of terms of both signs (cancellation)
        tol = 5e-4 if k.endswith(("A_log", "dt_bias")) else 1e-4
        assert rel_err(flat1[k], flat0[k]) < tol, k


def _caches(model, B, left=None, lengths=None):
    from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

    out = []
    for c in model.make_cache():
        if isinstance(c, ArraysCache):
            c = ArraysCache(len(c.cache), left_padding=left)
            if lengths is not None:
                c.prepare(lengths=lengths)
        elif left is not None:
            assert isinstance(c, KVCache)
            c = BatchKVCache(left)
        out.append(c)
    return out


def _ssm_states(caches):
    from mlx_lm.models.cache import ArraysCache

    return [s for c in caches if isinstance(c, ArraysCache) for s in c.cache if s is not None]


@pytest.mark.parametrize("name", MODELS)
def test_model_left_padded_prefill_and_decode(name, rng):
    """A left-padded batch (mlx-lm's batched generation layout) through the caches: prefill logits at the
    real tokens, the cached recurrent states, then greedy decode steps."""
    model = tiny_model(name, seed=1)
    B, T, steps = 3, 19, 4
    left = [0, 5, 11]
    tokens = mx.array(rng.integers(0, V, (B, T)))
    real = mx.array(np.arange(T)[None, :] >= np.array(left)[:, None])

    def run():
        caches = _caches(model, B, left=left)
        logits = [model(tokens, cache=caches)]
        nxt = mx.argmax(logits[-1][:, -1], axis=-1)
        ids = []
        for _ in range(steps):
            ids.append(nxt)
            logits.append(model(nxt[:, None], cache=caches))
            nxt = mx.argmax(logits[-1][:, -1], axis=-1)
        return logits, mx.stack(ids, axis=1), _ssm_states(caches)

    (l0, ids0, st0), (l1, ids1, st1) = both(run)
    assert rel_err(keep(real, l1[0][..., None]), keep(real, l0[0][..., None])) < 1e-5
    assert np.array_equal(np.asarray(ids0), np.asarray(ids1))
    for a, b in zip(l1[1:], l0[1:]):
        assert rel_err(a, b) < 1e-5
    assert len(st0) == len(st1) > 0
    for a, b in zip(st1, st0):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_model_right_padded_prefill(name, rng):
    """A right-padded batch (the cache's ``lengths``): logits at the real tokens and the cached state, which
    is the state after each row's last real token."""
    model = tiny_model(name, seed=2)
    B, T = 3, 23
    lengths = [23, 9, 16]
    tokens = mx.array(rng.integers(0, V, (B, T)))
    real = mx.array(np.arange(T)[None, :] < np.array(lengths)[:, None])

    def run():
        caches = _caches(model, B, lengths=lengths)
        return model(tokens, cache=caches), _ssm_states(caches)

    (l0, st0), (l1, st1) = both(run)
    assert rel_err(keep(real, l1[..., None]), keep(real, l0[..., None])) < 1e-5
    assert len(st0) == len(st1) > 0
    for a, b in zip(st1, st0):
        assert rel_err(a, b) < 1e-5
    # the state of row 1 is that of its real prefix alone
    caches = _caches(model, 1)
    with R.patch():
        model(tokens[1:2, :lengths[1]], cache=caches)
        alone = _ssm_states(caches)
    for a, b in zip(st1, alone):
        assert rel_err(a[1:2], b) < 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_generate_with_cache(name):
    """mlx-lm's own generation loop (``generate_step``: prefill in steps, then decode): token ids and
    log-probabilities agree patched and unpatched."""
    from mlx_lm.generate import generate_step

    model = tiny_model(name, seed=3)
    prompt = mx.array(np.random.default_rng(7).integers(0, V, 29))

    def run():
        out = list(generate_step(prompt, model, max_tokens=6, prefill_step_size=16))
        return [int(t) for t, _ in out], mx.stack([lp for _, lp in out])

    (ids0, lp0), (ids1, lp1) = both(run)
    assert ids0 == ids1 and len(ids0) == 6
    assert rel_err(lp1, lp0) < 1e-5
