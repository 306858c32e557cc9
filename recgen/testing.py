"""Random inputs for checks: fresh data, never zeros, float32-representable so that a kernel and the
float64 reference see the same numbers. Log-decays reach -20, delta-rule keys are unit-norm."""
import numpy as np

from .spec.layouts import Sizes


def kernel_inputs(rec, sizes: Sizes, rng):
    """(inputs, initial_state, do, dht, scale) in IR layouts for ``rec`` at ``sizes``."""
    B, T, H, Hk, K, V = sizes.B, sizes.T, sizes.H, sizes.Hk, sizes.Kin, sizes.V
    xs = {}
    for x in rec.inputs:
        if x.kind == "scalar":
            a = -20.0 * rng.uniform(0, 1, (B, T, H)) ** 3 if x.name == "g" else 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
        elif x.kind == "key":
            a = rng.standard_normal((B, T, Hk, K))
            if rec.step.transition is not None:
                a /= np.linalg.norm(a, axis=-1, keepdims=True)
        elif x.kind == "key_gate":
            a = -20.0 * rng.uniform(0, 1, (B, T, H, sizes.K)) ** 3
        elif x.kind == "value":
            a = rng.uniform(0.05, 1.0, (B, T, H, V)) if x.name == "dt" else rng.standard_normal((B, T, H, V))
        else:
            shape = (H,) + tuple({"i": sizes.K, "j": V}[c] for c in x.index)
            a = -rng.uniform(0.5, 8.0, shape) if x.name == "A" else rng.standard_normal(shape)
        xs[x.name] = a.astype(np.float32).astype(np.float64)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(np.float64)  # noqa: E731
    h0, dht = f(*sizes.state_shape), f(*sizes.state_shape)
    if rec.has_normalizer:  # (S, z) pairs
        h0, dht = (h0, f(*sizes.state_shape[:3])), (dht, f(*sizes.state_shape[:3]))
    do = f(B, T, H, V)
    scale = K ** -0.5 if rec.default_scale == "key" else 1.0
    return xs, h0, do, dht, scale


def _f64(x) -> np.ndarray:
    if type(x).__module__.startswith("mlx"):  # an mx.array, bf16 included
        import mlx.core as mx

        x = np.array(x.astype(mx.float32))
    return np.asarray(x, dtype=np.float64)


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64: the one error metric of recgen's checks (docs/design.md: float32 ≤ 1e-5 forward, 1e-4
    gradients). A non-finite ``a`` scores inf, so it never passes a tolerance and one bad case can be reported
    beside the others; arrays of different shapes are an AssertionError."""
    a, b = _f64(a), _f64(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    if not np.all(np.isfinite(a)):
        return float("inf")
    nb = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (nb if nb > 0 else 1.0))
