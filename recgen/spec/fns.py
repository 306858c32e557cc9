"""Gate functions as named sympy Functions with stable derivatives.

sympy would happily rewrite ``sigmoid(x)`` as ``1/(1+exp(-x))`` and differentiate that into
``exp(-x)/(1+exp(-x))**2``, which overflows to NaN in float32 for x < -88. Keeping each gate a
named Function with an explicit ``fdiff`` means the adjoint is written in terms of the gates
themselves (``sigmoid' = sigmoid (1 - sigmoid)``), and every backend prints the gate by name
from its dialect table.
"""
from __future__ import annotations

import numpy as np
import sympy as sp
from sympy import exp  # noqa: F401  (re-exported: the decay gate users write)

__all__ = ["sigmoid", "softplus", "logsigmoid", "exp", "NUMPY_GATES", "FUNCTIONS"]

# The functions a spec may apply (sympy's names). Every backend computes each of them and of their derivatives:
# the float64 reference (numpy), the chunked form's MLX table (``chunked.terms.mlx_module``) and each kernel
# dialect's table (``codegen.backends``); tests hold the tables to this set. Any other function is a SpecError at
# declaration, not a failure when some backend first meets it.
FUNCTIONS = frozenset({"exp", "log", "sqrt", "tanh", "sin", "cos", "Abs", "sign", "Max", "Min", "Heaviside",
                       "sigmoid", "softplus", "logsigmoid"})


class sigmoid(sp.Function):
    r"""σ(x) = 1 / (1 + e^{-x});  σ'(x) = σ(x) (1 - σ(x))."""

    def _eval_is_real(self):
        return self.args[0].is_real

    _eval_is_positive = _eval_is_real  # a decay built from gates is then known nonnegative (spec.decay)

    def fdiff(self, argindex=1):
        s = sigmoid(self.args[0])
        return s * (1 - s)


class softplus(sp.Function):
    r"""softplus(x) = log(1 + e^{x});  softplus'(x) = σ(x)."""

    def _eval_is_real(self):
        return self.args[0].is_real

    _eval_is_positive = _eval_is_real

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])


class logsigmoid(sp.Function):
    r"""log σ(x) = -softplus(-x);  (log σ)'(x) = σ(-x)."""

    def _eval_is_real(self):
        return self.args[0].is_real

    _eval_is_negative = _eval_is_real

    def fdiff(self, argindex=1):
        return sigmoid(-self.args[0])


def _np_sigmoid(x):
    # e^x / (1 + e^x) on the left, 1 / (1 + e^-x) on the right: no overflow and full relative
    # accuracy in both tails; branching on the real part keeps it analytic for complex-step tests
    x = np.asarray(x)
    neg = np.real(x) < 0
    e = np.exp(np.where(neg, x, -x))
    return np.where(neg, e / (1.0 + e), 1.0 / (1.0 + e))


def _np_softplus(x):
    # branch on the real part: stable for large |x|, and analytic, so complex-step tests work
    x = np.asarray(x)
    pos = np.real(x) > 0
    return np.where(pos, x + np.log1p(np.exp(-np.where(pos, x, 0))), np.log1p(np.exp(np.where(pos, 0, x))))


NUMPY_GATES = {
    "sigmoid": _np_sigmoid,
    "softplus": _np_softplus,
    "logsigmoid": lambda x: -_np_softplus(-np.asarray(x)),
    # |x| as ±x by the sign of the real part: the same for real x, and analytic off 0 (numpy's abs of a complex
    # number is its modulus), so complex-step derivatives of the reference see sign(x)
    "Abs": lambda x: np.where(np.real(x) < 0, -np.asarray(x), np.asarray(x)),
}
