"""Accuracy of the chunked form's log-decay gradients (float32) against the float64 reference, by log-decay.

The chunked backward forms dl from reverse cumulative sums of products whose terms cancel, so its error is
absolute, of the size of the chunk's largest gradient terms, not relative to each dl_t. Where a log-decay is very
negative the true dl_t = Σ_ij D_t ⊙ dS_t ⊙ S_{t-1} is tiny, and its relative error is large. This prints, per spec
and form: the absolute error of dl relative to max|dl| (the bound), and the relative error of the elements whose
log-decay is below -15 and above -1.

    python benchmarks/decay_grad_accuracy.py [--T 256] [--D 32] [--seeds 3] [--f64 | --kernels]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from spec_check import parts  # noqa: E402

from recgen import chunked, specs, tuning  # noqa: E402
from recgen.math import reference  # noqa: E402

GATE = {"simple_gla": "g", "gla": "gk", "gated_delta_net": "g"}


def inputs(rec, rng, B, T, H, D):
    xs = {}
    for x in rec.inputs:
        shape = {"scalar": (B, T, H), "key": (B, T, H, D), "key_gate": (B, T, H, D), "value": (B, T, H, D)}[x.kind]
        xs[x.name] = rng.standard_normal(shape)
    g = GATE[rec.name]
    strong = rng.uniform(size=xs[g].shape) < 0.5  # half the tokens: log-decay in [-20, -15], else [-1, 0]
    xs[g] = np.where(strong, -rng.uniform(15, 20, xs[g].shape), -rng.uniform(0, 1, xs[g].shape))
    if "beta" in xs:
        xs["beta"] = 1 / (1 + np.exp(-xs["beta"]))
        xs["k"] /= np.linalg.norm(xs["k"], axis=-1, keepdims=True)
    return {n: a.astype(np.float32).astype(np.float64) for n, a in xs.items()}


def measure(rec, xs, gpu_forms: bool, chunk: int, f64: bool = False):
    g = GATE[rec.name]
    B, T, H = xs[g].shape[:3]
    rng = np.random.default_rng(1)
    do = rng.standard_normal((B, T, H, xs["v"].shape[-1])).astype(np.float32).astype(np.float64)
    dt, kw = (mx.float64, {"compute_dtype": mx.float64}) if f64 else (mx.float32, {})
    ref = reference.grad(rec, do=do, scale=0.25, **xs)[g]
    names = list(xs)
    forms = dict(gpu_forms=gpu_forms, compile=gpu_forms, inverse_base=16 if gpu_forms else 1)

    def loss(*a):
        with tuning.override(**forms):
            o, _ = chunked.forward(rec, dict(zip(names, a)), scale=0.25, chunk_size=chunk, **kw)
        return (o * mx.array(do, dtype=dt)).sum()

    got = np.array(mx.grad(loss, argnums=names.index(g))(*[mx.array(xs[n], dtype=dt) for n in names]), np.float64)
    err = np.abs(got - ref)
    nz = np.abs(ref) > 0  # t = 0 without an initial state: dl_0 = 0 exactly
    strong, mild = (xs[g] < -15) & nz, (xs[g] > -1) & nz
    rel = err / np.where(nz, np.abs(ref), 1.0)
    return {"abs/max": err.max() / np.abs(ref).max(), "max|dl| strong/mild": np.abs(ref[strong]).max() /
            np.abs(ref[mild]).max(), "rel median strong": np.median(rel[strong]), "rel max strong": rel[strong].max(),
            "rel median mild": np.median(rel[mild]), "rel max mild": rel[mild].max()}


def measure_kernels(rec, xs):
    """The recurrent Metal kernels' backward (float32, on the CPU emulator; needs clang >= 15)."""
    from recgen.verify.kernels import emulate

    g = GATE[rec.name]
    B, T, H = xs[g].shape[:3]
    rng = np.random.default_rng(1)
    f = lambda *s: rng.standard_normal(s).astype(np.float32).astype(np.float64)  # noqa: E731
    K, V = xs["q"].shape[-1], xs["v"].shape[-1]
    h0, dht, do = f(B, H, K, V), f(B, H, K, V), f(B, T, H, V)
    got = emulate(rec, xs, initial_state=h0, do=do, dht=dht, scale=0.25)[2][g]
    ref = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=0.25, **xs)[g]
    err, strong = np.abs(got - ref), xs[g] < -15
    rel = err / np.abs(ref)
    return {"abs/max": err.max() / np.abs(ref).max(), "rel median strong": np.median(rel[strong]),
            "rel max strong": rel[strong].max(), "rel median mild": np.median(rel[~strong])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--D", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--f64", action="store_true", help="the chunked form in float64 (compute_dtype)")
    ap.add_argument("--kernels", action="store_true", help="the recurrent Metal kernels on the CPU emulator instead")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    print(f"B=1, T={a.T}, H=2, K=V={a.D}, {'float64' if a.f64 else 'float32'} chunked vs float64 reference; "
          "half the log-decays in [-20, -15]")
    for name in GATE:
        rec = specs.BUILTINS[name]
        if a.kernels:
            row = measure_kernels(rec, inputs(rec, np.random.default_rng(0), 1, a.T, 2, a.D))
            print(f"{name:16s} recurrent kernels (Metal, emulated): " + ", ".join(f"{k} {v:.1e}" for k, v in row.items()))
            continue
        for gpu_forms, chunk in ((False, 16), (True, 64)):
            rows = [measure(rec, inputs(rec, np.random.default_rng(s), 1, a.T, 2, a.D), gpu_forms, chunk, a.f64)
                    for s in range(a.seeds)]
            worst = {k: max(r[k] for r in rows) for k in rows[0]}
            print(f"{name:16s} {'gpu' if gpu_forms else 'cpu'} forms, C={chunk:2d}: "
                  + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
