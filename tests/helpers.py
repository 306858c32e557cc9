"""Shared test helpers: random inputs per spec in the IR layout, and the relative-error metric.

Inputs follow docs/design.md, "Tests that count": fresh random data per check (never zeros), strong decays (log-decay
down to -20), K != V, GQA (Hk < H) wherever the model has key inputs, beta = sigmoid(normal), and
L2-normalized keys for the delta rules.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from recgen.spec import ir
from recgen.testing import rel_err  # noqa: F401 (the tests import it from here)

ROOT = Path(__file__).resolve().parent.parent  # the project root


def log_decay(rng, shape, lo=-20.0):
    """Log-decays spread log-uniformly over [lo, -1e-3]: from ~no decay to e^{-20}."""
    return -np.exp(rng.uniform(np.log(1e-3), np.log(-lo), size=shape))


def sigmoid(x):
    return 0.5 * (1 + np.tanh(0.5 * x))


def l2norm(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


DELTA_RULES = {"gated_delta_net", "kda", "delta_net"}

# per-spec special inputs: name -> (rng, shape) -> array
_SPECIAL = {
    ("gated_delta_net", "g"): log_decay,
    ("simple_gla", "g"): log_decay,
    ("power_retention", "g"): log_decay,
    ("gla", "gk"): log_decay,
    ("kda", "g"): log_decay,
    ("kda", "beta"): lambda rng, s: sigmoid(rng.standard_normal(s)),
    ("retnet", "log_gamma"): log_decay,
    ("gated_delta_net", "beta"): lambda rng, s: sigmoid(rng.standard_normal(s)),
    ("delta_net", "beta"): lambda rng, s: sigmoid(rng.standard_normal(s)),
    # mamba: A = -exp(A_log) < 0 with magnitudes from 0.5 to 20; delta = softplus(dt + bias) ~ 0.1 .. 3
    ("selective_scan", "A"): lambda rng, s: -np.exp(rng.uniform(np.log(0.5), np.log(20.0), s)),
    ("selective_scan_linear_dt", "A"): lambda rng, s: -np.exp(rng.uniform(np.log(0.5), np.log(20.0), s)),
    ("selective_scan", "dt_bias"): lambda rng, s: 0.5 * rng.standard_normal(s),
    ("selective_scan_linear_dt", "dt"): lambda rng, s: rng.uniform(0.05, 1.5, s),
    ("mlstm_sigmoid", "ig"): lambda rng, s: 2 * rng.standard_normal(s),
    ("mlstm_sigmoid", "fg"): lambda rng, s: 3 * rng.standard_normal(s),
    ("mlstm", "ig"): lambda rng, s: 1.5 * rng.standard_normal(s),  # e^ig: input gates from ~0.01 to ~100
    ("mlstm", "fg"): lambda rng, s: 3 * rng.standard_normal(s),
    ("hgrn2", "g"): log_decay,
    # Mamba-2: A < 0 with magnitudes 0.5 to 20 (Δ A to -60), Δ = softplus(dt + bias) or dt > 0 as given
    ("mamba2", "A"): lambda rng, s: -np.exp(rng.uniform(np.log(0.5), np.log(20.0), s)),
    ("mamba2_linear_dt", "A"): lambda rng, s: -np.exp(rng.uniform(np.log(0.5), np.log(20.0), s)),
    ("mamba2", "dt_bias"): lambda rng, s: 0.5 * rng.standard_normal(s),
    ("mamba2_linear_dt", "dt"): lambda rng, s: rng.uniform(0.05, 1.5, s),
    ("rwkv6", "w"): log_decay,
    ("rwkv7", "w"): log_decay,
}


def has_keys(spec: ir.Recurrence) -> bool:
    return any(x.kind == "key" for x in spec.inputs)


def input_shape(x: ir.Input, B, T, H, Hk, Kin, K, V) -> tuple[int, ...]:
    if x.kind == "scalar":
        return (B, T, H)
    if x.kind == "key":
        return (B, T, Hk, Kin)
    if x.kind == "key_gate":
        return (B, T, H, K)
    if x.kind == "value":
        return (B, T, H, V)
    return (H,) + tuple({"i": K, "j": V}[c] for c in x.index)


def state_width(spec: ir.Recurrence, Kin: int) -> int:
    return spec.features[0].width(Kin) if spec.features else Kin


def random_inputs(spec: ir.Recurrence, rng, *, B=2, T=7, H=4, Hk=2, K=5, V=3) -> dict:
    """Random inputs of ``spec`` in the IR layout. ``K`` is the raw key width (Kin); with a feature
    map the state has ``state_width(spec, K)`` rows. ``Hk`` applies only where the model has keys."""
    Ks = state_width(spec, K)
    Hk = Hk if has_keys(spec) else H
    out = {}
    for x in spec.inputs:
        shape = input_shape(x, B, T, H, Hk, K, Ks, V)
        gen = _SPECIAL.get((spec.name, x.name))
        a = gen(rng, shape) if gen is not None else rng.standard_normal(shape)
        if spec.name in DELTA_RULES and x.name == "k":
            a = l2norm(a)
        out[x.name] = np.ascontiguousarray(a, dtype=np.float64)
    if spec.name == "rwkv7":  # RWKV-7's transition: a = -kk (unit), b = kk ⊙ iclr, iclr in (0, 1), plus an independent part
        out["a"] = -l2norm(out["a"])
        out["b"] = -out["a"] * rng.uniform(0.05, 0.95, out["a"].shape) + 0.1 * l2norm(out["b"])
    return out


def random_state(spec: ir.Recurrence, rng, *, B=2, H=4, K=5, V=3):
    """A random initial state (S, or (S, z) with a normalizer; z > 0 for power retention)."""
    Ks = state_width(spec, K)
    S = rng.standard_normal((B, H, Ks, V))
    if not spec.has_normalizer:
        return S
    z = rng.standard_normal((B, H, Ks))
    if spec.name == "power_retention":  # z = φ(w), a decayed sum of φ(k) could be: φ(q)ᵀz = (qᵀw)² ≥ 0
        from recgen.spec.features import sympow
        z = sympow(rng.standard_normal((B, H, K)))
    return (S, z)


def random_cotangents(spec: ir.Recurrence, rng, *, B=2, T=7, H=4, K=5, V=3):
    """(do, dht) shaped like (o, final_state)."""
    return rng.standard_normal((B, T, H, V)), random_state(spec, rng, B=B, H=H, K=K, V=V)


def state_parts(state) -> tuple:
    return tuple(state) if isinstance(state, (tuple, list)) else (state,)


def inner(a, b) -> float:
    """Σ a·b over matching (possibly tuple-structured) arrays, without conjugation."""
    return sum(float(np.sum(x * y)) for x, y in zip(state_parts(a), state_parts(b)))


def chunk_launches(target: str) -> list:
    """Every chunk kernel's launch at the GPU shapes (C = 64, K = V = 128; Metal's fragment UT transform and backward
    pass at C = 32, which its threadgroup memory holds): the golden set (``test_golden``), which the nvcc test
    compiles too."""
    from recgen.codegen.chunk_sources import ScanVariant
    from recgen.runtime import chunk_kernels as ck

    def scans(F, **terms):  # the same scan on FMAs (16-byte columns) and on fragments
        return [ck.scan_launch(target, ScanVariant(vec=True, **terms), 8, 4, 64, 128, 128, F),
                ck.scan_launch(target, ScanVariant(mma=True, **terms), 8, 4, 64, 128, 128, F)]

    def mma(ml=None, st=None, **terms):
        return ck.scan_launch(target, ScanVariant(mma=True, ml=ml is not None, s16=st is not None, **terms), 8, 4, 64,
                              128, 128, 1, ml=ml, st=st)

    ml = (2, 1, 2, True)  # the model's layout: H = 2 value heads over one key head, two chunks a sequence

    launches = ([ck.inverse_launch(target, 8, 64)] + [ck.decays_launch(target, 8, 64, 128, pe) for pe in (False, True)]
                + [ck.decays_launch(target, 8, 64, 128, False, ("Q",))]  # kda's and gla's, with u ⊙ Q
                + [ck.decays_launch(target, 8, 64, 128, False, ("Q",), q=False)]  # ... their forward's, P without Q
                # ... GLA's, u ⊙ Q in bf16, and its backward's, r ⊙ P too (``Tuning.key_scaled_16bit``)
                + [ck.decays_launch(target, 8, 64, 128, False, ("Q",), q=False, yt="bfloat16")]
                + [ck.decays_launch(target, 8, 64, 128, False, ("Q", "P"), yt="bfloat16")]
                # ... GLA's forward's reading l and u in the model's layout
                + [ck.decays_launch(target, 8, 64, 128, False, ("Q",), d=False, q=False, yt="bfloat16", ml=ml)]
                + [ck.decays_launch(target, 8, 64, 1, False, ("Q",), d=False)]  # GDN's, with f ⊙ Q (lanes)
                + [ck.decays_launch(target, 8, 64, 128, pe, ("Q", "Q", "P"), False) for pe in (True, False)]  # RWKV-7's
                + [x for e in (False, True) for x in scans(1, e=e, reverse=e)]
                + scans(128, a=False, b=True)
                + scans(128, e=True, reverse=True, a=True, b=False)
                + [mma(reverse=True, p=True, dg=True), mma(reverse=True, p=True, dg=True, aq=True, pq=True),
                   mma(reverse=True, e=True, b=False, aq=True), mma(q=True, pf=True),
                   mma(reverse=True, p=True, dg=True, aq=True, pq=True, pf=True), mma(p=True),
                   mma(q=True, hoist=True, ml=ml), mma(reverse=True, p=True, dg=True, aq=True, pq=True, hoist=True),
                   mma(reverse=True, e=True, b=False, aq=True, hoist=True)]
                + [mma(a=a, q=True) for a in (True, False)]
                + [ck.pair_launch(target, 8, 64, 128, strict, grad) for strict in (False, True) for grad in (False, True)]
                + [ck.pair_launch(target, 8, 64, 128, strict, grad, dual=True) for strict in (False, True)
                   for grad in (False, True)]
                + [ck.pair_launch(target, 8, 64, 128, True, grad, dual, mma=True) for grad in (False, True)
                   for dual in (False, True)]
                + [ck.pair_launch(target, 8, 64 if target == "cuda" else 32, 128, False, grad, True, mma=m, quad=True)
                   for grad in (False, True) for m in (False, True)]  # the quad form (Metal's at C = 32)
                + [ck.pair_launch(target, 8, 64 if target == "cuda" else 32, 128, not q, grad, True, mma=True, quad=q,
                                  fold=True) for grad in (False, True) for q in (False, True)]  # rows folded
                + [ck.pair_launch(target, 8, 64, 128, False, grad, mma=True, fold=True, scaled=True)
                   for grad in (False, True)]  # GLA's: r read times the readout's scale
                + [ck.pair_launch(target, 8, 64, 128, False, True, mma=True, fold=True, scaled=True,
                                  types=("bfloat16",) * 2)]  # ... its gradient's slabs copied ahead
                + [ck.pair_launch(target, 8, 64, 128, s, dual=d, quad=q, mma=True, scaled=not d, whole=True)
                   for s, d, q in ((False, False, False), (True, True, False), (True, True, True))]  # a chunk a group
                + [ck.pair_launch(target, 8, 64, 128, s, dual=d, mma=True, scaled=not d, whole=True, halves=True)
                   for s, d in ((False, False), (True, True))]  # ... its blocks' halves on fragments too
                + [ck.pair_launch(target, 8, 64, 128, False, mma=True, scaled=True, whole=True,
                                  types=("bfloat16",) * 2)]  # ... its slabs copied ahead
                + [ck.pair_launch(target, 8, 64, 128, False, mma=True, scaled=True, whole=True, ml=ml)]  # ... q, k so
                # GLA's backward reading q, k, gk so (``Tuning.key_model_backward``): its pair gradient and key tail
                + [ck.pair_launch(target, 8, 64, 128, False, True, mma=True, fold=True, scaled=True,
                                  types=("bfloat16",) * 2, ml=ml, ld=ld, dk_type="bfloat16") for ld in (False, True)]
                + [ck.bwd_key_launch(target, 8, 64, 128, ("bfloat16",) * 2, ml=ml, dl_type="bfloat16")]
                + [ck.decays_launch(target, 8, 64, 128, False, ("Q", "P"), d=d, pq=False, yt="bfloat16", ml=ml)
                   for d in (True, False)]  # ... its pair gradient forming the decays or not (pair_grad_logdecays)
                + [ck.sympow_launch(target, 2, 4096, 8, 8, 64, True, grad) for grad in (False, True)]
                + [ck.decayed_scores_launch(target, 256, 256, 2, grad) for grad in (False, True)]
                + [ck.feature_decode_launch(target, 16, 64, 64, has_z) for has_z in (True, False)]
                + [ck.feature_mix_launch(target, 16, 17, 2080 * 65)]
                + [ck.decay_factors_launch(target, 16, 16, 256, grad) for grad in (False, True)]
                + [ck.feature_states_launch(target, 256, 256, 64, 65), ck.feature_out_launch(target, 256, 256, 64, 65),
                   ck.feature_jac_launch(target, 256, 256, 64, 65), ck.feature_states_launch(target, 256, 256, 64, 65, 16),
                   ck.feature_jac_launch(target, 256, 256, 64, 65, rows=True)]
                + [ck.out_mma_launch(target, 8, 64, 128, 128), ck.out_mma_launch(target, 8, 64, 128, 128, (2, 2, "bfloat16"))]
                + [ck.out_mma_launch(target, 8, 64, 128, 128, (2, 2, "bfloat16"), key=True)]
                + [ck.out_mma_launch(target, 8, 64, 128, 128, (2, 2, "bfloat16"), key=True, m2=True)]  # RWKV-7's
                + [ck.out_mma_launch(target, 8, 64, 128, 128, (2, 2, "bfloat16"), uf=True)]  # GDN's factor reads
                + [ck.ut_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, 128, key=key) for key in (False, True)]
                + [ck.ut_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, 128, key=True, tb=True)]
                + [ck.ut_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, 128, uf=True, ot=ot)
                   for ot in (None, "bfloat16")]
                + [ck.ut_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, 128, key=True, uf=True)]
                + [ck.bwd_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, ("bfloat16", "float32", "bfloat16")),
                   ck.bwd_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, ("bfloat16", "bfloat16")),
                   ck.bwd_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, ("bfloat16", "bfloat16"), uf=True)]
                + [ck.bwd_key_launch(target, 8, 64, 128, ("float32",) * n) for n in (2, 3)]
                + [ck.bwd_key_launch(target, 8, 64, 128, ("float32",) * 2, uf=True)]
                + [ck.bwd_key_launch(target, 8, 64, 128, ("bfloat16",) * 2, running=True)]  # dl summed as it goes
                # GDN's factor reads in the model's layout (``Tuning.model_rows``)
                + [mma(q=True, ml=(2, 1, 4, True)), mma(reverse=True, p=True, dg=True, aq=True, pq=True, ml=(2, 1, 4, True)),
                   ck.out_mma_launch(target, 8, 64, 128, 128, (2, 2, "bfloat16"), uf=True, ml=ml),
                   ck.ut_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, 128, uf=True, ml=ml),
                   ck.bwd_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, ("bfloat16", "bfloat16"), uf=True,
                                     ml=ml)]
                # the products over values formed in the backward's pass (``Tuning.bwd_products``)
                + [ck.bwd_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, ("bfloat16", "bfloat16"), uf=True,
                                     ml=ml, V=128),
                   ck.bwd_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, ("bfloat16", "bfloat16"), V=128)]
                + [ck.bwd_key_launch(target, 8, 64, 128, ("float32",) * 4, before) for before in (False, True)]
                # the readout staged two deep by 16-byte copies (``Tuning.async_staging``): GDN's call, and float32
                + [ck.out_async_launch(target, 8, 64, 128, 128, ("bfloat16", "bfloat16", "float32", "float32"),
                                       (2, 2, "bfloat16"), uf=True, ml=ml),
                   ck.out_async_launch(target, 8, 64, 128, 128, ("float32",) * 4)]
                # ... a key-vector decay's (GLA's call: bf16 r, v and states beside float32 P; and float32)
                + [ck.out_async_launch(target, 8, 64, 128, 128, ("bfloat16", "float32", "bfloat16", "bfloat16"),
                                       (2, 2, "bfloat16"), key=True),
                   ck.out_async_launch(target, 8, 64, 128, 128, ("float32",) * 4, key=True),
                   ck.out_async_launch(target, 8, 64, 128, 128, ("bfloat16", "float32", "bfloat16", "bfloat16"),
                                       (2, 2, "bfloat16"), ml=ml, zm=True, key=True)]  # ... q and v so
                # ... on the wide multiply-add (``Tuning.wide_fragments``: CUDA's; Metal has none), GDN's call in bf16
                + ([ck.out_async_launch(target, 8, 64, 128, 128, ("bfloat16",) * 4, (2, 2, "bfloat16"), uf=True, ml=ml,
                                        wide=True),
                    ck.ut_async_launch(target, 8, 64, 128, 128, ("bfloat16",) * 2, uf=True, ot="bfloat16", ml=ml,
                                       st="bfloat16", wide=True),
                    mma(q=True, hoist=True, ml=ml, st="bfloat16", w16=True),
                    mma(reverse=True, p=True, dg=True, aq=True, pq=True, hoist=True, ml=ml, st="bfloat16", w16=True),
                    # ... with wide loads and transposed copies (``Tuning.scan_wide_loads``)
                    mma(q=True, hoist=True, ml=ml, st="bfloat16", w16=True, wl=True),
                    mma(reverse=True, p=True, dg=True, aq=True, pq=True, hoist=True, ml=ml, st="bfloat16", w16=True,
                        wl=True),
                    mma(reverse=True, b=False, p=True, dg=True, aq=True, pq=True, hoist=True, ml=ml, st="bfloat16",
                        w16=True, wl=True),  # simple GLA's
                    mma(a=False, q=True, hoist=True, st="bfloat16", w16=True, wl=True),  # ... and its forward, A-free
                    mma(a=False, hoist=True, st="bfloat16", w16=True, wl=True),  # GLA's forward: u ⊙ Q given
                    mma(reverse=True, b=False, p=True, dg=True, pq=True, hoist=True, st="bfloat16", w16=True,
                        wl=True),  # ... and its reverse one, u ⊙ Q and r ⊙ P given (``Tuning.key_scaled_16bit``)
                    # ... and a lane's eight columns of X, Y and the states 16 bytes an access (``scan_wide_columns``)
                    mma(q=True, hoist=True, ml=ml, st="bfloat16", w16=True, wl=True, vc=True),
                    # ... every state-free operand a step ahead (``Tuning.scan_ahead_most``)
                    mma(q=True, hoist=True, ml=ml, st="bfloat16", w16=True, wl=True, vc=True, nx=True),
                    mma(a=False, q=True, hoist=True, st="bfloat16", w16=True, wl=True, vc=True),
                    # ... reading v in the model's layout too (simple GLA's, ``Tuning.model_rows``), and its readout
                    mma(a=False, q=True, hoist=True, ml=ml, st="bfloat16", w16=True, wl=True, vc=True, xm=True),
                    ck.out_async_launch(target, 8, 64, 128, 128, ("bfloat16",) * 4, (2, 2, "bfloat16"), ml=ml,
                                        wide=True, zm=True),
                    mma(reverse=True, p=True, dg=True, aq=True, pq=True, hoist=True, ml=ml, st="bfloat16", w16=True,
                        wl=True, vc=True),
                    # the backward's pass forming its pair cotangents on it (``Tuning.bwd_scores``)
                    ck.bwd_mma_launch(target, 8, 64, 128, ("bfloat16", "bfloat16"), uf=True, ml=ml,
                                      scores=(128, "bfloat16")),
                    ck.bwd_mma_launch(target, 8, 64, 128, ("bfloat16", "bfloat16"), scores=(128, "bfloat16")),
                    # ... and its products over values too (``Tuning.bwd_products`` with it)
                    ck.bwd_mma_launch(target, 8, 64, 128, ("bfloat16", "bfloat16"), uf=True, ml=ml, V=128,
                                      scores=(128, "bfloat16")),
                    # ... both read 16 bytes a load (``Tuning.bwd_wide_loads``)
                    ck.bwd_mma_launch(target, 8, 64, 128, ("bfloat16", "bfloat16"), uf=True, ml=ml, V=128,
                                      scores=(128, "bfloat16"), wide_loads=True),
                    # ... simple GLA's, reading q and k in the model's layout (``parallel.reads_model_rows``)
                    ck.bwd_mma_launch(target, 8, 64, 128, ("bfloat16", "bfloat16"), ml=ml, V=128,
                                      scores=(128, "bfloat16"), wide_loads=True)]
                   if target == "cuda" else [])
                + [ck.ut_async_launch(target, 8, 64 if target == "cuda" else 32, 128, 128, ("bfloat16", "bfloat16"),
                                      uf=True, ot="bfloat16", ml=ml),
                   ck.ut_async_launch(target, 8, 64 if target == "cuda" else 32, 128, 128, ("float32",) * 3)]
                # GDN's with 16-bit states (``Tuning.states_16bit``): T, the states, Z and M, dS_next and dZ in bf16
                # (the staged readout's source is the same at any states' type: its types are template constants)
                + [mma(q=True, hoist=True, ml=ml, st="bfloat16"),
                   mma(reverse=True, p=True, dg=True, aq=True, pq=True, hoist=True, ml=ml, st="bfloat16"),
                   ck.out_mma_launch(target, 8, 64, 128, 128, (2, 2, "bfloat16"), uf=True, ml=ml, st="bfloat16"),
                   ck.ut_async_launch(target, 8, 64 if target == "cuda" else 32, 128, 128, ("bfloat16", "bfloat16"),
                                      uf=True, ot="bfloat16", ml=ml, st="bfloat16"),
                   ck.ut_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, 128, uf=True, ot="bfloat16", ml=ml,
                                    st="bfloat16")]
                # ... and simple GLA's: its two scans and the readout writing M in bf16
                + [mma(a=False, q=True, hoist=True, st="bfloat16"),
                   mma(reverse=True, e=True, b=False, aq=True, st="bfloat16"),
                   ck.out_mma_launch(target, 8, 64, 128, 128, (2, 2, "bfloat16"), st="bfloat16")]
                # with L2 hints (``Tuning.l2_prefetch``; the same kernels where the dialect has no prefetch)
                + ([ck.out_mma_launch(target, 8, 64, 128, 128, (2, 2, "bfloat16"), uf=True, ml=ml, l2=True),
                    ck.out_mma_launch(target, 8, 64, 128, 64, most_bv=16, l2=True),  # narrow column blocks
                    ck.ut_mma_launch(target, 8, 64, 128, 128, uf=True, ml=ml, ot="bfloat16", l2=True),
                    ck.ut_mma_launch(target, 8, 64, 128, 128, most_bw=16, l2=True)] if target == "cuda" else []))
    return launches
