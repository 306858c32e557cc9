r"""The adjoint of a recurrence step: fixed structure, sympy for every leaf partial.

Backward walks t = T-1 … 0 carrying dS (and dz). With dy = do / N(n) and
dn = -N'(n) / N(n)² · Σ_j do_j y_j::

    dr = S_t dy + z_t dn            dS += r dyᵀ ;  dz += r dn ;  ds = do ;  dc = (doᵀ w) 1 ;  dw += (Σ_i c_i) do
    du = dS w ;  dw = dSᵀ u ;  dQ = dS
    dP = dQ + b (aᵀ dQ) ;  da = dQ (Pᵀ b) ;  db = P (dQᵀ a)
    dS_{t-1} = D ⊙ dP ;  dD = dP ⊙ S_{t-1}
    dz_{t-1} = d ⊙ dz ;  dd = dz ⊙ z_{t-1} ;  du' = dz

With a transition ``before_decay`` (Q = P + a (bᵀ S_{t-1})): da = dQ (S_{t-1}ᵀ b), db = S_{t-1} (dQᵀ a),
dD = dQ ⊙ S_{t-1} and dS_{t-1} = D ⊙ dQ + b (aᵀ dQ).

With ``readout_before_update`` (y = S_{t-1}ᵀ r, no normalizer): dr = S_{t-1} dy, and r dyᵀ is added to
dS_{t-1} after the step's adjoint instead of to dS_t before it.

Each role's adjoint lives on the role's domain (decay: (i, j); a, b, u, r, d, u', c: (i); w, s: (j)).
An input x receives Σ_roles Σ_{domain \ index(x)} adj_role ⊙ ∂role/∂x: the reductions are stated
here, never discovered by sympy. Key inputs additionally sum over their GQA group, parameters
over batch and time; a feature map's gradient passes through its VJP to its source key.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import sympy as sp

from ..spec import ir

ROLE_DOMAIN = ir.ROLE_DOMAIN


@dataclass(frozen=True)
class Partial:
    """∂(role term)/∂(input element), summed over ``reduce`` after multiplying by the role's adjoint."""

    role: str
    wrt: str
    expr: sp.Expr
    reduce: tuple[str, ...]

    def __repr__(self) -> str:
        red = f"  Σ_{''.join(self.reduce)}" if self.reduce else ""
        return f"d{self.wrt} += d[{self.role}] * ({self.expr}){red}"


@dataclass(frozen=True)
class Adjoint:
    rec: ir.Recurrence
    partials: tuple[Partial, ...]
    dN: sp.Expr  # N'(n), or 0 without a normalizer

    def for_input(self, name: str) -> tuple[Partial, ...]:
        return tuple(p for p in self.partials if p.wrt == name)

    def __repr__(self) -> str:
        lines = [f"Adjoint of {self.rec.name}"] + [f"  {p!r}" for p in self.partials]
        if self.rec.has_normalizer:
            lines.append(f"  N'(n) = {self.dN}")
        return "\n".join(lines)


@lru_cache(maxsize=128)
def derive(rec: ir.Recurrence) -> Adjoint:
    """Differentiate every term with respect to every input (and feature) symbol it uses."""
    partials = []
    for role, expr in rec.terms().items():
        for sym in sorted(expr.free_symbols - {ir.SCALE}, key=lambda s: s.name):
            d = sp.diff(expr, sym)
            if d == 0:
                continue
            reduce = tuple(x for x in ROLE_DOMAIN[role] if x not in rec.index_of(sym))
            partials.append(Partial(role, sym.name, d, reduce))
    norm = rec.step.normalizer
    dN = sp.diff(norm.fn, ir.N_ARG) if norm is not None else sp.Integer(0)
    return Adjoint(rec, tuple(partials), dN)
