"""sympy expressions to numeric functions, immune to the names of the user's inputs.

``sympy.lambdify`` binds every free symbol of an expression by its printed name in the generated function's
namespace, over the module table: an input called ``sigmoid`` or ``exp`` would replace the gate of that name,
and one called ``pi`` would stand where the constant prints. Here every argument is replaced by a fresh Dummy
first, so the generated code names no input at all.
"""
from __future__ import annotations

import sympy as sp


def lambdify(args, expr, modules):
    """``sympy.lambdify(args, expr, modules)`` with the arguments renamed to fresh dummies."""
    args = tuple(args)
    dummies = tuple(sp.Dummy() for _ in args)
    body = sp.sympify(expr).xreplace(dict(zip(args, dummies)))
    return sp.lambdify(dummies, body, modules=modules)
