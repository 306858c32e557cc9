r"""Power retention of degree p, declared from scratch: the symmetric power feature map ``rg.sympow(k, p)`` makes the
state φ(k) vᵀ with φ(q)ᵀφ(k) = (qᵀk)^p, and a normalizer turns the readout into a ratio.

.. math::

    S_t = e^{g_t} S_{t-1} + \phi(k_t) v_t^\top, \quad z_t = e^{g_t} z_{t-1} + \phi(k_t), \quad
    o_t = \frac{\phi(s q_t)^\top S_t}{\phi(s q_t)^\top z_t + 10^{-2}}

recgen sees that both keys go through one feature map (``Analysis.feature_identity``), so its chunked form scores
tokens inside a chunk from the raw keys, (s qᵀk)^p, and touches the C(d + p - 1, p) expanded rows only between
chunks. (``rg.ops.power_retention`` is the built-in p = 2.)

    python examples/power_retention.py    # p = 2 and 4: the op against the attention form, gradients too
    recgen bench examples/power_retention.py:power_retention4 --shape 2,4096,8,64   # p = 4, timed on your device

At p = 4 the expanded rows outgrow any sequence (766 480 at d = 64), so from a zero initial state the op runs the
attention form itself (``Tuning.feature_attention``): quadratic in T, no expanded state but the final one, which is
formed only where it is read.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

import recgen as rg
from recgen.spec.analysis import analyze


def power_retention(p: int):
    @rg.recurrence(name=f"power_retention{p}")
    def spec(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar):
        pk = rg.sympow(k, p)
        return rg.Step(decay=rg.exp(g), update=rg.outer(pk, v), readout=rg.scale**p * rg.sympow(q, p),
                       normalizer=rg.normalizer(rg.exp(g), pk, lambda n: n + 1e-2))
    return spec


power_retention2, power_retention4 = power_retention(2), power_retention(4)


def attention_form(q, k, v, g, p, scale):
    """The same model without a state (float64 numpy):
    o_t = Σ_{s≤t} e^{G_t−G_s} (s q_t·k_s)^p v_s / (Σ_{s≤t} e^{G_t−G_s} (s q_t·k_s)^p + 1e-2)."""
    T = q.shape[1]
    G = np.cumsum(g, 1)
    w = np.exp(G[:, :, None] - G[:, None]) * np.tril(np.ones((T, T)))[None, :, :, None]
    A = w * (scale * np.einsum("bthd,bshd->btsh", q, k)) ** p
    return np.einsum("btsh,bshv->bthv", A, v) / (A.sum(2)[..., None] + 1e-2)


def check(p: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    B, T, H, d, V = 2, 40, 2, 4, 3
    q, k, v = rng.standard_normal((B, T, H, d)), rng.standard_normal((B, T, H, d)), rng.standard_normal((B, T, H, V))
    g = -rng.uniform(0, 2, (B, T, H))
    spec = power_retention(p)
    assert analyze(spec).feature_identity.degree == p
    op = rg.load(spec, backend="mlx")
    args = [mx.array(x.astype(np.float32)) for x in (q, k, v, g)]
    o = op(*args, scale=0.5)[0]
    want_o = attention_form(q, k, v, g, p, 0.5)
    err = np.linalg.norm(np.array(o) - want_o) / np.linalg.norm(want_o)
    assert err < 1e-4, err
    do = rng.standard_normal((B, T, H, V))
    grads = mx.vjp(lambda *a: op(*a, scale=0.5)[0], args, [mx.array(do.astype(np.float32))])[1]
    want = rg.reference.grad(spec, do=do, scale=0.5, q=q, k=k, v=v, g=g)  # the float64 definition's adjoint
    gerr = max(np.linalg.norm(np.array(a) - want[n]) / np.linalg.norm(want[n]) for a, n in zip(grads, "qkvg"))
    assert gerr < 1e-4, gerr
    print(f"p = {p}: {spec.features[0].width(d)} state rows a head; o against the attention form {err:.1e}, "
          f"gradients against the reference {gerr:.1e}")


if __name__ == "__main__":
    check(2)
    check(4)
    print("ok")
