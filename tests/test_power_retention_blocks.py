"""Power retention as simple_gla heads over blocks of its expanded keys (``ops.PowerRetention.key_blocks``, the
GPU-kernel path), checked on this machine with the blocks' op on the ``mlx`` backend: forward, final state and
every gradient (initial state included, cotangents on o and on both states) against the float64 reference, at
d = 32 (K' = 528 rows: over the kernels' budget, so three blocks of 176) and d = 4 (one block), with GQA."""
import mlx.core as mx
import numpy as np
import pytest

from recgen import ops, specs, tuning
from recgen.math import reference
from recgen.spec.features import sympow
from recgen.spec.layouts import Sizes
from recgen.testing import kernel_inputs, rel_err


@pytest.mark.parametrize("sizes,blocks", [(Sizes(B=2, T=5, H=2, Hk=1, Kin=32, K=528, V=3), 3),
                                          (Sizes(B=1, T=1, H=2, Hk=2, Kin=4, K=10, V=5), 1)])
def test_key_blocks_match_the_reference(sizes, blocks):
    rec = specs.power_retention
    assert ops.key_block(sizes.K, sizes, tuning.resolve("gpu", "cuda", environ={})) == sizes.K // blocks
    xs, h0, do, dht, scale = kernel_inputs(rec, sizes, np.random.default_rng(sizes.Kin))
    # a reachable initial state (S, z) = (Σ φ(w) vᵀ, Σ φ(w)), as the op checks do: φ(q)ᵀz stays a sum of squares
    rng = np.random.default_rng(1)
    phi = sympow(rng.standard_normal((sizes.B, sizes.H, 3, sizes.Kin)))
    h0 = (phi.swapaxes(-1, -2) @ rng.standard_normal((sizes.B, sizes.H, 3, sizes.V)), phi.sum(2))
    h0 = tuple(np.float32(x).astype(np.float64) for x in h0)
    names = list(xs)
    op = ops.power_retention

    def f(*a):
        arrays = dict(zip(names, a[:4]))
        o, (S, z) = op.key_blocks(arrays, sizes, (a[4], a[5]), True, scale, "mlx", None)
        return o, S, z

    primals = [mx.array(xs[n], mx.float32) for n in names] + [mx.array(h, mx.float32) for h in h0]
    cots = [mx.array(do, mx.float32), mx.array(dht[0], mx.float32), mx.array(dht[1], mx.float32)]
    (o, S, z), grads = mx.vjp(f, primals, cots)
    o_r, (S_r, z_r) = reference.run(rec, initial_state=h0, scale=scale, **xs)
    g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    for got, want in ((o, o_r), (S, S_r), (z, z_r)):
        assert rel_err(np.array(got), want) <= 1e-5
    for name, g in zip(names, grads[:4]):
        assert rel_err(np.array(g), g_r[name]) <= 1e-4, (name, rel_err(np.array(g), g_r[name]))
    for g, g_ref in zip(grads[4:], g_r["initial_state"]):
        assert rel_err(np.array(g), g_ref) <= 1e-4


def test_the_mlx_backend_keeps_the_spec_chunked_form():
    """On this machine (no GPU kernels) the op is the spec's own chunked form."""
    xs, _, _, _, scale = kernel_inputs(specs.power_retention, Sizes(B=1, T=4, H=2, Hk=2, Kin=4, K=10, V=3),
                                       np.random.default_rng(0))
    arrays = {n: mx.array(x, mx.float32) for n, x in xs.items()}
    o = ops.power_retention(**arrays)[0]
    o_r, _ = reference.run(specs.power_retention, scale=scale, **xs)
    assert rel_err(np.array(o), o_r) <= 1e-5
