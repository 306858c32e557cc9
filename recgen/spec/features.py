r"""Feature maps in float64 numpy (the reference); kernels compute the same products on the fly.

sympow of degree p: φ(x)_m = c_m Π_{a∈m} x_a over the multisets m = (a_1 ≤ … ≤ a_p) of key indices in
lexicographic order, c_m = √(p! / Π_j k_j!) (k_j how often j occurs in m), so φ(x)ᵀφ(y) = (xᵀy)^p; width
C(d + p − 1, p). Degree 2: the pairs a ≤ b row-major, c_aa = 1, c_ab = √2. Its VJP: dx_j = Σ_m c_m dφ_m ∂(Π x)/∂x_j,
each occurrence of j in m contributing the product of the others.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from functools import lru_cache

import numpy as np


def sympow_width(d: int, degree: int = 2) -> int:
    """The number of rows of φ: C(d + p − 1, p)."""
    return math.comb(d + degree - 1, degree)


@lru_cache(maxsize=None)
def sympow_terms(d: int, degree: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(index multisets [F, p] in lexicographic order, their coefficients [F])."""
    idx = np.array(list(itertools.combinations_with_replacement(range(d), degree)), dtype=np.int64).reshape(-1, degree)
    fact = math.factorial(degree)
    coef = np.array([math.sqrt(fact / math.prod(math.factorial(k) for k in Counter(m).values())) for m in idx.tolist()])
    return idx, coef


@lru_cache(maxsize=None)
def sympow_pairs(d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Degree 2's rows: (a, b, c) with a ≤ b row-major (the kernels' tables)."""
    idx, coef = sympow_terms(d, 2)
    return idx[:, 0], idx[:, 1], coef


def sympow(x: np.ndarray, degree: int = 2) -> np.ndarray:
    idx, c = sympow_terms(x.shape[-1], degree)
    return c * np.prod(x[..., idx], axis=-1)


def sympow_vjp(x: np.ndarray, dphi: np.ndarray, degree: int = 2) -> np.ndarray:
    d = x.shape[-1]
    idx, c = sympow_terms(d, degree)
    xs = x[..., idx]                                  # [..., F, p]
    dx = 0.0
    for i in range(degree):
        others = np.prod(np.delete(xs, i, axis=-1), axis=-1) if degree > 1 else 1.0
        dx = dx + (c * dphi * others) @ np.eye(d)[idx[:, i]]
    return dx


def span_decays(l: np.ndarray) -> np.ndarray:
    """Γ[..., t, s] = Π_{s<τ≤t} e^{l_τ} for s <= t, 0 above: the decays between a chunk's tokens from its log-decays
    l [..., C], as a product (a reset, l = -inf, is a 0)."""
    C = l.shape[-1]
    i = np.arange(C)
    spans = (i[None, :, None] < i[None, None, :]) & (i[None, None, :] <= i[:, None, None])  # [t, s, τ]: s < τ <= t
    return np.prod(np.where(spans, np.exp(l.astype(np.float64))[..., None, None, :], 1.0), -1) * np.tri(C)


def decayed_scores(P: np.ndarray, l: np.ndarray, power: int = 2) -> np.ndarray:
    """A = P^power ⊙ Γ (``span_decays``): the kernel identity's in-chunk scores from P = qkᵀ [..., C, C]."""
    return P.astype(np.float64) ** power * span_decays(l)


def decayed_scores_vjp(P: np.ndarray, l: np.ndarray, dA: np.ndarray, power: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(dP, dl) of ``decayed_scores``: dP = power P^(power-1) Γ dA, dl_τ = Σ_{t>=τ>s} G[t, s] with G = A ⊙ dA."""
    P64, gam = P.astype(np.float64), span_decays(l)
    G = P64 ** power * gam * dA
    dl = np.stack([G[..., tau:, :tau].sum((-2, -1)) for tau in range(l.shape[-1])], -1)
    return power * P64 ** (power - 1) * gam * dA, dl


def _factor_spans(n: int, C: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which log-decays each decay factor spans: along a chunk [t, τ] (τ <= t: to_t), [s, τ] (τ > s: to_end), and
    between chunks [j, m, i] (chunk i inside [L | l0]'s entry (j, m): m < i < j, or i < j in the last column)."""
    i = np.arange(C)
    j, m, c = np.arange(n + 1)[:, None, None], np.arange(n + 1)[None, :, None], np.arange(n)[None, None, :]
    between = np.where(m == n, c < j, (m < c) & (c < j) & (m < j))
    return i[None, :] <= i[:, None], i[None, :] > i[:, None], between


def decay_factors(l: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A scalar decay's factors in the feature-map form from its log-decays l [..., n, C], float64, each the product
    of the decays it spans (``_factor_spans``): e^{Γ_t} and e^{Γ_C − Γ_s} [..., n, C], and [L | l0] [..., n+1, n+1]
    (``recgen.chunked.features.decay_factors``, ``chunk_kernels.decay_factors_fn``)."""
    n, C = l.shape[-2:]
    upto, after, between = _factor_spans(n, C)
    e = np.exp(l.astype(np.float64))
    to_t = np.prod(np.where(upto, e[..., None, :], 1.0), -1)
    to_end = np.prod(np.where(after, e[..., None, :], 1.0), -1)
    chunk = np.prod(e, -1)  # [..., n]
    j, m = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    LL = np.prod(np.where(between, chunk[..., None, None, :], 1.0), -1) * ((m == n) | (m < j))
    return to_t, to_end, LL


def decay_factors_vjp(l: np.ndarray, dto_t: np.ndarray, dto_end: np.ndarray, dLL: np.ndarray) -> np.ndarray:
    """dl of ``decay_factors``: each factor F = e^{Σ_spanned l} adds dF · F to every log-decay it spans."""
    n, C = l.shape[-2:]
    upto, after, between = _factor_spans(n, C)
    to_t, to_end, LL = decay_factors(l)
    along = ((dto_t * to_t)[..., :, None] * upto).sum(-2) + ((dto_end * to_end)[..., :, None] * after).sum(-2)
    return along + ((dLL * LL)[..., None] * between).sum((-3, -2))[..., None]
