"""Ops are lazy: every built-in, a user spec and both adapters run under ``mx.compile`` (forward and
``mx.grad``) and ``mx.vmap`` on the CPU and match the uncompiled op. A host synchronization anywhere on an
op's path (``.item()``, ``np.array`` of an MLX array, ``bool`` of one) fails here with MLX's "Attempting to
eval an array during function transformations"."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from helpers import random_inputs, random_state, rel_err, state_parts

from recgen import adapters, specs
from recgen.ops import load

SPECS = dict(specs.BUILTINS)
SIZES = dict(B=2, T=9, H=4, Hk=2, K=4, V=3)


def _case(rec, rng):
    xs = [mx.array(a.astype(np.float32)) for a in random_inputs(rec, rng, **SIZES).values()]
    st = tuple(mx.array(a.astype(np.float32))
               for a in state_parts(random_state(rec, rng, B=2, H=4, K=4, V=3)))
    return xs, st if rec.has_normalizer else st[0]


def _close(a, b, tol=1e-5):
    for x, y in zip(state_parts(a), state_parts(b)):
        assert rel_err(np.array(x), np.array(y)) <= tol


@pytest.mark.parametrize("name", sorted(SPECS))
def test_op_compiles_forward_and_grad(name, rng):
    _compiles(SPECS[name], "mlx", rng)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(set(SPECS) - {"power_retention"}))  # no kernels for feature maps
def test_kernel_op_compiles_forward_and_grad(name, rng):
    """The generated kernels of this machine's GPU (skipped without one: not run on the CPU-only CI)."""
    from recgen.tuning import machine_dialect

    if machine_dialect() is None:
        pytest.skip("no GPU backend in MLX here")
    _compiles(SPECS[name], machine_dialect(), rng)


def _compiles(rec, backend, rng):
    op = load(rec, backend=backend)
    xs, h0 = _case(rec, rng)
    n = len(xs)
    dos = mx.array(rng.standard_normal((2, 9, 4, 3)).astype(np.float32))
    dst = tuple(mx.array(rng.standard_normal(s.shape).astype(np.float32)) for s in state_parts(h0))

    def fwd(*a):
        o, st = op(*a[:n], initial_state=tuple(a[n:]) if rec.has_normalizer else a[n], output_final_state=True)
        return (o, *state_parts(st))

    def loss(*a):
        o, *st = fwd(*a)
        return (o * dos).sum() + sum((s * d).sum() for s, d in zip(st, dst))

    args = [*xs, *state_parts(h0)]
    _close(mx.compile(fwd)(*args), fwd(*args))
    argnums = tuple(range(len(args)))
    _close(mx.compile(mx.grad(loss, argnums=argnums))(*args), mx.grad(loss, argnums=argnums)(*args), 1e-4)


def test_op_vmaps_over_a_leading_axis(rng):
    """vmap over an extra leading axis (two independent batches) equals two calls."""
    rec = specs.gla
    xs, _ = _case(rec, rng)
    stacked = [mx.stack([x, x * 0.5]) for x in xs]
    out = mx.vmap(lambda *a: load(rec, backend="mlx")(*a)[0])(*stacked)
    for i in range(2):
        _close(out[i], load(rec, backend="mlx")(*[s[i] for s in stacked])[0])


def test_adapters_compile(rng):
    Bt, D, L, N, G = 2, 6, 7, 3, 2
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    u, dt, Bm, Cm, Dv = f(Bt, D, L), f(Bt, D, L), f(Bt, G, N, L), f(Bt, G, N, L), f(D)
    A = -mx.exp(f(D, N))
    bias = f(D)

    def scan(u, dt, A, Bm, Cm, Dv, bias):
        out, last = adapters.selective_scan_fn(u, dt, A, Bm, Cm, Dv, delta_bias=bias, delta_softplus=True,
                                               return_last_state=True, backend="mlx")
        return out, last

    args = (u, dt, A, Bm, Cm, Dv, bias)
    _close(mx.compile(scan)(*args), scan(*args))
    g = lambda *a: mx.grad(lambda *b: sum(x.sum() for x in scan(*b)), argnums=(0, 1, 2))(*a)  # noqa: E731
    _close(mx.compile(g)(*args), g(*args), 1e-4)

    B, T, H, K, V = 2, 5, 2, 4, 3
    q, k, v = f(B, T, H, K), f(B, T, H, K), f(B, T, H, V)
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    gl, beta, state = mx.sigmoid(f(B, T, H)), mx.sigmoid(f(B, T, H)), f(B, H, V, K)

    def upd(*a):
        return adapters.mlxlm_gated_delta_update(*a, backend="mlx")

    args = (q, k, v, gl, beta, state)
    _close(mx.compile(upd)(*args), upd(*args))
    g = lambda *a: mx.grad(lambda *b: sum(x.sum() for x in upd(*b)), argnums=(0, 3, 5))(*a)  # noqa: E731
    _close(mx.compile(g)(*args), g(*args), 1e-4)
