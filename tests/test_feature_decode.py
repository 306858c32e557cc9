"""The feature decode kernel (one step of a feature map's state, split over its packed rows: issue 19's decode) on
the emulated Metal kernel against float64 numpy, plain and under the sanitizers; and power retention's decode
step through it end to end (``Tuning.feature_decode``), forward, state and gradients against the float64 reference."""
import mlx.core as mx
import numpy as np
import pytest

from recgen import chunked, specs, tuning
from recgen.codegen import chunk_sources as cs
from recgen.math import reference
from recgen.runtime import chunk_kernels as ck
from recgen.spec.features import sympow
from recgen.spec.layouts import Sizes
from recgen.testing import kernel_inputs, reachable_state, rel_err

verify = pytest.importorskip("recgen.verify.kernels")
from recgen.verify.typecheck import clang_problem  # noqa: E402

pytestmark = pytest.mark.skipif(clang_problem() is not None, reason=clang_problem() or "")


@pytest.mark.parametrize("BH,D,V,has_z,sanitizer", [(3, 8, 5, True, None),      # one block of 36 rows
                                                    (2, 12, 40, False, None),    # 78 rows: a full block and a part
                                                    (2, 16, 33, True, "address"),  # 136 rows, V past a SIMD group
                                                    (2, 12, 3, True, "thread")])
def test_feature_decode_kernel_matches_numpy(BH, D, V, has_z, sanitizer, rng):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    F = D * (D + 1) // 2
    q, k, w, S, z = f(BH, D), f(BH, D), f(BH, V), f(BH, F, V), f(BH, F)
    dec = np.exp(-rng.uniform(0, 3, BH)).astype(np.float32)
    launch = ck.feature_decode_launch("metal", BH, D, V, has_z)
    ins = {"q": q, "k": k, "w": w, "decay": dec, "S": S} | ({"z": z} if has_z else {})
    outs = verify.run_launch(launch, ins, sanitizer=sanitizer)
    pq, pk = sympow(q.astype(np.float64)), sympow(k.astype(np.float64))
    S1 = dec[:, None, None] * S + pk[:, :, None] * w[:, None, :]
    assert rel_err(outs[0], S1) <= 1e-6
    assert outs[-1].shape == (BH, -(-F // 64), V + has_z)
    assert rel_err(outs[-1].sum(1)[:, :V], np.einsum("bf,bfv->bv", pq, S1)) <= 1e-5
    if has_z:
        z1 = dec[:, None] * z + pk
        assert rel_err(outs[1], z1) <= 1e-6
        assert rel_err(outs[-1].sum(1)[:, V], (pq * z1).sum(-1)) <= 1e-5


def test_feature_decode_layouts():
    assert cs.feature_decode_layout("cuda", 64, 64, True) == {"D": 64, "F": 2080, "V": 64, "V1": 65, "NT": 128,
                                                              "CL": 32, "RL": 4, "VJ": 2, "RB": 64, "NB": 33}
    assert cs.feature_decode_supported("metal", 128, 128) and not cs.feature_decode_supported("metal", 1024, 2048)


def _emulated_call(launch, dialect, user, extra, debug=False, kernel_cache=""):
    names = [n for n in launch.source.inputs if n not in {r[0] for r in launch.runtime}]
    ins = {n: np.array(a.astype(mx.float32)) for n, a in zip(names, list(user) + list(extra))}
    return [mx.array(o) for o in verify.run_launch(launch, ins)]


@pytest.mark.parametrize("sizes", [Sizes(B=2, T=1, H=4, Hk=2, Kin=12, K=78, V=5),
                                   Sizes(B=1, T=1, H=2, Hk=1, Kin=8, K=36, V=33)])
def test_power_retention_decode_on_the_kernel_matches_the_reference(sizes, monkeypatch):
    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    rec = specs.power_retention
    rng = np.random.default_rng(sizes.Kin)
    xs, _, do, dht, scale = kernel_inputs(rec, sizes, rng)
    h0 = reachable_state(sizes, rng)
    names = list(xs)
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, feature_decode=True)

    def f(*a):
        o, (S, z) = chunked.forward(rec, dict(zip(names, a[:4])), scale=scale, initial_state=(a[4], a[5]), tuning=t)
        return o, S, z

    primals = [mx.array(x, mx.float32) for x in list(xs.values()) + list(h0)]
    got, grads = mx.vjp(f, primals, [mx.array(x, mx.float32) for x in (do, *dht)])
    assert calls and all(c.startswith("recgen_chunk_feature_decode_z") for c in calls)
    o_r, (S_r, z_r) = reference.run(rec, initial_state=h0, scale=scale, **xs)
    g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    for a, b in zip(got, (o_r, S_r, z_r)):
        assert rel_err(np.array(a), b) <= 1e-5
    for n, g, r in zip(names + ["S0", "z0"], grads, [g_r[n] for n in names] + list(g_r["initial_state"])):
        assert rel_err(np.array(g), r) <= 1e-4, n


def test_the_op_routes_decode_to_the_kernel(monkeypatch):
    """``ops.power_retention`` at T = 1 with ``Tuning.feature_decode`` runs the kernel (after its self-test), not the
    key-block composition; without it, not. With a GPU backend asked for by name too (a feature map has no
    recurrent kernel: passing the name on once raised UnsupportedKernel on CUDA)."""
    from recgen import ops
    from recgen.runtime import probe as pr

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    sizes = Sizes(B=1, T=1, H=2, Hk=1, Kin=8, K=36, V=4)
    xs, _, _, _, scale = kernel_inputs(specs.power_retention, sizes, np.random.default_rng(3))
    arrays = {n: mx.array(x, mx.float32) for n, x in xs.items()}
    o_r, _ = reference.run(specs.power_retention, scale=scale, **xs)
    for on in (False, True):
        calls.clear()
        pr.checked.cache_clear()
        t = tuning.resolve("cpu", environ={}, dialect="metal", feature_decode=on)
        monkeypatch.setattr(ops, "current", lambda: t)
        o = ops.power_retention(**arrays)[0]
        assert rel_err(np.array(o), o_r) <= 1e-5
        assert any(c.startswith("recgen_chunk_feature_decode_z") for c in calls) == on
    calls.clear()
    monkeypatch.setattr(ops, "check_backend", lambda *a: None)  # "metal" counts as available on this machine
    o = ops.PowerRetention(backend="metal")(**arrays)[0]
    assert rel_err(np.array(o), o_r) <= 1e-5
    assert any(c.startswith("recgen_chunk_feature_decode_z") for c in calls)
    pr.checked.cache_clear()
