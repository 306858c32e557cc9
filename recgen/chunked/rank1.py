r"""The general rank-1 transition's chunk core with its hand-derived VJP: a ≠ ρ·u (two key vectors of their own),
or the transition before the decay (RWKV-7's DPLR order). The delta rules (a = ρ u after the decay) take
``parallel``'s core, of which this is the two-key generalization.

Per chunk (state S, tokens t = 0..C-1) the step is S_t = D_t ⊙ S_{t-1} + a_t x_tᵀ + u_t w_tᵀ, where
x_t = b_tᵀ (D_t ⊙ S_{t-1}) reads the decayed state, or x_t = b_tᵀ S_{t-1} with ``before_decay``. With P, Q, g and
the pair matrices M_XY of ``parallel`` (P_t = Γ(t, start), Q_s = Γ(end, s), g = P_end), unrolling x gives

    A  = M_ba (strict),  B = M_bu (strict),  b̂ = b ⊙ P
    before the decay: A, B = the non-strict pairs of b one token earlier, read one row later; b̂_t = b_t ⊙ P_{t-1}
    T  = (I − A)^{-1},  U = T B w,  W = T b̂
    X_c     = U_c + W_c S_c                                  (the x_t of the chunk's tokens)
    S_{c+1} = g_c ⊙ S_c + (a ⊙ Q)_cᵀ X_c + (u ⊙ Q)_cᵀ w_c   (the scan over chunks; the last term is its E)
    y_c     = (r ⊙ P)_c S_c + M_ra,c X_c + M_ru,c w_c

No decay is divided: the earlier b pairs with Γ(t−1, s) through its own rows. The backward mirrors the delta
rule's (``parallel``'s docstring), with F = M_raᵀ dy and the reverse scan over (a ⊙ Q, W):

    dX = F + (a ⊙ Q) dS_{c+1},  Δ = Tᵀ dX,  dA = Δ Xᵀ,  dB = Δ wᵀ,  db̂ = Δ S_cᵀ
    dw = M_ruᵀ dy + Bᵀ Δ + (u ⊙ Q) dS_{c+1},  dM_ra = dy Xᵀ,  dM_ru = dy wᵀ
    d(r ⊙ P) = dy S_cᵀ,  d(a ⊙ Q) = X dS_{c+1}ᵀ,  d(u ⊙ Q) = w dS_{c+1}ᵀ,  dg = Σ_j dS_{c+1} ⊙ S_c

and the pair gradients (``pair_grad``) and the log-decays' gradient through G as there (``log_decay_grad``).
The four pairs go through the decay geometry of ``parallel`` (on GPUs with chunk kernels: the generated pair
kernels, all four in one pass where the quad kernels' tiles fit, else A with M_ra and B with M_ru in one pass
each), the inverse and both scans through the generated kernels where they have a layout, MLX ops elsewhere; on
the fragment frames the inverse with U and W is one kernel (the UT transform of ``parallel``'s key-vector decays,
A given), and a key-vector decay's backward ends in one elementwise kernel (``chunk_kernels.chunk_bwd_rank1``)."""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from ..codegen.chunk_sources import inverse_supported, pair_supported
from ..runtime import chunk_kernels as ck
from ..tuning import Tuning
from .core import row_major, rows_earlier, rows_later, tr, unit_lower_inv
from .parallel import core_layout, decay_geometry, log_decay_grad, model_layout, scan_backward, with_vjp

__all__ = ["core_fn", "logdecay_16bit", "roles_16bit"]


def _f32(x):
    """x in float32: a 16-bit role that several float32 products read is cast once (MLX would cast it for each)."""
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _pairs(geo, r, u, a, b, before: bool):
    """(A, B, M_ra, M_ru) of every chunk."""
    # b's and the readout's pairs with a and with u: one pass over the decays, b and r (the quad kernels; two dual
    # passes where their tiles do not fit). Before the decay b_t meets Γ(t−1, s), s ≤ t−1: the non-strict pairs of b
    # one token earlier, read one row later
    be = rows_earlier(b) if before else b
    A, Mra, B, Mru = geo.pair_quad(be, r, a, u, strict=not before)
    if before:
        A, B = rows_later(A), rows_later(B)
    return A, B, Mra, Mru


def _pair_grads(geo, dA, dB, dMra, dMru, r, u, a, b, before: bool):
    """(dr, du, da, dbe) through the four pairs, dbe the gradient of b as the pairs took it (``_pairs``: be, one token
    earlier before the decay)."""
    be = rows_earlier(b) if before else b
    if before:  # the pairs of the earlier b were read one row later
        dA, dB = rows_earlier(dA), rows_earlier(dB)
    # as ``_pairs`` formed them
    dbe, dr, da, du = geo.pair_quad_grad(dA, dMra, dB, dMru, be, r, a, u, strict=not before)
    return dr, du, da, dbe


def _scan_forward(geo, S0, W, U, aQ, uQ, w, kern):
    """(states [.., n, K, V], X [.., n, C, V], S_end): X_c = U_c + W_c S_c and
    S ← g_c ⊙ S + (a ⊙ Q)_cᵀ X_c + (u ⊙ Q)_cᵀ w_c."""
    C, K = aQ.shape[-2:]
    if kern and ck.scan_supported(kern, C, K):  # the last term as the factors of the generated scan's E
        return ck.chunk_scan(S0, W, U, aQ, geo.g, None, kern, reverse=False, P=(uQ, w))
    E = tr(uQ) @ w
    n = U.shape[-3]
    S, states, Xs = S0[..., None, :, :], [], []
    for c in range(n):
        sl = (Ellipsis, slice(c, c + 1), slice(None), slice(None))
        states.append(S)
        X = mx.addmm(U[sl], W[sl], S)
        Xs.append(X)
        S = mx.addmm(geo.g[..., c:c + 1, :, None] * S + E[sl], tr(aQ[sl]), X)
    return mx.concatenate(states, axis=-3), mx.concatenate(Xs, axis=-3), S[..., 0, :, :]


def _forward(geo, S0, r, u, w, a, b, before: bool, kern, rfac=None, out=None):
    """(y, S_end, residuals (states, X, T, W, B, M_ra, M_ru)); with ``rfac`` the readout role is rfac·r (y is linear in
    r through all three of its terms, so the last product scales them); with ``out`` (a dtype) y in the model's
    layout and that type (``parallel.model_layout``)."""
    A, B, Mra, Mru = _pairs(geo, r, u, a, b, before)
    (C, K), V = a.shape[-2:], w.shape[-1]
    Pb = geo.p_before() if before else geo.P
    w32 = _f32(w)  # a 16-bit w meets float32 operands in two products: cast once, not by each
    if kern and ck.fuses_ut(kern, C, K, V):  # the inverse and both products in one kernel (A formed); with
        tb = kern.ut_products  # ``ut_products`` U = (T B) w there too, so B w is never in memory
        Tm, U, W = ck.chunk_ut_key(A, w if tb else B @ w32, b, mx.broadcast_to(Pb, b.shape), kern, B=B if tb else None)
    else:
        Tm = ck.tril_inverse(A, kern) if kern and inverse_supported(C) else unit_lower_inv(A)
        U, W = Tm @ (B @ w32), Tm @ (b * Pb)
    states, X, S_end = _scan_forward(geo, S0, W, U, geo.role("aQ", a, "Q"), geo.role("uQ", u, "Q"), w, kern)
    rP = geo.role("rP", r, "P")
    if kern and kern.rank1_readout and ck.fuses_readout(kern, C, K, V):  # all three terms in one kernel
        y = ck.chunk_out_rank1(rP, Mra, X, states, Mru, w, kern, out, rfac)
    else:  # three accumulating products: with two of its terms in the key readout kernel and the third added after
        # it (one more pass over y), the forward measured slower (docs/design.md)
        c = 1.0 if rfac is None else rfac
        y = mx.addmm(mx.addmm(Mru @ w32, Mra, X), rP, states, alpha=c, beta=c)
        y = y if out is None else model_layout(y, out)
    return y, S_end, (states, X, Tm, W, B, Mra, Mru)


def _backward(geo, r, u, w, a, b, res, dy, dS_end, before: bool, kern, rfac=None, out=None):
    """(dS0, dr, du, dw, da, db, dl) of ``_forward``."""
    states, X, Tm, W, B, Mra, Mru = res
    # dy arrives as a view of the model's layout [B, T, H, V] (with ``out``: that layout itself): made row-major in
    # the core's once here, not by each of the five products and the reverse scan that read it (a lower training
    # peak). With ``rfac`` the readout's cotangent is rfac·dy: every gradient below then holds it, and r's is that
    # of the core's argument
    dy = row_major(dy) if out is None else core_layout(dy, r.shape[-3], mx.float32)
    dy = dy if rfac is None else dy * rfac
    rP, aQ, uQ = geo.role("rP", r, "P"), geo.role("aQ", a, "Q"), geo.role("uQ", u, "Q")
    C, K = a.shape[-2:]
    dSn, dX, dS0, dg = scan_backward(geo, dS_end, aQ, W, tr(Mra) @ dy, (rP, dy), 2 * C >= K, False, kern, states)
    w = _f32(w)  # a 16-bit w meets float32 operands in three products below: cast once, not by each
    Delta = tr(Tm) @ dX
    statesT, XT, wT, dSnT = tr(states), tr(X), tr(w), tr(dSn)
    dr, du, da, dbe = _pair_grads(geo, Delta @ XT, Delta @ wT, dy @ XT, dy @ wT, r, u, a, b, before)
    d_rP, d_aQ, d_uQ, dbP = dy @ statesT, X @ dSnT, w @ dSnT, Delta @ statesT
    dw = mx.addmm(mx.addmm(uQ @ dSn, tr(B), Delta), tr(Mru), dy)
    if geo.key and kern and ck.fuses_key_tail(kern, C):  # the elementwise tail below as one kernel
        dr, du, da, db, dl = ck.chunk_bwd_rank1(r, u, a, b, geo.l, dr, du, da, dbe, d_rP, d_uQ, d_aQ, dbP, dg, kern,
                                                before)
        return dS0, dr, du, dw, da, db, dl
    P, Q = geo.P, geo.Q
    be = rows_earlier(b) if before else b
    dG = be * dbe  # the pair's row t' (t − 1 before the decay) carries G_{t'}: its dG lands in the pair's rows
    db = rows_later(dbe) if before else dbe
    dG = dG + r * dr - a * da - u * du
    dr, da, du = dr + P * d_rP, da + Q * d_aQ, du + Q * d_uQ
    dG = dG + rP * d_rP - aQ * d_aQ - uQ * d_uQ
    if before:  # b̂_t = b_t ⊙ P_{t−1}: its G is the row before's (P_{−1} = 1 has none)
        Pb = geo.p_before()
        db = db + Pb * dbP
        dG = dG + rows_earlier(b * Pb * dbP)
    else:
        db = db + P * dbP
        dG = dG + (b * P) * dbP
    dl = log_decay_grad(geo, dG, (aQ * d_aQ + uQ * d_uQ).sum(-2) + geo.g * dg)
    return dS0, dr, du, dw, da, db, dl


def roles_16bit(kern: Tuning | None, key: bool, C: int, K: int) -> bool:
    """Whether the core may take roles that are inputs verbatim in their 16-bit type: with a key-vector decay on the
    pair kernels, every kernel that reads a role converts it on load (the pairs, the UT transform, the scans, the
    backward tail, which writes its gradients in the roles' types), and every MLX op that meets one meets a float32
    operand too, so MLX promotes and never rounds (the MLX pair forms multiply two roles: float32 there). The
    inputs' casts to float32 and the gradients' casts back are then never made (``roles_16bit = "none"``: they are)."""
    return bool(kern) and key and kern.roles_16bit != "none" and pair_supported(kern.dialect, C, K)


def logdecay_16bit(kern: Tuning | None, key: bool, C: int, K: int) -> bool:
    """Whether a key-vector decay's core (this one, or ``parallel``'s) may take a log-decay that is an input verbatim
    in its 16-bit type (``Tuning.logdecay_16bit``): with the roles so (``roles_16bit``) and the fused backward tail,
    only kernels read l (the decay geometry's pass, forward and backward, and the tail), each converting as it reads,
    so its float32 cast is never made."""
    return roles_16bit(kern, key, C, K) and kern.logdecay_16bit and ck.fuses_key_tail(kern, C)


@lru_cache(maxsize=64)
def core_fn(key: bool, before: bool, t: Tuning, rfac: float | None = None, out=None):
    """The general rank-1 core as an ``mx.custom_function`` with the VJP above.

    Arguments (chunked, [..., n, C, F]): S0 [..., K, V], r, u, a, b [.., C, K], w [.., C, V], l [.., C, F] (log-decays;
    F = K when ``key``, else 1; roles in 16 bits where ``roles_16bit``, l where ``logdecay_16bit``, float32
    otherwise). ``before``: the transition reads the state before the decay. ``rfac`` (a float): the readout role is
    rfac·r, applied inside (the role rfac·q is never formed, nor its gradient scaled after). ``out``: None, or a
    dtype for y in the model's layout [B, n C, H, V] (its cotangent arrives so too). Returns (y [.., n, C, V],
    S_end, *residuals), the residuals for the VJP only."""
    kern = t if t.chunk_kernels else None
    # the forward reads P_{t−1} (before the decay) or P; otherwise only the products, D and g (the fused backward tail
    # takes P and Q from l itself): the geometry kernel writes neither P nor Q where nothing reads them
    Geo, GeoFwd = decay_geometry(key, kern, pq=False), decay_geometry(key, kern, before, pq=not before)
    nres = 7
    # the roles scaled by a decay, formed with the decays (on the kernels: in the geometry's pass)
    scaled = lambda r, u, a: {"aQ": (a, "Q"), "uQ": (u, "Q"), "rP": (r, "P")}  # noqa: E731

    def fwd(S0, r, u, w, a, b, l):
        geo = GeoFwd(l, t, scaled=scaled(r, u, a))
        y, S_end, res = _forward(geo, S0, r, u, w, a, b, before, kern, rfac, out)
        return (y, S_end) + res + tuple(geo.saved())

    def bwd(*args):
        (S0, r, u, w, a, b, l), rest = args[:7], args[7:]
        res, geo_saved, (dy, dS_end) = rest[:nres], rest[nres:-2], rest[-2:]
        grads = _backward(Geo(l, t, geo_saved, scaled(r, u, a)), r, u, w, a, b, res, dy, dS_end, before, kern, rfac,
                          out)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, args[:7]))  # a 16-bit role takes its own type

    return with_vjp(fwd, bwd, t)
