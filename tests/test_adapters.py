"""The convention adapters against the independent handwritten references (mamba layout; mlx-lm's)."""
import mlx.core as mx
import numpy as np
import pytest

from recgen.adapters import mlxlm_gated_delta_update, selective_scan_fn
from recgen.errors import InputError
from recgen.testing import rel_err
from references.gated_delta_net import gated_delta_net as gdn_ref
from references.selective_scan import selective_scan as ss_ref
from references.selective_scan import selective_scan_bwd as ss_bwd


@pytest.mark.parametrize("softplus,bias,skip,groups", [(True, True, True, 1), (False, True, False, 2),
                                                        (False, False, True, 1), (True, False, False, 2)])
def test_selective_scan_fn_matches_mamba_reference(softplus, bias, skip, groups):
    rng = np.random.default_rng(5)
    Bt, Dch, N, L = 2, 6, 5, 9
    u = rng.standard_normal((Bt, Dch, L))
    delta = rng.uniform(0.05, 1.0, (Bt, Dch, L)) if not softplus else rng.standard_normal((Bt, Dch, L))
    A = -rng.uniform(0.5, 8.0, (Dch, N))
    Bm = rng.standard_normal((Bt, groups, N, L)) if groups > 1 else rng.standard_normal((Bt, N, L))
    Cm = rng.standard_normal(Bm.shape)
    D = rng.standard_normal(Dch) if skip else None
    db = rng.uniform(0, 0.5, Dch) if bias else None
    h0 = rng.standard_normal((Bt, Dch, N))
    f32 = lambda a: None if a is None else mx.array(np.asarray(a, np.float32))  # noqa: E731
    out, last = selective_scan_fn(f32(u), f32(delta), f32(A), f32(Bm), f32(Cm), D=f32(D), delta_bias=f32(db),
                                  delta_softplus=softplus, return_last_state=True, initial_state=f32(h0),
                                  backend="mlx")
    if groups == 1:
        o_r, s_r = ss_ref(u, delta, A, Bm, Cm, D=D, delta_bias=db, delta_softplus=softplus, initial_state=h0)
        assert rel_err(out, o_r) < 1e-5 and rel_err(last, s_r) < 1e-5
        dout = rng.standard_normal(o_r.shape)
        g = mx.grad(lambda uu, dd: (selective_scan_fn(uu, dd, f32(A), f32(Bm), f32(Cm), D=f32(D), delta_bias=f32(db),
                                                      delta_softplus=softplus, initial_state=f32(h0), backend="mlx")
                                    * f32(dout)).sum(), argnums=(0, 1))(f32(u), f32(delta))
        g_r = ss_bwd(u, delta, A, Bm, Cm, dout, None, D=D, delta_bias=db, delta_softplus=softplus, initial_state=h0)
        assert rel_err(g[0], g_r["u"]) < 1e-4 and rel_err(g[1], g_r["delta"]) < 1e-4
    else:  # groups: each group of D/G channels is an independent single-group scan
        V = Dch // groups
        for gi in range(groups):
            sl = slice(gi * V, (gi + 1) * V)
            o_r, s_r = ss_ref(u[:, sl], delta[:, sl], A[sl], Bm[:, gi], Cm[:, gi], D=None if D is None else D[sl],
                              delta_bias=None if db is None else db[sl], delta_softplus=softplus,
                              initial_state=h0[:, sl])
            assert rel_err(np.array(out)[:, sl], o_r) < 1e-5 and rel_err(np.array(last)[:, sl], s_r) < 1e-5


def test_selective_scan_fn_rejects_z_and_bad_shapes():
    x = mx.zeros((1, 4, 3))
    with pytest.raises(InputError, match="'z'"):
        selective_scan_fn(x, x, mx.zeros((4, 2)), mx.zeros((1, 2, 3)), mx.zeros((1, 2, 3)), z=x)
    with pytest.raises(InputError, match="'A'"):
        selective_scan_fn(x, x, mx.zeros((3, 2)), mx.zeros((1, 2, 3)), mx.zeros((1, 2, 3)))


def test_mlxlm_convention_matches_reference():
    rng = np.random.default_rng(9)
    B, T, H, Hk, K, V = 1, 7, 4, 2, 8, 6
    q, k = rng.standard_normal((B, T, Hk, K)), rng.standard_normal((B, T, Hk, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, g = rng.standard_normal((B, T, H, V)), rng.uniform(0.3, 1.0, (B, T, H))
    beta, h0 = rng.uniform(0, 1, (B, T, H)), rng.standard_normal((B, H, K, V))
    f32 = lambda a: mx.array(a.astype(np.float32))  # noqa: E731
    o, st = mlxlm_gated_delta_update(f32(q), f32(k), f32(v), f32(g), f32(beta), f32(h0.swapaxes(-1, -2)),
                                     backend="mlx")
    o_r, s_r = gdn_ref(q, k, v, np.log(g), beta, scale=1.0, initial_state=h0)
    assert rel_err(o, o_r) < 1e-5 and rel_err(np.array(st).swapaxes(-1, -2), s_r) < 1e-5


def test_adapters_name_non_array_arguments():
    a = mx.zeros((1, 4, 3))
    with pytest.raises(InputError, match="argument 'A'.*mx.array.*ndarray"):
        selective_scan_fn(a, a, np.zeros((4, 2)), a, a)
    with pytest.raises(InputError, match="argument 'u'.*mx.array.*list"):
        selective_scan_fn([[0.0]], a, a, a, a)
    q = mx.zeros((1, 2, 2, 4))
    with pytest.raises(InputError, match="argument 'state'.*float32.*int32"):
        mlxlm_gated_delta_update(q, q, q, mx.ones((1, 2, 2)), mx.ones((1, 2, 2)),
                                 state=mx.zeros((1, 2, 4, 4), dtype=mx.int32))
