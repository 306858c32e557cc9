"""Random recurrence specs for the fuzzer: a ``Recipe`` (a frozen record of choices, readable when a check fails)
becomes a spec through the public decorator, and gets inputs drawn to suit each input's role (log-decays down to
-20, unit keys for transitions, negative A, 0/1 masks with exact zeros).

The space is the README's: decays none / scalar / key-vector / value-vector / full (i, j), through the gates
exp, sigmoid, logsigmoid, softplus (a mask |m|·e^g with exact zeros, and (2σ(f) - 1)², not an exp); updates k, β·k, σ(i)·k, σ(gain)·k with values v or
softplus(dt)·v; no transition, a delta rule or a general rank-1 transition; readouts scale·q, q, σ(o)·scale·q, a
feature map; normalizers fused or with their own decay; skip terms; a readout before the update and a bonus
(RWKV-6's terms); the transition before the decay (RWKV-7's order); parameters of every signature; GQA (block and
tiled), K ≠ V.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import sympy as sp

import recgen as rg

DECAYS = ("none", "exp_scalar", "sigmoid_scalar", "logsigmoid_scalar", "softplus_scalar", "mask_scalar", "square_scalar",
          "exp_key", "sigmoid_key", "param_key", "value", "param_value", "full")
VALUE_DECAYS = ("value", "param_value", "full")
KEY_GATE_DECAYS = ("exp_key", "sigmoid_key")


@dataclass(frozen=True)
class Recipe:
    decay: str = "exp_scalar"
    transition: str = "none"     # none | delta | general
    u: str = "k"                 # k | beta_k | gate_k | gain_k
    w: str = "v"                 # v | dt_v
    readout: str = "scale_q"     # scale_q | q | gated_q
    features: bool = False       # sympow(k) updates, sympow(q) reads (raw keys then appear nowhere else)
    normalizer: str = "none"     # none | same | own
    norm_fn: str = "sqrt1"       # sqrt1: sqrt(n^2 + 1) | sq1: n^2 + 1
    skip: str = "none"           # none | param | gated
    gqa: str = "block"
    default_scale: str = "key"
    readout_at: str = "after"    # after | before (readout_before_update)
    bonus: str = "none"          # none | param: c = readout · cb · u, cb a Param["i"]
    before_decay: bool = False   # the transition reads S_{t-1} rather than the decayed state (RWKV-7's order)

    def rejection(self) -> str | None:
        """A regex matching the SpecError the decorator must raise for this recipe (any one of its faults), or
        None when it must accept it."""
        why = []
        if self.normalizer == "same" and self.decay in VALUE_DECAYS:
            why.append("normalizer decay d")
        if self.features and (self.decay in KEY_GATE_DECAYS or self.transition == "general"):
            why.append("one space")
        if self.normalizer != "none" and self.readout_at == "before":
            why.append("readout_before_update=True with a normalizer")
        if self.normalizer != "none" and self.bonus != "none":
            why.append("a bonus with a normalizer")
        return "|".join(why) or None


def _kinds(r: Recipe) -> dict:
    """Input name -> annotation, in signature order."""
    kinds = {"q": rg.Key, "k": rg.Key, "v": rg.Value}
    if r.transition == "general":
        kinds["kk"] = rg.Key
    if r.transition != "none" or r.u == "beta_k":
        kinds["beta"] = rg.Scalar
    if r.decay in ("exp_scalar", "mask_scalar"):
        kinds["g"] = rg.Scalar
    if r.decay in ("sigmoid_scalar", "logsigmoid_scalar", "softplus_scalar", "square_scalar"):
        kinds["f"] = rg.Scalar
    if r.decay == "mask_scalar":
        kinds["m"] = rg.Scalar
    if r.decay in KEY_GATE_DECAYS:
        kinds["gk"] = rg.KeyGate
    if r.decay == "param_key":
        kinds["lam"] = rg.Param["i"]
    if r.decay in ("value", "full") or r.w == "dt_v":
        kinds["dt"] = rg.Value
    if r.decay == "param_value":
        kinds["lamv"] = rg.Param["j"]
    if r.decay == "full":
        kinds["A"] = rg.Param["i", "j"]
    if r.u == "gate_k":
        kinds["ig"] = rg.Scalar
    if r.u == "gain_k":
        kinds["gain"] = rg.Param[()]
    if r.readout == "gated_q":
        kinds["og"] = rg.Scalar
    if r.normalizer == "own":
        kinds["zf"] = rg.Scalar
    if r.skip == "param":
        kinds["Dp"] = rg.Param["j"]
    if r.skip == "gated":
        kinds["sg"] = rg.Scalar
    if r.bonus == "param":
        kinds["cb"] = rg.Param["i"]
    return kinds


def _step(r: Recipe, s: dict):
    q, k, v = s["q"], s["k"], s["v"]
    decay = {
        "none": lambda: sp.Integer(1), "exp_scalar": lambda: rg.exp(s["g"]),
        "sigmoid_scalar": lambda: rg.sigmoid(s["f"]), "logsigmoid_scalar": lambda: rg.exp(rg.logsigmoid(s["f"])),
        "softplus_scalar": lambda: rg.exp(-rg.softplus(s["f"])), "mask_scalar": lambda: sp.Abs(s["m"]) * rg.exp(s["g"]),
        "square_scalar": lambda: (2 * rg.sigmoid(s["f"]) - 1) ** 2,  # nonnegative, not an exp, 0 at f = 0
        "exp_key": lambda: rg.exp(s["gk"]), "sigmoid_key": lambda: rg.sigmoid(s["gk"]),
        "param_key": lambda: rg.exp(-rg.softplus(s["lam"])), "value": lambda: rg.exp(-rg.softplus(s["dt"])),
        "param_value": lambda: rg.exp(-rg.softplus(s["lamv"])),
        "full": lambda: rg.exp(rg.softplus(s["dt"]) * s["A"]),
    }[r.decay]()
    kf = rg.sympow(k) if r.features else k
    beta = rg.sigmoid(s["beta"]) if "beta" in s else None
    u = {"k": lambda: kf, "beta_k": lambda: beta * kf, "gate_k": lambda: rg.sigmoid(s["ig"]) * kf,
         "gain_k": lambda: rg.sigmoid(s["gain"]) * kf}[r.u]()
    w = v * rg.softplus(s["dt"]) if r.w == "dt_v" else v
    qf = rg.sympow(q) if r.features else q
    readout = {"scale_q": lambda: rg.scale * qf, "q": lambda: qf,
               "gated_q": lambda: rg.sigmoid(s["og"]) * rg.scale * qf}[r.readout]()
    transition = None
    if r.transition == "delta":
        transition = rg.rank1(-beta * kf, kf, before_decay=r.before_decay)
    elif r.transition == "general":
        transition = rg.rank1(-beta * s["kk"], kf, before_decay=r.before_decay)
    norm = None
    if r.normalizer != "none":
        fn = {"sqrt1": lambda n: sp.sqrt(n ** 2 + 1), "sq1": lambda n: n ** 2 + 1}[r.norm_fn]
        zdecay = decay if r.normalizer == "same" else rg.sigmoid(s["zf"])
        norm = rg.normalizer(zdecay, u, fn)
    skip = {"none": lambda: None, "param": lambda: s["Dp"] * v, "gated": lambda: rg.sigmoid(s["sg"]) * v}[r.skip]()
    bonus = readout * s["cb"] * u if r.bonus == "param" else None
    return rg.Step(decay=decay, update=rg.outer(u, w), readout=readout, transition=transition, normalizer=norm,
                   skip=skip, readout_before_update=r.readout_at == "before", bonus=bonus)


def build(r: Recipe) -> rg.Recurrence:
    """The spec of ``r``, declared through ``rg.recurrence`` (raises the decorator's SpecError)."""
    kinds = _kinds(r)

    def fuzz(*syms):
        return _step(r, dict(zip(kinds, syms)))

    fuzz.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                              annotation=a) for n, a in kinds.items()])
    return rg.recurrence(fuzz, name="fuzz", gqa=r.gqa, default_scale=r.default_scale)


def _unit(a):
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def inputs(rec: rg.Recurrence, rng, B, T, H, Hk, Kin, V, dtype=np.float32):
    """Inputs for ``rec`` suited to each name's role, rounded through ``dtype`` (the reference sees the same
    numbers); returns (xs, h0, do, dht) in float64."""
    from helpers import input_shape, log_decay, state_width

    K = state_width(rec, Kin)
    xs = {}
    for x in rec.inputs:
        shape = input_shape(x, B, T, H, Hk, Kin, K, V)
        n = x.name
        if n in ("g", "gk"):
            a = log_decay(rng, shape)
        elif n == "m":
            a = rng.choice([0.0, 1.0, -1.0], size=shape, p=[0.3, 0.5, 0.2])
        elif n == "A":
            a = -rng.uniform(0.5, 8.0, shape)
        elif n in ("f", "zf"):
            a = 3 * rng.standard_normal(shape)
            a[rng.uniform(size=shape) < 0.1] = 0.0  # (2σ(0) - 1)² = 0: resets
        else:
            a = rng.standard_normal(shape)
        xs[n] = a
    if rec.step.transition is not None:
        xs["k"] = _unit(xs["k"])
        if "kk" in xs:  # near k: the transition's eigenvalue 1 - β kkᵀk stays in (0, 1]
            xs["kk"] = _unit(xs["k"] + 0.3 * _unit(rng.standard_normal(xs["k"].shape)))
    rnd = lambda a: np.asarray(a, dtype=np.float64).astype(dtype).astype(np.float64)  # noqa: E731
    xs = {n: rnd(a) for n, a in xs.items()}
    S = rnd(rng.standard_normal((B, H, K, V)))
    dS = rnd(rng.standard_normal((B, H, K, V)))
    if rec.has_normalizer:
        h0 = (S, rnd(np.abs(rng.standard_normal((B, H, K)))))
        dht = (dS, rnd(rng.standard_normal((B, H, K))))
    else:
        h0, dht = S, dS
    return xs, h0, rnd(rng.standard_normal((B, T, H, V))), dht
