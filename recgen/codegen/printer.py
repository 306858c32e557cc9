"""The one sympy printer: C-like syntax, every function name and literal from the dialect table.

Symbols print through a ``names`` map (input symbol -> the register or expression holding its
element), so the same term prints as ``k_[r]`` in a row loop and ``v_[c]`` in a column loop.
"""
from __future__ import annotations

import sympy as sp
from sympy.printing.c import C99CodePrinter

from .backends.dialect import Dialect


class KernelPrinter(C99CodePrinter):
    """float-only C printer: no double literals, no pow() calls, no stock function names."""

    def __init__(self, dialect: Dialect, names: dict[sp.Symbol, str]):
        super().__init__({"strict": False})
        self.dialect, self.names = dialect, names

    def _print_Symbol(self, s):
        if s in self.names:
            return self.names[s]
        raise KeyError(f"no kernel name for symbol {s}")

    def _print_Float(self, f):
        return f"{float(f)!r}{self.dialect.float_suffix}"

    def _print_Rational(self, r):
        return f"({float(r.p)!r}{self.dialect.float_suffix} / {float(r.q)!r}{self.dialect.float_suffix})"

    def _print_Integer(self, n):
        return f"{float(n)!r}{self.dialect.float_suffix}"

    def _print_NumberSymbol(self, c):
        """pi, E and the other named constants as literals: no dialect declares C's M_PI or M_E."""
        return f"{float(c)!r}{self.dialect.float_suffix}"

    _print_Pi = _print_Exp1 = _print_GoldenRatio = _print_EulerGamma = _print_Catalan = _print_NumberSymbol
    _print_TribonacciConstant = _print_NumberSymbol

    def _print_Pow(self, e):
        base, ex = e.args
        if ex.is_Integer and 0 < int(ex) <= 4:  # small powers as parenthesized products
            return "(" + " * ".join([self.parenthesize(base, 100)] * int(ex)) + ")"
        if ex == -1:
            return f"(1.0{self.dialect.float_suffix} / {self.parenthesize(base, 100)})"
        if ex == sp.Rational(1, 2):
            return f"{self.dialect.fns['sqrt']}({self._print(base)})"
        raise NotImplementedError(f"power {e} has no kernel spelling; rewrite it with exp/log")

    def _spelling(self, f) -> str:
        """The dialect's name of the function ``f`` applies, or NotImplementedError."""
        name = type(f).__name__
        if name not in self.dialect.fns:
            raise NotImplementedError(f"function {name} has no {self.dialect.name} spelling")
        return self.dialect.fns[name]

    def _print_Function(self, f):
        return f"{self._spelling(f)}({', '.join(self._print(a) for a in f.args)})"

    _print_exp = _print_log = _print_Abs = _print_sign = _print_sin = _print_cos = _print_Function
    _print_floor = _print_ceiling = _print_Function

    def _print_math_func(self, expr, nest=False, known=None):
        """sympy's C99 printer spells its math functions (atan, cosh, erf, ...) in double precision by C's names;
        here every function comes from the dialect table or is refused."""
        return self._print_Function(expr)

    def _print_Max(self, f):
        """Max and Min of any arity as nested two-argument calls (C's fmaxf, Metal's max take two)."""
        fn = self._spelling(f)
        first, *rest = f.args
        out = self._print(first)
        for a in rest:
            out = f"{fn}({out}, {self._print(a)})"
        return out

    _print_Min = _print_Max


def kprint(expr: sp.Expr, dialect: Dialect, names: dict) -> str:
    return KernelPrinter(dialect, names).doprint(sp.sympify(expr))
