"""Every argument of an op is validated like the inputs, before any compute and without a host sync, with
an error naming it: initial_state (type, dtype, shape; NaN only in debug mode), non-array inputs, scale,
default_scale at declaration, empty batches, a head-first layout warning like FLA's, missing GPU backends."""
import warnings

import mlx.core as mx
import numpy as np
import pytest

import recgen as rg
from recgen import ops, specs
from recgen.math import reference
from recgen.spec.layouts import InputError

B, T, H, HK, K, V = 1, 5, 2, 1, 4, 3


def _gla(rng, B=B, T=T, H=H):
    a = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    return a(B, T, HK, K), a(B, T, HK, K), a(B, T, H, V), -mx.abs(a(B, T, H, K))


@pytest.mark.parametrize("state, match", [
    (lambda: np.zeros((B, H, K, V), np.float32), "'initial_state'.*mx.array.*ndarray"),
    (lambda: (mx.zeros((B, H, K, V)),), "'initial_state'.*mx.array.*tuple"),
    (lambda: [[0.0]], "'initial_state'.*mx.array.*list"),
    (lambda: mx.zeros((B, H, K, V), dtype=mx.int32), "'initial_state'.*float32.*int32"),
    (lambda: mx.zeros((B, H, K, V), dtype=mx.float64), "'initial_state'.*float32.*float64"),
    (lambda: mx.zeros((B, H, V, K)), "'initial_state'.*shape"),
])
def test_initial_state_is_validated(state, match, rng):
    with pytest.raises(InputError, match=match):
        ops.gla(*_gla(rng), initial_state=state(), backend="mlx")


def test_initial_state_of_a_normalizer_spec(rng):
    q, k, v, gk = _gla(rng)
    g = gk[..., 0]
    S, z = mx.zeros((B, H, 10, V)), mx.zeros((B, H, 10))
    ops.power_retention(q, k, v, g, initial_state=(S, z), backend="mlx")
    with pytest.raises(InputError, match="'initial_state'.*pair"):
        ops.power_retention(q, k, v, g, initial_state=S, backend="mlx")
    with pytest.raises(InputError, match="'initial_state'.*mx.array.*ndarray"):
        ops.power_retention(q, k, v, g, initial_state=(S, np.zeros((B, H, 10), np.float32)), backend="mlx")
    with pytest.raises(InputError, match="'initial_state'.*float32.*int32"):
        ops.power_retention(q, k, v, g, initial_state=(S, z.astype(mx.int32)), backend="mlx")


def test_initial_state_nan_only_in_debug_mode(rng):
    h0 = mx.full((B, H, K, V), float("nan"))
    o, _ = ops.gla(*_gla(rng), initial_state=h0, backend="mlx")  # lazily: nothing read on the host
    assert np.isnan(np.array(o)).all()
    with pytest.raises(InputError, match="'initial_state'.*NaN"):
        ops.gla(*_gla(rng), initial_state=h0, backend="mlx", check_finite=True)


@pytest.mark.parametrize("bad, name, what", [
    (lambda a: (np.array(a[0]),) + a[1:], "q", "ndarray"),
    (lambda a: (a[0].tolist(),) + a[1:], "q", "list"),
    (lambda a: a[:3] + (tuple(a[3].tolist()),), "gk", "tuple"),
    (lambda a: a[:2] + (1.5,) + a[3:], "v", "float"),
])
def test_non_array_inputs_name_the_argument(bad, name, what, rng):
    with pytest.raises(InputError, match=f"argument '{name}'.*mx.array.*{what}"):
        ops.gla(*bad(_gla(rng)), backend="mlx")


@pytest.mark.parametrize("scale, match", [
    (float("nan"), "finite"), (float("inf"), "finite"), ("a", "str"), (True, "bool"), ([1.0], "list"),
    (mx.array(0.5), "Python float"),
])
def test_scale_must_be_a_finite_real_number(scale, match, rng):
    with pytest.raises(InputError, match=f"argument 'scale'.*{match}"):
        ops.gla(*_gla(rng), scale=scale, backend="mlx")


def test_scale_accepts_ints_and_numpy_scalars(rng):
    xs = _gla(rng)
    a = ops.gla(*xs, scale=np.float32(0.5), backend="mlx")[0]
    b = ops.gla(*xs, scale=0.5, backend="mlx")[0]
    c = ops.gla(*xs, scale=1, backend="mlx")[0]
    assert np.array_equal(np.array(a), np.array(b)) and not np.array_equal(np.array(b), np.array(c))


def test_default_scale_is_checked_at_declaration():
    def f(q: rg.Key, k: rg.Key, v: rg.Value):
        return rg.Step(update=rg.outer(k, v), readout=rg.scale * q)
    with pytest.raises(rg.SpecError, match="default_scale.*'key'.*'one'.*'keys'"):
        rg.recurrence(f, default_scale="keys")


@pytest.mark.parametrize("Bz, Tz", [(0, 5), (2, 0), (0, 0)])
@pytest.mark.parametrize("backend", ["mlx", None])
def test_empty_batch_or_sequence_shapes(Bz, Tz, backend, rng):
    q, k, v, gk = _gla(rng, B=Bz, T=Tz)
    h0 = mx.ones((Bz, H, K, V))
    o, ht = ops.gla(q, k, v, gk, initial_state=h0, output_final_state=True, backend=backend)
    assert o.shape == (Bz, Tz, H, V) and ht.shape == (Bz, H, K, V)
    assert np.array_equal(np.array(ht), np.array(h0))  # no step: the state is the initial state


def test_head_first_layout_warns_like_fla(rng):
    """[B,H,T,D] passed as [B,T,H,D] (T < H on the key input): a warning, as FLA gives (decode T = 1 excepted)."""
    q, k, v, g = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in
                  ((1, 4, 16, 8), (1, 4, 16, 8), (1, 4, 16, 8), (1, 4, 16)))
    with pytest.warns(UserWarning, match="head-first"):
        ops.simple_gla(q, k, v, -mx.abs(g), backend="mlx")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.simple_gla(*(x[:, :1] for x in (q, k, v)), -mx.abs(g[:, :1]), backend="mlx")  # decode
        ops.simple_gla(*(x.swapaxes(1, 2) for x in (q, k, v)), -mx.abs(g.swapaxes(1, 2)), backend="mlx")


def test_missing_gpu_backend_lists_what_exists(rng):
    from recgen.tuning import machine_dialect

    here = machine_dialect()
    for missing in ("metal", "cuda"):
        if missing == here:
            continue
        with pytest.raises(InputError, match=f"backend='{missing}'.*not available.*'mlx'"):
            ops.gla(*_gla(rng), backend=missing)


def test_reference_matches_after_validation(rng):
    """The validated call still computes the spec (guards against a check that swallows arguments)."""
    xs = _gla(rng)
    h0 = mx.array(rng.standard_normal((B, H, K, V)).astype(np.float32))
    o, ht = ops.gla(*xs, initial_state=h0, scale=0.7, output_final_state=True, backend="mlx")
    o_r, ht_r = reference.run(specs.gla, initial_state=np.array(h0), scale=0.7,
                              **dict(zip(("q", "k", "v", "gk"), (np.array(x) for x in xs))))
    assert np.allclose(np.array(o), o_r, atol=1e-5) and np.allclose(np.array(ht), ht_r, atol=1e-5)
