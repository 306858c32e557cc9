"""Random inputs per spec (IR layouts) and the error metric, for the GPU check and benchmarks."""
from __future__ import annotations

import numpy as np

from recgen.shapes import Sizes


def random_inputs(rec, sizes: Sizes, rng: np.random.Generator, strong: bool = True) -> dict[str, np.ndarray]:
    """Fresh random data, never zeros: log-decays down to -20 when ``strong``, unit-norm delta-rule keys."""
    B, T, H, Hk, K, V = sizes.B, sizes.T, sizes.H, sizes.Hk, sizes.Kin, sizes.V
    lo = 20.0 if strong else 1.0
    out = {}
    for x in rec.inputs:
        if x.kind == "scalar":
            a = rng.standard_normal((B, T, H))
            if x.name in ("g",):
                a = -rng.uniform(0.0, 1.0, (B, T, H)) ** 3 * lo
            if x.name == "beta":
                a = 1.0 / (1.0 + np.exp(-a))
        elif x.kind == "key":
            a = rng.standard_normal((B, T, Hk, K))
            if rec.step.transition is not None and x.name == "k":
                a /= np.linalg.norm(a, axis=-1, keepdims=True)
        elif x.kind == "key_gate":
            a = -rng.uniform(0.0, 1.0, (B, T, H, sizes.K)) ** 3 * lo
        elif x.kind == "value":  # mamba's dt is a positive step size
            a = rng.uniform(0.05, 1.0, (B, T, H, V)) if x.name == "dt" else rng.standard_normal((B, T, H, V))
        else:
            shape = (H,) + tuple({"i": sizes.K, "j": V}[c] for c in x.index)
            a = -rng.uniform(0.5, 4.0 if strong else 1.0, shape) if x.name == "A" else rng.standard_normal(shape)
        out[x.name] = a
    return out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))
