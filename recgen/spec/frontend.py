"""``@recurrence``: call the user's function on symbols, get an ``ir.Recurrence``.

Inside the function a key input stands for its element ``k[i]``, a value input for ``v[j]``, a
parameter for the element its signature names. Nothing is parsed or rewritten: the function
runs once on sympy symbols and returns an ``ir.Step``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import sympy as sp

from . import ir


@dataclass(frozen=True)
class InputKind:
    """An annotation: ``rg.Key``, ``rg.Value``, ``rg.Scalar``, ``rg.KeyGate``, ``rg.Param["i", "j"]``."""

    kind: str
    index: tuple[str, ...] = ()

    def __getitem__(self, index) -> "InputKind":
        if self.kind != "param":
            raise ir.SpecError(f"only Param takes an index signature, not {self.kind}")
        index = (index,) if isinstance(index, str) else tuple(index)
        if not set(index) <= {ir.I, ir.J} or len(set(index)) != len(index):
            raise ir.SpecError(f"Param{list(index)}: the signature must be (), ('i',), ('j',) or ('i', 'j')")
        return InputKind("param", tuple(x for x in (ir.I, ir.J) if x in index))


Scalar = InputKind("scalar", ())          # [B,T,H]: one number per token and value head
Key = InputKind("key", (ir.I,))           # [B,T,Hk,K]: shared by the GQA group of value heads
KeyGate = InputKind("key_gate", (ir.I,))  # [B,T,H,K]: a key-channel gate per value head
Value = InputKind("value", (ir.J,))       # [B,T,H,V]
Param = InputKind("param", ())            # [H, *signature]: per value head, constant in b and t

_features: list[ir.Feature] | None = None  # features declared while a spec function runs


def sympow(x: sp.Symbol, degree: int = 2) -> sp.Symbol:
    """φ(x): the symmetric power feature map of degree 2, 3 or 4 of a key input (φ(x)ᵀφ(y) = (xᵀy)^degree), of width
    C(d + degree − 1, degree): d(d+1)/2 at degree 2."""
    if _features is None:
        raise ir.SpecError("sympow() can only be used inside a @recurrence function")
    if not isinstance(x, sp.Symbol):
        raise ir.SpecError(f"sympow() takes a key input itself, got {x}: scale outside, "
                           "e.g. scale**2 * sympow(q)")
    if not isinstance(degree, int) or isinstance(degree, bool) or degree not in (2, 3, 4):
        raise ir.SpecError(f"sympow(): degree must be 2, 3 or 4, got {degree!r}")
    feat = ir.Feature(f"phi({x.name})" if degree == 2 else f"phi{degree}({x.name})", x.name, degree)
    if feat not in _features:
        _features.append(feat)
    return feat.symbol


def rank1(a, b, before_decay=False) -> ir.Rank1:
    """The transition Q = P + a (bᵀ P) (delta rule: a = -β k, b = k); with ``before_decay=True``
    Q = P + a (bᵀ S_{t-1}), the state before the decay (RWKV-7: S_t = (diag(d) + a bᵀ) S_{t-1} + u wᵀ)."""
    return ir.Rank1(sp.sympify(a), sp.sympify(b), before_decay)


def outer(u, w) -> ir.Outer:
    """The update u wᵀ with u over keys (i) and w over values (j)."""
    return ir.Outer(sp.sympify(u), sp.sympify(w))


def normalizer(decay, update, fn=lambda n: n) -> ir.Normalizer:
    """z_t = decay ⊙ z_{t-1} + update and o = y / fn(zᵀ r)."""
    return ir.Normalizer(sp.sympify(decay), sp.sympify(update), sp.sympify(fn(ir.N_ARG)))


def Step(update, readout, decay=1, transition=None, normalizer=None, skip=None, readout_before_update=False,
         bonus=None) -> ir.Step:
    """One step of the recurrence (see ``recgen.spec.ir``); numbers are accepted for any term.

    ``readout_before_update=True`` reads y = S_{t-1}ᵀ r (the state before this step's decay and update);
    ``bonus`` c(i) adds (Σ_i c_i) w to o, w the update's value factor (RWKV-6: c = r u k)."""
    if not isinstance(update, ir.Outer):
        raise ir.SpecError(f"update must be rg.outer(u, w) (an outer product), got {update!r}")
    if transition is not None and not isinstance(transition, ir.Rank1):
        raise ir.SpecError(f"transition must be rg.rank1(a, b), got {transition!r}")
    if normalizer is not None and not isinstance(normalizer, ir.Normalizer):
        raise ir.SpecError(f"normalizer must be rg.normalizer(decay, update, fn), got {normalizer!r}")
    return ir.Step(update=update, readout=sp.sympify(readout), decay=sp.sympify(decay),
                   transition=transition, normalizer=normalizer,
                   skip=None if skip is None else sp.sympify(skip), readout_before_update=readout_before_update,
                   bonus=None if bonus is None else sp.sympify(bonus))


def recurrence(fn=None, *, name: str | None = None, gqa: str = "block", default_scale: str = "key"):
    """Decorator: ``@recurrence def spec(q: Key, k: Key, v: Value, ...): return Step(...)``."""
    if fn is None:
        return lambda f: recurrence(f, name=name, gqa=gqa, default_scale=default_scale)
    global _features
    inputs = []
    for p in inspect.signature(fn, eval_str=True).parameters.values():
        ann = p.annotation
        if not isinstance(ann, InputKind):
            raise ir.SpecError(f"{fn.__name__}: argument {p.name!r} needs an annotation "
                               "rg.Key, rg.Value, rg.Scalar, rg.KeyGate or rg.Param[...]")
        inputs.append(ir.Input(p.name, ann.kind, ann.index))
    _features = []
    try:
        step = fn(*[x.symbol for x in inputs])
        features = tuple(_features)
    finally:
        _features = None
    if not isinstance(step, ir.Step):
        raise ir.SpecError(f"{fn.__name__} must return rg.Step(...), got {type(step).__name__}")
    rec = ir.Recurrence(fn.__name__ if name is None else name, inspect.getdoc(fn) or "", tuple(inputs), step,
                        features, gqa, default_scale)
    return rec.validate()
