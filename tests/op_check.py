"""One op against the float64 reference: forward, final state and every gradient, the initial state's
included, with a cotangent on the final state. The GPU suite (``tests/gpu``) runs it on the generated CUDA
kernels and on the chunked form; ``tests/test_op_check.py`` runs it on the CPU (backend "mlx") so that a
broken harness fails in CI, where there is no GPU.

Inputs (``recgen.testing.kernel_inputs``): fresh random data, log-decays down to -20, unit-norm keys for
the delta rules. They are rounded to the op's dtype first and the reference is given exactly what the op
saw (inputs, initial state, cotangents), so the errors measure the op, not the rounding of its inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import sympy as sp
from helpers import rel_err

import recgen as rg
from recgen import Recurrence, specs
from recgen.math import reference
from recgen.ops import Op
from recgen.spec.layouts import Sizes
from recgen.testing import kernel_inputs, reachable_state

ROOT = Path(__file__).resolve().parent.parent
MLSTM = "mlstm_sigmoid"  # the built-in with a normalizer state (C, n)

# the built-ins with a recurrent kernel (mlstm_sigmoid: the normalizer kernels)
KERNEL_SPECS = ("gated_delta_net", "kda", "delta_net", "gla", "simple_gla", "selective_scan", "selective_scan_linear_dt",
                "retnet", "hgrn2", "mamba2", "mamba2_linear_dt", MLSTM, "rwkv6", "rwkv7")
ALL_SPECS = tuple(specs.BUILTINS)
DTYPES = ("float32", "bfloat16")
# (forward and final state, gradients): relative errors, ||a - b|| / ||b||. float32 assumes MLX's float32
# matmuls are exact float32 (MLX_ENABLE_TF32=0 on CUDA; TF32 rounds operands to 10 mantissa bits).
TOL = {"float32": (1e-5, 1e-4), "bfloat16": (1e-2, 2e-2)}
# The gradient of a parameter inside the decay (Mamba's A, a learnable log-decay) is a sum over B·T tokens of
# per-token decay gradients, whose float32 error is absolute (docs/design.md, "decay gradients"): where the terms
# cancel, the sum's relative error grows. Measured on the H100: 2.1e-4 for mamba2's dA at T = 300, chunks of 64.
DECAY_PARAM_GRAD_TOL = {"float32": 1e-3, "bfloat16": 5e-2}
DECAY_PARAM_GRADS = frozenset({"dA", "dlog_gamma"})


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    Hk: int
    K: int
    V: int

    @property
    def id(self) -> str:
        return f"B{self.B}T{self.T}H{self.H}Hk{self.Hk}K{self.K}V{self.V}"


# Shapes are shared wherever coverage allows: each distinct (K, V, H, Hk, dtype) compiles its own kernels on a
# GPU (B and T are runtime values there), so three of the four cases share K = 64, V = 40, H = 4, Hk = 2.
CASES = (
    Case(2, 1, 4, 2, 64, 40),    # T = 1: the decode kernels; one partial chunk
    Case(2, 37, 4, 2, 64, 40),   # prime T, GQA (two value heads a key head), K != V, V = 40 not a multiple of a tile
    Case(1, 67, 2, 1, 128, 72),  # prime T at K = 128, V = 72: a full chunk of 64 and a partial one
    Case(1, 300, 4, 2, 64, 40),  # several chunks of 64 and a partial last one (44)
)


def group(name: str, dtype: str) -> str:
    """The ``xdist_group`` of a spec and dtype: its tests share the kernels their shapes compile."""
    return f"{name}-{dtype}"


def params(names, dtypes=DTYPES, cases=CASES) -> list:
    """pytest parameters (name, case, dtype) over the product, each in its ``group``."""
    return [pytest.param(n, c, d, id=f"{n}-{c.id}-{d}", marks=pytest.mark.xdist_group(group(n, d)))
            for n in names for c in cases for d in dtypes]


def norm_skip() -> Recurrence:
    """A normalizer beside a skip term (an mLSTM-style readout y / N(n) + D ⊙ v), for the kernels' checks.
    N(n) = sqrt(n² + 1), as mLSTM's: the bare ratio y / n is ill-conditioned where random signed readouts leave
    n near 0 (on the H100 its float32 o, rounded like any kernel's, read 1.2e-5 and 3.8e-5 against float64)."""
    @rg.recurrence
    def norm_skip(q: rg.Key, k: rg.Key, v: rg.Value, f: rg.Scalar, i: rg.Scalar, Dp: rg.Param["j"]):
        return rg.Step(decay=rg.sigmoid(f), update=rg.outer(rg.sigmoid(i) * k, v), readout=rg.scale * q,
                       normalizer=rg.normalizer(rg.sigmoid(f), rg.sigmoid(i) * k, lambda n: sp.sqrt(n**2 + 1)),
                       skip=Dp * v)
    return norm_skip


def load_spec(name: str) -> Recurrence:
    """A built-in by name."""
    return specs.BUILTINS[name]


def case_inputs(rec: Recurrence, case: Case, rng):
    """(inputs, initial state, do, dht) in float64, IR layouts."""
    B, T, H, Hk, K, V = case.B, case.T, case.H, case.Hk, case.K, case.V
    if rec.name.startswith("selective_scan"):  # B and C per head, as the kernel tests on the emulator take them
        Hk = H
    if not rec.features:
        xs, h0, do, dht, _ = kernel_inputs(rec, Sizes(B, T, H, Hk, K, K, V), rng)
        return xs, h0, do, dht
    # Power retention, at every case: K = 8 raw key columns (36 state rows) and a reachable initial state
    # (S, z) = (Σ φ(w) vᵀ, Σ φ(w)), so that φ(q)ᵀz is a sum of squares as the recurrence makes it. Log-decays down
    # to -20 like every spec (the readout's floor, specs.POWER_RETENTION_EPS, keeps it well-conditioned).
    K = 8
    xs, _, do, dht, _ = kernel_inputs(rec, Sizes(B, T, H, Hk, K, rec.features[0].width(K), V), rng)
    return xs, reachable_state(Sizes(B, T, H, Hk, K, rec.features[0].width(K), V), rng), do, dht


def op_errors(rec: Recurrence, case: Case, dtype: str, rng, *, backend: str, backward: str | None = None,
              op=None) -> dict[str, float]:
    """Relative errors of ``Op(rec, backend=backend, backward=backward)`` (or of ``op``, a callable with the
    op's signature) against ``recgen.math.reference`` at ``case``, inputs in ``dtype``: "o", the final state
    ("ht0", and "ht1" for a normalizer's z) and "d<input>" for every input and the initial state (and z)."""
    xs, h0, do, dht = case_inputs(rec, case, rng)
    op = op or Op(rec, backend=backend, backward=backward)
    names = [x.name for x in rec.inputs]
    norm = rec.has_normalizer
    mdt = getattr(mx, dtype)
    m32 = lambda a: mx.array(np.asarray(a, np.float32))  # noqa: E731
    f64 = lambda a: np.array(a.astype(mx.float32), np.float64)  # noqa: E731
    parts = lambda s: list(s) if norm else [s]  # noqa: E731

    def f(*args):
        state = tuple(args[len(names):]) if norm else args[len(names)]
        o, ht = op(*args[:len(names)], initial_state=state, output_final_state=True)
        return (o, *parts(ht))

    prim = [m32(xs[n]).astype(mdt) for n in names] + [m32(s) for s in parts(h0)]
    cot = [m32(do).astype(mdt)] + [m32(s) for s in parts(dht)]
    outs, grads = mx.vjp(f, prim, cot)
    mx.eval(outs, grads)
    # the reference at exactly what the op was given
    seen = {n: f64(a) for n, a in zip(names, prim)}
    h0r = [f64(a) for a in prim[len(names):]]
    h0r = tuple(h0r) if norm else h0r[0]
    dhtr = [f64(a) for a in cot[1:]]
    o_ref, ht_ref = reference.run(rec, initial_state=h0r, **seen)
    g_ref = reference.grad(rec, do=f64(cot[0]), dht=tuple(dhtr) if norm else dhtr[0], initial_state=h0r, **seen)

    errs = {"o": rel_err(f64(outs[0]), o_ref)}
    for i, (a, r) in enumerate(zip(outs[1:], parts(ht_ref))):
        errs[f"ht{i}"] = rel_err(f64(a), r)
    refs = [g_ref[n] for n in names] + parts(g_ref["initial_state"])
    for n, g, r in zip(names + ["initial_state", "initial_z"], grads, refs):
        errs["d" + n] = rel_err(f64(g), r)
    return errs


def over_tolerance(errs: dict[str, float], dtype: str) -> dict[str, float]:
    """The entries of ``errs`` above ``TOL[dtype]`` (NaN included)."""
    ftol, gtol = TOL[dtype]
    tol = {k: DECAY_PARAM_GRAD_TOL[dtype] if k in DECAY_PARAM_GRADS else gtol if k.startswith("d") else ftol
           for k in errs}
    return {k: v for k, v in errs.items() if not v <= tol[k]}


def assert_close(errs: dict[str, float], dtype: str):
    bad = over_tolerance(errs, dtype)
    assert not bad, f"above tolerance {TOL[dtype]}: {bad} (all: {errs})"
