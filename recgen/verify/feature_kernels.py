"""Power retention's other Metal kernels through every verification layer: the feature decode step, the three
fragment kernels over φ's packed rows (φ(X)ᵀY, φ(X)S and the gradient through them) and the in-chunk decayed
scores with their gradient, each on fresh random data against float64 numpy (``recgen check power_retention``
adds them to its table)."""
from __future__ import annotations

import numpy as np

from ..runtime import chunk_kernels as ck
from ..spec.features import decayed_scores, decayed_scores_vjp, sympow, sympow_vjp
from ..testing import rel_err as rel
from .kernels import Report, run_launch


def check_feature_kernels(d: int, V: int, *, sanitizer=None, report: Report | None = None, C: int = 16,
                          seed: int = 0) -> dict[str, float]:
    """{kernel: relative error against float64} for the decode step (3 heads, z beside S) and the three fragment
    kernels (2 chunks of C tokens, V + 1 columns as the normalizer makes them) at key width d."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    F, BH, V1 = d * (d + 1) // 2, 3, V + 1
    q, k, w, S, z = f(BH, d), f(BH, d), f(BH, V), f(BH, F, V), f(BH, F)
    dec = np.exp(-rng.uniform(0, 3, BH)).astype(np.float32)
    S1, z1, part = run_launch(ck.feature_decode_launch("metal", BH, d, V, True),
                              {"q": q, "k": k, "w": w, "decay": dec, "S": S, "z": z}, sanitizer, report)
    pq, pk = sympow(q.astype(np.float64)), sympow(k.astype(np.float64))
    S_r, z_r = dec[:, None, None] * S + pk[:, :, None] * w[:, None, :], dec[:, None] * z + pk
    errs = {"feature decode: state": max(rel(S1, S_r), rel(z1, z_r)),
            "feature decode: readout": rel(part.sum(1), np.concatenate([np.einsum("bf,bfv->bv", pq, S_r),
                                                                         (pq * z_r).sum(-1, keepdims=True)], -1))}
    X, Y, St = f(2, C, d), f(2, C, V1), f(2, F, V1)
    phi = sympow(X.astype(np.float64))
    (dS,) = run_launch(ck.feature_states_launch("metal", 2, C, d, V1), {"X": X, "Y": Y}, sanitizer, report)
    (dS_t,) = run_launch(ck.feature_states_launch("metal", 2, C, d, V1, 1), {"X": X, "Y": Y, "T0": St[:1]}, sanitizer,
                         report)  # one sequence of the two chunks, then its tail
    (Z,) = run_launch(ck.feature_out_launch("metal", 2, C, d, V1), {"X": X, "S": St}, sanitizer, report)
    (dX,) = run_launch(ck.feature_jac_launch("metal", 2, C, d, V1), {"X": X, "S": St, "Y": Y}, sanitizer, report)
    (dX_r,) = run_launch(ck.feature_jac_launch("metal", 2, C, d, V1, rows=True), {"X": X, "S": St, "Y": Y}, sanitizer,
                         report)
    errs["phi(X)^T Y"] = rel(dS, np.einsum("ncf,ncv->nfv", phi, Y))
    errs["phi(X)^T Y, then a tail"] = rel(dS_t, np.concatenate([np.einsum("ncf,ncv->nfv", phi, Y), St[:1]]))
    errs["phi(X) S"] = rel(Z, np.einsum("ncf,nfv->ncv", phi, St))
    dX_want = sympow_vjp(X.astype(np.float64), np.einsum("nfv,ncv->ncf", St, Y))
    errs["gradient through phi"] = rel(dX, dX_want)
    errs["gradient through phi, by rows"] = rel(dX_r, dX_want)
    errs |= _decayed_scores(rng, C, sanitizer, report)
    return errs


def _decayed_scores(rng, C: int, sanitizer, report) -> dict[str, float]:
    """A = (qᵀk)² ⊙ Γ over two chunks of C tokens (log-decays down to -5 a token) and its gradients: dP, and dl_τ =
    Σ_{t>=τ>s} G[t, s] (G = A ⊙ dA) summed over the row blocks' parts."""
    P, dA = rng.standard_normal((2, 2, C, C)).astype(np.float32)
    l = (-5 * rng.uniform(size=(2, C))).astype(np.float32)
    (A,) = run_launch(ck.decayed_scores_launch("metal", 2, C, 2), {"P": P, "l": l}, sanitizer, report)
    dP, parts = run_launch(ck.decayed_scores_launch("metal", 2, C, 2, grad=True), {"P": P, "dA": dA, "l": l},
                           sanitizer, report)
    dP_r, dl_r = decayed_scores_vjp(P, l, dA)
    return {"decayed scores": rel(A, decayed_scores(P, l)),
            "decayed scores: gradients": max(rel(dP, dP_r), rel(parts.sum(1), dl_r))}
