"""Importable MLX ops: ``recgen.load(spec)`` and one op per built-in (``recgen.ops.gated_delta_net`` …).

Every op takes the spec's inputs in FLA layouts plus ``scale=None``, ``initial_state=None``,
``output_final_state=False``, ``backend=None`` and returns ``(o, final_state)`` (final_state is
None unless asked for). Gradients flow to every input, to ``initial_state`` and from
``final_state``.

Backends: ``metal`` and ``cuda`` run the generated recurrent kernels; ``mlx`` runs the chunked
fallback built from MLX ops (any device, CPU included). Default: metal on Apple silicon, cuda
when MLX's CUDA backend is present, else mlx. ``backend=`` or ``RECGEN_BACKEND`` force one.

Gradients of a kernel backend: ``backward="recurrent"`` runs the generated backward kernel (one
sequential sweep, the state in registers); ``"chunked"`` runs the chunked form's backward (matmuls
over chunks). ``None`` (default, or ``RECGEN_BACKWARD``) picks chunked when the spec has the fast
chunked form (scalar or key-vector decay, no transition or a delta-rule one) and T reaches the
backend's measured ``Dialect.chunked_backward_min_t``: 1024 for CUDA (on the H100 it was 1.6-4×
faster at T = 4096 and 1.1-2.9× at T = 1024-2048, except GLA at D = 64: 0.85-0.99×; BENCHMARKS.md
run 33); none yet for Metal, whose default stays the recurrent backward until it is measured on an
Apple GPU.
MLX is imported lazily: importing recgen builds nothing.
"""
from __future__ import annotations

import os
from functools import lru_cache

from .spec import ir

from . import specs
from .spec.layouts import InputError, Sizes, check_state, infer_sizes

BACKENDS = ("metal", "cuda", "mlx")
BACKWARDS = ("recurrent", "chunked")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def default_backend() -> str:
    from .codegen.backends import machine_dialect

    forced = os.environ.get("RECGEN_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise InputError(f"RECGEN_BACKEND={forced!r}: expected one of {BACKENDS}")
        return forced
    return machine_dialect() or "mlx"


def _check_arrays(arrays: dict, check_finite: bool):
    import mlx.core as mx

    for name, a in arrays.items():
        if not isinstance(a, mx.array):
            raise InputError(f"argument {name!r}: expected an mx.array, got {type(a).__name__}")
        if str(a.dtype).split(".")[-1] not in FLOAT_DTYPES:
            raise InputError(f"argument {name!r}: expected float32, float16 or bfloat16, got {a.dtype}")
    if not check_finite:
        return
    finite = [mx.all(mx.isfinite(a)) for a in arrays.values()]
    if bool(mx.all(mx.stack(finite)).item()):  # one host sync for all inputs; name the culprit only on failure
        return
    bad = next(name for name, ok in zip(arrays, finite) if not bool(ok.item()))
    raise InputError(f"argument {bad!r}: contains NaN or Inf")


class Op:
    """A recurrence as a callable MLX op; see the module docstring for the arguments."""

    def __init__(self, rec: ir.Recurrence, backend: str | None = None, chunk_size: int | None = None,
                 backward: str | None = None):
        self.rec, self.backend, self.chunk_size, self.backward = rec.validate(), backend, chunk_size, backward
        if backend is not None and backend not in BACKENDS:
            raise InputError(f"backend={backend!r}: expected one of {BACKENDS}")
        if backward is not None and backward not in BACKWARDS:
            raise InputError(f"backward={backward!r}: expected one of {BACKWARDS} or None")
        self.__doc__ = rec.doc

    def __repr__(self) -> str:
        return f"<recgen op {self.rec.name} backend={self.backend or 'auto'}>"

    def __call__(self, *args, scale=None, initial_state=None, output_final_state=False, backend=None,
                 check_finite=True, **kwargs):
        rec = self.rec
        if len(args) > len(rec.inputs):
            raise InputError(f"{rec.name}: takes {len(rec.inputs)} inputs {[x.name for x in rec.inputs]}, "
                             f"got {len(args)}")
        arrays = dict(zip([x.name for x in rec.inputs], args))
        dup = set(arrays) & set(kwargs)
        if dup:
            raise InputError(f"{rec.name}: argument(s) {sorted(dup)} given twice")
        arrays.update(kwargs)
        sizes = infer_sizes(rec, {k: tuple(v.shape) for k, v in arrays.items()})
        _check_arrays(arrays, check_finite)
        if scale is None:
            scale = sizes.Kin ** -0.5 if rec.default_scale == "key" else 1.0
        if initial_state is not None:
            check_state(rec, sizes, initial_state)
        backend = backend or self.backend or default_backend()
        if backend not in BACKENDS:
            raise InputError(f"backend={backend!r}: expected one of {BACKENDS}")
        xs = [arrays[x.name] for x in rec.inputs]
        if backend == "mlx":
            from . import chunked

            o, ht = chunked.forward(rec, dict(zip([x.name for x in rec.inputs], xs)), scale=float(scale),
                                    initial_state=initial_state, chunk_size=self.chunk_size)
        else:
            o, ht = self._kernel_call(backend, xs, sizes, float(scale), initial_state)
        return o, (ht if output_final_state else None)

    def _kernel_call(self, backend, xs, sizes: Sizes, scale: float, initial_state):
        import mlx.core as mx

        from .codegen.backends import get
        from .runtime.recurrent import kernel_op
        from .codegen.lower import plan

        if sizes.T == 0 or sizes.B == 0:
            raise InputError(f"{self.rec.name}: empty batch or sequence (B={sizes.B}, T={sizes.T})")
        p = plan(self.rec, sizes)
        if self.rec.has_normalizer:
            h0, z0 = initial_state if initial_state is not None else (None, None)
            states = [_zeros(sizes.state_shape) if h0 is None else h0.astype(mx.float32),
                      _zeros(sizes.state_shape[:3]) if z0 is None else z0.astype(mx.float32)]
        else:
            states = [_zeros(sizes.state_shape) if initial_state is None else initial_state.astype(mx.float32)]
        values = [a.dtype for x, a in zip(self.rec.inputs, xs) if x.kind == "value"]
        out_dtype = str(values[0] if values else mx.float32).split(".")[-1]
        dialect = get(backend)
        outs = kernel_op(p, dialect, sizes, scale, out_dtype, self._backward(sizes, dialect))(*xs, *states)
        return (outs[0], (outs[1], outs[2])) if self.rec.has_normalizer else outs

    def _backward(self, sizes: Sizes, dialect) -> str:
        """The kernel op's backward path (see the module docstring)."""
        choice = self.backward or os.environ.get("RECGEN_BACKWARD")
        if choice:
            if choice not in BACKWARDS:
                raise InputError(f"RECGEN_BACKWARD={choice!r}: expected one of {BACKWARDS}")
            if choice == "chunked":
                from .chunked import supported

                supported(self.rec)
            return choice
        from .chunked import fast_form

        min_t = dialect.chunked_backward_min_t
        return "chunked" if fast_form(self.rec) and min_t is not None and sizes.T >= min_t else "recurrent"


@lru_cache(maxsize=32)
def _zeros(shape):
    """A cached zero initial state: built once per shape, never written (kernels only read h0)."""
    import mlx.core as mx

    return mx.zeros(shape, dtype=mx.float32)


def load(spec, backend: str | None = None, chunk_size: int | None = None, backward: str | None = None) -> Op:
    """The op of a spec: a Recurrence, a built-in name, or 'path/to/file.py:function'."""
    if isinstance(spec, str):
        from .cli import resolve_spec

        spec = resolve_spec(spec)
    if not isinstance(spec, ir.Recurrence):
        raise InputError(f"spec: expected a Recurrence (use @recgen.recurrence), got {type(spec).__name__}")
    return Op(spec, backend=backend, chunk_size=chunk_size, backward=backward)


gated_delta_net = Op(specs.gated_delta_net)
kda = Op(specs.kda)
delta_net = Op(specs.delta_net)
gla = Op(specs.gla)
simple_gla = Op(specs.simple_gla)
selective_scan = Op(specs.selective_scan)
selective_scan_linear_dt = Op(specs.selective_scan_linear_dt)
power_retention = Op(specs.power_retention)
