"""recgen: declare a linear recurrence, get fused differentiable kernels for MLX.

    import recgen as rg

    @rg.recurrence
    def retnet(q: rg.Key, k: rg.Key, v: rg.Value, lam: rg.Param[()]):
        return rg.Step(decay=rg.exp(lam), update=rg.outer(k, v), readout=rg.scale * q)

    o, state = rg.load(retnet)(q, k, v, lam, output_final_state=True)   # an MLX op with a VJP

Nothing here imports MLX or builds a kernel: ``import recgen`` and ``recgen emit`` work anywhere.
"""
from . import ops, specs, tuning
from .errors import InputError, SpecError, UnsupportedKernel
from .math import reference
from .ops import Op, load
from .spec.fns import exp, logsigmoid, sigmoid, softplus
from .spec.frontend import Key, KeyGate, Param, Scalar, Step, Value, normalizer, outer, rank1, recurrence, sympow
from .spec.ir import SCALE as scale
from .spec.ir import Recurrence
from .version import __version__

__all__ = ["recurrence", "Step", "Key", "KeyGate", "Value", "Scalar", "Param", "outer", "rank1", "normalizer",
           "sympow", "scale", "exp", "sigmoid", "softplus", "logsigmoid", "load", "Op", "ops", "reference", "specs",
           "Recurrence", "SpecError", "InputError", "UnsupportedKernel", "tuning", "__version__"]
