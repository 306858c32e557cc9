"""recgen: declare a linear recurrence, get fused differentiable kernels for MLX.

    import recgen as rg

    @rg.recurrence
    def retnet(q: rg.Key, k: rg.Key, v: rg.Value, lam: rg.Param[()]):
        return rg.Step(decay=rg.exp(lam), update=rg.outer(k, v), readout=rg.scale * q)

    o, state = retnet(q, k, v, lam, output_final_state=True)   # an MLX op with a VJP

Nothing here imports MLX or builds a kernel: ``import recgen`` and ``recgen emit`` work anywhere.
"""
__version__ = "0.1.0"

from . import specs  # noqa: E402
from .math import reference  # noqa: E402
from .spec.fns import exp, logsigmoid, sigmoid, softplus  # noqa: E402
from .spec.frontend import (Key, KeyGate, Param, Scalar, Step, Value, normalizer, outer, rank1,  # noqa: E402
                            recurrence, sympow)
from .spec.ir import SCALE as scale  # noqa: E402
from .spec.ir import Recurrence, SpecError  # noqa: E402
from .ops import Op, load  # noqa: E402
from .spec.layouts import InputError  # noqa: E402

__all__ = ["recurrence", "Step", "Key", "KeyGate", "Value", "Scalar", "Param", "outer", "rank1", "normalizer",
           "sympow", "scale", "exp", "sigmoid", "softplus", "logsigmoid", "load", "Op", "reference", "specs",
           "Recurrence", "SpecError", "InputError"]
