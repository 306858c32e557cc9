r"""The logarithm of a decay, exactly, or the reason there is none.

The chunked forms take a decay D through log D (products of decays over a chunk are exponentials of sums of
log-decays). The kernels and the reference use D itself. So a decay must have a real logarithm for every input:
D ≥ 0 by construction. ``log_decay`` derives log D factor by factor, never through a rewrite that needs a sign
(sympy's ``expand_log(force=True)`` turns log(x²) into 2·log(x), NaN for x < 0):

- ``exp(e)`` -> e;  ``sigmoid(x)`` -> logsigmoid(x);  a positive number c -> log c;
- ``b**e`` -> e·log b for a nonnegative base b, else e·log|b| for an even integer e;
- ``Abs(x)`` and any factor sympy proves nonnegative -> log|x| (``logabs``);
- a product -> the sum of its factors' logs (every factor nonnegative);
- anything else (a factor whose sign sympy cannot prove, e.g. an input x, x·y, cos x, x³) -> None: the spec is
  rejected at declaration.

A decay exactly 0 (x² at x = 0, Abs(m) of a 0/1 mask) is a reset: ``logabs(0)`` is -inf with a zero gradient
(the chunked forms then give exp(-inf) = 0 exactly, as the reference and the kernels do, and no 0·∞ reaches a
gradient). An ``exp(g)`` decay gets no such care: g = -inf is not a finite input.
"""
from __future__ import annotations

import sympy as sp

from .fns import logsigmoid, sigmoid


class logabs(sp.Function):
    r"""log|x|, with log|0| = -inf and a zero gradient there (a decay of exactly 0 is a reset).

    Only the chunked forms evaluate it (their MLX table implements it); its derivative 1/x is right wherever
    x ≠ 0, and where x = 0 the decay's own factor D = 0 multiplies every gradient that reaches it."""

    def fdiff(self, argindex=1):
        return 1 / self.args[0]


def _log_factor(f: sp.Expr):
    """log f for a nonnegative factor f, or None when sympy cannot prove f ≥ 0."""
    if f.func == sp.exp:
        return f.args[0]
    if f.func == sigmoid:
        return logsigmoid(f.args[0])
    if f.is_Number:
        if f.is_positive:
            return sp.log(f)
        return logabs(f) if f.is_zero else None
    if f.is_Pow:
        b, e = f.args
        lb = _log_factor(b)  # first: sigmoid(x)**2 keeps logsigmoid's range
        if lb is not None:
            return e * lb
        return e * logabs(b) if e.is_integer and e.is_even else None
    if f.is_Mul:
        parts = [_log_factor(a) for a in f.args]
        return None if any(p is None for p in parts) else sp.Add(*parts)
    if f.func == sp.Abs:
        return logabs(f.args[0])
    if f.is_nonnegative:
        return logabs(f)
    return None


def log_decay(decay) -> sp.Expr | None:
    """log D as a sympy expression (exact for every input, -inf where D = 0), or None when D can be negative."""
    decay = sp.sympify(decay)
    if decay == 1:
        return sp.Integer(0)
    return _log_factor(decay)
