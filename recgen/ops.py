"""Importable MLX ops: ``recgen.load(spec)`` and one op per built-in (``recgen.ops.gated_delta_net`` …).

Every op takes the spec's inputs in FLA layouts plus ``scale=None``, ``initial_state=None``,
``output_final_state=False``, ``backend=None``, ``check_finite=None`` and returns ``(o, final_state)``
(final_state is None unless asked for). Gradients flow to every input, to ``initial_state`` and from
``final_state``. Ops are lazy: nothing on their path waits for the device, so they compose with
``mx.compile``, ``mx.vmap`` of the inputs and asynchronous evaluation.

This module is the dispatcher: per call it takes the device's tuning (``recgen.tuning.current``, checked
against this machine once by ``recgen.runtime.probe``) and chooses

- the backend: ``metal`` and ``cuda`` run the generated recurrent kernels, ``mlx`` the chunked form built
  from MLX ops (any device, CPU included). Default: the kernels of the default device's GPU (the chunked form
  where the spec has none at the call's sizes: ``has_kernel``), else ``mlx``;
  ``backend=`` on the op or the call, or ``Tuning.backend``, forces one;
- a kernel op's backward: the generated backward kernel (one sequential sweep, the state in registers) or
  the chunked form's backward (matmuls over chunks), chosen by ``backward=`` / ``Tuning.backward``, else the
  chunked one where the spec has the fast chunked form and T reaches ``Tuning.chunked_backward_min_t`` (a
  measured constant per GPU dialect; none for Metal until measured on Apple hardware);
- from ``Tuning.chunked_forward_min_t`` (also measured), a kernel op with the chunked backward runs wholly as
  the chunked form: its forward is then faster than the sequential kernel's, and its backward is the chunked
  form's own, without recomputing the forward.

``cu_seqlens`` (FLA's varlen convention): B = 1, the sequences packed along T with offsets 0 = c_0 <= ... <=
c_N = T given on the host; ``initial_state`` and the final state then have N rows, one per sequence. Each
sequence runs as its own call of the op (exact, N launches).

``check_finite``: None follows ``Tuning.debug``; True checks every input for NaN/Inf, which waits for the
device (a debug mode: it does not work under ``mx.compile``).
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from . import specs
from .codegen.backends import get as dialect_named
from .codegen.lower import has_kernel as lowers
from .codegen.lower import plan
from .errors import InputError
from .key_blocks import key_blocks
from .op_args import (CheckedSignatures, check_array, check_backend, check_cu_seqlens, check_initial_state,
                      check_mamba2, check_names, check_scale, signature, warn_head_first)
from .op_args import check_finite as check_finite_values
from .op_args import check_delta_product
from .runtime.probe import checked_for
from .runtime.recurrent import kernel_op
from .spec import ir
from .spec.analysis import analyze
from .spec.layouts import Sizes, infer_sizes
from .tuning import BACKENDS, BACKWARDS, Tuning, current


def _call_signature(args: tuple, kwargs: dict) -> tuple | None:
    """An op call's arrays as a key (``op_args.signature``): positional, then the keywords' names and arrays."""
    pos, kw = signature(args), signature(kwargs.values())
    return None if pos is None or kw is None else (pos, tuple(kwargs), kw)


def choose_backend(t: Tuning, *explicit) -> str:
    """The first explicit choice, else the tuning's, else the default device's GPU kernels, else ``mlx``; a choice
    this machine cannot run is an error that lists the backends it has."""
    for b, source in ((*((e, "backend") for e in explicit), (t.backend, "RECGEN_BACKEND"))):
        if b is not None:
            check_backend(b, BACKENDS, source)
            return b
    return t.dialect if t.device == "gpu" and t.dialect else "mlx"


def op_scale(rec: ir.Recurrence, sizes: Sizes, scale) -> float:
    """The call's ``scale`` checked, or the spec's default (K^{-1/2} of the raw keys, or 1.0)."""
    if scale is None:
        return sizes.Kin ** -0.5 if rec.default_scale == "key" else 1.0
    return check_scale(scale)


def has_kernel(rec: ir.Recurrence, sizes: Sizes, t: Tuning) -> bool:
    """Whether ``rec`` has recurrent kernels at ``sizes`` (not for feature maps, nor for K > 512): where it has
    none, an op left to its default backend runs the chunked form, and one asked for a kernel backend raises
    ``UnsupportedKernel`` naming the term."""
    return lowers(rec, sizes, t.fwd_layout)


def choose_backward(rec: ir.Recurrence, t: Tuning, T: int, explicit: str | None) -> str:
    """A kernel op's backward path: see the module docstring. (``recgen.chunked`` is imported only where asked:
    a decode step, below every threshold, asks on every call.)"""
    choice = explicit or t.backward
    if choice:
        if choice not in BACKWARDS:
            raise InputError(f"backward={choice!r}: expected one of {BACKWARDS}")
        if choice == "chunked":
            from .chunked import supported

            supported(rec)
        return choice
    min_t = t.chunked_backward_min_t
    if min_t is None or T < min_t:
        return "recurrent"
    from .chunked import fast_form

    return "chunked" if fast_form(rec) else "recurrent"


class Op:
    """A recurrence as a callable MLX op; see the module docstring for the arguments."""

    def __init__(self, rec: ir.Recurrence, backend: str | None = None, chunk_size: int | None = None,
                 backward: str | None = None):
        self.rec, self.backend, self.chunk_size, self.backward = rec.validate(), backend, chunk_size, backward
        self._seen = CheckedSignatures()  # call signature -> (input names in call order, sizes)
        if backend is not None and backend not in BACKENDS:
            raise InputError(f"backend={backend!r}: expected one of {BACKENDS}")
        if backward is not None and backward not in BACKWARDS:
            raise InputError(f"backward={backward!r}: expected one of {BACKWARDS} or None")
        if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                       or chunk_size < 1):
            raise InputError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
        self.__doc__ = rec.doc

    def __repr__(self) -> str:
        return f"<recgen op {self.rec.name} backend={self.backend or 'auto'}>"

    def __call__(self, /, *args, scale=None, initial_state=None, output_final_state=False, backend=None,
                 check_finite=None, cu_seqlens=None, **kwargs):
        key = _call_signature(args, kwargs)
        seen = self._seen.get(key)
        if seen is not None and cu_seqlens is None:  # checked before: a decode loop's every step after the first
            arrays, sizes = dict(zip(seen[0], (*args, *kwargs.values()))), seen[1]
            return self._run(arrays, sizes, initial_state, output_final_state, scale=scale, backend=backend,
                             check_finite=check_finite)
        arrays, sizes = self._check(args, kwargs)
        kw = dict(scale=scale, backend=backend, check_finite=check_finite)
        if cu_seqlens is not None:
            offsets = check_cu_seqlens(cu_seqlens, sizes)
            return self._packed(arrays, offsets, sizes, initial_state, output_final_state, **kw)
        warn_head_first(self.rec, sizes)
        self._seen.put(key, (tuple(arrays), sizes))
        return self._run(arrays, sizes, initial_state, output_final_state, **kw)

    def _check(self, args: tuple, kwargs: dict) -> tuple[dict, Sizes]:
        """The inputs by name and their sizes, every argument checked from metadata (no host sync)."""
        rec = self.rec
        if len(args) > len(rec.inputs):
            raise InputError(f"{rec.name}: takes {len(rec.inputs)} inputs {[x.name for x in rec.inputs]}, "
                             f"got {len(args)}")
        arrays = dict(zip([x.name for x in rec.inputs], args))
        dup = set(arrays) & set(kwargs)
        if dup:
            raise InputError(f"{rec.name}: argument(s) {sorted(dup)} given twice")
        arrays.update(kwargs)
        check_names(rec, arrays)
        for name, a in arrays.items():
            check_array(name, a)
        return arrays, infer_sizes(rec, {k: tuple(v.shape) for k, v in arrays.items()})

    def _run(self, arrays: dict, sizes: Sizes, initial_state, output_final_state, scale, backend, check_finite):
        rec = self.rec
        states = [] if initial_state is None else check_initial_state(rec, sizes, initial_state)
        scale = op_scale(rec, sizes, scale)
        t = current()  # checked (the chunk kernels' self-test) only where the chunked form runs: below
        defaulted = backend is None and self.backend is None and t.backend is None
        backend = choose_backend(t, backend, self.backend)
        if defaulted and backend != "mlx" and not has_kernel(rec, sizes, t):
            backend = "mlx"  # the device's kernels by default, the chunked form where the spec has none
        if t.debug if check_finite is None else check_finite:
            check_finite_values({**{k: [v] for k, v in arrays.items()}, "initial_state": states})
        xs = [arrays[x.name] for x in rec.inputs]
        # the chunked form: asked for, nothing to launch (B or T = 0), or a long sequence (faster there)
        if backend == "mlx" or sizes.B == 0 or sizes.T == 0 or self.runs_chunked(t, sizes.T):
            from . import chunked

            o, ht = chunked.forward(rec, dict(zip([x.name for x in rec.inputs], xs)), scale=scale,
                                    initial_state=initial_state, chunk_size=self.chunk_size,
                                    tuning=self.checked(t))
        else:
            o, ht = self._kernel_call(backend, xs, sizes, scale, initial_state, t)
        return o, (ht if output_final_state else None)

    def _packed(self, arrays: dict, offsets: tuple, sizes: Sizes, initial_state, output_final_state, **kw):
        """The sequences of a packed batch one by one: each its own slice of the per-token inputs and its own row
        of the initial state; o concatenated along T, the final states stacked along B."""
        import mlx.core as mx

        rec, n = self.rec, len(offsets) - 1
        states = None if initial_state is None else check_initial_state(rec, replace(sizes, B=n), initial_state)
        os, finals = [], []
        for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
            xs = {x.name: arrays[x.name][:, a:b] if x.per_token else arrays[x.name] for x in rec.inputs}
            h0 = None if states is None else [s[i:i + 1] for s in states]
            o, ht = self._run(xs, replace(sizes, T=b - a), None if h0 is None else (tuple(h0) if rec.has_normalizer
                                                                                     else h0[0]), True, **kw)
            os.append(o)
            finals.append(ht if rec.has_normalizer else (ht,))
        o = mx.concatenate(os, axis=1)
        if not output_final_state:
            return o, None
        ht = tuple(mx.concatenate([f[j] for f in finals], axis=0) for j in range(len(finals[0])))
        return o, (ht if rec.has_normalizer else ht[0])

    def checked(self, t: Tuning) -> Tuning:
        """``t`` after the chunk kernels' self-test over this spec's frames: asked for only where the chunked form
        runs (the recurrent kernels alone compile none of its kernels)."""
        return checked_for(analyze(self.rec), t)

    def runs_chunked(self, t: Tuning, T: int) -> bool:
        """A kernel op whose forward is the chunked form too (its backward then MLX's autodiff of it, the chunked
        backward without the recompute): see ``chunked_forward``."""
        return chunked_forward(self.rec, t, T) and choose_backward(self.rec, t, T, self.backward) == "chunked"

    def _kernel_call(self, backend, xs, sizes: Sizes, scale: float, initial_state, t: Tuning):
        import mlx.core as mx

        p = plan(self.rec, sizes, fwd_layout=t.fwd_layout)
        if self.rec.has_normalizer:
            h0, z0 = initial_state if initial_state is not None else (None, None)
            states = [_zeros(sizes.state_shape) if h0 is None else h0.astype(mx.float32),
                      _zeros(sizes.state_shape[:3]) if z0 is None else z0.astype(mx.float32)]
        else:
            states = [_zeros(sizes.state_shape) if initial_state is None else initial_state.astype(mx.float32)]
        values = [a.dtype for x, a in zip(self.rec.inputs, xs) if x.kind == "value"]
        out_dtype = str(values[0] if values else mx.float32).split(".")[-1]
        backward = choose_backward(self.rec, t, sizes.T, self.backward)
        vjp = None  # the recurrent kernels alone need no self-test: a decode step compiles no chunk kernel
        if backward == "chunked":
            vjp = chunked_vjp(self.rec, scale, self.chunk_size, self.checked(t))
        outs = kernel_op(p, dialect_named(backend), sizes, scale, out_dtype, vjp, t.debug, t.kernel_cache)(*xs, *states)
        return (outs[0], (outs[1], outs[2])) if self.rec.has_normalizer else outs


def chunked_forward(rec: ir.Recurrence, t: Tuning, T: int) -> bool:
    """Whether a kernel op with the chunked backward runs its forward as the chunked form as well: from
    ``Tuning.chunked_forward_min_t`` (measured per GPU dialect), where the spec has the fast chunked form. Its
    backward is then the chunked form's own (autodiff around the core's written VJP), with no recompute."""
    from .chunked import fast_form

    return t.chunked_forward_min_t is not None and T >= t.chunked_forward_min_t and fast_form(rec)


@lru_cache(maxsize=64)
def chunked_vjp(rec: ir.Recurrence, scale: float, chunk_size: int | None, t: Tuning):
    """The VJP of the chunked form at the same point (recompute its forward, run its backward), as a kernel
    op's backward; ``outputs`` (the kernel op's, same shapes) stand in for a missing cotangent's shape.
    (Compiling the recompute and the backward here cannot work: this runs inside the caller's ``mx.vjp``, and MLX
    compiles nothing whose inputs are a transformation's tracers; a caller's compiled training step fuses it.)"""
    import mlx.core as mx

    from . import chunked

    n, norm = len(rec.inputs), rec.has_normalizer
    names = [x.name for x in rec.inputs]

    def f(*a):
        o, s = chunked.forward(rec, dict(zip(names, a[:n])), scale=scale,
                               initial_state=tuple(a[n:]) if norm else a[n], chunk_size=chunk_size, tuning=t)
        return (o, *s) if norm else (o, s)

    def vjp(primals, cotangents, outputs):
        cots = [mx.zeros_like(o) if c is None else c for c, o in zip(cotangents, outputs)]
        return tuple(mx.vjp(f, list(primals), cots)[1])

    return vjp


@lru_cache(maxsize=32)
def _zeros(shape):
    """A cached zero initial state: built once per shape, never written (kernels only read h0)."""
    import mlx.core as mx

    return mx.zeros(shape, dtype=mx.float32)


class PowerRetention(Op):
    r"""Power retention (``specs.power_retention``) that runs on the GPU's recurrent kernels, as a composition:
    its expanded key space (K' = d(d+1)/2 rows of φ, over the kernels' 512-row register budget from d = 32) is
    cut into nb blocks of Kb rows, each block a head of ``simple_gla`` (decay e^g, update φ(k)_blk [v, 1]ᵀ,
    readout scale²·φ(q)_blk), so that the normalizer z rides along S as value column V and every block's
    (y, n) partial comes back in one launch; then o = Σ_blk y / (Σ_blk n + ε), in float32.

    Exact to rounding: the blocks of a sum of rows are independent (no transition mixes rows), so the composition
    is the spec's own recurrence. φ(q) and φ(k) are formed in MLX (a decode step's are tiny; for long T this is
    the expanded-feature path, not the kernel identity of issue 19's chunk kernels), and gradients flow through
    MLX autodiff of the composition into simple_gla's kernel VJPs. Used where the backend is a GPU's kernels and
    T < ``Tuning.key_blocks_max_t`` (but for decode with ``Tuning.feature_decode``: the feature decode kernel);
    otherwise the spec's own chunked form runs."""

    def __init__(self, backend: str | None = None, chunk_size: int | None = None, backward: str | None = None):
        super().__init__(specs.power_retention, backend, chunk_size, backward)
        self._blocks_op = Op(specs.simple_gla, backend=backend, chunk_size=chunk_size, backward=backward)

    def _run(self, arrays: dict, sizes: Sizes, initial_state, output_final_state, scale, backend, check_finite):
        t = current()
        from .chunked.features import decodes

        if (choose_backend(t, backend, self.backend) == "mlx" or sizes.B == 0 or sizes.T == 0
                or sizes.T >= t.key_blocks_max_t
                or (sizes.T == 1 and decodes(self.checked(t), sizes.Kin, sizes.V))):
            # the spec's own chunked form, which runs this device's chunk kernels where the tuning has them (the
            # kernel identity's, the feature decode kernel), whichever backend was asked for: a feature map has no
            # recurrent kernel, so passing a GPU backend on would raise UnsupportedKernel
            return super()._run(arrays, sizes, initial_state, output_final_state, scale, "mlx", check_finite)
        states = None if initial_state is None else check_initial_state(self.rec, sizes, initial_state)
        return self.key_blocks(arrays, sizes, states, output_final_state, op_scale(self.rec, sizes, scale), backend,
                               check_finite)

    def key_blocks(self, arrays: dict, sizes: Sizes, states, output_final_state, scale, backend, check_finite):
        """The composition (see the class docstring) on ``backend`` (None: the default); ``states`` the checked
        (S, z) or None."""
        q, k, v, g = (arrays[n] for n in ("q", "k", "v", "g"))
        kb = key_blocks(sizes, current().fwd_layout)
        into, out_of = key_block_maps(self.rec.gqa, sizes, kb, v.dtype, states is not None, output_final_state,
                                      compiled=sizes.T == 1)
        parts = into(q, k, v, g, *(states or ()))
        inner = dict(zip(("q", "k", "v", "g"), parts[:4]))
        h0 = parts[4] if states is not None else None
        yn, ht = self._blocks_op._run(inner, kb.inner(sizes), h0, True, scale=scale * scale, backend=backend,
                                      check_finite=check_finite)  # checked above; T < H·nb is no layout mistake
        out = out_of(yn, ht)
        return out[0], (tuple(out[1:]) if output_final_state else None)


@lru_cache(maxsize=32)
def key_block_maps(gqa: str, sizes: Sizes, kb, dtype, with_state: bool, with_final: bool, compiled: bool):
    """The composition's two elementwise ends for one call signature: ``into(q, k, v, g[, S0, z0])`` -> the blocks'
    (q, k, v, g[, h0]) and ``out_of(yn, ht)`` -> (o[, S, z]). Compiled for decode (T = 1: one shape a stream,
    and its ~30 small ops cost ~0.1 ms of host time a step); MLX traces them as plain ops under a transformation."""
    import mlx.core as mx

    from .chunked.terms import expand_heads, sympow_mx

    B, T, H, K, V = sizes.B, sizes.T, sizes.H, sizes.K, sizes.V
    Kb, nb = kb.block, kb.count
    f32 = mx.float32

    def blocks(x):  # [B,T,Hk,d] -> φ per value head and block: [B,T,H·nb,Kb]
        return expand_heads(sympow_mx(x.astype(f32)), H, gqa, 2).reshape(B, T, H * nb, Kb)

    def into(q, k, v, g, *state):
        v1 = mx.concatenate([v.astype(f32), mx.ones((B, T, H, 1), f32)], axis=-1)
        parts = [blocks(q), blocks(k), mx.repeat(v1, nb, axis=2), mx.repeat(g.astype(f32), nb, axis=2)]
        if with_state:
            S0, z0 = (s.astype(f32) for s in state)
            h0 = mx.concatenate([S0.reshape(B, H, nb, Kb, V), z0.reshape(B, H, nb, Kb, 1)], axis=-1)
            parts.append(h0.reshape(B, H * nb, Kb, V + 1))
        return parts

    def out_of(yn, ht):
        yn = yn.reshape(B, T, H, nb, V + 1).sum(axis=3)
        o = (yn[..., :V] / (yn[..., V:] + specs.POWER_RETENTION_EPS)).astype(dtype)
        if not with_final:
            return [o]
        ht = ht.reshape(B, H, nb, Kb, V + 1)
        return [o, ht[..., :V].reshape(B, H, K, V), ht[..., V].reshape(B, H, K)]

    return (mx.compile(into), mx.compile(out_of)) if compiled else (into, out_of)


def load(spec, backend: str | None = None, chunk_size: int | None = None, backward: str | None = None) -> Op:
    """The op of a spec: a Recurrence, a built-in name, or 'path/to/file.py:function'."""
    if isinstance(spec, str):
        from .spec.resolve import resolve_spec

        spec = resolve_spec(spec)
    if not isinstance(spec, ir.Recurrence):
        raise InputError(f"spec: expected a Recurrence (use @recgen.recurrence), got {type(spec).__name__}")
    if spec is specs.power_retention:  # its kernel path is a composition (``PowerRetention``)
        return PowerRetention(backend=backend, chunk_size=chunk_size, backward=backward)
    return Op(spec, backend=backend, chunk_size=chunk_size, backward=backward)


gated_delta_net = Op(specs.gated_delta_net)
kda = Op(specs.kda)
delta_net = Op(specs.delta_net)
gla = Op(specs.gla)
simple_gla = Op(specs.simple_gla)
selective_scan = Op(specs.selective_scan)
selective_scan_linear_dt = Op(specs.selective_scan_linear_dt)
power_retention = PowerRetention()
hgrn2 = Op(specs.hgrn2)
mlstm = Op(specs.mlstm)
mlstm_sigmoid = Op(specs.mlstm_sigmoid)


class RetNet(Op):
    """FLA's ``chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False)``: simple GLA
    with RetNet's fixed decay γ_h = 1 - 2^{-5-h} per value head h (``specs.retnet_log_gamma``, float32 as FLA's
    ``g_gamma``), supplied by the op: S_t = γ_h S_{t-1} + k_t v_tᵀ, o_t = S_tᵀ (scale · q_t).
    q, k [B,T,Hk,K] (Hk = H in FLA; Hk dividing H is block GQA), v [B,T,H,V], state [B,H,K,V]. The other keyword
    arguments are every op's (module docstring). ``load("retnet")`` takes the log-decay as an input instead."""

    def __init__(self, backend: str | None = None, chunk_size: int | None = None, backward: str | None = None):
        super().__init__(specs.retnet, backend=backend, chunk_size=chunk_size, backward=backward)
        self.__doc__ = RetNet.__doc__

    def __repr__(self) -> str:
        return f"<recgen op retnet (FLA's chunk_retention) backend={self.backend or 'auto'}>"

    def __call__(self, q, k, v, /, **kwargs):
        check_array("v", v)
        if v.ndim != 4:
            raise InputError(f"argument 'v': expected [B,T,H,V], got shape {tuple(v.shape)}")
        return super().__call__(q, k, v, _retnet_log_gamma(v.shape[2]), **kwargs)


@lru_cache(maxsize=32)
def _retnet_log_gamma(H: int):
    """RetNet's log-decays [H] as a float32 array, built once per H (never written)."""
    import mlx.core as mx

    return mx.array(specs.retnet_log_gamma(H), dtype=mx.float32)


retnet = RetNet()


@lru_cache(maxsize=16)
def _mamba2_op(name: str, chunk_size: int | None) -> Op:
    return Op(specs.BUILTINS[name], chunk_size=chunk_size)


def mamba2(x, dt, A, B, C, chunk_size=None, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
           cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
           return_varlen_states=False, state_dtype=None, backend=None):
    r"""Mamba-2 SSD with mamba_ssm's ``mamba_chunk_scan_combined`` arguments and layouts; returns ``out`` or
    ``(out, final_states)`` with ``return_final_states``.

    x [B,T,H,P], dt [B,T,H], A [H], B, C [B,T,G,N] (head h reads group h // (H/G)), D [H] or [H,P], z [B,T,H,P],
    dt_bias [H], initial_states and the final state [B,H,P,N] (float32; recgen's state [B,H,N,P] is transposed
    in and out):

        Δ_t = clip(softplus(dt_t + dt_bias), *dt_limit)  (no softplus unless ``dt_softplus``; the clip always, as
                                                          mamba's kernel: by default a negative Δ becomes 0)
        h_t = e^{Δ_t A} h_{t-1} + Δ_t x_t B_tᵀ,   out_t = (h_t C_t + D ⊙ x_t) ⊙ silu(z_t)  (silu(z) only with z)

    With ``dt_softplus`` and no ``dt_limit`` the gate is fused into the recurrence (spec ``mamba2``); otherwise Δ
    is formed by MLX ops and the spec ``mamba2_linear_dt`` takes it. ``chunk_size`` is the chunked form's chunk
    (None: recgen's default); the kernels need none. ``seq_idx``, ``cu_seqlens``, ``return_varlen_states`` and
    ``state_dtype`` are refused (an ``InputError`` says what to do instead). Lazy, gradients to every array.
    """
    import mlx.core as mx

    lo, hi = check_mamba2(x, dt, A, B, C, D, z, dt_bias, initial_states, dt_limit,
                          dict(seq_idx=seq_idx, cu_seqlens=cu_seqlens, return_varlen_states=return_varlen_states,
                               state_dtype=state_dtype))
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise InputError(f"argument 'chunk_size': expected a positive int or None, got {chunk_size!r}")
    H, P = x.shape[2], x.shape[3]
    D = mx.zeros((H, P), dtype=x.dtype) if D is None else (mx.broadcast_to(D[:, None], (H, P)) if D.ndim == 1 else D)
    h0 = None if initial_states is None else initial_states.swapaxes(-1, -2)
    kw = dict(initial_state=h0, output_final_state=return_final_states, backend=backend)
    if dt_softplus and lo <= 0.0 and hi == float("inf"):  # the clip cannot bind (softplus > 0): the fused gate
        bias = mx.zeros((H,), dtype=dt.dtype) if dt_bias is None else dt_bias
        out, ht = _mamba2_op("mamba2", chunk_size)(x, dt, A, B, C, D, bias, **kw)
    else:
        delta = dt if dt_bias is None else dt + dt_bias
        if dt_softplus:
            delta = mx.logaddexp(delta, mx.array(0.0, dtype=delta.dtype))
        delta = mx.clip(delta, lo, hi)  # as mamba's kernel, always: dt_softplus=False clips a negative dt to 0
        out, ht = _mamba2_op("mamba2_linear_dt", chunk_size)(x, delta, A, B, C, D, **kw)
    if z is not None:
        out = out * (z * mx.sigmoid(z))
    return (out, ht.swapaxes(-1, -2)) if return_final_states else out


rwkv6 = Op(specs.rwkv6)
rwkv7 = Op(specs.rwkv7)


class GatedDeltaProduct:
    r"""Gated DeltaProduct (Siems et al. 2025) with FLA's ``chunk_gated_delta_product`` arguments and layouts:
    n = ``num_householder`` delta-rule (generalized Householder) steps a token, the gate and the readout once a token.

        S = e^{g_t} S_{t-1}                                  (skipped with g=None: the ungated DeltaProduct)
        S ← (I - β_{t,j} k_{t,j} k_{t,j}ᵀ) S + β_{t,j} k_{t,j} v_{t,j}ᵀ,   j = 0..n-1
        S_t = S,   o_t = S_tᵀ (scale · q_t)

    q [B,T,Hk,K]; k [B,T·n,Hk,K], v [B,T·n,H,V], beta [B,T·n,H], token t's micro-step j at row t·n + j
    (interleaved, as FLA); g [B,T,H] log-decays or None; state [B,H,K,V] (float32). Hk = H in FLA; Hk dividing H
    is block GQA. ``scale=None`` means K^{-1/2}. ``use_qk_l2norm_in_kernel`` normalizes q and k first as FLA does
    (x / sqrt(Σx² + 1e-6), in float32). ``cu_seqlens``: FLA's packed sequences (B = 1, host offsets over T; each
    sequence's k, v, beta rows are its tokens' n·(c_{i+1} - c_i) rows).

    A composition, exact to rounding: recgen's ``gated_delta_net`` (``delta_net`` with g=None) over the T·n
    micro-steps, the gate at each token's first micro-step (log-decay 0 elsewhere), q at its last (0 elsewhere),
    and every n-th output: the backend's kernels or chunked form, with their gradients to every input and the
    initial state, lazy and ``mx.compile``-safe. Arguments are checked from metadata before any compute."""

    def __init__(self, backend: str | None = None, chunk_size: int | None = None, backward: str | None = None):
        self.backend = backend
        self._gated = Op(specs.gated_delta_net, backend=backend, chunk_size=chunk_size, backward=backward)
        self._ungated = Op(specs.delta_net, backend=backend, chunk_size=chunk_size, backward=backward)

    def __repr__(self) -> str:
        return f"<recgen op gated_delta_product (FLA's chunk_gated_delta_product) backend={self.backend or 'auto'}>"

    def __call__(self, q, k, v, g, beta, num_householder, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, backend=None, check_finite=None):
        import mlx.core as mx

        offsets = check_delta_product(q, k, v, g, beta, num_householder, initial_state, cu_seqlens)
        n = int(num_householder)
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q), _l2norm(k)
        B, T = q.shape[:2]
        if n > 1:  # token t's q at micro-step n-1, its gate at micro-step 0, zeros elsewhere
            q = mx.pad(q[:, :, None], [(0, 0), (0, 0), (n - 1, 0), (0, 0), (0, 0)]).reshape(B, T * n, *q.shape[2:])
            if g is not None:
                g = mx.pad(g[:, :, None], [(0, 0), (0, 0), (0, n - 1), (0, 0)]).reshape(B, T * n, g.shape[2])
        op = self._ungated if g is None else self._gated
        arrays = dict(q=q, k=k, v=v, beta=beta) if g is None else dict(q=q, k=k, v=v, g=g, beta=beta)
        sizes = infer_sizes(op.rec, {name: tuple(a.shape) for name, a in arrays.items()})  # over the T·n steps
        kw = dict(scale=scale, backend=backend, check_finite=check_finite)
        if offsets is None:
            o, ht = op._run(arrays, sizes, initial_state, output_final_state, **kw)
        else:
            o, ht = op._packed(arrays, tuple(c * n for c in offsets), sizes, initial_state, output_final_state, **kw)
        if n > 1:
            o = o.reshape(B, T, n, *o.shape[2:])[:, :, n - 1]
        return o, ht


def _l2norm(x):
    """FLA's ``l2norm_fwd``: x / sqrt(Σ x² + 1e-6) over the last axis, in float32, back in x's dtype."""
    import mlx.core as mx

    x32 = x.astype(mx.float32)
    return (x32 * mx.rsqrt(mx.sum(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


gated_delta_product = GatedDeltaProduct()
