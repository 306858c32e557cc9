"""Correctness on a real GPU against the float64 reference: the generated CUDA kernels, or with
``--backend mlx`` the chunked MLX fallback in its GPU forms (matrix scan over chunks, mx.compile).

Run on the GPU host:  python benchmarks/cuda_check.py [--out DIR] [--backend cuda|mlx] [--dtypes float32,bfloat16]
                                                    [--backward recurrent|chunked] [--specs a,b]
Every built-in with a recurrent kernel (with mlx: every built-in and the mLSTM example), forward,
final state and every gradient (incl. initial state, with a cotangent on the final state), float32
and bfloat16 inputs, odd T, T=1, K != V, GQA. MLX runs float32 matmuls on CUDA in TF32 unless
MLX_ENABLE_TF32=0; the float32 tolerance assumes it is off.
"""
from __future__ import annotations

import json
import sys
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import rel_err  # noqa: E402

from recgen.math import reference

from recgen import specs  # noqa: E402
from recgen.ops import Op  # noqa: E402
from recgen.spec.resolve import resolve_spec  # noqa: E402
from recgen.spec.layouts import Sizes  # noqa: E402
from recgen.testing import kernel_inputs  # noqa: E402

SPECS = ["gated_delta_net", "delta_net", "gla", "simple_gla", "selective_scan", "selective_scan_linear_dt"]
CASES = [  # B, T, H, Hk, K, V: T=1, odd and prime T, K != V, GQA, V not a multiple of the column tile
    (2, 1, 4, 2, 32, 48), (2, 37, 4, 2, 64, 40), (1, 67, 2, 1, 128, 72),
    (1, 300, 2, 1, 64, 40),  # several chunks of 64 with a partial last one (the chunked scans)
]
TOL = {"float32": (1e-5, 1e-4), "bfloat16": (1e-2, 2e-2)}


def check(name, case, dtype, rng, backend, backward=None):
    rec = specs.BUILTINS[name] if name in specs.BUILTINS else resolve_spec(name)
    B, T, H, Hk, K, V = case
    if "selective" in name:
        Hk = H
    if rec.features:  # power retention: K raw key columns -> K(K+1)/2 state rows
        K = 8
        sizes = Sizes(B, T, H, Hk, K, rec.features[0].width(K), V)
    else:
        sizes = Sizes(B, T, H, Hk, K, K, V)
    xs, h0, do, dht, _ = kernel_inputs(rec, sizes, rng)
    if rec.features:  # a reachable state (sums of features), so the ratio readout's denominator is not ~0
        from recgen.spec.features import sympow

        phi = sympow(rng.standard_normal((B, H, 3, K)))
        xs = {k: (v * 0.5 if k in ("q", "k") else v) for k, v in xs.items()}
        h0 = (phi.swapaxes(-1, -2) @ rng.standard_normal((B, H, 3, V)), phi.sum(2))
    mdt = getattr(mx, dtype)
    xm = {k: mx.array(v.astype(np.float32)).astype(mdt) for k, v in xs.items()}
    xr = {k: np.array(v.astype(mx.float32)).astype(np.float64) for k, v in xm.items()}  # what the kernel saw
    o_ref, ht_ref = reference.run(rec, initial_state=h0, **xr)
    g_ref = reference.grad(rec, do=do, dht=dht, initial_state=h0, **xr)
    op = Op(rec, backend=backend, backward=backward)
    names = [x.name for x in rec.inputs]

    norm = rec.has_normalizer
    m32 = lambda a: mx.array(np.asarray(a, np.float32))  # noqa: E731
    n_in = len(names)

    def f(*args):
        state = tuple(args[n_in:]) if norm else args[n_in]
        o, ht = op(*args[:n_in], initial_state=state, output_final_state=True, check_finite=False)
        return (o, *ht) if norm else (o, ht)

    prim = [xm[n] for n in names] + ([m32(h0[0]), m32(h0[1])] if norm else [m32(h0)])
    cot = [m32(do).astype(mdt)] + ([m32(dht[0]), m32(dht[1])] if norm else [m32(dht)])
    outs, vjps = mx.vjp(f, prim, cot)
    mx.eval(outs, vjps)
    errs = {"o": rel_err(np.array(outs[0].astype(mx.float32)), o_ref)}
    refs = list(ht_ref) if norm else [ht_ref]
    for i, (a, r) in enumerate(zip(outs[1:], refs)):
        errs[f"ht{i}"] = rel_err(np.array(a), r)
    gref = [g_ref[n] for n in names] + (list(g_ref["initial_state"]) if norm else [g_ref["initial_state"]])
    for n, g, r in zip(names + ["initial_state", "initial_z"], vjps, gref):
        errs["d" + n] = rel_err(np.array(g.astype(mx.float32)), r)
    ftol, gtol = TOL[dtype]
    ok = all(v <= (ftol if k == "o" or k.startswith("ht") else gtol) for k, v in errs.items())
    return ok, errs


def main():
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else \
        ("cuda" if mx.cuda.is_available() else "mlx")
    dtypes = sys.argv[sys.argv.index("--dtypes") + 1].split(",") if "--dtypes" in sys.argv else ["float32", "bfloat16"]
    backward = sys.argv[sys.argv.index("--backward") + 1] if "--backward" in sys.argv else None
    rng = np.random.default_rng(2026)
    rows, allok = [], True
    default = SPECS + (["power_retention", "examples/mlstm.py:mlstm"] if backend == "mlx" else [])
    only = sys.argv[sys.argv.index("--specs") + 1].split(",") if "--specs" in sys.argv else default
    for name in only:
        for case in CASES:
            for dtype in dtypes:
                t0 = time.time()
                try:
                    ok, errs = check(name, case, dtype, rng, backend, backward)
                except Exception as e:  # report and keep going: one failure must not hide the others
                    ok, errs = False, {"error": repr(e)[:300]}
                allok &= ok
                worst = max((v for v in errs.values() if isinstance(v, float)), default=float("nan"))
                rows.append({"spec": name, "case": case, "dtype": dtype, "ok": ok, "errs": errs})
                print(f"{'PASS' if ok else 'FAIL'} {name:26s} {str(case):26s} {dtype:8s} worst={worst:.2e} "
                      f"({time.time() - t0:.1f}s) {'' if ok else errs}", flush=True)
    if out:
        json.dump(rows, open(f"{out}/cuda_check_{backend}_{backward or 'auto'}_{'_'.join(dtypes)}.json", "w"), indent=1)
    print(f"{sum(r['ok'] for r in rows)} passed, {sum(not r['ok'] for r in rows)} failed")
    sys.exit(0 if allok else 1)


if __name__ == "__main__":
    main()
