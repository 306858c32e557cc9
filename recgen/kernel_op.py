"""The generated recurrent kernels as one differentiable MLX op (``mx.custom_function``).

The forward runs without checkpoints (inference pays nothing for training); the VJP reruns the
forward with ``SAVE`` to write one state per chunk, then the backward kernel recomputes each chunk
from its checkpoint and sweeps back. Gradients summed over columns arrive as one partial per
threadgroup and are finished here by one MLX reduction each (deterministic: no atomics).
"""
from __future__ import annotations

from functools import lru_cache

from . import ir
from .backends.dialect import Dialect
from .lower import KernelPlan
from .render import KernelSource, backward_source, forward_source
from .shapes import Sizes


@lru_cache(maxsize=256)
def _kernel(src: KernelSource, factory: str):
    import mlx.core as mx

    make = getattr(mx.fast, factory)
    return make(name=src.name, input_names=list(src.inputs), output_names=list(src.outputs),
                source=src.source, header=src.header)


def sources(plan: KernelPlan, dialect: Dialect) -> tuple[KernelSource, KernelSource]:
    return _sources(plan, dialect.name)


@lru_cache(maxsize=64)
def _sources(plan: KernelPlan, dialect_name: str) -> tuple[KernelSource, KernelSource]:
    from .backends import get

    return forward_source(plan, get(dialect_name)), backward_source(plan, get(dialect_name))


def _template(src: KernelSource, **override):
    import mlx.core as mx

    out = []
    for name, value in src.template:
        value = override.get(name, value)
        out.append((name, getattr(mx, value) if isinstance(value, str) else value))
    return out


def run_forward(plan: KernelPlan, dialect: Dialect, xs, h0, scale: float, sizes: Sizes, out_dtype, save: bool):
    import mlx.core as mx

    fsrc, _ = sources(plan, dialect)
    nc = -(-sizes.T // plan.C)
    grid, tg = plan.grid(plan.fwd, sizes.B)
    rt = mx.array([sizes.T, sizes.B], dtype=mx.int32)
    sc = mx.array([scale], dtype=mx.float32)
    shapes = [(sizes.B, sizes.T, sizes.H, sizes.V), sizes.state_shape,
              (sizes.B, sizes.H, nc, sizes.K, sizes.V) if save else (1,)]
    return _kernel(fsrc, dialect.mlx_factory)(
        inputs=list(xs) + [rt, sc, h0], output_shapes=shapes,
        output_dtypes=[out_dtype, mx.float32, mx.float32], grid=grid, threadgroup=tg,
        template=_template(fsrc, SAVE=save, OT=str(out_dtype).split(".")[-1]))


def run_backward(plan: KernelPlan, dialect: Dialect, xs, ckpt, do, dht, scale: float, sizes: Sizes):
    """Gradients of every input (in its own layout and dtype) and of the initial state."""
    import mlx.core as mx

    _, bsrc = sources(plan, dialect)
    B, T, H, Hk, K, V = sizes.B, sizes.T, sizes.H, sizes.Hk, sizes.K, sizes.V
    npart = plan.n_partials()
    nwarp = npart * plan.bwd.WV
    shapes = []
    for x in plan.rec.inputs:
        shapes.append({"key": (npart, B, T, H, K), "key_gate": (npart, B, T, H, K), "scalar": (npart, B, T, H),
                       "value": (B, T, H, V)}.get(x.kind) or
                      {(ir.I, ir.J): (B, H, K, V), (ir.J,): (B, H, V), (ir.I,): (nwarp, B, H, K),
                       (): (nwarp, B, H)}[x.index])
    grid, tg = plan.grid(plan.bwd, B)
    rt = mx.array([T, B], dtype=mx.int32)
    sc = mx.array([scale], dtype=mx.float32)
    outs = _kernel(bsrc, dialect.mlx_factory)(
        inputs=list(xs) + [rt, sc, ckpt, do, dht], output_shapes=shapes + [sizes.state_shape],
        output_dtypes=[mx.float32] * (len(shapes) + 1), grid=grid, threadgroup=tg,
        template=_template(bsrc))
    grads = []
    for x, g, xin in zip(plan.rec.inputs, outs, xs):
        if x.kind in ("key", "key_gate", "scalar"):
            g = g.sum(axis=0)
        if x.kind == "key" and Hk != H:  # fold the GQA group of value heads onto its key head
            G = H // Hk
            g = (g.reshape(B, T, Hk, G, K).sum(axis=3) if plan.rec.gqa == "block"
                 else g.reshape(B, T, G, Hk, K).sum(axis=2))
        if x.kind == "param":
            g = g.sum(axis=0) if x.index in ((ir.I, ir.J), (ir.J,)) else g.sum(axis=(0, 1))
        grads.append(g.astype(xin.dtype))
    return grads, outs[-1]


def kernel_op(plan: KernelPlan, dialect: Dialect, sizes: Sizes, scale: float, out_dtype):
    """An mx.custom_function (xs..., h0) -> (o, ht) running the generated kernels both ways."""
    import mlx.core as mx

    @mx.custom_function
    def op(*args):
        xs, h0 = args[:-1], args[-1]
        o, ht, _ = run_forward(plan, dialect, xs, h0, scale, sizes, out_dtype, save=False)
        return o, ht

    @op.vjp
    def op_vjp(primals, cotangents, outputs):
        xs, h0 = primals[:-1], primals[-1]
        do, dht = cotangents
        _, _, ckpt = run_forward(plan, dialect, xs, h0, scale, sizes, out_dtype, save=True)
        grads, dh0 = run_backward(plan, dialect, xs, ckpt, do, dht.astype(mx.float32), scale, sizes)
        return tuple(grads) + (dh0,)

    return op
