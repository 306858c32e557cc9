r"""HGRN2: a gated linear RNN whose input gate is tied to the forget gate (1 - f), state expanded
by an outer product (Qin et al. 2024).

With a per-value-head, per-key-channel forget-gate pre-activation ``fg`` ``[B,T,H,K]``:

.. math::

    f_t = \sigma(fg_t) \in (0,1)^K, \qquad
    S_t = \mathrm{diag}(f_t)\, S_{t-1} + (1 - f_t)\, v_t^\top, \qquad
    o_t = S_t^\top (\mathrm{scale} \cdot q_t)

The decay is written in log space, ``exp(logsigmoid(fg))``, and ``1 - σ(x)`` as ``σ(-x)`` so that
neither underflows to garbage for large |fg|. HGRN2 has no key input: the forget gate plays its role.
(HGRN's lower-bound on the forget gate per layer is a reparametrization of ``fg`` done outside.)

Layouts: q ``[B,T,Hk,K]``, fg ``[B,T,H,K]``, v ``[B,T,H,V]``, state ``[B,H,K,V]``.

    python examples/hgrn2.py      # checks the reference interpreter against a plain numpy loop
"""
from __future__ import annotations

import numpy as np

from recgen.spec.fns import exp, logsigmoid, sigmoid
from recgen.spec.frontend import Key, KeyGate, Step, Value, outer, recurrence
from recgen.spec.ir import SCALE as scale


@recurrence
def hgrn2(q: Key, v: Value, fg: KeyGate):
    r"""HGRN2: S_t = diag(σ(fg_t)) S_{t-1} + (1 - σ(fg_t)) v_tᵀ,  o_t = S_tᵀ (scale · q_t)."""
    return Step(decay=exp(logsigmoid(fg)), update=outer(sigmoid(-fg), v), readout=scale * q)


def hgrn2_loop(q, v, fg, initial_state=None, scale=None):
    """An independent plain loop over b, h, t (no recgen), block GQA."""
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    o = np.zeros((B, T, H, V))
    S_all = np.zeros((B, H, K, V))
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hk)
            S = np.zeros((K, V)) if initial_state is None else initial_state[b, h].copy()
            for t in range(T):
                f = 1.0 / (1.0 + np.exp(-fg[b, t, h]))
                S = f[:, None] * S + np.outer(1.0 - f, v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, hk])
            S_all[b, h] = S
    return o, S_all


def random_inputs(rng, B=2, T=9, H=4, Hk=2, K=5, V=3):
    return dict(q=rng.standard_normal((B, T, Hk, K)), v=rng.standard_normal((B, T, H, V)),
                fg=3 * rng.standard_normal((B, T, H, K)))


def check(seed: int = 0, tol: float = 1e-12) -> None:
    from recgen.math import reference
    rng = np.random.default_rng(seed)
    x = random_inputs(rng)
    h0 = rng.standard_normal((2, 4, 5, 3))
    o, S = reference.run(hgrn2, initial_state=h0, **x)
    o_ref, S_ref = hgrn2_loop(**x, initial_state=h0)
    for got, want in ((o, o_ref), (S, S_ref)):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= tol, err


if __name__ == "__main__":
    check()
    print("ok")
