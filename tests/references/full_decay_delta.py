"""A delta rule with a full (i, j) decay (Mamba's per-element decay beside gated DeltaNet's transition), float64
numpy, written from the recurrence alone:

    D_t[i, j] = exp(softplus(dt_t[j]) A[i, j])
    X_t = S_{t-1} (``before_decay``) or D_t ⊙ S_{t-1}
    S_t = D_t ⊙ S_{t-1} - β_t k_t (k_tᵀ X_t) + β_t k_t v_tᵀ ;   o_t = S_tᵀ (scale q_t)

q, k [B,T,Hk,K] (value head h reads key head h // (H // Hk)); v, dt [B,T,H,V]; A [H,K,V]; beta [B,T,H];
state [B,H,K,V]. Complex inputs pass through (the tests differentiate it by complex steps).
"""
from __future__ import annotations

import numpy as np

__all__ = ["full_decay_delta"]


def _softplus(x):
    return np.log1p(np.exp(x)) if np.iscomplexobj(x) else np.logaddexp(0.0, x)


def full_decay_delta(q, k, v, dt, A, beta, scale, initial_state=None, before_decay=False):
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    dtype = np.result_type(q, k, v, dt, A, beta, np.float64, *([] if initial_state is None else [initial_state]))
    S = np.zeros((B, H, K, V), dtype) if initial_state is None else np.array(initial_state, dtype)
    o = np.zeros((B, T, H, V), dtype)
    for t in range(T):
        for h in range(H):
            g = h // (H // Hk)
            D = np.exp(_softplus(dt[:, t, h])[:, None, :] * A[h][None])      # [B,K,V]
            kt, qt, bt = k[:, t, g], q[:, t, g], beta[:, t, h][:, None, None]
            X = S[:, h] if before_decay else D * S[:, h]
            kX = np.einsum("bk,bkv->bv", kt, X)
            S[:, h] = D * S[:, h] - bt * kt[:, :, None] * kX[:, None, :] + bt * kt[:, :, None] * v[:, t, h][:, None, :]
            o[:, t, h] = np.einsum("bk,bkv->bv", scale * qt, S[:, h])
    return o, S
