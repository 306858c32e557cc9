"""mlx-lm's recurrences on recgen's ops: drop-in ``gated_delta_update`` and ``ssm_update``, and ``patch()``.

mlx-lm (``mlx_lm.models.gated_delta``) routes every gated-delta layer through one function,
``gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
lower_bound=None, allow_neg_eigval=False)``; in training (``use_kernel=False``) and on every non-Metal
device it runs a per-token loop whose autodiff keeps every state. ``gated_delta_update`` here has the same
signature, semantics and layouts and runs recgen's ``gated_delta_net`` (scalar gate) or ``kda`` (vector
gate) op on whichever backend recgen picks: lazy (no host sync), ``mx.compile``-safe, differentiable
w.r.t. every array input, ``A_log`` and ``dt_bias`` included.

    from recgen.integrations import mlx_lm as rg_mlx
    rg_mlx.patch()            # or: with rg_mlx.patch(): ...
    ...                       # mlx-lm models train and generate through recgen
    rg_mlx.unpatch()

mlx-lm's conventions, kept exactly:

- q, k ``[B,T,Hk,Dk]`` (q already carries the ``Dk**-0.5`` readout scale: recgen runs with scale = 1),
  v ``[B,T,Hv,Dv]``, Hv a multiple of Hk (value head h reads key head h // (Hv/Hk)).
- Scalar gate: a ``[B,T,Hv]``, A_log and dt_bias broadcasting to ``[Hv]``. Vector gate (Kimi Linear):
  a ``[B,T,Hv,Dk]``, A_log ``[Hv,1]``, dt_bias ``[Hv,Dk]``.
- log-decay = -exp(A_log)·softplus(a + dt_bias), or with ``lower_bound`` lower_bound·sigmoid(exp(A_log)·
  (a + dt_bias)); computed directly (never as log of the decay, which may be exactly 0).
- beta = sigmoid(b), times 2 with ``allow_neg_eigval``.
- state ``[B,Hv,Dv,Dk]`` (recgen's is ``[B,H,K,V]``: a swap of the last two axes), float32 when None.
- mask ``[B,T]``: where it is false the state is kept unchanged (a token with log-decay 0 and beta 0).
  The output at such a token is the readout of the kept state; mlx-lm's own paths differ there (its loop
  reads out the discarded update, its Metal kernel writes 0), and its models never use those positions.

``use_kernel`` is accepted and ignored: recgen chooses its own path (generated kernels on Metal and CUDA,
the chunked form elsewhere).

``ssm_update`` (``recgen.integrations.mlx_lm_ssm``) does the same for the Mamba-2 family's
``mlx_lm.models.ssm.ssm_update``, and ``wkv7`` (``recgen.integrations.mlx_lm_rwkv7``) for RWKV-7's WKV, the method
``mlx_lm.models.rwkv7.Rwkv7TimeMixing._wkv7`` (a class attribute, set on the class). What ``patch()`` covers in mlx-lm 0.32: gated delta in qwen3_next,
qwen3_5 (and qwen3_5_moe, which imports qwen3_5), kimi_linear, kimi_k3, bailing_moe_v3, olmo_hybrid; the
Mamba-2 scan in mamba2, nemotron_h, falcon_h1, granitemoehybrid, plamo2. Not covered: mamba (Mamba-1) and
jamba, whose selective scans are per-token loops inside their model classes, not one module-level function.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache

from ..op_args import CheckedSignatures, signature
from ..spec.layouts import InputError
from .calls import call_in_layout, check_floating_arrays, shape_error
from .mlx_lm_rwkv7 import wkv7
from .mlx_lm_ssm import ssm_update
from .rebind import Rebinding, rebind, rebind_attribute

__all__ = ["gated_delta_update", "ssm_update", "wkv7", "patch", "unpatch", "patched", "Patch", "Target", "TARGETS"]

PACKAGE = "mlx_lm.models"

# A float32 exp of anything below -104 is 0, so flooring the log-decay at -110 changes no decay mlx-lm
# computes; it keeps the chunked form's within-chunk cumulative log-decays small, where float32 still
# resolves the small log-decays of the tokens that follow (a log-decay of -1e4 would leave an ulp of 1e-3).
LOG_DECAY_FLOOR = -110.0


def _broadcasts_to(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def check_inputs(q, k, v, a, b, A_log, dt_bias, state, mask) -> bool:
    """Shapes and kinds of a call, from metadata only (no host sync). Returns whether the gate is a vector."""
    import mlx.core as mx

    named = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    if state is not None:
        named["state"] = state
    check_floating_arrays(named)
    if q.ndim != 4:
        raise shape_error("q", q.shape, "[B,T,Hk,Dk]")
    B, T, Hk, Dk = q.shape
    if k.shape != q.shape:
        raise shape_error("k", k.shape, f"the shape of q [B,T,Hk,Dk] = {tuple(q.shape)}")
    if v.ndim != 4 or tuple(v.shape[:2]) != (B, T):
        raise shape_error("v", v.shape, f"[B,T,Hv,Dv] with B={B}, T={T}")
    Hv, Dv = v.shape[2], v.shape[3]
    if Hv % Hk:
        raise InputError(f"argument 'v': Hv={Hv} value heads must be a multiple of the Hk={Hk} key heads of q, k")
    vector = a.ndim == 4
    gate = (B, T, Hv, Dk) if vector else (B, T, Hv)
    if tuple(a.shape) != gate:
        raise shape_error("a", a.shape, f"[B,T,Hv] = {(B, T, Hv)} (scalar gate) or [B,T,Hv,Dk] = "
                           f"{(B, T, Hv, Dk)} (vector gate)")
    if tuple(b.shape) != (B, T, Hv):
        raise shape_error("b", b.shape, f"[B,T,Hv] = {(B, T, Hv)}")
    param = "[Hv,1] or [Hv,Dk]" if vector else "[Hv]"
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if not _broadcasts_to(x.shape, gate[2:]):
            raise shape_error(name, x.shape, f"{param} broadcasting to {gate[2:]}")
    if state is not None and tuple(state.shape) != (B, Hv, Dv, Dk):
        raise shape_error("state", state.shape, f"[B,Hv,Dv,Dk] = {(B, Hv, Dv, Dk)}")
    if mask is not None:
        if not isinstance(mask, mx.array):
            raise InputError(f"argument 'mask': expected an mx.array, got {type(mask).__name__}")
        if tuple(mask.shape) != (B, T):
            raise shape_error("mask", mask.shape, f"[B,T] = {(B, T)}")
    return vector


_checked = CheckedSignatures()  # signature -> whether the gate is a vector


def checked_inputs(*arrays) -> bool:
    """``check_inputs``, once per call signature (``op_args.signature``)."""
    key = signature(arrays)
    vector = _checked.get(key)
    if vector is None:
        vector = check_inputs(*arrays)
        _checked.put(key, vector)
    return vector


@lru_cache(maxsize=16)
def gates(allow_neg_eigval: bool, lower_bound):
    """(beta, log-decay) from mlx-lm's (a, b, A_log, dt_bias) as one compiled, shapeless function, as mlx-lm's
    own ``compute_g``: one kernel a decode step instead of several (inside a transformation MLX traces it as
    plain ops)."""
    import mlx.core as mx

    return mx.compile(lambda a, b, A_log, dt_bias: gate_values(a, b, A_log, dt_bias, allow_neg_eigval, lower_bound),
                      shapeless=True)


def gate_values(a, b, A_log, dt_bias, allow_neg_eigval: bool, lower_bound):
    """mlx-lm's beta = sigmoid(b) (times 2 with ``allow_neg_eigval``) and the log-decay (``log_decay``)."""
    import mlx.core as mx

    beta = mx.sigmoid(b)
    return (beta * 2.0 if allow_neg_eigval else beta), log_decay(A_log, a, dt_bias, lower_bound)


def log_decay(A_log, a, dt_bias, lower_bound=None):
    """The log of mlx-lm's decay, in float32, from its parameters; floored at ``LOG_DECAY_FLOOR``."""
    import mlx.core as mx
    import mlx.nn as nn

    rate = mx.exp(A_log.astype(mx.float32))
    if lower_bound is None:
        lg = -rate * nn.softplus(a + dt_bias)  # a + dt_bias in a's own type, as mlx-lm's compute_g
    else:
        lg = lower_bound * mx.sigmoid(rate * (a.astype(mx.float32) + dt_bias))
    return mx.maximum(lg.astype(mx.float32), LOG_DECAY_FLOOR)


def gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
                       lower_bound=None, allow_neg_eigval=False):
    """mlx-lm's ``gated_delta_update`` on recgen's ops; returns ``(y [B,T,Hv,Dv], state [B,Hv,Dv,Dk])``.
    See the module docstring for the conventions."""
    import mlx.core as mx

    from .. import ops

    del use_kernel  # recgen picks its own path
    vector = checked_inputs(q, k, v, a, b, A_log, dt_bias, state, mask)
    B, _, _, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if lower_bound is None or isinstance(lower_bound, (int, float)):
        beta, lg = gates(bool(allow_neg_eigval), lower_bound)(a, b, A_log, dt_bias)
    else:  # an array bound is no cache key
        beta, lg = gate_values(a, b, A_log, dt_bias, allow_neg_eigval, lower_bound)
    if mask is not None:
        keep = mask.astype(mx.bool_)[..., None]
        beta = mx.where(keep, beta, 0.0)
        lg = mx.where(keep[..., None] if vector else keep, lg, 0.0)
    state_dtype = mx.float32 if state is None else state.dtype
    h0 = mx.zeros((B, Hv, Dk, Dv), dtype=mx.float32) if state is None else state.swapaxes(-1, -2)
    op = ops.kda if vector else ops.gated_delta_net
    y, ht = call_in_layout(op, q.shape[1], Hv, q, k, v, lg, beta, scale=1.0, initial_state=h0,
                           output_final_state=True)
    return y.astype(q.dtype), ht.swapaxes(-1, -2).astype(state_dtype)


@dataclass(frozen=True)
class Target:
    """A function mlx-lm's models import by name from ``module`` (or, with ``owner``, a method of the class
    ``module.owner``), and recgen's drop-in for it."""

    module: str
    name: str
    replacement: object
    owner: str | None = None

    def holder(self):
        """The module, or the class, that holds the target (importing the module)."""
        mod = importlib.import_module(self.module)
        return getattr(mod, self.owner) if self.owner else mod

    def rebind(self, original, replacement) -> tuple[Rebinding, ...]:
        """Every binding of ``original`` set to ``replacement``: in each importer, or on the class."""
        if self.owner is None:
            return rebind(PACKAGE, self.name, original, replacement)
        return rebind_attribute(self.holder(), f"{self.module}.{self.owner}", self.name, original, replacement)


TARGETS = (Target("mlx_lm.models.gated_delta", "gated_delta_update", gated_delta_update),
           Target("mlx_lm.models.ssm", "ssm_update", ssm_update),
           Target("mlx_lm.models.rwkv7", "_wkv7", wkv7, owner="Rwkv7TimeMixing"))


@dataclass(frozen=True)
class Patch:
    """What one ``patch()`` replaced (``originals``: (target, mlx-lm's function) pairs; ``rebindings``: every
    module binding it set), and whether that call applied it (``applied``: False when mlx-lm was already
    patched). As a context manager it undoes only what it applied."""

    originals: tuple[tuple[Target, object], ...]
    rebindings: tuple[Rebinding, ...]
    applied: bool

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.applied:
            unpatch()
        return False


_active: Patch | None = None


def patch(gated_delta: bool = True, ssm: bool = True, rwkv7: bool = True) -> Patch:
    """Make mlx-lm's models run their recurrences on recgen: rebind ``gated_delta_update`` (with
    ``gated_delta``) and ``ssm_update`` (with ``ssm``) in their defining modules and in every loaded
    ``mlx_lm.models`` module that imported them by name (models imported later take them from the defining
    modules), and set RWKV-7's ``Rwkv7TimeMixing._wkv7`` (with ``rwkv7``) on its class. Idempotent while patched
    (the first call's choice stays); ``unpatch()`` undoes it."""
    global _active
    if _active is not None:
        return Patch(_active.originals, _active.rebindings, applied=False)
    chosen = [t for t, on in zip(TARGETS, (gated_delta, ssm, rwkv7)) if on]
    originals, done = [], []
    for t in chosen:
        original = getattr(t.holder(), t.name)
        if original is t.replacement:
            raise RuntimeError(f"{t.module}.{t.name} is already recgen's but no patch is recorded")
        originals.append((t, original))
        done.extend(t.rebind(original, t.replacement))
    _active = Patch(tuple(originals), tuple(done), applied=True)
    return _active


def unpatch() -> tuple[Rebinding, ...]:
    """Restore mlx-lm's own functions everywhere the patch put recgen's (also in model modules imported
    while patched). Returns the restored bindings; a no-op when not patched."""
    global _active
    if _active is None:
        return ()
    done = []
    for t, original in _active.originals:
        done.extend(t.rebind(t.replacement, original))  # swapped: back wherever the replacement is bound
    _active = None
    return tuple(done)


def patched() -> bool:
    """Whether ``patch()`` is in effect."""
    return _active is not None
