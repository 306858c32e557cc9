r"""One analysis of a spec, computed once and passed along: what every later stage asks of its terms.

The decay's index signature decides its kind everywhere (the recurrent kernels compute it once per step, row,
column or element; the chunked forms take a scalar, key-vector or full form); the transition decides whether
the chunked core's delta-rule form applies (a = ρ·u with ρ free of the key index); bare and scaled roles let
the chunked core read an input as it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import sympy as sp

from . import ir

KERNEL_KIND = {(): "scalar", (ir.I,): "row", (ir.J,): "col", (ir.I, ir.J): "elem"}  # per step, row, column, element
CHUNK_CLASS = {(): "scalar", (ir.I,): "key", (ir.J,): "full", (ir.I, ir.J): "full"}  # value-indexed: no matmul form


@dataclass(frozen=True)
class FeatureIdentity:
    """A spec whose readout and update keys are one feature map of two key inputs, r = c·φ(q), u = φ(k) (c free of
    every input but scale), with a scalar decay, no transition, skip or bonus, and no normalizer or one that rides
    along S: its chunked form computes in-chunk scores through the map's kernel identity (``chunked.features``)."""

    q: str        # the readout's key input
    k: str        # the update's key input
    c: sp.Expr    # the readout's constant factor, an expression of scale
    degree: int = 2  # the feature map's: φ(q)ᵀφ(k) = (qᵀk)^degree

    def constant(self, scale: float) -> float:
        """c at the call's ``scale`` (a substitution once per value: every call asks)."""
        return _at_scale(self.c, float(scale))


@lru_cache(maxsize=64)
def _at_scale(c: sp.Expr, scale: float) -> float:
    return float(c.subs(ir.SCALE, scale))


@dataclass(frozen=True)
class Analysis:
    rec: ir.Recurrence
    decay_index: tuple[str, ...]          # free indices of the decay: (), (i,), (j,) or (i, j)
    zdecay_index: tuple[str, ...] | None  # of the normalizer's decay, or None without one
    rho: sp.Expr | None                   # ρ where the transition is a = ρ·u with ρ free of the key index (and reads
    #                                       the decayed state: a transition before the decay takes the general form)
    rho_pow2: float | None                # ρ when it is a constant ±2^e (the delta rules' -1): ρ·b exact in b's type
    bare_roles: tuple                     # (role, input symbol) where a role is an input verbatim (GDN's b = k, w = v)
    r_scaled: tuple | None                # (input symbol x, c as an expression of scale) where the readout is r = c·x
    fuse_z: bool                          # z rides along S as an extra value column (same decay and update)
    feature_identity: "FeatureIdentity | None" = None  # the chunked form through φ(q)ᵀφ(k) = (qᵀk)^p
    u_factor: tuple | None = None         # (key input symbol x, f) where the update key is u = f·x, f free of the key
    #                                       and value indices (GDN's β k): kernels can read x and scale as they read
    raw_keys: frozenset = frozenset()     # key inputs some term reads as they are (not only through a feature map)

    @property
    def decay_kind(self) -> str:
        """How the recurrent kernels compute the decay: "scalar", "row", "col" or "elem"."""
        return KERNEL_KIND[self.decay_index]

    @property
    def decay_class(self) -> str:
        """The chunked forms' class of the decay: "scalar", "key" or "full"."""
        return CHUNK_CLASS[self.decay_index]

    @property
    def zdecay_class(self) -> str | None:
        return None if self.zdecay_index is None else CHUNK_CLASS[self.zdecay_index]

    @property
    def delta_rule(self) -> bool:
        """A transition the chunked core's WY/UT form covers (a = ρ·u)."""
        return self.rho is not None

    @property
    def parallel_core(self) -> bool:
        """Whether the chunked form runs on the parallel core: a scalar or key-vector decay with no transition or
        a delta-rule one."""
        return self.decay_class != "full" and (self.rec.step.transition is None or self.delta_rule)

    @property
    def matmul_core(self) -> bool:
        """Whether the chunked form runs on a matmul core with a written VJP: the parallel core, or for any other
        rank-1 transition (RWKV-7's, one before the decay included) the general rank-1 core; both need a scalar or
        key-vector decay."""
        return self.decay_class != "full"


@lru_cache(maxsize=256)
def analyze(rec: ir.Recurrence) -> Analysis:
    terms = rec.terms()
    norm = rec.step.normalizer
    decay_index = rec.free_indices(terms["decay"])
    zindex = rec.free_indices(norm.decay) if norm is not None else None
    fuse = (norm is not None and rec.step.transition is None and CHUNK_CLASS[decay_index] != "full"
            and sp.simplify(norm.decay - terms["decay"]) == 0 and sp.simplify(norm.update - terms["u"]) == 0)
    rho, rho_pow2 = None, None
    tr = rec.step.transition
    if tr is not None and not tr.before_decay and sp.sympify(terms["u"]) != 0:  # the WY core's order only
        r = sp.simplify(sp.sympify(tr.a) / terms["u"])
        if not rec.free_indices(r) and r.is_finite is not False and not r.has(sp.zoo, sp.nan):
            rho = r
            if r.is_Number and r != 0 and math.log2(abs(float(r))).is_integer():
                rho_pow2 = float(r)
    sides = ir.KEY_ROLES + ir.VALUE_ROLES
    bare = tuple((role, e) for role, e in terms.items() if role in sides and isinstance(e, sp.Symbol) and e in rec.symbols)
    raw = frozenset(x.symbol for x in rec.inputs
                    if x.kind == "key" and any(x.symbol in e.free_symbols for e in terms.values()))
    return Analysis(rec, decay_index, zindex, rho, rho_pow2, bare, _scaled(rec, terms.get("r")), fuse,
                    _feature_identity(rec, terms, decay_index, fuse), _key_factor(rec, terms["u"]), raw)


def _key_factor(rec: ir.Recurrence, u) -> tuple | None:
    """(x, f) where u = f·x for a key input x and a factor f free of x and of the key and value indices (a per-token
    scalar, a parameter per head or a constant, but not 1: then u is x itself, a bare role), else None."""
    u = sp.sympify(u)
    for x in rec.inputs:
        if x.kind != "key" or x.symbol not in u.free_symbols:
            continue
        f = sp.simplify(u / x.symbol)
        if (x.symbol not in f.free_symbols and not rec.free_indices(f) and f != 1 and f.is_finite is not False
                and not f.has(sp.zoo, sp.nan)):
            return x.symbol, f
    return None


def _feature_identity(rec: ir.Recurrence, terms: dict, decay_index, fuse: bool) -> FeatureIdentity | None:
    """The spec's ``FeatureIdentity``, or None where its chunked form is the general one."""
    feats = {f.symbol: f for f in rec.features}
    if (not feats or decay_index or rec.step.transition is not None or rec.step.readout_before_update
            or "skip" in terms or "bonus" in terms or (rec.has_normalizer and not fuse)):
        return None
    u, r = sp.sympify(terms["u"]), _constant_multiple(rec, terms["r"])
    if u not in feats or r is None or r[0] not in feats:
        return None
    return FeatureIdentity(feats[r[0]].source, feats[u].source, r[1], feats[u].degree)


def _constant_multiple(rec: ir.Recurrence, e) -> tuple | None:
    """(x, c) where e = c·x for an input or feature symbol x and c free of every input but ``scale`` (c may be 1),
    else None."""
    if e is None:
        return None
    c, x = sp.sympify(e).as_independent(*rec.symbols, as_Add=False)
    if not (isinstance(x, sp.Symbol) and x in rec.symbols) or not c.free_symbols <= {ir.SCALE}:
        return None
    return x, c


def _scaled(rec: ir.Recurrence, e) -> tuple | None:
    """(x, c) where e = c·x for an input symbol x and c ≠ 1 free of every input but ``scale``, else None."""
    m = _constant_multiple(rec, e)
    return None if m is None or m[1] == 1 else m
