r"""HGRN2 as FLA's ``HGRN2Attention`` computes it, through the built-in ``rg.ops.hgrn2`` (Qin et al. 2024).

FLA's layer turns the forget-gate pre-activation ``f`` ``[B,T,H,K]`` into a log forget gate
``g = logsigmoid(f)``, past the first layer lower-bounded by ``lb`` ``[H,K]`` in ``[0, 1)``:
``g = log(lb + (1 - lb) σ(f))``, then runs GLA with the input gate tied to it, ``k = 1 - e^g``:

.. math::

    S_t = \mathrm{diag}(e^{g_t})\, S_{t-1} + (1 - e^{g_t})\, v_t^\top, \qquad
    o_t = S_t^\top (\mathrm{scale} \cdot q_t)

HGRN2 has no key input: the forget gate plays its role. The gate map is a few MLX ops before the op (so
gradients reach ``f`` and ``lb`` through MLX autodiff); the recurrence takes ``g``, as FLA's ``chunk_gla`` does.

Layouts: q ``[B,T,Hk,K]``, v ``[B,T,H,V]``, g ``[B,T,H,K]``, state ``[B,H,K,V]``.

    python examples/hgrn2.py      # the op against a plain numpy loop on the pre-activation
"""
from __future__ import annotations

import numpy as np

import recgen as rg


def fla_gate(f, lower_bound=None):
    """FLA's HGRN2 gate in MLX ops: logsigmoid(f), or logaddexp(log lb, log1p(-lb) + logsigmoid(f))."""
    import mlx.core as mx

    g = -mx.logaddexp(0.0, -f)
    return g if lower_bound is None else mx.logaddexp(mx.log(lower_bound), mx.log1p(-lower_bound) + g)


def hgrn2_loop(q, v, f, lower_bound=None, initial_state=None, scale=None):
    """An independent plain loop over b, h, t on the pre-activation (no recgen), block GQA."""
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    lb = np.zeros((H, K)) if lower_bound is None else lower_bound
    o = np.zeros((B, T, H, V))
    S_all = np.zeros((B, H, K, V))
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hk)
            S = np.zeros((K, V)) if initial_state is None else initial_state[b, h].copy()
            for t in range(T):
                a = lb[h] + (1 - lb[h]) / (1.0 + np.exp(-f[b, t, h]))
                S = a[:, None] * S + np.outer(1.0 - a, v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, hk])
            S_all[b, h] = S
    return o, S_all


def random_inputs(rng, B=2, T=9, H=4, Hk=2, K=5, V=3):
    return dict(q=rng.standard_normal((B, T, Hk, K)), v=rng.standard_normal((B, T, H, V)),
                f=3 * rng.standard_normal((B, T, H, K)))


def check(seed: int = 0, tol: float = 1e-5) -> None:
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    x = {n: a.astype(np.float32) for n, a in random_inputs(rng).items()}
    h0 = rng.standard_normal((2, 4, 5, 3)).astype(np.float32)
    for lb in (None, rng.uniform(0, 0.9, (4, 5)).astype(np.float32)):
        g = fla_gate(mx.array(x["f"]), None if lb is None else mx.array(lb))
        o, S = rg.ops.hgrn2(mx.array(x["q"]), mx.array(x["v"]), g, initial_state=mx.array(h0),
                            output_final_state=True, backend="mlx")
        o_ref, S_ref = hgrn2_loop(x["q"], x["v"], x["f"], lb, initial_state=h0)
        for got, want in ((o, o_ref), (S, S_ref)):
            err = np.linalg.norm(np.array(got) - want) / np.linalg.norm(want)
            assert err <= tol, err


if __name__ == "__main__":
    check()
    print("ok")
