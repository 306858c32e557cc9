"""Decode: gated DeltaNet one token at a time (T=1; default B=64, H=32, D=128) with its float32 state [B,H,D,D]
read once and written once a token, against a device copy of the same bytes: ``recgen bench --passes decode``
(``recgen.bench.measure_decode``: chained through the state, one ``mx.async_eval`` a token as mlx-lm generates)
at the shape BENCHMARKS.md reports, with the op's default arguments.

    python benchmarks/bench_decode.py [--B 64 --H 32 --D 128 --tokens 200] [--json PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json

import mlx.core as mx

from recgen import bench, specs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=bench.DECODE_TOKENS)
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args()
    m = bench.measure_decode(specs.gated_delta_net, bench.Shape(a.B, 1, a.H, a.D, a.D), "bfloat16", tokens=a.tokens)
    t_dec, t_cp, nbytes = m.value, m.extra["copy_ms"], m.extra["state_bytes_moved"]
    res = {"B": a.B, "H": a.H, "D": a.D, "tokens": a.tokens, "decode_ms": t_dec, "copy_ms": t_cp,
           "decode_GBps": nbytes / t_dec / 1e6, "copy_GBps": nbytes / t_cp / 1e6, "decode_over_copy": t_cp / t_dec,
           "device": {"default_device": str(mx.default_device()), **mx.device_info()}, "mlx_version": mx.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "method": bench.METHOD["decode"]}
    print(f"decode B={a.B} H={a.H} D={a.D}: {t_dec:.4f} ms a token = {res['decode_GBps']:.0f} GB/s; copy {t_cp:.4f} "
          f"ms = {res['copy_GBps']:.0f} GB/s; decode at {res['decode_over_copy']:.0%} of copy bandwidth", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
