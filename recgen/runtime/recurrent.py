"""The generated recurrent kernels as one differentiable MLX op (``mx.custom_function``).

The forward runs without checkpoints (inference pays nothing for training); the VJP reruns the
forward with ``SAVE`` to write one state per chunk, then the backward kernel recomputes each chunk
from its checkpoint and sweeps back. Gradients summed over columns arrive as one partial per
threadgroup and are finished by one array reduction each (deterministic: no atomics).

Which backward runs is the dispatcher's choice (``recgen.ops``): ``kernel_op`` takes ``backward_vjp``, a
function with MLX's VJP signature that replaces the backward kernel (the chunked form's backward), or None.
"""
from __future__ import annotations

from functools import lru_cache

from ..spec import ir
from ..codegen.backends.dialect import Dialect
from ..codegen.lower import KernelPlan
from ..codegen.render import KernelSource, backward_source, forward_source
from ..spec.layouts import Sizes
from .launch import Launch, mlx_call


@lru_cache(maxsize=64)
def sources(plan: KernelPlan, dialect: Dialect) -> tuple[KernelSource, KernelSource]:
    return forward_source(plan, dialect), backward_source(plan, dialect)


@lru_cache(maxsize=256)
def forward_launch(plan: KernelPlan, dialect: Dialect, sizes: Sizes, scale: float, out_dtype: str,
                   save: bool) -> Launch:
    fsrc, _ = sources(plan, dialect)
    nc = -(-sizes.T // plan.C)
    grid, tg = plan.grid(plan.fwd, sizes.B)
    outs = (((sizes.B, sizes.T, sizes.H, sizes.V), out_dtype), (sizes.state_shape, "float32"),
            ((sizes.B, sizes.H, nc, sizes.K, sizes.V) if save else (1,), "float32"))
    if plan.rec.has_normalizer:
        outs += ((sizes.state_shape[:3], "float32"), ((sizes.B, sizes.H, nc, sizes.K) if save else (1,), "float32"))
    if plan.normalized_skip:  # y / N(n) before the skip term, for the backward's sum_j do_j y_j / N
        outs += (((sizes.B, sizes.T, sizes.H, sizes.V) if save else (1,), "float32"),)
    tmpl = tuple((n, {"SAVE": save, "OT": out_dtype}.get(n, v)) for n, v in fsrc.template)
    return Launch(fsrc, _runtime(sizes, scale), outs, grid, tg, tmpl)


@lru_cache(maxsize=256)
def backward_launch(plan: KernelPlan, dialect: Dialect, sizes: Sizes, scale: float) -> Launch:
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


def normalized_readout(plan: KernelPlan, saved, o):
    """y / N(n) per value column, which the normalizer's gradient reduces against do: the output ``o`` itself, or
    where a skip term is added to it, ``yn``, the last output of the checkpointing forward (``saved``: its
    outputs, in ``render.forward_source``'s order). Works on numpy and MLX arrays alike."""
    return saved[-1] if plan.normalized_skip else o


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


@lru_cache(maxsize=256)
def kernel_op(plan: KernelPlan, dialect: Dialect, sizes: Sizes, scale: float, out_dtype: str, backward_vjp=None,
              debug: bool = False, kernel_cache: str = ""):
    """An mx.custom_function (xs..., h0[, z0]) -> (o, ht[, zt]) running the generated forward kernel, made once
    per argument tuple (decode calls it per token: building the custom function each time is host time).

    Its VJP runs the generated backward kernel, or ``backward_vjp(primals, cotangents, outputs)`` when given
    (the dispatcher passes the chunked form's backward where it is faster); both give the same gradients up to
    rounding. ``debug``: print each kernel's source when it is built; ``kernel_cache``: the tuning's (``mlx_call``)."""
    import mlx.core as mx

    n = len(plan.rec.inputs)
    norm = plan.rec.has_normalizer

    @mx.custom_function
    def op(*args):
        outs = mlx_call(forward_launch(plan, dialect, sizes, scale, out_dtype, save=False), dialect, args[:n],
                        list(args[n:]), debug, kernel_cache)
        return (outs[0], outs[1], outs[3]) if norm else (outs[0], outs[1])

    @op.vjp
    def op_vjp(primals, cotangents, outputs):
        if backward_vjp is not None:
            return backward_vjp(primals, cotangents, outputs)
        xs, states = list(primals[:n]), list(primals[n:])
        f = mlx_call(forward_launch(plan, dialect, sizes, scale, out_dtype, save=True), dialect, xs, states, debug,
                     kernel_cache)
        extra = [f[2], cotangents[0], cotangents[1].astype(mx.float32)]
        if norm:  # sum_j do_j y_j / N (o_j without a skip term), for dn: the one quantity that needs every column
            yn = normalized_readout(plan, f, outputs[0]).astype(mx.float32)
            ydo = (cotangents[0].astype(mx.float32) * yn).sum(axis=-1)
            extra += [f[4], cotangents[2].astype(mx.float32), ydo]
        outs = mlx_call(backward_launch(plan, dialect, sizes, scale), dialect, xs, extra, debug, kernel_cache)
        grads, dstate = finish_grads(plan, sizes, outs)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, xs)) + (tuple(dstate) if norm else (dstate,))

    return op
