"""Random inputs for checks: fresh data, never zeros, float32-representable so that a kernel and the
float64 reference see the same numbers. Log-decays reach -20, delta-rule keys are unit-norm."""
import numpy as np

from .spec.features import sympow
from .spec.layouts import Sizes, input_dims


def input_law(rec, x) -> tuple:
    """How input ``x`` of ``rec`` is drawn (by ``kernel_inputs`` here and on the device by ``recgen.bench``):
    ("cubed", c): c·U(0,1)³ (log-decays reach c = -20); ("sigmoid",): σ(N(0,1)); ("normal", unit): N(0,1), each
    row of the last axis scaled to unit norm where ``unit`` (delta-rule keys); ("uniform", lo, hi, sign):
    sign·U(lo, hi)."""
    if x.kind == "scalar":
        return ("cubed", -20.0) if x.name == "g" else ("sigmoid",)
    if x.kind == "key":
        return ("normal", rec.step.transition is not None)
    if x.kind == "key_gate":
        return ("cubed", -20.0)
    if x.kind == "value":
        return ("uniform", 0.05, 1.0, 1.0) if x.name == "dt" else ("normal", False)
    if x.name == "log_gamma":  # a per-head log-decay (retnet)
        return ("cubed", -20.0)
    return ("uniform", 0.5, 8.0, -1.0) if x.name == "A" else ("normal", False)


def input_shape(x, sizes: Sizes) -> tuple[int, ...]:
    """The shape of input ``x`` at ``sizes`` (``recgen.spec.layouts.input_dims``)."""
    dims = {"B": sizes.B, "T": sizes.T, "H": sizes.H, "Hk": sizes.Hk, "Kin": sizes.Kin, "K": sizes.K, "V": sizes.V}
    return tuple(dims[d] for d in input_dims(x))


def _draw(law: tuple, shape: tuple, rng) -> np.ndarray:
    if law[0] == "cubed":
        return law[1] * rng.uniform(0, 1, shape) ** 3
    if law[0] == "sigmoid":
        return 1 / (1 + np.exp(-rng.standard_normal(shape)))
    if law[0] == "normal":
        a = rng.standard_normal(shape)
        return a / np.linalg.norm(a, axis=-1, keepdims=True) if law[1] else a
    return law[3] * rng.uniform(law[1], law[2], shape)


def kernel_inputs(rec, sizes: Sizes, rng):
    """(inputs, initial_state, do, dht, scale) in IR layouts for ``rec`` at ``sizes``."""
    B, T, H, K, V = sizes.B, sizes.T, sizes.H, sizes.Kin, sizes.V
    xs = {x.name: _draw(input_law(rec, x), input_shape(x, sizes), rng).astype(np.float32).astype(np.float64)
          for x in rec.inputs}
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(np.float64)  # noqa: E731
    h0, dht = f(*sizes.state_shape), f(*sizes.state_shape)
    if rec.has_normalizer:  # (S, z) pairs
        h0, dht = (h0, f(*sizes.state_shape[:3])), (dht, f(*sizes.state_shape[:3]))
    do = f(B, T, H, V)
    scale = K ** -0.5 if rec.default_scale == "key" else 1.0
    return xs, h0, do, dht, scale


def reachable_state(sizes: Sizes, rng) -> tuple[np.ndarray, np.ndarray]:
    """A reachable initial state of power retention, (S, z) = (Σ φ(w) vᵀ, Σ φ(w)) over 3 random w, float32-exact:
    φ(q)ᵀz is then a sum of squares, as the recurrence makes it (a random signed z makes the ratio readout's
    denominator cross 0)."""
    phi = sympow(rng.standard_normal((sizes.B, sizes.H, 3, sizes.Kin)))
    S, z = phi.swapaxes(-1, -2) @ rng.standard_normal((sizes.B, sizes.H, 3, sizes.V)), phi.sum(2)
    return tuple(np.float32(x).astype(np.float64) for x in (S, z))


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
