"""The generated recurrent kernels as one differentiable MLX op (``mx.custom_function``).

The forward runs without checkpoints (inference pays nothing for training); the VJP reruns the
forward with ``SAVE`` to write one state per chunk, then the backward kernel recomputes each chunk
from its checkpoint and sweeps back. Gradients summed over columns arrive as one partial per
threadgroup and are finished by one array reduction each (deterministic: no atomics).

``Launch`` is the recipe of one kernel call (inputs, output shapes, grid, template), shared by MLX
and by the Metal CPU emulator (``recgen.verify.kernels``), so both run exactly the same thing.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache

from ..spec import ir
from ..codegen.backends import get
from ..codegen.backends.dialect import Dialect
from ..codegen.lower import KernelPlan
from ..codegen.render import KernelSource, backward_source, forward_source
from ..spec.layouts import Sizes


@lru_cache(maxsize=64)
def sources(plan: KernelPlan, dialect_name: str) -> tuple[KernelSource, KernelSource]:
    d = get(dialect_name)
    return forward_source(plan, d), backward_source(plan, d)


@dataclass(frozen=True)
class Launch:
    """One kernel call: extra runtime inputs, outputs (shape, dtype name), grid, template values."""

    source: KernelSource
    runtime: tuple         # ((name, values, dtype name), ...) for rt and scale_in
    outputs: tuple         # ((shape, dtype name), ...) in source.outputs order
    grid: tuple
    threadgroup: tuple
    template: tuple        # ((name, int | bool | dtype name), ...)


def forward_launch(plan: KernelPlan, dialect: Dialect, sizes: Sizes, scale: float, out_dtype: str,
                   save: bool) -> Launch:
    return _forward_launch(plan, dialect.name, sizes, scale, out_dtype, save)


def backward_launch(plan: KernelPlan, dialect: Dialect, sizes: Sizes, scale: float) -> Launch:
    return _backward_launch(plan, dialect.name, sizes, scale)


@lru_cache(maxsize=256)
def _forward_launch(plan: KernelPlan, dialect: str, sizes: Sizes, scale: float, out_dtype: str, save: bool) -> Launch:
    fsrc, _ = sources(plan, dialect)
    nc = -(-sizes.T // plan.C)
    grid, tg = plan.grid(plan.fwd, sizes.B)
    outs = (((sizes.B, sizes.T, sizes.H, sizes.V), out_dtype), (sizes.state_shape, "float32"),
            ((sizes.B, sizes.H, nc, sizes.K, sizes.V) if save else (1,), "float32"))
    if plan.rec.has_normalizer:
        outs += ((sizes.state_shape[:3], "float32"), ((sizes.B, sizes.H, nc, sizes.K) if save else (1,), "float32"))
    tmpl = tuple((n, {"SAVE": save, "OT": out_dtype}.get(n, v)) for n, v in fsrc.template)
    return Launch(fsrc, _runtime(sizes, scale), outs, grid, tg, tmpl)


@lru_cache(maxsize=256)
def _backward_launch(plan: KernelPlan, dialect: str, sizes: Sizes, scale: float) -> Launch:
    _, bsrc = sources(plan, dialect)
    B, T, H, K, V = sizes.B, sizes.T, sizes.H, sizes.K, sizes.V
    npart, nwarp = plan.n_partials(), plan.n_partials() * plan.bwd.WV
    shapes = []
    for x in plan.rec.inputs:
        shapes.append({"key": (npart, B, T, H, K), "key_gate": (npart, B, T, H, K), "scalar": (npart, B, T, H),
                       "value": (B, T, H, V)}.get(x.kind) or
                      {(ir.I, ir.J): (B, H, K, V), (ir.J,): (B, H, V), (ir.I,): (nwarp, B, H, K),
                       (): (nwarp, B, H)}[x.index])
    grid, tg = plan.grid(plan.bwd, B)
    outs = tuple((s, "float32") for s in shapes + [sizes.state_shape])
    if plan.rec.has_normalizer:
        outs += ((sizes.state_shape[:3], "float32"),)
    return Launch(bsrc, _runtime(sizes, scale), outs, grid, tg, bsrc.template)


def _runtime(sizes: Sizes, scale: float) -> tuple:
    return (("rt", (sizes.T, sizes.B), "int32"), ("scale_in", (scale,), "float32"))


def finish_grads(plan: KernelPlan, sizes: Sizes, outs):
    """Sum the kernel's partial gradients (threadgroups, GQA groups, batch) into each input's layout.

    Works on numpy and MLX arrays alike (sum, reshape only)."""
    B, T, H, Hk, K = sizes.B, sizes.T, sizes.H, sizes.Hk, sizes.K
    grads = []
    for x, g in zip(plan.rec.inputs, outs):
        if x.kind in ("key", "key_gate", "scalar"):
            g = g.sum(axis=0)
        if x.kind == "key" and Hk != H:  # fold the GQA group of value heads onto its key head
            G = H // Hk
            g = (g.reshape(B, T, Hk, G, K).sum(axis=3) if plan.rec.gqa == "block"
                 else g.reshape(B, T, G, Hk, K).sum(axis=2))
        if x.kind == "param":
            g = g.sum(axis=0) if x.index in ((ir.I, ir.J), (ir.J,)) else g.sum(axis=(0, 1))
        grads.append(g)
    n = len(plan.rec.inputs)
    return grads, (tuple(outs[n:n + 2]) if plan.rec.has_normalizer else outs[n])


# -- MLX ----------------------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _mlx_kernel(src: KernelSource, factory: str):
    import mlx.core as mx

    if os.environ.get("RECGEN_DEBUG"):  # the generated source, once per kernel, as MLX receives it
        print(f"// ---- {src.name} ({factory})\n{src.text}", file=sys.stderr)

    return getattr(mx.fast, factory)(name=src.name, input_names=list(src.inputs), output_names=list(src.outputs),
                                     source=src.source, header=src.header)


def mlx_call(launch: Launch, dialect: Dialect, user: list, extra: list):
    """Buffers in source order: the spec's inputs, the runtime values (T, B, scale), then ``extra``."""
    import mlx.core as mx

    ins = list(user) + list(_runtime_arrays(launch.runtime)) + list(extra)
    return _mlx_kernel(launch.source, dialect.mlx_factory)(
        inputs=ins, output_shapes=[s for s, _ in launch.outputs],
        output_dtypes=[getattr(mx, dt) for _, dt in launch.outputs], grid=launch.grid,
        threadgroup=launch.threadgroup,
        template=[(n, getattr(mx, v) if isinstance(v, str) else v) for n, v in launch.template])


@lru_cache(maxsize=256)
def _runtime_arrays(runtime: tuple) -> tuple:
    """T, B and scale as small device arrays, made once per distinct value (host uploads are not free)."""
    import mlx.core as mx

    return tuple(mx.array(list(v), dtype=getattr(mx, dt)) for _, v, dt in runtime)


def chunked_vjp(rec: ir.Recurrence, scale: float, primals, cotangents, outputs):
    """The VJP of the chunked MLX form at the same point: recompute its forward, run its backward.
    ``outputs`` (the kernel op's, same shapes) stand in for a missing cotangent's shape."""
    import mlx.core as mx

    from .. import chunked

    n, norm = len(rec.inputs), rec.has_normalizer
    names = [x.name for x in rec.inputs]

    def f(*a):
        o, s = chunked.forward(rec, dict(zip(names, a[:n])), scale=scale,
                               initial_state=tuple(a[n:]) if norm else a[n])
        return (o, *s) if norm else (o, s)

    cots = [mx.zeros_like(o) if c is None else c for c, o in zip(cotangents, outputs)]
    return tuple(mx.vjp(f, list(primals), cots)[1])


def kernel_op(plan: KernelPlan, dialect: Dialect, sizes: Sizes, scale: float, out_dtype: str,
              backward: str = "recurrent"):
    """See ``_kernel_op``; made once per (plan, dialect, sizes, scale, dtype, backward): decode calls
    it per token, and building the custom function each time is host time on every step."""
    return _kernel_op(plan, dialect.name, sizes, scale, out_dtype, backward)


@lru_cache(maxsize=256)
def _kernel_op(plan: KernelPlan, dialect_name: str, sizes: Sizes, scale: float, out_dtype: str, backward: str):
    """An mx.custom_function (xs..., h0[, z0]) -> (o, ht[, zt]) running the generated forward kernel.

    Its VJP runs the generated backward kernel (``backward="recurrent"``) or the chunked form's
    backward (``"chunked"``: matmuls over chunks, faster for long sequences on GPUs, see
    ``recgen.ops``); both give the same gradients up to rounding."""
    import mlx.core as mx

    dialect = get(dialect_name)

    n = len(plan.rec.inputs)
    norm = plan.rec.has_normalizer

    @mx.custom_function
    def op(*args):
        outs = mlx_call(forward_launch(plan, dialect, sizes, scale, out_dtype, save=False), dialect, args[:n],
                        list(args[n:]))
        return (outs[0], outs[1], outs[3]) if norm else (outs[0], outs[1])

    @op.vjp
    def op_vjp(primals, cotangents, outputs):
        if backward == "chunked":
            return chunked_vjp(plan.rec, scale, primals, cotangents, outputs)
        xs, states = list(primals[:n]), list(primals[n:])
        f = mlx_call(forward_launch(plan, dialect, sizes, scale, out_dtype, save=True), dialect, xs, states)
        extra = [f[2], cotangents[0], cotangents[1].astype(mx.float32)]
        if norm:  # sum_j do_j o_j, for dn: the one quantity that needs every value column
            ydo = (cotangents[0].astype(mx.float32) * outputs[0].astype(mx.float32)).sum(axis=-1)
            extra += [f[4], cotangents[2].astype(mx.float32), ydo]
        outs = mlx_call(backward_launch(plan, dialect, sizes, scale), dialect, xs, extra)
        grads, dstate = finish_grads(plan, sizes, outs)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, xs)) + (tuple(dstate) if norm else (dstate,))

    return op
