"""Power retention as simple_gla heads over blocks of its expanded keys (``ops.PowerRetention.key_blocks``, the
GPU-kernel path), checked on this machine with the blocks' op on the ``mlx`` backend: forward, final state and
every gradient (initial state included, cotangents on o and on both states) against the float64 reference, at
d = 32 (K' = 528 rows: over the kernels' budget, so three blocks of 176) and d = 4 (one block), with GQA."""
import mlx.core as mx
import numpy as np
import pytest

from recgen import ops, specs, tuning
from recgen.key_blocks import key_blocks
from recgen.math import reference
from recgen.spec.layouts import Sizes
from recgen.testing import kernel_inputs, reachable_state, rel_err
from recgen.verify.typecheck import clang_problem


@pytest.mark.parametrize("sizes,blocks", [(Sizes(B=2, T=5, H=2, Hk=1, Kin=32, K=528, V=3), 3),
                                          (Sizes(B=1, T=1, H=2, Hk=2, Kin=4, K=10, V=5), 1)])
def test_key_blocks_match_the_reference(sizes, blocks):
    rec = specs.power_retention
    assert key_blocks(sizes).count == blocks
    xs, h0, do, dht, scale = kernel_inputs(rec, sizes, np.random.default_rng(sizes.Kin))
    h0 = reachable_state(sizes, np.random.default_rng(1))
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
    eager = f(*primals)  # outside a transformation, where decode (T = 1) runs the composition's compiled ends
    for got, want in zip((o, S, z) + eager, (o_r, S_r, z_r) * 2):
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


def test_a_named_gpu_backend_runs_the_chunked_form_beyond_the_key_blocks(monkeypatch):
    """From ``Tuning.key_blocks_max_t`` on, ``PowerRetention(backend=<a GPU's>)`` runs the spec's chunked form (with
    that device's chunk kernels where the tuning has them): passing the backend's name on looked for a recurrent
    kernel a feature map does not have and raised UnsupportedKernel. Here "metal" is made to count as available and
    the composition stops at T = 2, so T = 6 takes the chunked form on this CPU."""
    sizes = Sizes(B=1, T=6, H=2, Hk=1, Kin=8, K=36, V=4)
    xs, _, _, _, scale = kernel_inputs(specs.power_retention, sizes, np.random.default_rng(3))
    arrays = {n: mx.array(x, mx.float32) for n, x in xs.items()}
    t = tuning.resolve("cpu", environ={}, dialect="metal", key_blocks_max_t=2)
    monkeypatch.setattr(ops, "check_backend", lambda *a: None)
    monkeypatch.setattr(ops, "current", lambda: t)
    o = ops.PowerRetention(backend="metal")(**arrays)[0]
    o_r, _ = reference.run(specs.power_retention, scale=scale, **xs)
    assert rel_err(np.array(o), o_r) <= 1e-5


@pytest.mark.skipif(clang_problem() is not None, reason=clang_problem() or "")
@pytest.mark.parametrize("sizes,block,sanitizer", [(Sizes(B=2, T=5, H=4, Hk=2, Kin=4, K=10, V=5), 5, None),
                                                   (Sizes(B=1, T=1, H=2, Hk=1, Kin=4, K=10, V=3), None, None),
                                                   (Sizes(B=1, T=3, H=2, Hk=2, Kin=4, K=10, V=4), 2, "address")])
def test_key_blocks_on_the_emulated_metal_kernels(sizes, block, sanitizer):
    """The composition on the Metal kernels as the CPU emulator runs them (``recgen check power_retention``),
    over several blocks (``block`` forced narrow) and one, GQA, T = 1, under ASan/UBSan: against the reference."""
    from recgen.key_blocks import KeyBlocks
    from recgen.verify.key_blocks import emulate_key_blocks

    rec = specs.power_retention
    xs, _, do, dht, scale = kernel_inputs(rec, sizes, np.random.default_rng(sizes.T))
    h0 = reachable_state(sizes, np.random.default_rng(2))
    kb = KeyBlocks(sizes.K, block) if block else None
    o, (S, z), g = emulate_key_blocks(xs, initial_state=h0, do=do, dht=dht, scale=scale, kb=kb, sanitizer=sanitizer)
    o_r, (S_r, z_r) = reference.run(rec, initial_state=h0, scale=scale, **xs)
    g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    errs = {"o": rel_err(o, o_r), "S": rel_err(S, S_r), "z": rel_err(z, z_r)}
    errs |= {f"d{n}": rel_err(g[n], g_r[n]) for n in ("q", "k", "v", "g")}
    errs |= {f"dinitial_{p}": rel_err(a, b) for p, a, b in zip("Sz", g["initial_state"], g_r["initial_state"])}
    bad = {n: e for n, e in errs.items() if e > (1e-5 if n in ("o", "S", "z") else 1e-4)}
    assert not bad, errs
