"""Where the key-vector decay pair gradient's time goes (docs/design.md, "The pair gradients copy each slab's raw
rows a slab ahead"): GLA's pair gradient on CUDA (N chunks of 64 x 128, bf16 operands, X read scaled) as
generated, then with parts of it cut out or its staging rewritten, each variant timed by CUPTI (torch.profiler)
over synchronized calls and compared with the generated kernel's results (a cut kernel's are wrong: it measures
time only; the rewritten stagings must agree exactly).

    python benchmarks/pair_grad_parts.py [N]               # every variant (N = 4096 chunks by default)
    PARTS="generated;copied ahead" ITERS=20 python benchmarks/pair_grad_parts.py

Needs an NVIDIA GPU, MLX's CUDA backend and torch (for its profiler only).
"""
import dataclasses
import os
import statistics
import sys

import mlx.core as mx

from recgen import tuning
from recgen.codegen.backends.cuda import COPY_PRELUDE
from recgen.runtime import chunk_kernels as ck

# The generated staging: each thread walks one column of one block, reading decays and operands from the buffers.
WALKS = ("    for (int q = tid; q < NB * KS; q += NT) {\n      const int J = q / KS, c = q % KS;\n"
         "      const long long col")
WALKS_END = "      Tot_[J * KS + c] = p;\n    }\n"
SLAB_LOOP = "  for (int k0 = 0; k0 < K; k0 += KS) {\n"
TILES = "  __shared__ float Dd_[BS * LDS];"

# Loads first: the slab's rows this threadgroup needs (blocks up to its own for dX, from its own for dY), every
# load independent, into threadgroup memory; then the walks there.
LOADS = """\
    for (int q = tid; q < C * KS; q += NT) {
      const int row = q / KS, c = q % KS, J = row / BS;
      if (cols ? J < B0 : J > B0) continue;
      const long long at = base + (long long)row * K + k0 + c;
      Dall_[row * LDS + c] = dk[at];
      const float o = cols ? static_cast<float>(X[at]) * xsc : static_cast<float>(Y[at]);
      if (J == B0) Od_[(row - B0 * BS) * LDS + c] = o;
      else if (!cols) Os_[row * LDS + c] = o;
      else Os_[(row - (B0 + 1) * BS) * LDS + c] = o;
    }
    __syncthreads();
"""
WALKS_IN_TILES = """\
    for (int q = tid; q < NB * KS; q += NT) {  // the walks
      const int J = q / KS, c = q % KS;
      float p = 1.0f;
      if (J == B0 && !cols) {
        for (int s = 0; s < BS; ++s) {
          const float dv = Dall_[(J * BS + s) * LDS + c]; p *= dv; Dd_[s * LDS + c] = dv; Gs_[s * LDS + c] = p;
        }
      } else if (J == B0) {
        for (int s = BS - 1; s >= 0; --s) {
          const float dv = Dall_[(J * BS + s) * LDS + c]; Dd_[s * LDS + c] = dv; Gs_[s * LDS + c] = p; p *= dv;
        }
      } else if (!cols && J < B0) {
        for (int s = BS - 1; s >= 0; --s) { Os_[(J * BS + s) * LDS + c] *= p; p *= Dall_[(J * BS + s) * LDS + c]; }
      } else if (cols && J > B0) {
        for (int s = 0; s < BS; ++s) {
          p *= Dall_[(J * BS + s) * LDS + c]; Os_[((J - B0 - 1) * BS + s) * LDS + c] *= p;
        }
      }
      Tot_[J * KS + c] = p;
    }
"""
ALL_ROWS = "  __shared__ float Dall_[C * LDS];\n" + TILES

# The next slab's rows loaded into registers while this one is multiplied (16 values of each a thread).
AHEAD_PROLOGUE = """\
  float pd_[C * KS / NT], po_[C * KS / NT];
  const float* dk_ = dk + base;
  const auto* O_ = cols ? (const void*)(X + base) : (const void*)(Y + base);
  const float osc = cols ? xsc : 1.0f;
#pragma unroll
  for (int i = 0; i < C * KS / NT; ++i) {
    const int q = tid + i * NT, row = q / KS, c = q % KS, J = row / BS;
    if (cols ? J < B0 : J > B0) continue;
    pd_[i] = dk_[row * K + c];
    po_[i] = static_cast<float>(((const __nv_bfloat16*)O_)[row * K + c]) * osc;
  }
"""
AHEAD_STORE = """\
#pragma unroll
    for (int i = 0; i < C * KS / NT; ++i) {
      const int q = tid + i * NT, row = q / KS, c = q % KS, J = row / BS;
      if (cols ? J < B0 : J > B0) continue;
      Dall_[row * LDS + c] = pd_[i];
      if (J == B0) Od_[(row - B0 * BS) * LDS + c] = po_[i];
      else if (!cols) Os_[row * LDS + c] = po_[i];
      else Os_[(row - (B0 + 1) * BS) * LDS + c] = po_[i];
    }
    __syncthreads();
    if (k0 + KS < K) {
#pragma unroll
      for (int i = 0; i < C * KS / NT; ++i) {
        const int q = tid + i * NT, row = q / KS, c = q % KS, J = row / BS;
        if (cols ? J < B0 : J > B0) continue;
        pd_[i] = dk_[row * K + k0 + KS + c];
        po_[i] = static_cast<float>(((const __nv_bfloat16*)O_)[row * K + k0 + KS + c]) * osc;
      }
    }
"""


def variants(src: str) -> dict:
    """name -> the generated kernel's body with (old, new) replacements applied (each old text found once)."""
    start = src.index(WALKS)
    walks = src[start:src.index(WALKS_END, start) + len(WALKS_END)]
    no_loads = walks.replace("dk[at]", "0.999f")
    for op in ("X", "Y"):
        no_loads = no_loads.replace(f"static_cast<float>({op}[at])", "1.0f")
    junk_loads = LOADS.replace("dk[at]", "(0.99f + 1e-6f * c)").replace("static_cast<float>(X[at])", "(float)c")
    return {
        "generated": [],
        "no own block": [("if (h < BS / 2) {", "if (h < 0) {")],  # (writes no output either)
        "no fragments": [("k0 < B0 * BS; k0 += 8", "k0 < 0; k0 += 8"),
                         ("k0 < (NB - 1 - B0) * BS; k0 += 8", "k0 < 0; k0 += 8")],
        "no staging": [(walks, "")],
        "staging without loads": [(walks, no_loads)],
        "loads first": [(walks, LOADS + WALKS_IN_TILES), (TILES, ALL_ROWS)],
        "loads first, no walks": [(walks, LOADS), (TILES, ALL_ROWS)],
        "walks, nothing loaded": [(walks, junk_loads.replace("static_cast<float>(Y[at])", "(float)row")
                                   + WALKS_IN_TILES), (TILES, ALL_ROWS)],
        "next slab in registers": [(SLAB_LOOP, AHEAD_PROLOGUE + SLAB_LOOP), (walks, AHEAD_STORE + WALKS_IN_TILES),
                                   (TILES, ALL_ROWS)],
        "other chunks' rows": [(walks, walks.replace("const long long col = base + k0 + c;",
                                                     "const long long col = (((long long)blockIdx.x * 7919) % "
                                                     "(long long)rt[0]) * C * K + k0 + c;"))],
    }


def launches(N: int, C: int = 64, K: int = 128) -> dict:
    """name -> Launch: the variants of ``variants`` and the generated kernel copying its slabs ahead."""
    base = ck.pair_launch("cuda", N, C, K, True, grad=True, mma=True, fold=True, scaled=True)
    out = {}
    for i, (name, cuts) in enumerate(variants(base.source.source).items()):
        s = base.source.source
        for old, new in cuts:
            if s.count(old) != 1:
                raise RuntimeError(f"{name}: the generated kernel no longer holds the text it replaces")
            s = s.replace(old, new)
        src = dataclasses.replace(base.source, source=s, name=base.source.name + (f"_part{i}" if cuts else ""))
        out[name] = dataclasses.replace(base, source=src)
    out["copied ahead"] = ck.pair_launch("cuda", N, C, K, True, grad=True, mma=True, fold=True, scaled=True,
                                         types=("bfloat16", "bfloat16"))
    return out


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    N, C, K = (int(sys.argv[1]) if len(sys.argv) > 1 else 4096), 64, 128
    only = [p for p in os.environ.get("PARTS", "").split(";") if p]
    iters = int(os.environ.get("ITERS", 20))
    t = dataclasses.replace(tuning.resolve("gpu", "cuda"), kernel_cache=None)
    torch.cuda.init()
    mx.random.seed(0)
    user = [mx.random.normal((N, C, C)), mx.random.normal((N, C, K)).astype(mx.bfloat16),
            mx.random.normal((N, C, K)).astype(mx.bfloat16), mx.random.uniform(0.9, 1.0, (N, C, K)),
            mx.array([0.1], mx.float32)]
    mx.eval(user)
    ref = None
    for name, launch in launches(N, C, K).items():
        if only and name not in only:
            continue
        for _ in range(3):
            mx.eval(ck._call(t, launch, user))
        mx.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                outs = ck._call(t, launch, user)
                mx.eval(outs)
                mx.synchronize()
        times = [(getattr(e, "device_time", None) or e.cuda_time) / 1e3 for e in prof.events()
                 if str(getattr(e, "device_type", "")).endswith("CUDA") and "pair_grad" in (e.name or "")]
        ref = outs if ref is None else ref
        diff = max(float(mx.max(mx.abs(a - b))) for a, b in zip(outs, ref))
        print(f"{name:24s} {statistics.median(times):.3f} ms (min {min(times):.3f}), max |diff| against the first "
              f"{diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
