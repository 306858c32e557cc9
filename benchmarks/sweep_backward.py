"""Where the kernel op's chunked VJP starts to beat the recurrent backward kernel (CUDA).

    python benchmarks/sweep_backward.py [--out DIR]

Forward+backward (one call per eval, median of 3) of every fast-form built-in with ``backward="recurrent"``
and ``backward="chunked"``, at shapes of equal tokens·heads with T from 256 to 4096, bf16. The crossover T
is the measured ``Dialect.chunked_backward_min_t``."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu import bench_recgen  # noqa: E402

SHAPES = [(32, 256, 8, 64), (16, 512, 8, 64), (8, 1024, 8, 64), (4, 2048, 8, 64), (8, 1024, 16, 128),
          (4, 2048, 16, 128)]


def main():
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."
    res = {}
    for shape in SHAPES:
        for name in ("gated_delta_net", "delta_net", "gla", "simple_gla"):
            row = {}
            for bw in ("recurrent", "chunked"):
                row[bw] = bench_recgen(name, *shape, backward=bw)[2]
            res[f"{name}/{shape}"] = row
            print(f"{name:16s} {str(shape):22s} fwd+bwd recurrent {row['recurrent']:7.3f} ms  chunked "
                  f"{row['chunked']:7.3f} ms  ({row['recurrent'] / row['chunked']:.2f}x)", flush=True)
    json.dump(res, open(f"{out}/sweep_backward.json", "w"), indent=1)


if __name__ == "__main__":
    main()
