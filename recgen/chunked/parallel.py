r"""Chunk-parallel forward and its hand-derived backward: the fast chunked core.

Per (b, h) the sequence is cut into n chunks of C = 2^L tokens. A chunk enters with state S_c (K×V)
and carries per-token roles r, u (key side, C×K), w (C×V), optionally b̃ = ρ ⊙ b (the delta-rule
transition a = ρ u, ρ per token) and log-decays l (C×F: F = 1 scalar, F = K key-vector). With
P_t = Γ(t, start) (decay from the chunk start through t), Q_s = Γ(end, s), g = P_end and the
pair matrices M_XY[t, s] = Σ_i X_ti Y_si Γ_i(t, s) (s ≤ t, or s < t when strict):

    A  = M_b̃u (strict),  T = (I − A)^{-1},  U = T w,  W = T (b̃ ⊙ P)      (W = 0, U = w without b̃)
    Z_c     = U_c + W_c S_c                         ("v_new": the values that enter the state)
    S_{c+1} = g_c ⊙ S_c + (u ⊙ Q)_cᵀ Z_c           (the only sequential step: a scan over chunks)
    y_c     = (r ⊙ P)_c S_c + M_ru,c Z_c

Backward, with dy and dS_n = the cotangent of the final state (derived by hand, checked against
the float64 reference and MLX autodiff in the tests):

    F = M_ruᵀ dy,   E = (r ⊙ P)ᵀ dy + Wᵀ F
    dS_c = g_c ⊙ dS_{c+1} + E_c + W_cᵀ (u ⊙ Q)_c dS_{c+1}       (reverse scan; dS_0 = d initial state)
    dZ = F + (u ⊙ Q) dS_{c+1};  Δ = Tᵀ dZ = dw;   d(b̃ ⊙ P) = Δ S_cᵀ
    d(r ⊙ P) = dy S_cᵀ,  d(u ⊙ Q) = Z dS_{c+1}ᵀ,  dg = Σ_j dS_{c+1} ⊙ S_c
    dM_ru = dy Zᵀ,  dA = Δ Zᵀ  →  pair gradients dX_t = Σ_s dM[t,s] Γ(t,s) Y_s, dY_s = Σ_t dM[t,s] Γ(t,s) X_t

Decays enter through G_t = Σ_{τ≤t} l_τ: every factor is exp(G_t − G_s) for some pair, so
∂/∂G_t collects X ⊙ dX for each factor's left side and −Y ⊙ dY for its right side, and
dl = the reverse cumulative sum of dG inside each chunk. Everything but the two scans is batched
over all chunks; memory is O(T·(K + V + C)) plus the n chunk-entry states, never T states.

Decay products are never divisions. Scalar decays build Γ[t, s] = exp(Σ_{s<τ≤t} l_τ) from sums
anchored at s (a cumulative sum of a masked C×C matrix), so a small decay far from the chunk start
stays accurate; key-vector decays use the multiplicative hierarchy of ``core.decay_levels`` (one exp
per token and element, no [C, C, K] tensor), or on GPUs with chunk kernels (``chunk_kernels``) the
pair kernels, which multiply Γ up one step at a time. There the inverse and both scans run as
generated kernels too (``recgen.runtime.chunk_kernels``), and where the fragment frames are on (CUDA) a scalar
decay's UT transform (A, T, U, W) and readout (y, M_ru) are one kernel each; there the roles that are inputs
verbatim stay in the inputs' 16-bit type (``role_dtype``) and y leaves in the model's layout (``core_fn``'s ``out``).
"""
from __future__ import annotations

from functools import cached_property, lru_cache

import mlx.core as mx

from ..codegen.chunk_sources import inverse_supported, pair_supported
from ..runtime import chunk_kernels as ck
from ..runtime.launch import dtype_name
from ..runtime.pieces import Piece
from ..tuning import Tuning
from .core import (add_half, decay_levels, exp, half, offdiag_blocks, p_before, pair_levels, tr,
                   unit_lower_inv)

__all__ = ["core_fn", "decay_geometry", "log_decay_grad", "scan_backward", "with_vjp"]


def _tri(C: int, strict: bool):
    t = mx.arange(C)
    return (t[:, None] > t[None, :]) if strict else (t[:, None] >= t[None, :])


def _decay_to_end(l, pow2: bool):
    """Q_s = Γ(end, s) = exp(Σ_{τ>s} l_τ) [.., C, F]: a reverse cumulative sum anchored at the chunk's end,
    so no difference of large sums."""
    after = mx.cumsum(l, axis=-2, reverse=True)[..., 1:, :]          # Σ_{τ>s} l_τ for s < C-1
    return exp(mx.concatenate([after, mx.zeros_like(l[..., :1, :])], axis=-2), pow2)


class PairsOneByOne:
    """The delta rule's two pairs of one Y (A of b̃, strict; M of r) and their gradients, one pair at a time."""

    def pair_dual(self, X, X2, Y, strict: bool = True):
        """(pair(X, Y, strict), pair(X2, Y))."""
        return self.pair(X, Y, strict=strict), self.pair(X2, Y, strict=False)

    def pair_dual_grad(self, dM, dM2, X, X2, Y, strict: bool = True):
        """(dX, dX2, dY) of ``pair_dual``, dY summed over both pairs."""
        dX, dY = self.pair_grad(dM, X, Y, strict=strict)
        dX2, dY2 = self.pair_grad(dM2, X2, Y, strict=False)
        return dX, dX2, dY + dY2

    def pair_quad(self, X, X2, Y, Yb, strict: bool = True):
        """(M, M2, Mb, M2b): ``pair_dual`` of Y and of Yb (the general rank-1 core's four pairs)."""
        return self.pair_dual(X, X2, Y, strict) + self.pair_dual(X, X2, Yb, strict)

    def pair_quad_grad(self, dM, dM2, dMb, dM2b, X, X2, Y, Yb, strict: bool = True):
        """(dX, dX2, dY, dYb) of ``pair_quad``, each summed over the pairs its operand is in."""
        dX, dX2, dY = self.pair_dual_grad(dM, dM2, X, X2, Y, strict)
        dXb, dX2b, dYb = self.pair_dual_grad(dMb, dM2b, X, X2, Yb, strict)
        return dX + dXb, dX2 + dX2b, dY, dYb

    def p_before(self):
        """P_{t−1} [.., C, F] (P_{−1} = 1): the decay a transition before the decay meets."""
        return p_before(self.P)

    def scale(self, scaled: dict | None) -> dict:
        """name -> x ⊙ P, x ⊙ Q or x ⊙ P_{t−1} for each name -> (x, "P" | "Q" | "Pe") of ``scaled``, in the decays'
        type: the roles a geometry is built with (``scaled=``, kept as ``scaled``), by MLX ops (the kernel geometry
        forms them in its own pass)."""
        decay = {"P": lambda: self.P, "Q": lambda: self.Q, "Pe": self.p_before}
        return {name: decay[w]() * x for name, (x, w) in (scaled or {}).items()}

    def role(self, name: str, x, which: str):
        """x ⊙ the decay ``which`` ("P", "Q" or "Pe"): the one formed with the decays where the geometry was built
        with it under ``name``, else formed here."""
        return self.scaled[name] if name in self.scaled else self.scale({name: (x, which)})[name]


class ScalarDecay(PairsOneByOne):
    """One decay per token (F = 1): Γ as a [.., C, C] matrix; pair terms are masked matmuls."""

    key = False

    def __init__(self, l, t: Tuning, saved=(), scaled=None):
        """``scaled``: roles to scale by a decay (``scale``), formed as ``self.scaled``."""
        self.l, self.t = l, t
        self.P, self.Q = exp(mx.cumsum(l, axis=-2), t.pow2_exp), _decay_to_end(l, t.pow2_exp)  # anchored sums
        self.g = self.P[..., -1, :]
        self.scaled = self.scale(scaled)

    @cached_property
    def gamma(self):
        """Γ [.., C, C], formed only where a product needs it: the fused kernels form it themselves (the
        forward's Q once came from its last row, a [.., C, C] cumulative sum, exp and mask per forward)."""
        C = self.l.shape[-2]
        # D[t, s] = Σ_{s<τ≤t} l_τ, summed from s (anchored): accurate however far t is from the start
        D = mx.cumsum(mx.where(_tri(C, True), self.l[..., 0][..., :, None], 0.0), axis=-2)
        return mx.where(_tri(C, False), exp(D, self.t.pow2_exp), 0.0)

    @cached_property
    def gamma_strict(self):
        return mx.where(_tri(self.l.shape[-2], True), self.gamma, 0.0)

    def pair(self, X, Y, strict: bool):
        return (X @ tr(Y, self.t.copy_transposes)) * (self.gamma_strict if strict else self.gamma)

    @staticmethod
    def saved() -> list:
        """Nothing kept for the backward: recomputing Γ is cheaper than holding it."""
        return []

    def pair_grad(self, dM, X, Y, strict: bool):
        E = dM * (self.gamma_strict if strict else self.gamma)
        return E @ Y, E.swapaxes(-1, -2) @ X

    @staticmethod
    def fold(x):
        """A per-key-element quantity summed to the decay's shape."""
        return x.sum(-1, keepdims=True)


class KernelScalarDecay(ScalarDecay):
    """``ScalarDecay`` with P, Q, g and the scaled roles (here [.., C, 1], as l) from one generated pass
    (``chunk_kernels.key_decays``, F = 1), the same anchored sums: as MLX ops they were two cumulative sums, a
    concatenation and two exps, g a strided copy of P's last row and each scaled role a product, each a launch of
    its own."""

    def __init__(self, l, t: Tuning, saved=(), scaled=None):
        self.l, self.t = l, t
        scaled = scaled or {}
        out = ck.key_decays(l, t, scaled=tuple(scaled.values()), d=False)
        self.P, self.Q, self.g = out.P, out.Q, out.g
        self.scaled = dict(zip(scaled, out.scaled))


class KeyDecay(PairsOneByOne):
    """A decay per token and key element (F = K): the multiplicative hierarchy of ``decay_levels``."""

    key = True

    def __init__(self, l, t: Tuning, saved=(), scaled=None):
        """From the log-decays l, or from ``saved()`` of the forward's instance (the backward reuses
        the hierarchy instead of recomputing it: one exp and log2(C) levels of [T, K] products).
        ``scaled``: roles to scale by a decay (``scale``), formed as ``self.scaled``."""
        self.l, self.t = l, t
        if saved:
            self.P, self.Q, *lv = saved
            self.levels = [(2 ** i, lv[2 * i], lv[2 * i + 1]) for i in range(len(lv) // 2)]
        else:
            self.levels, self.P, self.Q = decay_levels(exp(l, t.pow2_exp))
        self.g = self.P[..., -1, :]
        self.scaled = self.scale(scaled)

    def saved(self) -> list:
        return [self.P, self.Q] + [x for _, PR, QL in self.levels for x in (PR, QL)]

    def pair(self, X, Y, strict: bool):
        return pair_levels(X, Y, self.levels, strict, self.t.copy_transposes)

    def pair_grad(self, dM, X, Y, strict: bool):
        """dX_t = Σ_{s≤t} dM[t,s] Γ(t,s) ⊙ Y_s and dY_s = Σ_{t≥s} dM[t,s] Γ(t,s) ⊙ X_t, level by
        level: an off-diagonal block factors as Γ_i(t,s) = P_R,i(t) Q_L,i(s)."""
        if strict:
            dX, dY = mx.zeros_like(X), mx.zeros_like(Y)
        else:
            dd = mx.diagonal(dM, 0, dM.ndim - 2, dM.ndim - 1)[..., None]
            dX, dY = dd * Y, dd * X
        for m, PR, QL in self.levels:
            Db = offdiag_blocks(dM, m)
            dXR = PR * (Db @ (half(Y, m, 0) * QL))
            dYL = QL * (Db.swapaxes(-1, -2) @ (half(X, m, 1) * PR))
            dX, dY = add_half(dX, dXR, m, 1), add_half(dY, dYL, m, 0)
        return dX, dY

    @staticmethod
    def fold(x):
        return x


class KernelKeyDecay(PairsOneByOne):
    """A key-vector decay through the generated pair kernels (``chunk_kernels.pair`` / ``pair_grad``): each
    pair matrix is built from products of per-token decays in 16-token blocks (``chunk_pair.j2``), so no
    hierarchy of levels is built or kept. The per-token decays, P and Q come from one kernel pass
    (``chunk_kernels.key_decays``), with sums anchored at the chunk's start and end (P_t = exp(Σ_{τ≤t} l_τ),
    Q_s = exp(Σ_{τ>s} l_τ)): no difference of large sums."""

    key = True

    def __init__(self, l, t: Tuning, saved=(), scaled=None, before: bool = False, pq: bool = True, q: bool = True,
                 st=None):
        """``saved`` (KeyDecay's signature) is always empty here: see ``saved``. ``before``: P_{t−1} too, from the
        same pass (``p_before``; a shifted copy of P and a mask were two more passes). ``scaled``: roles scaled by a
        decay (``scale``), formed in that pass too (``self.scaled``; a 16-bit role's cast and the product were two
        passes each). ``pq`` off: that pass writes g, not P and Q (where their readers take the products); P and Q
        are then a second pass, formed only if read (``_pq``); ``q`` off: that pass writes P but not Q (a forward
        reads none: its scans take u ⊙ Q formed), Q then likewise a second pass if read. ``st``: the scaled roles
        in that 16-bit type (the forward's u ⊙ Q where its scan keeps 16-bit states: ``states_type``)."""
        self.l, self.t = l, t
        scaled = scaled or {}
        # one kernel pass for the three (MLX spent two cumulative sums, three exps and a concatenation on them, in
        # the forward and again in the backward)
        out = ck.key_decays(l, t, before, tuple(scaled.values()), pq, q=q, st=st)
        self.d, self.g, self._pe = out.d, out.g, out.pe
        if pq:
            self.P = out.P
        if pq and q:
            self.Q = out.Q
        self.scaled = dict(zip(scaled, out.scaled))
        self.dual = pair_supported(t.dialect, *l.shape[-2:], dual=True)  # the dual kernels' tiles fit
        self.quad = pair_supported(t.dialect, *l.shape[-2:], dual=True, quad=True)  # ... the quad kernels' too

    @staticmethod
    def saved() -> list:
        """Nothing kept: three elementwise passes rebuild it in the backward."""
        return []

    def p_before(self):
        return self._pe if self._pe is not None else super().p_before()

    @cached_property
    def _pq(self):
        """P and Q by a pass of their own, for a geometry built without them (``pq`` off): MLX runs it only if
        read."""
        return ck.key_decays(self.l, self.t, d=False)

    @cached_property
    def P(self):
        return self._pq.P

    @cached_property
    def Q(self):
        return self._pq.Q

    def pair(self, X, Y, strict: bool, scale: float | None = None):
        """M of (scale·X, Y), the scale applied as X is read (``chunk_kernels.pair``)."""
        return ck.pair(X, Y, self.d, strict, self.t, scale)

    def pair_grad(self, dM, X, Y, strict: bool, scale: float | None = None):
        return ck.pair_grad(dM, X, Y, self.d, strict, self.t, scale)

    def pair_dual(self, X, X2, Y, strict: bool = True):
        """Both pairs in one pass over Y and the decays (``chunk_kernels.pair_dual``) where its tiles fit."""
        if self.dual:
            return ck.pair_dual(X, X2, Y, self.d, self.t, strict)
        return super().pair_dual(X, X2, Y, strict)

    def pair_dual_grad(self, dM, dM2, X, X2, Y, strict: bool = True):
        if self.dual:
            return ck.pair_dual_grad(dM, dM2, X, X2, Y, self.d, self.t, strict)
        return super().pair_dual_grad(dM, dM2, X, X2, Y, strict)

    def pair_quad(self, X, X2, Y, Yb, strict: bool = True):
        """The four pairs in one pass over the decays and X, X2 (``chunk_kernels.pair_quad``) where its tiles fit
        (CUDA's threadgroup memory at C = 64; Metal's 32 KiB takes two dual passes)."""
        if self.quad:
            return ck.pair_quad(X, X2, Y, Yb, self.d, self.t, strict)
        return super().pair_quad(X, X2, Y, Yb, strict)

    def pair_quad_grad(self, dM, dM2, dMb, dM2b, X, X2, Y, Yb, strict: bool = True):
        if self.quad:
            return ck.pair_quad_grad(dM, dM2, dMb, dM2b, X, X2, Y, Yb, self.d, self.t, strict)
        return super().pair_quad_grad(dM, dM2, dMb, dM2b, X, X2, Y, Yb, strict)

    fold = staticmethod(KeyDecay.fold)


def _split(x):
    """[..., n, a, b] -> n arrays [..., 1, a, b] (one op; the chunk axis stays for broadcasting).
    Moving the chunk axis first and indexing contiguous blocks instead measured slower on the H100 (more
    ops, and the copy), so the views stay."""
    n = x.shape[-3]
    return mx.split(x, n, axis=-3) if n > 1 else [x]


def _transition(geo, uQ, W):
    """A_c = diag(g_c) + (u ⊙ Q)_cᵀ W_c: the K×K map S_c -> S_{c+1} of chunk c."""
    K = uQ.shape[-1]
    return geo.g[..., None] * mx.eye(K, dtype=uQ.dtype) + uQ.swapaxes(-1, -2) @ W


def _chunk_decay_matrix(l, key: bool, pow2: bool):
    """L[c, j] = Π_{j ≤ c'' < c} g_{c''} for j ≤ c (0 above): the map from x = [S_0, ΔS_0, .., ΔS_{n-1}]
    to the states S_0..S_n of the diagonal scan S_{c+1} = g_c ⊙ S_c + ΔS_c. Built from sums of
    log g anchored at j (exp of a masked cumulative sum), so it is exact at any decay strength.
    Returns [.., n+1, n+1] for scalar decays, [.., K, n+1, n+1] for key-vector ones."""
    logg = l.sum(-2)                                            # [.., n, F]
    if key:
        logg = logg.swapaxes(-1, -2)                            # [.., K, n]
    else:
        logg = logg[..., 0]
    n = logg.shape[-1]
    c = mx.arange(n + 1)
    prev = mx.pad(logg, [(0, 0)] * (logg.ndim - 1) + [(1, 0)])  # logg_{c-1} at row c
    Y = mx.where((c[:, None] - 1) >= c[None, :], prev[..., :, None], 0.0)
    return mx.where(c[:, None] >= c[None, :], exp(mx.cumsum(Y, axis=-2), pow2), 0.0)


def _apply_rows(L, x, key: bool):
    """L applied along the chunk axis of x [.., m, K, V] (per key row when ``key``)."""
    if not key:
        s = x.shape
        return (L @ x.reshape(*s[:-2], s[-2] * s[-1])).reshape(*s[:-3], L.shape[-2], s[-2], s[-1])
    return (L @ x.swapaxes(-3, -2)).swapaxes(-3, -2)


def _scan_forward(geo, S0, u, U, W, compose: bool, matrix: bool, kern=None, st=None, ml=None):
    """Chunk-entry states [.., n, K, V], Z [.., n, C, V] and the final state, the state update taking
    u ⊙ Q. ``kern``: the tuning of the generated chunk scan (``chunk_kernels.chunk_scan``: delta-rule or
    diagonal), or None; it scales a scalar decay's u by Q as it reads u (u ⊙ Q never in memory); a key-vector
    decay's u ⊙ Q comes formed with the decays (``geo.scaled``: in the geometry kernel's pass). ``st``: the states
    (and Z) written in that 16-bit type (``chunk_kernels.chunk_scan``'s). ``ml`` (``_forward``'s): u
    and U, the diagonal scan's key and value inputs, in the model's layout."""
    if ml is not None or kern and ck.scan_supported(kern, geo.l.shape[-2], S0.shape[-2]):  # W None: the diagonal scan
        if geo.key:
            return ck.chunk_scan(S0, W, U, geo.role("uQ", u, "Q"), geo.g, None, kern, reverse=False, st=st)
        return ck.chunk_scan(S0, W, U, u, geo.g, None, kern, reverse=False, Bq=geo.Q, st=st, ml=ml,
                             x_model=ml is not None)
    u, U = _up(geo, u, U)
    uQ = geo.role("uQ", u, "Q")
    gs = geo.g[..., None]
    uQt = uQ.swapaxes(-1, -2)
    S = S0[..., None, :, :]
    states = []
    if W is None and matrix:
        S_all = _apply_rows(_chunk_decay_matrix(geo.l, geo.key, geo.t.pow2_exp), mx.concatenate([S, uQt @ U], axis=-3), geo.key)
        return S_all[..., :-1, :, :], U, S_all[..., -1, :, :]
    if W is None:
        for gc, dc in zip(_split(gs), _split(uQt @ U)):
            states.append(S)
            S = gc * S + dc
        Z = U
    elif compose:  # one K×K·K×V product per chunk: as cheap as two C-sized ones when C ≥ K/2
        for Ac, Bc in zip(_split(_transition(geo, uQ, W)), _split(uQt @ U)):
            states.append(S)
            S = mx.addmm(Bc, Ac, S)
        Z = None
    else:
        Zs = []
        for gc, uc, Uc, Wc in zip(_split(gs), _split(uQt), _split(U), _split(W)):
            states.append(S)
            Zc = mx.addmm(Uc, Wc, S)
            Zs.append(Zc)
            S = mx.addmm(gc * S, uc, Zc)
        Z = mx.concatenate(Zs, axis=-3)
    states = mx.concatenate(states, axis=-3)
    if Z is None:
        Z = U + W @ states
    return states, Z, S[..., 0, :, :]


def scan_backward(geo, dS_end, uQ, W, F, E, compose: bool, matrix: bool, kern=None, states=None, ml=None, st=None):
    """Reverse scan over chunks: dS_{c+1} for every chunk c [.., n, K, V], dZ [.., n, C, V] and
    dS_0, from dZ_c = F_c + (u ⊙ Q)_c dS_{c+1} and dS_c = g_c ⊙ dS_{c+1} + E_c + W_cᵀ dZ_c.
    With ``compose`` the step is dS_c = A_cᵀ dS_{c+1} + (E_c + W_cᵀ F_c) and dZ is batched after.
    With ``kern`` the scan is the generated one, (A, X, B, E) = (u ⊙ Q, F, W, E) reversed (no B
    without a delta rule). ``E`` may come as its factors (Pa, Pb), E_c = Pa_cᵀ Pb_c: the generated
    scan takes them as they are where it can (``chunk_kernels.scan_fuses_products``; ``chunk_scan`` multiplies
    them out before it elsewhere); MLX ops multiply them out here.
    With ``states`` (the forward's [.., n, K, V]) a fourth result: dg = Σ_j dS_{c+1} ⊙ S_c [.., n, K],
    formed inside the generated scan where it fuses products.
    ``uQ`` and E's first factor may come as (x, row scales) pairs (u, Q) and (r, P): the generated scan applies
    the scales as it reads x, where it can; elsewhere they are multiplied out as the factors are. ``ml``: those x
    are the model's key inputs (``chunk_kernels.chunk_scan``); ``st``: dS_{c+1} and dZ written in that 16-bit
    type by the generated scan (``chunk_kernels.chunk_scan``'s)."""
    uQ, Aq = uQ if isinstance(uQ, tuple) else (uQ, None)
    C, K = F.shape[-2], dS_end.shape[-2]
    generated = kern and ck.scan_supported(kern, C, K)  # W None: dS_c = g_c ⊙ dS_{c+1} + E_c
    P, Pq = None, None
    if isinstance(E, tuple):
        (Pa, Pq), Pb = (E[0] if isinstance(E[0], tuple) else (E[0], None)), E[1]
        if generated:
            P, E = (Pa, Pb), None
        else:
            E, Pq = _rows(Pa, Pq).swapaxes(-1, -2) @ Pb, None
    if generated:
        return ck.chunk_scan(dS_end, uQ, F, W, geo.g, E, kern, reverse=True, P=P, St=states, Aq=Aq, Pq=Pq, ml=ml,
                             st=st)
    out = _scan_backward_ops(geo, dS_end, _rows(uQ, Aq), W, F, E, compose, matrix)
    return out if states is None else out + ((out[0] * states).sum(-1),)


def _rows(x, scale):
    """x with its rows scaled (``scale`` [.., C, 1]; None: x), in the scale's (compute) dtype."""
    return x if scale is None else scale * x.astype(scale.dtype)


def _scan_backward_ops(geo, dS_end, uQ, W, F, E, compose: bool, matrix: bool):
    """``scan_backward`` in MLX ops."""
    gs = geo.g[..., None]
    dS = dS_end[..., None, :, :]
    nxt, dZs = [], []
    if W is None and matrix:  # the adjoint of the forward's matrix form is its transpose
        L = _chunk_decay_matrix(geo.l, geo.key, geo.t.pow2_exp).swapaxes(-1, -2)
        d_all = _apply_rows(L, mx.concatenate([E, dS], axis=-3), geo.key)
        dSn = d_all[..., 1:, :, :]
        return dSn, F + uQ @ dSn, d_all[..., 0, :, :]
    if W is None:
        for gc, Ec in zip(reversed(_split(gs)), reversed(_split(E))):
            nxt.append(dS)
            dS = gc * dS + Ec
    elif compose:
        E = E + W.swapaxes(-1, -2) @ F
        for At, Ec in zip(reversed(_split(_transition(geo, uQ, W).swapaxes(-1, -2))), reversed(_split(E))):
            nxt.append(dS)
            dS = mx.addmm(Ec, At, dS)
    else:
        for gc, uc, Wc, Fc, Ec in zip(*(reversed(_split(x)) for x in (gs, uQ, W.swapaxes(-1, -2), F, E))):
            nxt.append(dS)
            dZs.append(mx.addmm(Fc, uc, dS))
            dS = mx.addmm(gc * dS + Ec, Wc, dZs[-1])
    dSn = mx.concatenate(nxt[::-1], axis=-3)
    dZ = mx.concatenate(dZs[::-1], axis=-3) if dZs else F + uQ @ dSn
    return dSn, dZ, dS[..., 0, :, :]


def role_dtype(kern: Tuning | None, key: bool, delta: bool, C: int, K: int, V: int, dtype, compute, bare: bool = False):
    """The dtype the roles r, u, w, b̃ are handed to the core in: ``dtype`` (the inputs') where it is a 16-bit
    float and every forward product that reads them is a fused fragment kernel (a scalar decay, the fragment
    scan, the readout kernel and, for a delta rule, the UT transform: they convert on load), else ``compute``. In 16 bits the
    role passes and the kernels' reads of them move half the bytes; the roles are then rounded once to the
    inputs' precision (FLA keeps its operands in bf16 throughout). MLX's products and the backward take
    them in ``compute`` (``_up``). Rounding every role so (``Tuning.roles_16bit = "all"``) was measured on the H100:
    the forward did not move, while the backward's casts made forward+backward slower and its peak higher; a
    forward-only (inference) choice, off by default.
    A ``bare`` role (an input verbatim: GDN's w = v, simple GLA's u = k and w = v) is exact in its input's type, so
    it stays there wherever the kernels read it (``roles_16bit = "bare"``, the default): no cast pass in the
    forward. ``"none"`` casts every role. A key-vector decay's roles are cast, but for bare ones where
    ``Tuning.key_roles_16bit`` asks (its kernels convert on load; MLX's products cast them, ``_up``)."""
    mode = kern.roles_16bit if kern else "none"
    key_cast = key and not (bare and kern and kern.key_roles_16bit)
    if dtype not in (mx.bfloat16, mx.float16) or key_cast or mode == "none" or not (bare or mode == "all"):
        return compute
    if not (ck.use_mma(kern, C, K, V) and ck.fuses_readout(kern, C, K, V)
            and (not delta or ck.fuses_ut(kern, C, K, V))):
        return compute
    return dtype


def _up(geo, *xs):
    """Roles in the compute dtype (that of the log-decays, float32 at least: a key-vector decay's may arrive in its
    input's 16-bit type, ``rank1.logdecay_16bit``): MLX products of 16-bit operands would round. One array given
    twice (Z is w without a delta rule) is cast once."""
    cast, dtype = {}, mx.result_type(geo.l.dtype, mx.float32)
    for x in xs:
        if x is not None and id(x) not in cast:
            cast[id(x)] = x.astype(dtype)
    return [None if x is None else cast[id(x)] for x in xs]


def model_layout(y, out):
    """y [B, H, n, C, V] -> [B, n C, H, V] of dtype ``out`` (the model's layout)."""
    B, H, n, C, V = y.shape
    return y.transpose(0, 2, 3, 1, 4).reshape(B, n * C, H, V).astype(out)


def group_heads(g, HK: int, gqa: str):
    """A gradient per value head [B, T, H, K] summed over GQA's groups to HK key heads (``terms.expand_heads``'s
    adjoint: value head h reads key head h // (H / HK) for "block", h % HK for "tiled")."""
    B, T, H, K = g.shape
    if H == HK:
        return g
    if gqa == "block":
        return g.reshape(B, T, HK, H // HK, K).sum(3)
    return g.reshape(B, T, H // HK, HK, K).sum(2)


def core_layout(y, n: int, dtype):
    """``model_layout``'s inverse: [B, n C, H, V] -> [B, H, n, C, V] of ``dtype``, row-major. MLX's cast of the
    transposed view would keep its strides, and then every product and kernel that reads it (three GEMMs and the
    reverse scan, each wanting row-major operands) would copy it again; one copy in the input's type comes first
    (``chunk_kernels.model_chunks``)."""
    return ck.model_chunks(y, n).astype(dtype)


def states_type(key: bool, delta: bool, kern: Tuning | None, w, C: int, K: int, V: int):
    """The 16-bit type of the forward's chunk states and Z, or None: without a delta rule (simple GLA; a key-vector
    decay's, GLA's, with ``Tuning.key_roles_16bit``) the values' (``Tuning.states_16bit``), where the fragment scan
    and the fused readout run. A key-vector decay's u ⊙ Q comes from its decays' pass in it too (the scan's B operand
    then shares the states' type, so it runs on the wide multiply-add: ``chunk_kernels.chunk_scan``)."""
    if (not delta and kern and kern.states_16bit and (not key or kern.key_roles_16bit)
            and w.dtype in (mx.bfloat16, mx.float16) and ck.use_mma(kern, C, K, V) and ck.fuses_readout(kern, C, K, V)):
        return w.dtype
    return None


def _forward(geo, S0, r, u, w, bt, compose, matrix=False, inv_base=1, kern=None, out=None, rfac=None, ml=None):
    """(y, S_end, residuals): residuals are (states, M_ru) and, with b̃, (Z, T, W) too. The roles may
    arrive in 16 bits (``role_dtype``): the fused kernels read them so, MLX's products in the compute dtype.
    With ``out`` (a dtype) y comes in the model's layout and that type (``model_layout``): the fused readout
    writes it so (a transposing cast after it would be a pass over y in float32). With ``rfac`` the
    readout role is rfac·r: the fused readout scales as it reads r (M_ru and y are linear in r). ``ml`` (no delta
    rule, a scalar decay, the fused scan and readout: ``core_fn``'s ``model_rows``): r, u and w are the model's
    inputs as they are, read so by the scan and the readout."""
    U, W, Tm, M = w, None, None, None
    C, K, V = geo.l.shape[-2], S0.shape[-2], S0.shape[-1]
    if bt is not None and kern and not geo.key and ck.fuses_ut(kern, C, K, V):
        Tm, U, W = ck.chunk_ut(bt, u, w, geo.l, kern)  # A never in memory
    elif bt is not None:  # A and M_ru share u and the decays: one pass forms both
        bt_, u_, w_, r_ = _up(geo, bt, u, w, _scaled(r, rfac))
        A, M = geo.pair_dual(bt_, r_, u_)
        if kern and ck.fuses_ut(kern, C, K, V):  # a key-vector decay: the inverse and both products in one kernel
            Tm, U, W = ck.chunk_ut_key(A, w, bt_, geo.P, kern)
        else:
            Tm = ck.tril_inverse(A, kern) if kern and inverse_supported(A.shape[-1]) else unit_lower_inv(A, inv_base)
            U, W = Tm @ w_, Tm @ (bt_ * geo.P)
    st = states_type(geo.key, bt is not None, kern, w, C, K, V)
    states, Z, S_end = _scan_forward(geo, S0, u, U, W, compose, matrix, kern, st, ml)
    if kern and not geo.key and ck.fuses_readout(kern, C, K, V):
        # M_ru is written for the backward: forming it again there was measured slower than keeping it
        y, M = ck.chunk_out(r, u, Z, states, geo.l, kern, out, rfac, ml=ml, z_model=ml is not None)
    else:
        if M is None and isinstance(geo, KernelKeyDecay):
            # the pair kernel converts 16-bit roles as it reads them (no float32 copies) and scales r by rfac so
            M, r_ = geo.pair(r, u, strict=False, scale=rfac), None
        elif M is None:  # else formed with A, from the same r_
            r_, u_ = _up(geo, _scaled(r, rfac), u)
            M = geo.pair(r_, u_, strict=False)
        if kern and ck.fuses_readout(kern, C, K, V):  # a key-vector decay: M_ru given, P per key element
            y = ck.chunk_out_key(r, M, Z, states, geo.P, kern, out, rfac)
        else:
            (Z_,) = _up(geo, Z)
            r_ = _up(geo, _scaled(r, rfac))[0] if r_ is None else r_
            y = (r_ * geo.P) @ states + M @ Z_
            if out is not None:
                y = model_layout(y, out)
    return y, S_end, (states, M) + ((Z, Tm, W) if bt is not None else ())


def _forward_key_model(S0, r, u, w, l, kern: Tuning, out, rfac, ml: tuple):
    """``_forward`` of a key-vector decay without a transition (GLA) on the kernels, every input in the model's layout
    (``core_fn``'s ``model_rows`` with ``key``): r, u [B, n C, HK, K], w [B, n C, H, V] and the log-decays l [B, n,
    C, H, K] (the input's [B, T, H, K], viewed by chunks) are read so by the decays' pass (l, and u for u ⊙ Q), the
    scan (w), the pair (r, u and l: it forms the decays e^l as it reads them, so no pass writes them) and the readout
    (r and w): none of the four is copied to the chunks' layout.
    ``ml`` = (H, HK, n, GB) (``chunk_kernels._model_consts``). Returns (y, S_end, (states, M)) as ``_forward``."""
    B, n, C, H, K = l.shape
    st = states_type(True, False, kern, w, C, K, S0.shape[-1])
    lm = l.reshape(B, n * C, H, K)
    dec = ck.key_decays(lm, kern, scaled=((u, "Q"),), d=False, q=False, st=st, ml=ml)  # the pair forms e^l itself
    states, _, S_end = ck.chunk_scan(S0, None, w, dec.scaled[0], dec.g, None, kern, reverse=False, st=st, ml=ml,
                                     x_model=True)
    M = ck.pair(r, u, lm, False, kern, rfac, ml)
    y = ck.chunk_out_key(r, M, w, states, dec.P, kern, out, rfac, ml)
    return y, S_end, (states, M)


def _backward_key_model(r, u, w, l, res, dy, dS_end, kern: Tuning, rfac, ml: tuple, st):
    """``_backward`` of ``_forward_key_model`` reading r, u and l in the model's layout too (``key_model_backward``):
    the decays' pass forms u ⊙ Q and r ⊙ P from them (no P nor Q: the tail forms its own), the pair gradient copies
    r's and u's raw rows from them (with ``Tuning.pair_grad_logdecays`` l's too, each decay e^l formed as read, and
    the pass writes no D), the key tail reads them and writes dr, du, dl per value head in that layout
    [B, n C, H, K]; w (Z) and dy ([B, H, n, C, V], as ``core_fn`` brings it) meet MLX's products in the chunks'
    layout. ``st``: the 16-bit type of u ⊙ Q and r ⊙ P (``core_fn``'s). Returns (dS0, dr, du, dw, dl)."""
    states, M = res
    B, n, C, H, K = l.shape
    lm = l.reshape(B, n * C, H, K)
    ld = kern.pair_grad_logdecays  # no D either: the pair gradient forms each decay from l as it reads it
    dec = ck.key_decays(lm, kern, scaled=((u, "Q"), (r, "P")), d=not ld, pq=False, st=st or None, ml=ml)
    uQ, rP = dec.scaled
    Z = ck.model_chunks(w, n)
    ps = key_products_type(True, False, states, dy, kern)
    if ps is None:  # MLX's products in float32 (16-bit operands give a 16-bit product)
        Z, states, dy = (x.astype(mx.float32) for x in (Z, states, dy))
    F = M.swapaxes(-1, -2) @ dy.astype(M.dtype)
    dSn, dZ, dS0, dg = ck.chunk_scan(dS_end, uQ, F, None, dec.g, None, kern, reverse=True, P=(rP, dy), St=states,
                                     Pq=_rfac_rows(rP, rfac), st=ps)
    cp = kern.copy_transposes
    d_uQ, d_rP = Z @ tr(dSn, cp), dy @ tr(states, cp)
    dr_, du_ = ck.pair_grad(dy @ tr(Z, cp), r, u, lm if ld else dec.d, False, kern, rfac, ml, ld)
    dr, du, _, dl = ck.chunk_bwd_key(r, u, None, lm, dr_, du_, None, d_rP, d_uQ, None, dg, kern, rfac, ml=ml)
    return dS0, dr, du, dZ, dl.reshape(l.shape)


def key_model_backward(kern: Tuning, C: int, K: int, types: tuple) -> bool:
    """Whether ``_backward_key_model`` runs (``Tuning.key_model_backward``): the key tail a kernel and the pair
    gradient copying its raw rows (r's and u's dtype names ``types``) ahead."""
    return kern.key_model_backward and ck.fuses_key_tail(kern, C) and ck.pair_grad_reads_model(kern, C, K, types)


def key_model_rows(kern: Tuning | None, C: int, K: int, V: int) -> bool:
    """Whether a key-vector decay without a transition can read its inputs in the model's layout
    (``_forward_key_model``): the pair kernels (the whole-chunk form reading its buffers: ``ck.pair_reads_model``),
    the fragment scan and the staged key readout run."""
    return bool(kern and kern.async_staging and pair_supported(kern.dialect, C, K) and ck.pair_reads_model(kern, C, K)
                and ck.scan_supported(kern, C, K) and ck.fuses_readout(kern, C, K, V))


def _forward_keyed(geo, S0, r, x, w, f, rho: float, kern, out=None, rfac=None, ml=None):
    """``_forward`` of the delta rule with factor reads (``core_fn``'s ``rho``): u = f ⊙ x and b̃ = ρ x for a key x,
    a factor per token f [.., C, 1] and a constant ρ, read so by every fused kernel (the UT transform, both scans
    through their row scales, the readout) and never formed. ``ml``: r, x and w are the model's inputs as they are
    (``core_fn``'s ``model_rows``)."""
    if geo.key:
        return _forward_keyed_key(geo, S0, r, x, w, f, rho, kern, out, rfac)
    o16 = x.dtype if kern.ut_16bit and x.dtype in (mx.bfloat16, mx.float16) else None  # U, W in the keys' type
    s16 = o16 if kern.states_16bit else None  # and the residuals: T, the states, Z (then M, as the readout writes it)
    Tm, U, W = ck.chunk_ut(None, x, w, geo.l, kern, uf=f, bf=rho, out=o16, ml=ml, st=s16)
    Bq = geo.role("fQ", f, "Q")  # formed in the decays' pass
    states, Z, S_end = ck.chunk_scan(S0, W, U, x, geo.g, None, kern, reverse=False, Bq=Bq, ml=ml, st=s16)
    y, M = ck.chunk_out(r, x, Z, states, geo.l, kern, out, rfac, uf=f, ml=ml)
    return y, S_end, (states, M, Z, Tm, W)


def _forward_keyed_key(geo, S0, r, x, w, f, rho: float, kern, out=None, rfac=None):
    """``_forward_keyed`` for a key-vector decay (KDA): the pair kernels form Ax = pair(x, x) and Mx = pair(r, x), and
    A = ρ Ax and M = Mx with their columns scaled by f (u's factor belongs to the column token s); the UT kernel reads
    b̃ = ρ x, the decays' pass forms x ⊙ Q, the scan scales its rows by f. Residuals: (states, Mx, Z, Tm, W, Ax), the
    unscaled pairs giving df without a division by f."""
    (r_,) = _up(geo, _scaled(r, rfac))
    Ax, Mx = geo.pair_dual(x, r_, x)
    fT = f.swapaxes(-1, -2)
    A, M = (rho * Ax) * fT, Mx * fT
    Tm, U, W = ck.chunk_ut_key(A, w, x, geo.P, kern, bf=rho)
    states, Z, S_end = ck.chunk_scan(S0, W, U, geo.role("uQ", x, "Q"), geo.g, None, kern, reverse=False, Bq=f)
    y = ck.chunk_out_key(r, M, Z, states, geo.P, kern, out, rfac)
    return y, S_end, (states, Mx, Z, Tm, W, Ax)


def _backward_keyed(geo, r, x, f, rho: float, res, dy, dS_end, compose, matrix, kern, rfac, ml=None):
    """``_backward_fused`` with factor reads (``_forward_keyed``): the gradients (dS0, dr, dx, dw, dl, df); the pass
    after the reverse scan writes dx = f du + ρ db̃ and df = Σ_i du ⊙ x itself."""
    if geo.key:
        return _backward_keyed_key(geo, r, x, f, rho, res, dy, dS_end, compose, matrix, kern, rfac)
    return _backward_fused(geo, r, x, None, None, res, dy, dS_end, compose, matrix, kern, rfac, factors=(f, rho),
                           ml=ml)


def _backward_keyed_key(geo, r, x, f, rho: float, res, dy, dS_end, compose, matrix, kern, rfac):
    """``_backward_keyed`` for a key-vector decay (``_forward_keyed_key``): the pairs' cotangents scaled as the pairs
    were (dAx = ρ dA f_s, dMx = dM f_s) go to the pair gradients for x and r, df_s takes Σ_t (ρ dA Ax + dM Mx)_ts
    from them and Σ_i x Q DUQ from the tail kernel, which writes dx and dr."""
    states, Mx, Z, Tm, W, Ax = res
    fT = f.swapaxes(-1, -2)
    (r_,) = _up(geo, _scaled(r, rfac))
    F = (Mx * fT).swapaxes(-1, -2) @ dy
    E = (_readout_rows(geo, r, r_, rfac), dy)
    dSn, dZ, dS0, dg = scan_backward(geo, dS_end, (geo.role("uQ", x, "Q"), f), W, F, E, compose, matrix, kern, states)
    cp = geo.t.copy_transposes
    statesT, ZT = tr(states, cp), tr(Z, cp)
    Delta = Tm.swapaxes(-1, -2) @ dZ
    dA, dM = Delta @ ZT, dy @ ZT
    rdA = rho * dA
    df = (rdA * Ax + dM * Mx).sum(-2)[..., None]  # the pairs' part of df, per column token s
    dX1, dr_, dY = geo.pair_dual_grad(rdA * fT, dM * fT, x, r_, x)
    dr, dx, df_tail, dl = ck.chunk_bwd_key(r, x, None, geo.l, dr_, dY, dX1, dy @ statesT, Z @ tr(dSn, cp),
                                           Delta @ statesT, dg, kern, rfac, uf=f, bf=rho)
    return dS0, dr, dx, Delta, dl, df + df_tail


def _readout_rows(geo, r, r_, rfac):
    """(r ⊙ P, row scales) for a key-vector decay's reverse scan: where formed with the decays (``core_fn``'s
    ``scaled``), r ⊙ P of r as the core got it and rfac as its rows' scale [.., C, 1] (None without it, ``_rows``);
    else formed here of r_ = rfac·r, which a delta rule's pair gradients read anyway."""
    if "rP" not in geo.scaled:
        return geo.role("rP", r_, "P"), None
    return geo.scaled["rP"], _rfac_rows(geo.scaled["rP"], rfac)


def _rfac_rows(rP, rfac):
    """rfac as r ⊙ P's row scales [.., C, 1] for the reverse scan (None without it), unrounded."""
    return None if rfac is None else mx.full((*rP.shape[:-1], 1), rfac, mx.float32)


def _scaled(r, rfac):
    """rfac·r, the readout role (``core_fn``'s ``rfac``; None: r itself), in float32 at least: a 16-bit r (an input
    verbatim, ``role_dtype``) times rfac (K^-1/2, not a power of two) would round to 16 bits, and r·dr in the key
    tail (which reads r itself, scaled as it reads) would then meet pair gradients of another r: with KDA's factor
    reads dgk lost a digit (bf16 inputs: 0.02 off float64, 0.002 scaled in float32)."""
    if rfac is None:
        return r
    return (r if r.dtype not in (mx.bfloat16, mx.float16) else r.astype(mx.float32)) * rfac


def _backward(geo, r, u, w, bt, res, dy, dS_end, compose, matrix=False, kern=None, rfac=None):
    """The gradients of the inputs of ``_forward`` (with ``rfac``: of r, d(rfac·r) rfac)."""
    if kern and not geo.key and ck.fuses_bwd(kern, *u.shape[-2:], bt is not None):
        return _backward_fused(geo, r, u, w, bt, res, dy, dS_end, compose, matrix, kern, rfac)
    states, M = res[:2]
    Z, Tm, W = res[2:] if bt is not None else (w, None, None)
    given = (r, u, bt)  # the roles as the core got them: the key-decay tail kernel reads them so
    # 16-bit states (a key-vector decay's, ``Tuning.key_roles_16bit``) and dy in their type (``core_fn``) meet MLX's
    # products in the compute dtype too (two 16-bit operands give a 16-bit product), unless
    # ``Tuning.key_products_16bit`` keeps them so: then the products over values round to it, as FLA's dh and dv
    st = key_products_type(geo.key, bt is not None, states, dy, kern)
    if st is None:
        r, u, w, bt, Z, states, dy = _up(geo, r, u, w, bt, Z, states, dy)
        F = M.swapaxes(-1, -2) @ dy
    else:  # F = Mᵀ dy in M's float32
        r, u = _up(geo, r, u)
        F = M.swapaxes(-1, -2) @ dy.astype(M.dtype)
    r = _scaled(r, rfac)
    if geo.key:  # formed with the decays (``core_fn``'s ``scaled``), r ⊙ P of r as given: rfac its rows' scale
        scan_u, scan_r = geo.role("uQ", u, "Q"), _readout_rows(geo, given[0], r, rfac)
    else:  # u ⊙ Q and r ⊙ P formed as the generated scan reads u and r (row scales)
        scan_u, scan_r = (u, geo.Q), (r, geo.P)
    # E = (r ⊙ P)ᵀ dy
    dSn, dZ, dS0, dg = scan_backward(geo, dS_end, scan_u, W, F, (scan_r, dy), compose, matrix, kern, states, st=st)
    cp = geo.t.copy_transposes
    statesT, ZT = tr(states, cp), tr(Z, cp)
    d_uQ = Z @ tr(dSn, cp)
    if bt is None:
        if isinstance(geo, KernelKeyDecay):  # r and u as given (no float32 copies), rfac applied as r is read
            dr_, du_ = geo.pair_grad(dy @ ZT, *given[:2], strict=False, scale=rfac)
        else:
            dr_, du_ = geo.pair_grad(dy @ ZT, r, u, strict=False)
        d_rP = dy @ statesT
        dw, dbt_, dR = dZ, None, None
    else:
        Delta = Tm.swapaxes(-1, -2) @ dZ
        d_rP, dR = dy @ statesT, Delta @ statesT  # two products: one over [dy; Delta] held a 2C-row copy and its result
        dbt_, dr_, du_ = geo.pair_dual_grad(Delta @ ZT, dy @ ZT, bt, r, u)  # du_: of both pairs
        dw = Delta
    if geo.key and kern and ck.fuses_key_tail(kern, u.shape[-2]):  # the elementwise tail below as one kernel
        dr, du, dbt, dl = ck.chunk_bwd_key(*given, geo.l, dr_, du_, dbt_, d_rP, d_uQ, dR, dg, kern, rfac)
        return dS0, dr, du, dw, dl, dbt
    P, Q = geo.P, geo.Q  # read here only: a key decay's tail kernel forms its own (its geometry then writes none)
    uQ, rP = (scan_u, _rows(*scan_r)) if geo.key else (u * Q, r * P)
    dG = r * dr_ - u * du_ + rP * d_rP - uQ * d_uQ
    dbt = None
    if bt is not None:
        dbt = P * dR + dbt_
        dG = dG + bt * dbt_ + (bt * P) * dR
    du = Q * d_uQ + du_
    dr = P * d_rP + dr_
    dl = log_decay_grad(geo, dG, (uQ * d_uQ).sum(-2) + geo.g * dg)
    return dS0, _scaled(dr, rfac), du, dw, dl, dbt


def key_products_type(key: bool, delta: bool, states, dy, kern):
    """The 16-bit type of the backward's products over values for a key-vector decay without a delta rule where
    ``Tuning.key_products_16bit`` asks and the states, dy and the generated reverse scan allow (the scan then writes
    dS and dZ in it; with ``Tuning.key_scaled_16bit`` the backward's decays' pass writes u ⊙ Q and r ⊙ P, the scan's
    other operands, in it too, so that the scan runs on the wide multiply-add); None: the products in the compute
    dtype."""
    lo = (mx.bfloat16, mx.float16)
    if not (key and not delta and kern and kern.key_products_16bit and states.dtype in lo
            and dy.dtype == states.dtype):
        return None
    C, K, V = dy.shape[-2], states.shape[-2], states.shape[-1]
    return states.dtype if ck.scan_supported(kern, C, K) and ck.use_mma(kern, C, K, V) else None


def log_decay_grad(geo, dG, dG_end):
    """dl [.., C, F] from dG, the gradient of the cumulative log-decays G_t [.., C, K] through every factor
    exp(±G_t), and dG_end [.., K], that of G_end (which enters Q_s for every s, and g = e^{G_end}): both folded
    to the decay's shape, dG_end joining the last row, then a reverse cumulative sum inside each chunk."""
    dG, dG_end = geo.fold(dG), geo.fold(dG_end)
    C = dG.shape[-2]
    dG = dG + mx.where((mx.arange(C) == C - 1)[:, None], dG_end[..., None, :], 0.0)
    return mx.cumsum(dG, axis=-2, reverse=True)


def _backward_fused(geo, r, u, w, bt, res, dy, dS_end, compose, matrix, kern, rfac, factors=None, ml=None):
    """``_backward`` for a scalar decay where the backward's fragment pass runs (``chunk_kernels.fuses_bwd``): the
    reverse scan reads u and r as the core got them (16-bit where ``role_dtype`` kept them so) with their row
    scales Q and rfac·P (u ⊙ Q and r ⊙ P never formed), and the pass after it (``chunk_kernels.chunk_bwd``) forms
    the pair gradients through Γ and the elementwise tail; MLX keeps the products over V. ``factors`` = (f, ρ):
    factor reads (``_backward_keyed``), u a key x read as f ⊙ x (the scan's row scales f ⊙ Q) and b̃ = ρ x, bt None;
    the gradients of x and f come in place of du and db̃; ``ml``: r and x the model's key inputs, dr and dx per value
    head in the model's layout (``chunk_kernels.chunk_bwd``). 16-bit states (``Tuning.states_16bit``, with M, T and
    Z so, and dy in their type: ``core_fn``) make the reverse scan write dS_next and dZ in it too, and every MLX
    product here then runs on 16-bit operands (FLA's dh and dv)."""
    delta = bt is not None or factors is not None
    f, rho = factors or (None, None)
    states, M = res[:2]
    Z, Tm, W = res[2:] if delta else (w, None, None)
    Z = Z.astype(states.dtype)  # products with the states' operands in one type (no promotion in MLX's products)
    Pr = geo.P if rfac is None else geo.P * rfac
    F = M.swapaxes(-1, -2) @ dy
    Aq = geo.Q if f is None else geo.role("fQ", f, "Q")
    st = None if states.dtype == mx.float32 else states.dtype
    dSn, dZ, dS0, dg = scan_backward(geo, dS_end, (u, Aq), W, F, ((r, Pr), dy), compose, matrix, kern, states, ml,
                                     st)
    cp = geo.t.copy_transposes
    Delta = Tm.swapaxes(-1, -2) @ dZ if delta else dZ
    rows = (Z, dy, Delta if delta else None)
    # the pair cotangents Δ Zᵀ and dy Zᵀ: formed in the pass (``Tuning.bwd_scores``), or by MLX for it; and the three
    # products that read the states: formed in the pass (``Tuning.bwd_products``; on the wide multiply-add with the
    # pair cotangents where the states share the rows' type), or by MLX for it
    wide = ck.scores_in_pass(kern, rows + (states, dSn))
    scores = rows if wide or not kern.bwd_products and ck.scores_in_pass(kern, rows) else None
    dMA, dMR = (None, None) if scores else ((Delta @ tr(Z, cp)) if delta else None, dy @ tr(Z, cp))
    if ck.products_in_pass(kern, Z.shape[-2], states.shape[-2], Z.shape[-1], delta, wide):
        prods, DUQ, DRP, dR = rows + (states, dSn), None, None, None
    else:
        statesT = tr(states, cp)
        prods, DUQ, DRP, dR = None, Z @ tr(dSn, cp), dy @ statesT, Delta @ statesT if delta else None
    dr, du, dbt, dl = ck.chunk_bwd(dMA, dMR, r, u, bt, DUQ, DRP, dR, geo.l, dg.sum(-1), kern, rfac, uf=f, bf=rho,
                                   ml=ml, prods=prods, scores=scores)
    return dS0, dr, du, Delta, dl, dbt


def reads_model_rows(kern: Tuning, C: int, K: int, V: int) -> bool:
    """Whether the backward without a delta rule reads r and u in the model's layout: its reverse scan takes its
    products as factors (``chunk_kernels.scan_fuses_products``: the fragment frame, r and u read with their row
    scales) and the fragment pass after it runs (``chunk_kernels.fuses_bwd``)."""
    return ck.scan_fuses_products(kern, C, K, V, False) and ck.fuses_bwd(kern, C, K, False)


def decay_geometry(key: bool, kern: Tuning | None, before: bool = False, pq: bool = True, q: bool = True):
    """The class (or factory, same signature) of a chunk's decay geometry: ``ScalarDecay`` (its factors by a kernel,
    ``KernelScalarDecay``, with chunk kernels); for a key-vector decay
    with chunk kernels (``kern``) the pair kernels where they have a layout for (C, K) (K a multiple of 32, known at
    the first call), the hierarchy (``KeyDecay``) otherwise. ``before``: the geometry's kernel also forms
    ``p_before`` (a transition before the decay reads it); ``pq`` off: it writes g for P and Q (``KernelKeyDecay``);
    ``q`` off: P but no Q (the forward's)."""
    if not key:
        return KernelScalarDecay if kern else ScalarDecay
    if not kern:
        return KeyDecay

    def make(l, t_, saved=(), scaled=None, st=None):
        if pair_supported(t_.dialect, *l.shape[-2:]):
            return KernelKeyDecay(l, t_, saved, scaled, before, pq, q, st)
        return KeyDecay(l, t_, saved, scaled)  # u ⊙ Q formed by MLX in float32 (``st`` is the kernels')
    return make


@lru_cache(maxsize=128)
def core_fn(key: bool, delta: bool, compose: bool, t: Tuning, out=None, rfac: float | None = None,
            rho: float | None = None, model_rows: str | None = None):
    """The chunked core as an ``mx.custom_function`` with the hand-derived VJP above.

    Arguments (all chunked, [..., n, C, F]): S0 [..., K, V], r, u [.., C, K], w [.., C, V],
    l [.., C, F] (log-decays; F = K when ``key``, else 1) and, when ``delta``, b̃ [.., C, K].
    ``t``: the tuning (device forms, compilation, the triangular inverse's base, chunk kernels); ``out``: None, or a dtype for y in the
    model's layout [B, n C, H, V] (leading axes then B, H; its cotangent arrives so too); ``rfac``: None, or a
    constant c for the readout role c·r (given r; ``chunked._readout_role``); ``rho``: None, or the delta rule's
    constant ρ with factor reads (a scalar decay on the fused kernels, ``chunked._keyed_input``): u is then a key x,
    the last argument is the factor f [.., C, 1] of u = f ⊙ x, b̃ = ρ x, and the gradients are those of x and f;
    ``model_rows`` (with ``out``, and ``rho`` or no delta rule): None, or GQA's head map ("block" or "tile") where r,
    x (u) and w are the model's inputs as they are, [B, n C, HK, K] (r, x) and [B, n C, H, V] (w), read so by the
    forward's kernels (no layout copies; the key heads shared, not expanded), their gradients returned so (dr, dx
    summed over GQA's groups); without a delta rule the backward copies them to the chunks' layout itself. A
    key-vector decay (no delta rule, ``key_model_rows``) takes l so too, viewed by chunks [B, n, C, H, K], its
    gradient returned so (``_forward_key_model``).
    Returns (y [.., n, C, V], S_end, *residuals); the residuals (chunk-entry states, M_ru, with b̃
    Z, T, W, and a key-vector decay's hierarchy) are for the VJP only and take no cotangent."""
    matrix, inv_base = t.gpu_forms, t.inverse_base
    kern = t if t.chunk_kernels else None
    Geo = decay_geometry(key, kern)
    GeoFwd = decay_geometry(key, kern, q=False)  # the forward reads no Q: its scans take u ⊙ Q formed
    GeoTail = decay_geometry(key, kern, pq=False)  # ... nor a backward whose key tail is a kernel (it forms its own)
    nres = (6 if key and rho is not None else 5) if delta else 2  # factor reads keep a key decay's unscaled A too
    key_rows = key and not delta and model_rows is not None  # ``_forward_key_model``

    def scaled(r, u, bt, backward: bool):
        """The roles scaled by the decays, formed with them (on the kernels: in the geometry's pass): a key-vector
        decay's u ⊙ Q for the scans, and the backward's r ⊙ P of r as given (the reverse scan applies rfac as its
        rows' scale) unless a delta rule scales r by rfac for its pair gradients anyway: then r ⊙ P of that, formed
        where the scan reads it (kept from the decays' pass it lived the whole backward, 0.13 GiB more at KDA's peak);
        with factor reads of a scalar decay the scans' row scales f ⊙ Q (f: ``bt``, as l [.., C, 1])."""
        if not key:
            return {"fQ": (bt, "Q")} if rho is not None else None
        return {"uQ": (u, "Q")} | ({"rP": (r, "P")} if backward and not (delta and rfac is not None) else {})

    def ml(r, l, by_rows: bool = False):
        """The kernels' model-layout constants (H, HK, NCH, GB) of r [B, n C, HK, K] and l [B, H, n, C, F], or
        (``by_rows``: a key decay's forward) l [B, n, C, H, K]."""
        if model_rows is None:
            return None
        H, n = (l.shape[3], l.shape[1]) if by_rows else (l.shape[1], l.shape[2])
        return H, r.shape[2], n, model_rows == "block"

    def fwd(S0, r, u, w, l, bt=None):
        if key_rows:  # l [B, n, C, H, K] too (``_forward_key_model``)
            y, S_end, res = _forward_key_model(S0, r, u, w, l, kern, out, rfac, ml(r, l, by_rows=True))
            return (y, S_end) + res  # the pair kernels' geometry keeps nothing (``KernelKeyDecay.saved``)
        st = key and states_type(key, delta, kern, w, l.shape[-2], S0.shape[-2], S0.shape[-1])
        geo = GeoFwd(l, t, scaled=scaled(r, u, bt, False), **({"st": st} if st else {}))
        if rho is not None:
            y, S_end, res = _forward_keyed(geo, S0, r, u, w, bt, rho, kern, out, rfac, ml(r, l))
        else:
            y, S_end, res = _forward(geo, S0, r, u, w, bt, compose, matrix, inv_base, kern, out, rfac, ml(r, l))
        return (y, S_end) + res + tuple(geo.saved())

    def bwd(*a):
        r, u, w, l = a[1:5]  # a[0], the initial state, enters only through the residual states
        if key_rows and key_model_backward(kern, l.shape[2], l.shape[-1], (dtype_name(r.dtype), dtype_name(u.dtype))):
            res, (dy, dS_end) = a[5:7], a[-2:]
            dy = core_layout(dy, l.shape[1], res[0].dtype)
            st = kern.key_scaled_16bit and key_products_type(True, False, res[0], dy, kern)
            dS0, dr, du, dw, dl = _backward_key_model(r, u, w, l, res, dy, dS_end, kern, rfac,
                                                      ml(r, l, by_rows=True), st)
            grads = (dS0, *(group_heads(g, r.shape[2], model_rows) for g in (dr, du)), model_layout(dw, w.dtype), dl)
            return tuple(g.astype(x.dtype) for g, x in zip(grads, a))
        if key_rows:  # l [B, n, C, H, K]: the backward's kernels read the chunks' layout
            l = ck.model_chunks(l.reshape(l.shape[0], -1, *l.shape[3:]), l.shape[1])
        bt = a[5] if delta else None
        k = 6 if delta else 5
        res, geo_saved, (dy, dS_end) = a[k:k + nres], a[k + nres:-2], a[-2:]
        if out is not None:  # in the states' type: 16-bit states (``Tuning.states_16bit``) take 16-bit products
            dy = core_layout(dy, l.shape[-3], res[0].dtype)
        # u ⊙ Q and r ⊙ P in the products' 16-bit type where the reverse scan alone reads them (the tail's kernel)
        st = (key and kern and kern.key_scaled_16bit and ck.fuses_key_tail(kern, l.shape[-2])
              and key_products_type(key, delta, res[0], dy, kern))

        def geometry(r, u):
            # P and Q, then formed only if read (a delta rule's r ⊙ P is: ``scaled``)
            tail = key and not delta and kern and ck.fuses_key_tail(kern, l.shape[-2])
            return (GeoTail if tail else Geo)(l, t, geo_saved, scaled(r, u, bt, True), **({"st": st} if st else {}))

        if key_rows:  # r and u scaled in the decays' pass in the chunks' layout too
            n, heads = l.shape[2], ml(r, l)
            rc, uc = ck.model_chunks(r, n, heads), ck.model_chunks(u, n, heads)
            dS0, dr, du, dw, dl, dbt = _backward(geometry(rc, uc), rc, uc, ck.model_chunks(w, n), bt, res, dy, dS_end,
                                                 compose, matrix, kern, rfac)
            dr, du = model_layout(dr, dr.dtype), model_layout(du, du.dtype)  # summed over GQA groups below
        elif rho is not None:
            geo = geometry(r, u)
            dS0, dr, du, dw, dl, dbt = _backward_keyed(geo, r, u, bt, rho, res, dy, dS_end, compose, matrix, kern, rfac,
                                                       ml(r, l))
        elif model_rows is not None:  # no delta rule: w goes to the chunks' layout (copied here, not kept); r and u
            # too where the reverse scan and the pass after it cannot read the model's
            n, heads, geo = l.shape[2], ml(r, l), geometry(r, u)
            wc = ck.model_chunks(w, n)
            if reads_model_rows(kern, l.shape[-2], r.shape[-1], w.shape[-1]):  # dr, du per value head
                dS0, dr, du, dw, dl, dbt = _backward_fused(geo, r, u, wc, None, res, dy, dS_end, compose, matrix, kern,
                                                           rfac, ml=heads)
            else:
                rc, uc = ck.model_chunks(r, n, heads), ck.model_chunks(u, n, heads)
                dS0, dr, du, dw, dl, dbt = _backward(geo, rc, uc, wc, bt, res, dy, dS_end, compose, matrix, kern, rfac)
                dr, du = model_layout(dr, dr.dtype), model_layout(du, du.dtype)  # summed over GQA groups below
        else:
            dS0, dr, du, dw, dl, dbt = _backward(geometry(r, u), r, u, w, bt, res, dy, dS_end, compose, matrix, kern,
                                                 rfac)
        if model_rows is not None:  # dr, dx per value head [B, n C, H, K]; Δ (dw) [B, H, n, C, V] as w's layout
            dr, du = (group_heads(g, r.shape[2], model_rows) for g in (dr, du))
            dw = model_layout(dw, w.dtype)
            dl = dl.transpose(0, 2, 3, 1, 4) if key_rows else dl  # as its l came, [B, n, C, H, K]
        grads = (dS0, dr, du, dw, dl) + ((dbt,) if delta else ())
        return tuple(g.astype(x.dtype) for g, x in zip(grads, a))  # a 16-bit role (``role_dtype``) takes its own type

    return with_vjp(fwd, bwd, t)


def with_vjp(fwd, bwd, t: Tuning):
    """A chunk core as a ``pieces.Piece``: ``fwd(*args)`` returns (y, S_end, *residuals); its VJP is
    ``bwd(*args, *residuals, dy, dS_end)``, the two cotangents zeros where none came. Both are recorded and replayed
    where the tuning replays graphs (``ck.piece``: under ``mx.vjp``, where ``mx.compile`` would trace nothing),
    else traced once by ``mx.compile`` where it compiles (``Tuning.compile``)."""
    def vjp(args, outs, cots):
        return bwd(*args, *outs[2:], cots[0], cots[1])

    if t.replay_graphs:
        return ck.piece(fwd, vjp, "core", t)
    return Piece(fwd, vjp, (lambda f, name: mx.compile(f)) if t.compile else (lambda f, name: f), "core")
