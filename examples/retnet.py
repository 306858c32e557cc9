r"""RetNet retention (recurrent form): the built-in ``recgen.specs.retnet``, run two ways.

Each head h has a fixed decay γ_h ∈ (0, 1), stored as a log-decay parameter so that the decay is
always positive: γ_h = e^{λ_h}, λ_h ≤ 0 (RetNet uses γ_h = 1 - 2^{-5-h}, i.e. λ_h = log γ_h).

.. math::

    S_t = \gamma_h \, S_{t-1} + k_t v_t^\top, \qquad
    o_t = S_t^\top (\mathrm{scale} \cdot q_t), \qquad \gamma_h = e^{\lambda_h}

Layouts: q, k ``[B,T,Hk,K]``, v ``[B,T,H,V]``, ``log_gamma`` ``[H]``, state ``[B,H,K,V]``.
(RetNet's group norm and swish gate act on ``o`` outside the recurrence.) ``rg.ops.retnet(q, k, v)`` is FLA's
``chunk_retention`` (the op supplies RetNet's decays); ``rg.load("retnet")`` takes ``log_gamma`` as an input.

    python examples/retnet.py     # the reference interpreter and the op against a plain numpy loop
"""
from __future__ import annotations

import numpy as np

import recgen as rg
from recgen.specs import retnet, retnet_log_gamma  # noqa: F401 (the spec: examples/retnet.py:retnet resolves)


def retnet_loop(q, k, v, log_gamma, initial_state=None, scale=None):
    """An independent plain loop over b, h, t (no recgen), block GQA: key head of h is h // (H // Hk)."""
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    o = np.zeros((B, T, H, V))
    S_all = np.zeros((B, H, K, V))
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hk)
            gamma = np.exp(log_gamma[h])
            S = np.zeros((K, V)) if initial_state is None else initial_state[b, h].copy()
            for t in range(T):
                S = gamma * S + np.outer(k[b, t, hk], v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, hk])
            S_all[b, h] = S
    return o, S_all


def random_inputs(rng, B=2, T=9, H=4, Hk=2, K=5, V=3):
    return dict(q=rng.standard_normal((B, T, Hk, K)), k=rng.standard_normal((B, T, Hk, K)),
                v=rng.standard_normal((B, T, H, V)),
                log_gamma=-np.geomspace(1e-3, 20.0, H))  # from γ ≈ 0.999 down to e^{-20}


def check(seed: int = 0, tol: float = 1e-12) -> None:
    from recgen.math import reference
    rng = np.random.default_rng(seed)
    x = random_inputs(rng)
    h0 = rng.standard_normal((2, 4, 5, 3))
    o, S = reference.run(retnet, initial_state=h0, **x)
    o_ref, S_ref = retnet_loop(**x, initial_state=h0)
    for got, want in ((o, o_ref), (S, S_ref)):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= tol, err


def check_op(seed: int = 1, tol: float = 1e-5) -> None:
    """rg.ops.retnet (FLA's convention: RetNet's decays supplied) on the CPU against the loop, float32."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    x = random_inputs(rng)
    f32 = {n: a.astype(np.float32) for n, a in x.items()}
    o, S = rg.ops.retnet(mx.array(f32["q"]), mx.array(f32["k"]), mx.array(f32["v"]), output_final_state=True,
                         backend="mlx")
    o_ref, S_ref = retnet_loop(f32["q"], f32["k"], f32["v"], np.array(retnet_log_gamma(4)))
    for got, want in ((o, o_ref), (S, S_ref)):
        err = np.linalg.norm(np.array(got) - want) / np.linalg.norm(want)
        assert err <= tol, err


if __name__ == "__main__":
    check()
    check_op()
    print("ok")
