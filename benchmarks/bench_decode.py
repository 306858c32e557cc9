"""Decode: gated DeltaNet one token at a time (T=1; default B=64, H=32, D=128) with its float32 state [B,H,D,D]
read once and written once a token, against a device copy of the same bytes.

Both are chained over tokens (token t+1 starts from token t's state; the copy from the last copy) and pipelined
with one ``mx.async_eval`` a token, as mlx-lm generates: the host builds token t+1 while the device runs token t.
The op runs with its default arguments (``recgen.ops.gated_delta_net``: the device's kernels, no finite check).

    python benchmarks/bench_decode.py [--B 64 --H 32 --D 128 --tokens 200] [--json PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import time

import mlx.core as mx

from recgen import ops, specs
from recgen.bench import Shape, make_inputs


def pipelined(step, carry, tokens: int, warm: int = 20) -> float:
    """ms a token of ``tokens`` chained calls of ``step``, one ``mx.async_eval`` each."""
    for _ in range(warm):
        carry = step(carry)
        mx.async_eval(carry)
    mx.eval(carry)
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(tokens):
        carry = step(carry)
        mx.async_eval(carry)
    mx.eval(carry)
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3 / tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args()
    B, H, D = a.B, a.H, a.D
    xs, _ = make_inputs(specs.gated_delta_net, Shape(B, 1, H, D, D), "bfloat16")
    h0 = mx.random.normal((B, H, D, D))
    mx.eval(h0)
    op = ops.gated_delta_net

    def decode(carry):
        return list(op(**xs, initial_state=carry[1], output_final_state=True))

    def copy(x):
        return x * 1.0

    nbytes = 2 * h0.nbytes  # the state read and written once a token
    t_dec = pipelined(decode, [None, h0], a.tokens)
    t_cp = pipelined(copy, h0, a.tokens)
    res = {"B": B, "H": H, "D": D, "tokens": a.tokens, "decode_ms": t_dec, "copy_ms": t_cp,
           "decode_GBps": nbytes / t_dec / 1e6, "copy_GBps": nbytes / t_cp / 1e6, "decode_over_copy": t_cp / t_dec,
           "device": {"default_device": str(mx.default_device()), **mx.device_info()}, "mlx_version": mx.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "method": "chained over tokens (the state carried), one mx.async_eval a token, 20 warm-up tokens; "
                     "bytes = the float32 state read and written once"}
    print(f"decode B={B} H={H} D={D}: {t_dec:.4f} ms a token = {res['decode_GBps']:.0f} GB/s; copy {t_cp:.4f} ms "
          f"= {res['copy_GBps']:.0f} GB/s; decode at {res['decode_over_copy']:.0%} of copy bandwidth", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
