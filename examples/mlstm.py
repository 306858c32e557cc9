r"""mLSTM (xLSTM's matrix memory) with a sigmoid input gate and a log-sigmoid forget gate: the built-in
``recgen.specs.mlstm_sigmoid`` (``rg.ops.mlstm_sigmoid``), checked against a plain loop.

With per-token, per-head gate pre-activations ``ig`` (input) and ``fg`` (forget):

.. math::

    C_t &= \sigma(f_t)\, C_{t-1} + \sigma(i_t)\, k_t v_t^\top, &\qquad
    n_t &= \sigma(f_t)\, n_{t-1} + \sigma(i_t)\, k_t, \\
    o_t &= \frac{C_t^\top \tilde q_t}{N(n_t^\top \tilde q_t)}, &\qquad
    \tilde q_t &= \mathrm{scale} \cdot q_t, \quad N(x) = \sqrt{x^2 + 1}.

The forget gate is written as the decay ``exp(logsigmoid(fg))`` (log-space, as FLA), the input gate
as ``sigmoid(ig)`` (the "sig" variant: no exponential input gate, hence no max-stabilizer state).
Not xLSTM's mLSTM, which the built-in ``mlstm`` is (an exponential input gate, and ``max(|n_tᵀ q̃_t|, 1)``,
whose derivative jumps at ±1: docs/design.md). This example uses the smooth stand-in ``N(x) = sqrt(x² + 1)``:
N ≥ 1 (never divides by ~0), N(x) ≈ |x| for large |x|, N'(x) = x / N(x). The readout carries ``scale · q`` (default scale K^{-1/2}).

Layouts: q, k ``[B,T,Hk,K]``, v ``[B,T,H,V]``, ig, fg ``[B,T,H]``, state ``(C [B,H,K,V], n [B,H,K])``.

    python examples/mlstm.py      # checks the reference interpreter against a plain numpy loop
"""
from __future__ import annotations

import numpy as np

from recgen.specs import mlstm_sigmoid as mlstm  # the spec (examples/mlstm.py:mlstm resolves to the built-in)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def mlstm_loop(q, k, v, ig, fg, initial_state=None, scale=None):
    """An independent plain loop over b, h, t (no recgen), block GQA."""
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    o = np.zeros((B, T, H, V))
    C_all, n_all = np.zeros((B, H, K, V)), np.zeros((B, H, K))
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hk)
            if initial_state is None:
                C, n = np.zeros((K, V)), np.zeros(K)
            else:
                C, n = initial_state[0][b, h].copy(), initial_state[1][b, h].copy()
            for t in range(T):
                f, i = _sigmoid(fg[b, t, h]), _sigmoid(ig[b, t, h])
                C = f * C + i * np.outer(k[b, t, hk], v[b, t, h])
                n = f * n + i * k[b, t, hk]
                qt = scale * q[b, t, hk]
                o[b, t, h] = C.T @ qt / np.sqrt((n @ qt) ** 2 + 1.0)
            C_all[b, h], n_all[b, h] = C, n
    return o, (C_all, n_all)


def random_inputs(rng, B=2, T=9, H=4, Hk=2, K=5, V=3):
    return dict(q=rng.standard_normal((B, T, Hk, K)), k=rng.standard_normal((B, T, Hk, K)),
                v=rng.standard_normal((B, T, H, V)), ig=2 * rng.standard_normal((B, T, H)),
                fg=3 * rng.standard_normal((B, T, H)))


def check(seed: int = 0, tol: float = 1e-12) -> None:
    from recgen.math import reference
    rng = np.random.default_rng(seed)
    x = random_inputs(rng)
    h0 = (rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 4, 5)))
    o, (C, n) = reference.run(mlstm, initial_state=h0, **x)
    o_ref, (C_ref, n_ref) = mlstm_loop(**x, initial_state=h0)
    for got, want in ((o, o_ref), (C, C_ref), (n, n_ref)):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= tol, err


if __name__ == "__main__":
    check()
    print("ok")
