r"""Feature maps in float64 numpy (the reference); kernels compute the same products on the fly.

sympow of degree 2: φ(x)_{(a,b)} = c_{ab} x_a x_b for a ≤ b (row-major), c_{aa} = 1, c_{ab} = √2,
so φ(x)ᵀφ(y) = (xᵀy)². Its VJP: dx_a = Σ_{b} c_{ab} dφ_{(a,b)} x_b + Σ_{b} c_{ba} dφ_{(b,a)} x_b.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=None)
def sympow_pairs(d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-major (a, b) pairs with a ≤ b and their coefficients."""
    a, b = np.triu_indices(d)
    coef = np.where(a == b, 1.0, np.sqrt(2.0))
    return a, b, coef


def sympow(x: np.ndarray) -> np.ndarray:
    a, b, c = sympow_pairs(x.shape[-1])
    return c * x[..., a] * x[..., b]


def sympow_vjp(x: np.ndarray, dphi: np.ndarray) -> np.ndarray:
    d = x.shape[-1]
    a, b, c = sympow_pairs(d)
    ea, eb = np.eye(d)[a], np.eye(d)[b]  # one-hot [D, d]
    return (c * dphi * x[..., b]) @ ea + (c * dphi * x[..., a]) @ eb
