"""Gated DeltaProduct (ops.gated_delta_product) against gated DeltaNet at the same tokens, chained calls, bf16.

    python benchmarks/bench_delta_product.py --shape 4,4096,16,128 --n 2 [--json PATH]

DeltaProduct with n Householder steps runs gated DeltaNet over T·n micro-steps, so its natural yardstick is
gated_delta_net at T (same tokens) and at T·n (same steps); both are timed in the same process.
"""
from __future__ import annotations

import argparse
import json

import mlx.core as mx

from recgen import bench, ops, specs


def measure(forward, inputs: dict, do) -> dict:
    st = bench.steps(forward, inputs, do)
    out = {}
    for kind in ("fwd", "fwdbwd"):
        m = bench.measure_timed("recgen", kind, getattr(st, kind), getattr(st, kind + "_step"), st.start)
        out[kind] = m.value
    out["peak_fwdbwd"] = bench.peak_gib(st.fwdbwd)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,4096,16,128")
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    B, T, H, D = (int(x) for x in a.shape.split(","))
    n = a.n
    keys = mx.random.split(mx.random.key(0), 6)
    bf = mx.bfloat16
    unit = lambda x: x * mx.rsqrt((x * x).sum(-1, keepdims=True))  # noqa: E731
    q = unit(mx.random.normal((B, T, H, D), key=keys[0])).astype(bf)
    k = unit(mx.random.normal((B, T * n, H, D), key=keys[1])).astype(bf)
    v = mx.random.normal((B, T * n, H, D), key=keys[2]).astype(bf)
    g = (-0.1 * mx.random.uniform(shape=(B, T, H), key=keys[3])).astype(bf)
    beta = mx.sigmoid(mx.random.normal((B, T * n, H), key=keys[4])).astype(bf)
    do = mx.random.normal((B, T, H, D), key=keys[5]).astype(bf)
    mx.eval(q, k, v, g, beta, do)
    res = {"shape": [B, T, H, D], "n": n, "dtype": "bfloat16", "device": str(mx.default_device())}
    dp = lambda xs: ops.gated_delta_product(num_householder=n, **xs)[0]  # noqa: E731
    res["gated_delta_product"] = measure(dp, dict(q=q, k=k, v=v, g=g, beta=beta), do)
    gdn = bench.recgen_forward(specs.gated_delta_net, "auto")
    for label, TT in (("gated_delta_net_same_tokens", T), ("gated_delta_net_same_steps", T * n)):
        shape = bench.Shape.parse(f"{B},{TT},{H},{D}")
        xs, dd = bench.make_inputs(specs.gated_delta_net, shape, "bfloat16")
        res[label] = measure(gdn, xs, dd)
    for k_, v_ in res.items():
        print(k_, v_)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
