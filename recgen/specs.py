r"""The built-in recurrences, in FLA's conventions (docs/design.md).

Log-space gates (decay exp(g), g ≤ 0), ``scale`` applied to q (default K^{-1/2}), decay applied
before the delta-rule prediction, state [B,H,K,V], block GQA.
"""
from __future__ import annotations

import math

import sympy as sp

from .spec.fns import exp, logsigmoid, sigmoid, softplus
from .spec.frontend import Key, KeyGate, Param, Scalar, Step, Value, normalizer, outer, rank1, recurrence, sympow
from .spec.ir import SCALE as scale

# The ratio readout's floor, in units of (scale·qᵀk)² (mean 1 a token for unit-variance q, k at the default scale).
# 1e-6 made the readout ill-conditioned in float32 (docs/design.md, "Power retention's denominator").
POWER_RETENTION_EPS = 1e-2


def retnet_log_gamma(H: int) -> list[float]:
    """RetNet's fixed log-decays, one per head: λ_h = log(1 - 2^{-5-h}), h = 0..H-1 (FLA's ``g_gamma``)."""
    return [math.log1p(-2.0 ** (-5 - h)) for h in range(H)]


@recurrence
def gated_delta_net(q: Key, k: Key, v: Value, g: Scalar, beta: Scalar):
    r"""Gated DeltaNet: S_t = e^{g_t} (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,  o_t = S_tᵀ (scale · q_t)."""
    return Step(decay=exp(g), transition=rank1(-beta * k, k), update=outer(beta * k, v), readout=scale * q)


@recurrence
def kda(q: Key, k: Key, v: Value, g: KeyGate, beta: Scalar):
    r"""Kimi Delta Attention (FLA's ``chunk_kda``): Gated DeltaNet with a per-channel gate g [B,T,H,K] in log
    space, S_t = (I - β_t k_t k_tᵀ) diag(e^{g_t}) S_{t-1} + β_t k_t v_tᵀ,  o_t = S_tᵀ (scale · q_t)."""
    return Step(decay=exp(g), transition=rank1(-beta * k, k), update=outer(beta * k, v), readout=scale * q)


@recurrence
def delta_net(q: Key, k: Key, v: Value, beta: Scalar):
    r"""DeltaNet: S_t = (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,  o_t = S_tᵀ (scale · q_t)."""
    return Step(transition=rank1(-beta * k, k), update=outer(beta * k, v), readout=scale * q)


@recurrence
def gla(q: Key, k: Key, v: Value, gk: KeyGate):
    r"""GLA: S_t = diag(e^{gk_t}) S_{t-1} + k_t v_tᵀ,  o_t = S_tᵀ (scale · q_t); gk [B,T,H,K] per value head."""
    return Step(decay=exp(gk), update=outer(k, v), readout=scale * q)


@recurrence
def simple_gla(q: Key, k: Key, v: Value, g: Scalar):
    r"""Simple GLA (scalar gate per head): S_t = e^{g_t} S_{t-1} + k_t v_tᵀ,  o_t = S_tᵀ (scale · q_t)."""
    return Step(decay=exp(g), update=outer(k, v), readout=scale * q)


@recurrence(default_scale="one")
def selective_scan(x: Value, dt: Value, A: Param["i", "j"], B: Key, C: Key, D: Param["j"],
                   dt_bias: Param["j"]):
    r"""Mamba-1 selective scan (S6) with K = N state size, V = D channels per head (group).

    Δ_j = softplus(dt_j + dt_bias_j);  S_t[i,j] = e^{Δ_j A_ij} S_{t-1}[i,j] + B_i Δ_j x_j;
    o_j = Σ_i C_i S_t[i,j] + D_j x_j.  A is stored [H, N, D] (mamba's [D, N] transposed per group).
    """
    delta = softplus(dt + dt_bias)
    return Step(decay=exp(delta * A), update=outer(B, delta * x), readout=C, skip=D * x)


@recurrence(default_scale="one")
def selective_scan_linear_dt(x: Value, dt: Value, A: Param["i", "j"], B: Key, C: Key, D: Param["j"]):
    r"""Selective scan with Δ = dt used as given (mamba's ``delta_softplus=False``, no bias):
    S_t[i,j] = e^{dt_j A_ij} S_{t-1}[i,j] + B_i dt_j x_j;  o_j = Σ_i C_i S_t[i,j] + D_j x_j."""
    return Step(decay=exp(dt * A), update=outer(B, dt * x), readout=C, skip=D * x)


@recurrence
def power_retention(q: Key, k: Key, v: Value, g: Scalar):
    r"""Power retention, p = 2, with its normalizer (ratio readout).

    φ = sympow2 (width d(d+1)/2, √2 cross terms, φ(x)ᵀφ(y) = (xᵀy)²);
    S_t = e^{g_t} S_{t-1} + φ(k_t) v_tᵀ;  z_t = e^{g_t} z_{t-1} + φ(k_t);
    o_t = φ(scale·q_t)ᵀ S_t / (φ(scale·q_t)ᵀ z_t + ε),  ε = 1e-2,  with φ(scale·q) = scale² φ(q).

    n_t = φ(scale·q_t)ᵀ z_t = Σ_s w_ts (scale·q_tᵀk_s)² ≥ 0 is a quadratic form read from a float32 state: its
    rounding is absolute, ~2⁻²⁴ |φ(q_t)| |z_t|, so the floor ε, not n_t, bounds the relative error of o_t and
    of its gradients. ε = 1e-6 (the power-retention package's constant, added there after a per-chunk max shift)
    let float32 miss the float64 definition by up to 1.6e-1 on dq at log-decays to -20; ε = 1e-2 keeps the error
    below 1e-4 there (docs/design.md, "Power retention's denominator"). The gradient is exact: N(n) = n + ε.
    """
    pk = sympow(k)
    return Step(decay=exp(g), update=outer(pk, v), readout=scale**2 * sympow(q),
                normalizer=normalizer(exp(g), pk, lambda n: n + POWER_RETENTION_EPS))


@recurrence
def retnet(q: Key, k: Key, v: Value, log_gamma: Param[()]):
    r"""RetNet retention (FLA's ``chunk_retention``): simple GLA with a fixed decay per value head,
    S_t = e^{λ_h} S_{t-1} + k_t v_tᵀ,  o_t = S_tᵀ (scale · q_t);  log_gamma = λ [H] (≤ 0).

    ``recgen.ops.retnet(q, k, v)`` supplies RetNet's λ_h = log(1 - 2^{-5-h}) as FLA does; ``load("retnet")``
    takes ``log_gamma`` as an input (a learnable per-head decay, with its gradient)."""
    return Step(decay=exp(log_gamma), update=outer(k, v), readout=scale * q)


@recurrence
def hgrn2(q: Key, v: Value, g: KeyGate):
    r"""HGRN2 (FLA's ``HGRN2Attention``: ``chunk_gla(q, k=1 - exp(g), v, g)``), g [B,T,H,K] the log forget gate
    (g = logsigmoid(f), or FLA's lower-bounded form, computed by the caller):
    S_t = diag(e^{g_t}) S_{t-1} + (1 - e^{g_t}) v_tᵀ,  o_t = S_tᵀ (scale · q_t)."""
    return Step(decay=exp(g), update=outer(1 - exp(g), v), readout=scale * q)


@recurrence(default_scale="one")
def mamba2(x: Value, dt: Scalar, A: Param[()], B: Key, C: Key, D: Param["j"], dt_bias: Param[()]):
    r"""Mamba-2 SSD (mamba_ssm's ``mamba_chunk_scan_combined`` with ``dt_softplus=True``) in recgen's layout:
    x [B,T,H,P] (V = P), dt [B,T,H], A, dt_bias [H], B, C [B,T,G,N] (keys, K = N, G groups: block GQA),
    D [H,P], state [B,H,N,P] (mamba's [B,H,P,N] transposed; ``recgen.ops.mamba2`` takes mamba's).

    Δ_t = softplus(dt_t + dt_bias);  S_t = e^{Δ_t A} S_{t-1} + B_t (Δ_t x_t)ᵀ;  y_t = S_tᵀ C_t + D ⊙ x_t.
    """
    delta = softplus(dt + dt_bias)
    return Step(decay=exp(delta * A), update=outer(B, delta * x), readout=C, skip=D * x)


@recurrence(default_scale="one")
def mamba2_linear_dt(x: Value, dt: Scalar, A: Param[()], B: Key, C: Key, D: Param["j"]):
    r"""Mamba-2 SSD with Δ = dt as given (``dt_softplus=False``; a bias or ``dt_limit`` is applied by
    ``recgen.ops.mamba2`` before): S_t = e^{dt_t A} S_{t-1} + B_t (dt_t x_t)ᵀ;  y_t = S_tᵀ C_t + D ⊙ x_t."""
    return Step(decay=exp(dt * A), update=outer(B, dt * x), readout=C, skip=D * x)


@recurrence
def mlstm_sigmoid(q: Key, k: Key, v: Value, ig: Scalar, fg: Scalar):
    r"""mLSTM with a *sigmoid* input gate and a smooth normalizer: a variant, not xLSTM's mLSTM (that is ``mlstm``:
    an exponential input gate and max(|n_tᵀq̃_t|, 1); docs/design.md, "Built-ins beyond FLA's ops").

    C_t = σ(fg_t) C_{t-1} + σ(ig_t) k_t v_tᵀ;  n_t = σ(fg_t) n_{t-1} + σ(ig_t) k_t;
    o_t = C_tᵀ q̃_t / sqrt((n_tᵀ q̃_t)² + 1),  q̃_t = scale · q_t (xLSTM's k/√K is the same: C, n are linear in k).
    ig, fg [B,T,H] pre-activations; state (C [B,H,K,V], n [B,H,K]). xLSTM divides by max(|n_tᵀq̃_t|, 1);
    sqrt(x² + 1) is its smooth stand-in (≥ 1, ≈ |x| for large |x|)."""
    forget = exp(logsigmoid(fg))
    return Step(decay=forget, update=outer(sigmoid(ig) * k, v), readout=scale * q,
                normalizer=normalizer(forget, sigmoid(ig) * k, lambda n: sp.sqrt(n**2 + 1)))


@recurrence
def mlstm(q: Key, k: Key, v: Value, ig: Scalar, fg: Scalar):
    r"""xLSTM's mLSTM as its paper defines it: exponential input gate, sigmoid forget gate, the normalizer
    max(|n_tᵀ q̃_t|, 1).

    C_t = σ(fg_t) C_{t-1} + e^{ig_t} k_t v_tᵀ;  n_t = σ(fg_t) n_{t-1} + e^{ig_t} k_t;
    o_t = C_tᵀ q̃_t / max(|n_tᵀ q̃_t|, 1),  q̃_t = scale · q_t.
    ig, fg [B,T,H] pre-activations; state (C [B,H,K,V], n [B,H,K]). xLSTM's running-max stabilizer m_t rescales C,
    n and the floor 1 together (C̃ = e^{-m} C, and max(|ñᵀq̃|, e^{-m})), so it changes no value: it keeps e^{ig}
    in range. Without it the gradients, which scale as 1/max(|nᵀq̃|, 1), leave float32's range first, for input
    gates past about e^40 (docs/design.md, "xLSTM's mLSTM needs no stabilizer state"). Its kernels also add ε to the
    stabilized denominator, which is ε·e^{m_t} in these units; this op adds nothing. The normalizer's derivative is sign(x) where |x| > 1, 0 below
    (½ at the kink, sympy's Heaviside)."""
    forget = exp(logsigmoid(fg))
    return Step(decay=forget, update=outer(exp(ig) * k, v), readout=scale * q,
                normalizer=normalizer(forget, exp(ig) * k, lambda n: sp.Max(sp.Abs(n), 1)))


@recurrence
def rwkv6(r: Key, k: Key, v: Value, w: KeyGate, u: Param["i"]):
    r"""RWKV-6 (FLA's ``chunk_rwkv6``): S_t = diag(e^{w_t}) S_{t-1} + k_t v_tᵀ,
    o_t = (S_{t-1} + diag(u) k_t v_tᵀ)ᵀ (scale · r_t): the state before this step, plus the current token with the
    bonus u [H,K]; w [B,T,H,K] is the log-decay per value head."""
    return Step(decay=exp(w), update=outer(k, v), readout=scale * r, readout_before_update=True,
                bonus=scale * r * u * k)


@recurrence(default_scale="one")
def rwkv7(r: Key, w: KeyGate, k: Key, v: Value, a: Key, b: Key):
    r"""RWKV-7 (FLA's ``chunk_rwkv7`` / ``fused_recurrent_rwkv7``, the generalized delta rule):
    S_t = (diag(e^{w_t}) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ,  o_t = S_tᵀ (scale · r_t); w [B,T,H,K] is the log-decay per
    value head, the transition reads the state before the decay (mlx-lm's [V,K] state is its transpose)."""
    return Step(decay=exp(w), transition=rank1(b, a, before_decay=True), update=outer(k, v), readout=scale * r)


BUILTINS = {r.name: r for r in (gated_delta_net, kda, delta_net, gla, simple_gla, selective_scan,
                                selective_scan_linear_dt, power_retention, retnet, hgrn2, mamba2, mamba2_linear_dt,
                                mlstm, mlstm_sigmoid, rwkv6, rwkv7)}
