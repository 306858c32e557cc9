"""Capture the exact MSL that MLX would compile for a `mx.fast.metal_kernel` call, on Linux.

Why: recgen only writes kernel *bodies*; MLX wraps them in a signature whose rules
(buffer order, ``constant`` for inputs with fewer than 8 elements, ``constant T&`` for
0-d inputs, ``_shape``/``_strides`` params, injected thread attributes, template
instantiation) change between releases.  Checking or executing anything other than
MLX's own wrapper would verify the wrong program.

How: since MLX 0.32.0 a metal_kernel call is accepted on a placeholder stream while
`mx.export_function` traces, and with ``verbose=True`` the C++ side prints the full
generated source to ``std::cout`` before anything needs Metal.  We redirect file
descriptor 1 (not just ``sys.stdout``) around the trace and cut the source out of the
fenced block.  The printed text is ``header + signature + body + instantiation``; on
a Mac MLX additionally prepends its ``kernels/utils.h`` (which our headers stand in for).
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from typing import Any, Sequence

MIN_MLX = (0, 32, 0)


class CaptureError(RuntimeError):
    """MLX could not produce (or did not print) the wrapped source."""


def _mlx():
    try:
        import mlx.core as mx
    except ImportError as e:  # pragma: no cover - environment dependent
        raise CaptureError("mlx is not installed; `pip install 'mlx[cpu]>=0.32'`") from e
    ver = tuple(int(x) for x in re.findall(r"\d+", mx.__version__)[:3])
    if ver < MIN_MLX:
        raise CaptureError(f"mlx {mx.__version__} is too old: capturing the wrapped Metal source on a "
                           f"machine without Metal needs mlx >= {'.'.join(map(str, MIN_MLX))}")
    return mx


def _to_mx(mx, x):
    if isinstance(x, mx.array):
        return x
    if isinstance(x, (bool, int, float)):
        return None  # Python scalar: passed through untouched, MLX picks its dtype
    return mx.array(x)  # numpy array, list, numpy scalar


def wrapped_source(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                   header: str = "", inputs: Sequence[Any] = (), output_shapes: Sequence[Sequence[int]] = (),
                   output_dtypes: Sequence[Any] = (), grid=(1, 1, 1), threadgroup=(1, 1, 1),
                   template: Sequence[tuple[str, Any]] | None = None, *, atomic_outputs: bool = False,
                   ensure_row_contiguous: bool = True) -> str:
    """Return the exact full MSL MLX generates for this kernel and call.

    `inputs` may hold mx arrays, numpy arrays or Python scalars (scalars keep MLX's own
    dtype rule: int -> int32/int64 by value, float -> float32, bool -> bool).
    `output_dtypes` may be mx dtypes or numpy dtypes.  Raises `CaptureError` if MLX is
    too old or prints nothing.
    """
    mx = _mlx()
    kernel = mx.fast.metal_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                                  source=source, header=header, ensure_row_contiguous=ensure_row_contiguous,
                                  atomic_outputs=atomic_outputs)
    converted = [_to_mx(mx, x) for x in inputs]
    traced = [c for c in converted if c is not None]
    odt = [_mx_dtype(mx, d) for d in output_dtypes]

    def call(*arrays):
        it = iter(arrays)
        ins = [next(it) if c is not None else raw for c, raw in zip(converted, inputs)]
        kw = dict(inputs=ins, output_shapes=[tuple(s) for s in output_shapes], output_dtypes=odt,
                  grid=tuple(grid), threadgroup=tuple(threadgroup), verbose=True)
        if template:
            kw["template"] = [(k, _mx_dtype(mx, v) if _is_dtype(v) else v) for k, v in template]
        return kernel(**kw)

    with tempfile.TemporaryDirectory(prefix="recgen_capture_") as tmp:
        cap = os.path.join(tmp, "stdout.txt")
        sys.stdout.flush()
        saved = os.dup(1)
        fd = os.open(cap, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        try:
            mx.export_function(os.path.join(tmp, "k.mlxfn"), call, *traced)
        except Exception as e:
            raise CaptureError(f"mlx failed while tracing metal_kernel {name!r}: {e}") from e
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(fd)
            os.close(saved)
        with open(cap, encoding="utf-8", errors="replace") as f:
            text = f.read()
    m = re.search(r"```\n(.*)\n```", text, re.S)
    if not m:
        raise CaptureError(f"mlx {mx.__version__} printed no generated source for {name!r} "
                           f"(stdout was {text[:200]!r}); the verbose/export path may have changed")
    return m.group(1)


def _is_dtype(v) -> bool:
    if isinstance(v, (bool, int)):
        return False
    return True


def _mx_dtype(mx, d):
    if isinstance(d, mx.Dtype):
        return d
    import numpy as np
    s = d if isinstance(d, str) else np.dtype(d).name
    return getattr(mx, s)
