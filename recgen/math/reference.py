r"""The float64 numpy interpreter of any recurrence: the living definition of recgen.

It runs the step equations of ``recgen.spec.ir`` token by token, vectorized over batch and heads, and
the backward of ``recgen.math.adjoint`` in reverse. Every kernel and chunked form is tested against it.

    o, final_state = reference.run(spec, q=q, k=k, ..., initial_state=None, scale=None)
    grads = reference.grad(spec, do=do, dht=None, q=q, k=k, ..., initial_state=None, scale=None)

Each input symbol is bound to an array that broadcasts to the frame [B, H, K, V]: a scalar to
[B,H,1,1], a key to [B,H,K,1] (key heads repeated over their GQA group), a value to [B,H,1,V],
a parameter to [1,H,K|1,V|1]. Terms then evaluate elementwise in that frame.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import sympy as sp

from . import adjoint as adj
from ..spec import ir
from ..spec.numeric import lambdify
from ..spec.features import sympow, sympow_vjp
from ..spec.fns import NUMPY_GATES
from ..spec.layouts import InputError, Sizes, check_state, infer_sizes


@dataclass(frozen=True)
class _Compiled:
    """Lambdified terms and partials of one spec, all taking the same ordered symbols."""

    symbols: tuple[sp.Symbol, ...]
    terms: dict
    partials: tuple  # (Partial, fn)
    N: object
    dN: object


@lru_cache(maxsize=64)
def _compile(rec: ir.Recurrence) -> _Compiled:
    syms = tuple(rec.symbols) + (ir.SCALE,)
    mods = [NUMPY_GATES, "numpy"]
    # the generated code names no input (spec.numeric): inputs called exp, pi or sigmoid shadow nothing
    lam = lambda e: lambdify(syms, e, mods)  # noqa: E731
    terms = {role: lam(e) for role, e in rec.terms().items()}
    ad = adj.derive(rec)
    parts = tuple((p, lam(p.expr)) for p in ad.partials)
    norm = rec.step.normalizer
    N = lambdify((ir.N_ARG,), norm.fn, mods) if norm else None
    dN = lambdify((ir.N_ARG,), ad.dN, mods) if norm else None
    return _Compiled(syms, terms, parts, N, dN)


def _finite(name: str, a) -> np.ndarray:
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
        raise InputError(f"argument {name!r}: contains NaN or Inf")
    return a


def _prepare(rec: ir.Recurrence, inputs: dict, initial_state, scale):
    if initial_state is not None:
        parts = initial_state if isinstance(initial_state, (tuple, list)) else (initial_state,)
        for p in parts:
            _finite("initial_state", p)
    arrays = {}
    for name, x in inputs.items():
        a = np.asarray(x)
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.complexfloating)):
            raise InputError(f"argument {name!r}: expected a floating-point array, got dtype {a.dtype}")
        if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
            raise InputError(f"argument {name!r}: contains NaN or Inf")
        arrays[name] = a.astype(np.result_type(a.dtype, np.float64))
    sizes = infer_sizes(rec, {k: v.shape for k, v in arrays.items()})
    if scale is None:
        scale = sizes.Kin ** -0.5 if rec.default_scale == "key" else 1.0
    kh = np.array([sizes.key_head(h, rec.gqa) for h in range(sizes.H)])
    if initial_state is None:
        S0 = np.zeros(sizes.state_shape)
        z0 = np.zeros(sizes.state_shape[:3]) if rec.has_normalizer else None
    else:
        check_state(rec, sizes, initial_state)
        S0, z0 = (initial_state if rec.has_normalizer else (initial_state, None))
        S0 = np.asarray(S0, dtype=np.result_type(S0, np.float64))
        z0 = None if z0 is None else np.asarray(z0, dtype=np.result_type(z0, np.float64))
    return arrays, sizes, scale, kh, S0, z0


def _frame(rec: ir.Recurrence, x: ir.Input, a: np.ndarray, t: int, kh: np.ndarray) -> np.ndarray:
    """The value of input x at time t, shaped to broadcast to [B, H, K, V]."""
    if x.kind == "scalar":
        return a[:, t, :, None, None]
    if x.kind == "key":
        return a[:, t][:, kh, :, None]
    if x.kind == "key_gate":
        return a[:, t, :, :, None]
    if x.kind == "value":
        return a[:, t, :, None, :]
    shape = (1, a.shape[0], a.shape[1] if ir.I in x.index else 1, a.shape[-1] if ir.J in x.index else 1)
    return a.reshape(shape)


def _bind(rec, arrays, t, kh, scale) -> tuple:
    vals = {x.symbol: _frame(rec, x, arrays[x.name], t, kh) for x in rec.inputs}
    for f in rec.features:
        vals[f.symbol] = sympow(vals[sp.Symbol(f.source, real=True)][..., 0], f.degree)[..., None]
    return tuple(vals[s] for s in _compile(rec).symbols[:-1]) + (scale,)


def _term(fn, args, shape) -> np.ndarray:
    return np.broadcast_to(np.asarray(fn(*args)), shape)


class _Step:
    """All quantities of one forward step, as the backward needs them."""

    def __init__(self, rec, c: _Compiled, args, S_prev, z_prev, sz: Sizes):
        frame = {(ir.I, ir.J): lambda v: v, (ir.I,): lambda v: v[..., 0], (ir.J,): lambda v: v[:, :, 0, :]}
        shape = {(ir.I, ir.J): (sz.B, sz.H, sz.K, sz.V), (ir.I,): (sz.B, sz.H, sz.K, 1),
                 (ir.J,): (sz.B, sz.H, 1, sz.V)}
        self.t = {}  # role -> value on its domain: decay [B,H,K,V], key side [B,H,K], value side [B,H,V]
        for role, fn in c.terms.items():
            dom = adj.ROLE_DOMAIN[role]
            self.t[role] = frame[dom](_term(fn, args, shape[dom]))
        self.S_prev, self.z_prev = S_prev, z_prev
        self.P = self.t["decay"] * S_prev
        Q = self.P
        if "a" in self.t:  # bᵀP, or bᵀS_{t-1} for a transition before the decay
            self.bP = np.einsum("bhk,bhkv->bhv", self.t["b"], S_prev if rec.transition_before_decay else self.P)
            Q = self.P + self.t["a"][..., None] * self.bP[:, :, None, :]
        self.S = Q + self.t["u"][..., None] * self.t["w"][:, :, None, :]
        r = self.t["r"]
        self.y = np.einsum("bhk,bhkv->bhv", r, S_prev if rec.step.readout_before_update else self.S)
        self.o = self.y
        if rec.has_normalizer:
            self.z = self.t["zdecay"] * z_prev + self.t["zupdate"]
            self.n = np.einsum("bhk,bhk->bh", r, self.z)
            self.Nn = c.N(self.n)
            self.o = self.y / self.Nn[..., None]
        else:
            self.z = None
        if "skip" in self.t:
            self.o = self.o + self.t["skip"]
        if "bonus" in self.t:  # o += (Σ_i c_i) w
            self.o = self.o + self.t["bonus"].sum(-1)[..., None] * self.t["w"]


def _walk(rec, arrays, sizes, scale, kh, S0, z0, keep: bool):
    c = _compile(rec)
    S, z, steps = S0, z0, []
    o = np.zeros((sizes.B, sizes.T, sizes.H, sizes.V), dtype=np.result_type(S0, *arrays.values()))
    for t in range(sizes.T):
        st = _Step(rec, c, _bind(rec, arrays, t, kh, scale), S, z, sizes)
        o[:, t] = st.o
        S, z = st.S, st.z
        if keep:
            steps.append(st)
    return o, S, z, steps


def run(rec: ir.Recurrence, /, *, initial_state=None, scale=None, **inputs):
    """Forward: returns (o [B,T,H,V], final_state S [B,H,K,V] or (S, z) with a normalizer)."""
    arrays, sizes, scale, kh, S0, z0 = _prepare(rec, inputs, initial_state, scale)
    o, S, z, _ = _walk(rec, arrays, sizes, scale, kh, S0, z0, keep=False)
    return o, ((S, z) if rec.has_normalizer else S)


def grad(rec: ir.Recurrence, /, *, do, dht=None, initial_state=None, scale=None, **inputs) -> dict:
    """Gradients of L = Σ o·do + Σ final_state·dht for every input and ``initial_state``."""
    arrays, sizes, scale, kh, S0, z0 = _prepare(rec, inputs, initial_state, scale)
    c = _compile(rec)
    _, _, _, steps = _walk(rec, arrays, sizes, scale, kh, S0, z0, keep=True)
    do = _finite("do", do)
    if dht is not None:
        for p in (dht if isinstance(dht, (tuple, list)) else (dht,)):
            _finite("dht", p)
    if do.shape != (sizes.B, sizes.T, sizes.H, sizes.V):
        raise InputError(f"argument 'do': expected shape {(sizes.B, sizes.T, sizes.H, sizes.V)}, got {do.shape}")
    dS = np.zeros(sizes.state_shape, dtype=S0.dtype)
    dz = np.zeros(sizes.state_shape[:3], dtype=S0.dtype) if rec.has_normalizer else None
    if dht is not None:
        check_state(rec, sizes, dht, "dht")
        dS0, dz0 = dht if rec.has_normalizer else (dht, None)
        dS = dS + np.asarray(dS0)
        if dz0 is not None:
            dz = dz + np.asarray(dz0)
    grads = {x.name: np.zeros_like(arrays[x.name]) for x in rec.inputs}
    feats = {f.name: f for f in rec.features}
    for t in reversed(range(sizes.T)):
        st, args = steps[t], _bind(rec, arrays, t, kh, scale)
        dot = do[:, t]
        d = {}  # role adjoints in the frame [B,H,K,V]
        if rec.has_normalizer:
            dy = dot / st.Nn[..., None]
            dn = -c.dN(st.n) / st.Nn ** 2 * np.einsum("bhv,bhv->bh", dot, st.y)
            d["r"] = np.einsum("bhkv,bhv->bhk", st.S, dy) + st.z * dn[..., None]
            dS = dS + st.t["r"][..., None] * dy[:, :, None, :]
            dz = dz + st.t["r"] * dn[..., None]
        elif rec.step.readout_before_update:  # y = S_{t-1}ᵀ r: r dyᵀ joins dS_{t-1}, after this step's adjoint
            dy = dot
            d["r"] = np.einsum("bhkv,bhv->bhk", st.S_prev, dy)
        else:
            dy = dot
            d["r"] = np.einsum("bhkv,bhv->bhk", st.S, dy)
            dS = dS + st.t["r"][..., None] * dy[:, :, None, :]
        if "skip" in st.t:
            d["skip"] = dot
        d["u"] = np.einsum("bhkv,bhv->bhk", dS, st.t["w"])
        d["w"] = np.einsum("bhkv,bhk->bhv", dS, st.t["u"])
        if "bonus" in st.t:  # o += (Σ_i c_i) w: dc_i = Σ_j do_j w_j for every i, dw += (Σ_i c_i) do
            d["bonus"] = np.broadcast_to(np.einsum("bhv,bhv->bh", dot, st.t["w"])[..., None], st.t["bonus"].shape)
            d["w"] = d["w"] + st.t["bonus"].sum(-1)[..., None] * dot
        dP, aQ = dS, None
        if "a" in st.t:
            aQ = np.einsum("bhk,bhkv->bhv", st.t["a"], dS)
            d["a"] = np.einsum("bhkv,bhv->bhk", dS, st.bP)
            d["b"] = np.einsum("bhkv,bhv->bhk", st.S_prev if rec.transition_before_decay else st.P, aQ)
            if not rec.transition_before_decay:
                dP = dS + st.t["b"][..., None] * aQ[:, :, None, :]
        d["decay"] = dP * st.S_prev
        dS = st.t["decay"] * dP
        if aQ is not None and rec.transition_before_decay:  # b (aᵀ dQ) reaches S_{t-1} undecayed
            dS = dS + st.t["b"][..., None] * aQ[:, :, None, :]
        if rec.step.readout_before_update:
            dS = dS + st.t["r"][..., None] * dy[:, :, None, :]
        if rec.has_normalizer:
            d["zdecay"] = dz * st.z_prev
            d["zupdate"] = dz
            dz = st.t["zdecay"] * dz
        _accumulate(rec, c, d, args, t, kh, arrays, grads, feats, sizes)
    grads["initial_state"] = (dS, dz) if rec.has_normalizer else dS
    return grads


def _accumulate(rec, c, d, args, t, kh, arrays, grads, feats, sizes):
    """grad[x] += Σ_{domain \\ index(x)} d[role] ⊙ ∂role/∂x, then heads/batch/time reductions."""
    frame = {"decay": lambda a: a, "i": lambda a: a[..., None], "j": lambda a: a[:, :, None, :]}
    feat_grads: dict[str, np.ndarray] = {}
    for p, fn in c.partials:
        dom = adj.ROLE_DOMAIN[p.role]
        adj4 = frame["decay" if len(dom) == 2 else dom[0]](d[p.role])
        contrib = adj4 * fn(*args)
        axes = tuple(2 if ix == ir.I else 3 for ix in p.reduce)
        contrib = contrib.sum(axis=axes, keepdims=True) if axes else contrib
        if p.wrt in feats:
            feat_grads[p.wrt] = feat_grads.get(p.wrt, 0) + np.broadcast_to(contrib, (sizes.B, sizes.H, sizes.K, 1))[..., 0]
            continue
        x = rec.input(p.wrt)
        _add_input_grad(x, contrib, grads[x.name], t, kh, sizes)
    for fname, g in feat_grads.items():
        src = rec.input(feats[fname].source)
        xk = arrays[src.name][:, t][:, kh]
        _add_input_grad(src, sympow_vjp(xk, g, feats[fname].degree)[..., None], grads[src.name], t, kh, sizes)


def _add_input_grad(x: ir.Input, contrib: np.ndarray, out: np.ndarray, t, kh, sizes: Sizes):
    """Fold a frame-shaped contribution [B,H,K|1,V|1] into the input's own layout."""
    if x.kind == "scalar":
        out[:, t] += np.broadcast_to(contrib, (sizes.B, sizes.H, 1, 1))[..., 0, 0]
    elif x.kind == "key":
        g = contrib[..., 0]
        for h in range(sizes.H):
            out[:, t, kh[h]] += np.broadcast_to(g[:, h], out[:, t, kh[h]].shape)
    elif x.kind == "key_gate":
        out[:, t] += np.broadcast_to(contrib[..., 0], out[:, t].shape)
    elif x.kind == "value":
        out[:, t] += np.broadcast_to(contrib[:, :, 0, :], out[:, t].shape)
    else:  # a parameter: sum over batch here, over time by accumulation across steps
        g = contrib.sum(axis=0)
        if ir.J not in x.index:
            g = g[:, :, 0]
        if ir.I not in x.index:
            g = g[:, 0]
        out += np.broadcast_to(g, out.shape)
