r"""The per-element terms of a spec as MLX functions, bound to a chunk frame.

A chunk of C tokens is bound to the frame ``[B, H, C, K, V]``: a per-token scalar to
``[B,H,C,1,1]``, a key to ``[B,H,C,K,1]`` (key heads repeated over their GQA group), a key gate
to ``[B,H,C,K,1]``, a value to ``[B,H,C,1,V]``, a parameter to ``[1,H,1,K|1,V|1]``. Each term is
then evaluated elementwise with MLX ops (sympy ``lambdify`` with an MLX module table) and kept at
its own broadcast shape; key-side roles are returned as ``[B,H,C,K]``, value-side roles as
``[B,H,C,V]``.

The decay enters the chunked forms through its logarithm (a cumulative sum of log-decays is the
only stable way to form products of decays over a chunk): ``recgen.spec.decay.log_decay`` derives it
exactly for every decay the decorator accepts (nonnegative by construction; 0 is a reset, log -inf).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import sympy as sp

from ..spec import ir
from ..spec.analysis import Analysis, analyze
from ..spec.decay import log_decay
from ..spec.numeric import lambdify
from ..spec.features import sympow_terms


def _mx():
    import mlx.core as mx

    return mx


def mlx_module(pow2_exp: bool = False) -> dict:
    """The name table lambdify uses: gates and elementary functions as MLX ops (``pow2_exp``: ``core.exp``'s)."""
    mx = _mx()
    from .core import exp

    return {
        "exp": lambda x: exp(x, pow2_exp), "log": mx.log, "sqrt": mx.sqrt, "tanh": mx.tanh, "sin": mx.sin, "cos": mx.cos,
        "Abs": mx.abs, "abs": mx.abs, "sign": mx.sign,
        "Max": lambda *a: functools.reduce(mx.maximum, a), "Min": lambda *a: functools.reduce(mx.minimum, a),
        "Heaviside": lambda x, at0=0.5: mx.where(x > 0, 1.0, mx.where(x < 0, 0.0, at0)),
        "sigmoid": mx.sigmoid,
        "softplus": lambda x: mx.logaddexp(x, 0.0),
        "logsigmoid": lambda x: -mx.logaddexp(-x, 0.0),
        "logabs": _logabs,
        "E": float(np.e), "pi": float(np.pi),
    }


def log_decay_expr(decay: sp.Expr) -> sp.Expr:
    """log D (``recgen.spec.decay.log_decay``: exact, -inf where D = 0); validation rejects decays without one."""
    e = log_decay(decay)
    if e is None:  # Recurrence.validate() rejects such specs; guard a hand-built one
        raise ir.SpecError(f"decay {decay}: can be negative, so the chunked form has no log-decay for it")
    return e


def _logabs(x):
    """log|x| with log|0| = -inf and a zero gradient at 0 (``spec.decay.logabs``): the inner where keeps
    log's 1/x away from x = 0, so no 0·∞ reaches the gradient."""
    mx = _mx()
    x = x if isinstance(x, mx.array) else mx.array(float(x))
    nz = x != 0
    return mx.where(nz, mx.log(mx.abs(mx.where(nz, x, 1.0))), -float("inf"))


KEY_ROLES, VALUE_ROLES = ir.KEY_ROLES, ir.VALUE_ROLES


@dataclass(frozen=True)
class Plan:
    """What the chunked forms need of a spec, compiled once per spec: its roles as MLX functions beside the
    spec's one analysis (``recgen.spec.analysis``), whose answers it passes on."""

    rec: ir.Recurrence
    analysis: Analysis
    symbols: tuple
    fns: dict           # role -> callable(*symbol values, scale); "logdecay", "zlogdecay", "rho", "ufac" included
    N: object           # normalizer function of n, or None
    r_scaled: tuple | None = None  # (input symbol x, c(scale)) where the readout role is r = c·x, c a constant
    # (every built-in's r = scale·q): the chunked core then takes x as it is and applies c inside (``core_fn``'s rfac)
    logdecay_input: object = None  # the input symbol the log-decay is verbatim (GLA's, KDA's, RWKV-7's), or None

    decay_class = property(lambda self: self.analysis.decay_class)    # "scalar" | "key" | "full"
    zdecay_class = property(lambda self: self.analysis.zdecay_class)
    fuse_z = property(lambda self: self.analysis.fuse_z)              # z rides along S as an extra value column
    has_rho = property(lambda self: self.analysis.delta_rule)         # a = ρ·u: fns["rho"]
    bare_roles = property(lambda self: self.analysis.bare_roles)      # roles that are inputs verbatim: ``bind``
    rho_pow2 = property(lambda self: self.analysis.rho_pow2)          # ρ = ±2^e: ρ·b exact in b's type


@lru_cache(maxsize=64)
def plan(rec: ir.Recurrence, pow2_exp: bool = False) -> Plan:
    """The roles of ``rec`` as MLX functions (``pow2_exp``: see ``core.exp``)."""
    syms = tuple(rec.symbols) + (ir.SCALE,)
    mod = [mlx_module(pow2_exp)]
    # the generated code names no input (spec.numeric): inputs called exp, pi or sigmoid shadow nothing
    lam = lambda e: lambdify(syms, e, mod)  # noqa: E731
    terms = rec.terms()
    a = analyze(rec)
    fns = {role: lam(e) for role, e in terms.items() if role not in ("decay", "zdecay")}
    ld = log_decay_expr(terms["decay"])
    fns["logdecay"] = lam(ld)
    N = None
    norm = rec.step.normalizer
    if norm is not None:
        fns["zlogdecay"] = lam(log_decay_expr(norm.decay))
        N = lambdify((ir.N_ARG,), norm.fn, mod)
    if a.rho is not None:
        fns["rho"] = lam(a.rho)
    if a.u_factor is not None:  # u = f·x: the factor per token, for kernels that read x and scale as they read
        fns["ufac"] = lam(a.u_factor[1])
    r_scaled = None if a.r_scaled is None else (a.r_scaled[0], lambdify((ir.SCALE,), a.r_scaled[1], "math"))
    return Plan(rec, a, syms, fns, N, r_scaled, ld if isinstance(ld, sp.Symbol) and ld in rec.symbols else None)


# -- binding -----------------------------------------------------------------------------------

def sympow_mx(x, degree: int = 2):
    """φ(x) of recgen.spec.features.sympow with MLX ops (differentiable): [..., d] -> [..., C(d + p − 1, p)]."""
    mx = _mx()
    cols, out = _sympow_gathers(x.shape[-1], degree, x.dtype)
    for col in cols:
        out = out * mx.take(x, col, axis=-1)
    return out


@lru_cache(maxsize=16)
def _sympow_gathers(d: int, degree: int, dtype):
    """``sympow_mx``'s index columns and coefficients as MLX arrays, made once per width, degree and type: a call
    would otherwise copy them from the host each time (4 × 766 480 indices at d = 64, p = 4: on the H100 that
    copying, for graphs never evaluated, was most of a training step)."""
    mx = _mx()
    idx, c = sympow_terms(d, degree)
    return tuple(mx.array(idx[:, i].astype(np.int32)) for i in range(degree)), mx.array(c, dtype=dtype)


def expand_heads(x, H: int, gqa: str, axis: int):
    """Key heads -> value heads along ``axis``: block (h // g) or tiled (h % Hk)."""
    mx = _mx()
    Hk = x.shape[axis]
    if Hk == H:
        return x
    g = H // Hk
    if gqa == "block":
        return mx.repeat(x, g, axis=axis)
    reps = [1] * x.ndim
    reps[axis] = g
    return mx.tile(x, reps)


def bind(p: Plan, chunk: dict, H: int, dtype=None, raw: dict | None = None, sympow=None, features: bool = True) -> dict:
    """Symbol -> array in the chunk frame [B,H,C,K|1,V|1]; per-token inputs are [B,C,...] slices.
    With ``dtype`` each value is cast after its layout view (transpose, head expansion), so under
    ``mx.compile`` the cast fuses into the role math's strided pass instead of being a pass of its
    own before the transpose (standalone casts were a measurable part of GDN's forward on the H100).
    Features (sympow) are formed from the cast input: products of bf16 values lose precision.

    A key or value that a role is verbatim (``Plan.bare_roles``) or a constant multiple of (``Plan.r_scaled``) is
    first copied to row-major order in its own type: MLX's cast keeps a transposed view's strides, so the chunked
    core's reshape would copy it again in float32 (a cast and a float32 layout copy per such input); so is a log-decay
    that is an input verbatim (``Plan.logdecay_input``).
    ``raw`` (a dict), if given, receives those row-major copies before the cast, by symbol. ``sympow``: the degree-2
    feature map as (x [B,C,Hk,D], H, gqa) -> φ [B,H,C,F] (default: ``sympow_mx``, heads expanded, transposed; the
    chunk kernels' ``chunk_kernels.sympow_fn``, which writes that layout itself); other degrees take ``sympow_mx``;
    ``features=False`` binds none."""
    from .core import row_major as as_row_major  # recordable by ``runtime.replay`` (no ``Contiguous``)

    rec = p.rec
    vals = {}
    cast = (lambda a: a.astype(dtype)) if dtype is not None else (lambda a: a)
    # and the log-decay where it is an input verbatim: cast from the row-major copy, it is a contiguous float32
    # array the chunks' reshape views, not a strided cast the reshape copies again in float32
    bare = ({s for _, s in p.bare_roles} | ({p.r_scaled[0]} if p.r_scaled else set())
            | ({p.logdecay_input} if p.logdecay_input is not None else set()))

    def phi(x, H, gqa, degree):
        if sympow is not None and degree == 2:
            return sympow(x, H, gqa)
        return expand_heads(sympow_mx(x, degree), H, gqa, 2).transpose(0, 2, 1, 3)

    def row_major(a, x):
        if x.symbol not in bare:
            return a
        a = as_row_major(a)
        if raw is not None:
            raw[x.symbol] = a
        return a

    for x in rec.inputs:
        a = chunk[x.name]
        if x.kind == "scalar":                       # [B,C,H]
            vals[x.symbol] = cast(a.transpose(0, 2, 1)[..., None, None])
        elif x.kind == "key":                        # [B,C,Hk,Kin]
            if x.symbol in p.analysis.raw_keys:
                vals[x.symbol] = cast(row_major(expand_heads(a, H, rec.gqa, 2).transpose(0, 2, 1, 3)[..., None], x))
            for f in rec.features if features else ():
                if f.source == x.name:
                    vals[f.symbol] = phi(cast(a), H, rec.gqa, f.degree)[..., None]
        elif x.kind == "key_gate":                   # [B,C,H,K]
            vals[x.symbol] = cast(row_major(a.transpose(0, 2, 1, 3)[..., None], x))
        elif x.kind == "value":                      # [B,C,H,V]
            vals[x.symbol] = cast(row_major(a.transpose(0, 2, 1, 3)[..., None, :], x))
        else:                                        # param [H, *index]
            shape = (1, a.shape[0], 1, a.shape[1] if ir.I in x.index else 1,
                     a.shape[-1] if ir.J in x.index else 1)
            vals[x.symbol] = cast(a.reshape(shape))
    return vals


def evaluate(p: Plan, vals: dict, scale: float, B: int, H: int, C: int, K: int, V: int, dtype=None,
             roles=None) -> dict:
    """Every role (or those of ``roles``) on its domain: key roles [B,H,C,K], value roles [B,H,C,V]; log-decays at
    the shape of their class: scalar [B,H,C], key [B,H,C,K], full [B,H,C,K|1,V] (broadcastable)."""
    mx = _mx()
    args = tuple(vals.get(s, None) for s in p.symbols[:-1]) + (scale,)
    out = {}

    def as_array(v):
        return v if isinstance(v, mx.array) else mx.array(float(v), dtype=dtype or mx.float32)

    for role, fn in p.fns.items():
        if roles is not None and role not in roles:
            continue
        v = as_array(fn(*args))
        if role in KEY_ROLES:
            out[role] = mx.broadcast_to(v, (B, H, C, K, 1))[..., 0]
        elif role in VALUE_ROLES:
            out[role] = mx.broadcast_to(v, (B, H, C, 1, V))[..., 0, :]
        elif role in ("rho", "ufac"):
            out[role] = mx.broadcast_to(v, (B, H, C, 1, 1))[..., 0, 0]
        elif role in ("logdecay", "zlogdecay"):
            cls = p.decay_class if role == "logdecay" else p.zdecay_class
            if cls == "scalar":
                out[role] = mx.broadcast_to(v, (B, H, C, 1, 1))[..., 0, 0]
            elif cls == "key":
                out[role] = mx.broadcast_to(v, (B, H, C, K, 1))[..., 0]
            else:
                v = v.reshape(v.shape if v.ndim == 5 else (1,) * (5 - v.ndim) + v.shape)
                shp = (B, H, C, K if v.shape[3] != 1 else 1, V)
                out[role] = mx.broadcast_to(v, shp)
    return out
