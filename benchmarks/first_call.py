"""A process's first call of a spec (the self-test's probes and its kernels compiled, or read from the kernel cache
where ``RECGEN_KERNEL_CACHE`` keeps them), its second, and the same call on the CPU's chunked MLX ops: the GPU's
output and every gradient against it. Run it twice in a row with one cache directory to time a cold and a warm
process (``bash benchmarks/run_gpu.sh first-call:SPEC:SHAPE``).

    RECGEN_KERNEL_CACHE=/tmp/kc python benchmarks/first_call.py power_retention --shape 1,300,2,64
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--shape", default="1,300,2,64", help="B,T,H,D")
    ap.add_argument("--tolerance", type=float, default=2e-2, help="most relative error against the CPU (TF32)")
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np

    from recgen import load, tuning
    from recgen.bench import Shape, make_inputs
    from recgen.runtime import kernel_binary, nvrtc, probe
    from recgen.spec.analysis import analyze

    op = load(args.spec)
    inputs, do = make_inputs(op.rec, Shape.parse(args.shape), "float32", seed=1)
    names = list(inputs)

    def step(device):
        mx.set_default_device(device)
        xs = [mx.array(np.array(inputs[n])) for n in names]
        (o,), grads = mx.vjp(lambda *p: [op(**dict(zip(names, p)))[0]], xs, [mx.array(np.array(do))])
        mx.eval(o, grads)
        return [np.array(a, np.float64) for a in (o, *grads)]

    mx.set_default_device(mx.gpu)
    t0 = time.perf_counter()
    probe.checked_for(analyze(op.rec))  # the chunk kernels' self-test alone (cached: the call below reuses it)
    selftest = time.perf_counter() - t0
    t0 = time.perf_counter()
    gpu = step(mx.gpu)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(mx.gpu)
    second = time.perf_counter() - t0
    errors = [float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30)) for a, b in zip(gpu, step(mx.cpu))]
    nv = nvrtc.compiler()
    print(f"{args.spec} {args.shape}: self-test {selftest:.2f} s, then first call {first:.2f} s, second "
          f"{second * 1e3:.1f} ms; kernel cache "
          f"{tuning.current().kernel_cache!r}, NVRTC {nv and (nv.path, nv.version)}, "
          f"architecture {kernel_binary.architecture()}, binaries {kernel_binary.binary.cache_info()}")
    print("relative error against the CPU: " + " ".join(f"{n}={e:.1e}" for n, e in zip(["o", *names], errors)))
    if not max(errors) <= args.tolerance:
        raise SystemExit(f"off by {max(errors):.1e} (more than {args.tolerance})")


if __name__ == "__main__":
    main()
