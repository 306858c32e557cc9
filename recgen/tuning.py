"""Every choice recgen makes for speed, as one frozen object per device.

A ``Tuning`` is resolved once per device, from the lowest precedence to the highest:

1. device defaults (``DEVICE_DEFAULTS``: the CPU and GPUs cost different things);
2. the measured table of the GPU's kernel dialect (``MEASURED``: what was measured faster on that hardware);
3. the environment (``ENVIRONMENT``: this module is the only one in recgen that reads it), read once per process
   (``reload_environment()`` reads it again): every op call asks for its tuning, and reading a dozen variables
   each time cost more host time than the rest of a decode step's dispatch;
4. explicit overrides: ``with recgen.tuning.override(chunk_kernels=False): ...`` (tests, benchmarks).

It is hashable, so caches key on it, and it names intentions only: whether a GPU's generated chunk kernels
really build and pass their self-test there is checked by the dispatcher (``recgen.runtime.probe.checked``),
which turns a failing choice off. ``current()`` is the tuning of MLX's default device.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, fields, replace
from functools import lru_cache

from .errors import InputError
from .hashing import hash_once

BACKENDS = ("metal", "cuda", "mlx")
BACKWARDS = ("recurrent", "chunked")
FEATURE_ATTENTION = ("wide", "always", "never")
KERNEL_CACHE_DIR = "~/.cache/recgen/kernels"  # CUDA's default; RECGEN_KERNEL_CACHE=1 names it too


@dataclass(frozen=True)
class Tuning:
    device: str                     # "cpu" | "gpu"
    dialect: str | None = None      # the GPU's kernel dialect ("metal" | "cuda"), None on the CPU
    backend: str | None = None      # force an op backend ("metal" | "cuda" | "mlx"); None: by device
    backward: str | None = None     # force a kernel op's backward ("recurrent" | "chunked"); None: by T
    chunked_backward_min_t: int | None = None  # from this T the kernel op's VJP is the chunked backward
    chunked_forward_min_t: int | None = None   # ... and from this T its forward too (the chunked form)
    key_blocks_max_t: int = 256     # power retention runs as simple_gla heads over key blocks below this T (one
    #                                 chunk of the identity form; at T = 512 that form trained 3.3x faster)
    debug: bool = False             # finite checks on every call (they sync the host); print kernels when built
    kernel_cache: str = ""          # compiled kernels kept in this directory across processes, where the dialect runs
    #                                 binaries (CUDA: MLX keeps no custom kernel, so each process compiles every kernel
    #                                 again); "" keeps none (MLX compiles each kernel once a process). CUDA keeps them
    #                                 in KERNEL_CACHE_DIR (MEASURED); RECGEN_KERNEL_CACHE=off or a directory
    # -- the chunked form ---------------------------------------------------------------------------
    chunk_size: int = 16            # default chunk length
    key_chunk_size: int = 16        # ... for key-vector decays
    feature_identity: bool = True   # a feature map's chunked form through its kernel identity (``chunked.features``)
    feature_chunk_size: int = 64    # ... its chunk length (entry states are the expanded space: fewer, longer chunks)
    feature_attention: str = "wide"  # ... as attention, no expanded state (``features.attention_form``: quadratic in T,
    #                                 where one chunk of queries' scores against the sequence fits the segment budget):
    #                                 "wide" where φ's rows have no kernels (degrees 3, 4: 766 480 rows at d = 64,
    #                                 p = 4) and it takes fewer multiply-adds; "always"; "never"
    feature_decode: bool = False    # ... its decode step (T = 1) on the generated kernel split over K
    feature_kernels: bool = False   # ... its products over φ's rows as fragment kernels forming φ as read (half the
    #                                 memory of MLX's products over formed rows, a faster forward, training alike)
    feature_jac_rows: bool = False  # ... their gradient by the rows of φ's pairs (the packed count of multiply-adds,
    #                                 half the quadratic form's D² a token); even with it on the H100 (7.14 against
    #                                 7.23 ms a training step, within the spread): both are latency-bound
    feature_jac_groups: int = 8     # ... SIMD groups a threadgroup of their gradient at most (8, 4, 2 or 1): fewer
    #                                 let more threadgroups share an SM, but each stages the whole state (H100:
    #                                 6.95 ms a training step at 8, 7.88 at 4, 9.61 at 2)
    feature_states_fragments: int = 1  # ... 16-row fragments a SIMD group of their φᵀY kernel (1 or 2): each staged
    #                                 B element then serves that many (shared-memory reads bound the kernel; H100:
    #                                 its three calls 1.00 ms at 2 against 1.19-1.22 at 1)
    feature_out_fragments: int = 1  # ... 16-token fragments a SIMD group of their φS kernel (1 or 2, where they fit;
    #                                 H100: its two calls 0.45 ms at 2 against 0.68 at 1)
    feature_jac_min_blocks: int = 1  # ... threadgroups an SM their registers must allow (CUDA's launch bounds, where
    #                                 recgen compiles them: the kernel cache); 1 leaves the compiler's choice (H100:
    #                                 2 holds it to 128 registers, and the kernel took 1.32-1.34 ms against 1.83-1.90)
    gram_slices: int = 1            # ... the gradient of its decays between chunks, a product over the expanded
    #                                 state's entries, cut in this many slices read as rows (``features._gram``):
    #                                 more multiply-adds, far more parallel (cuBLAS ran the one product serially)
    feature_mix: bool = False       # ... the backward's products over chunks (entry states, their cotangents, the
    #                                 decays' gradient) as one generated kernel reading each expanded state once,
    #                                 not three MLX products (with ``chunk_kernels``; up to 36 states on CUDA; H100:
    #                                 a training step 5.60 ms against 5.96, the kernel 0.29 ms)
    feature_keep_states: bool = False  # ... the chunks' expanded states kept from the forward for the backward, not
    #                                 formed again (one φᵀY pass fewer a training step; H100: 5.24 against 5.86 ms,
    #                                 peak 1.58 against 1.73 GiB). Not where MLX's tiles form the state one after
    #                                 another to bound memory (the CPU, sizes without the sympow kernels)
    decay_factor_kernels: bool = False  # ... its decay factors (along chunks and between them) and their gradient by
    #                                 generated kernels, two launches where MLX ops took some 35 (with
    #                                 ``chunk_kernels``; H100: 0.015 + 0.017 ms, a training step 5.12 against 5.20)
    decayed_scores: bool = False    # ... its in-chunk scores (qᵀk)^p e^{Γ_t−Γ_s} and their gradients by generated
    #                                 kernels (with ``chunk_kernels``), not MLX ops over [C, C] a chunk
    scores_rows: int = 16           # ... rows of a chunk a threadgroup of those kernels (the gradient's registers
    #                                 grow with it: 63 a thread at 16, 108 at 32, ptxas for sm_90)
    gpu_forms: bool = False         # few large ops (the scan over chunks as one matmul, full-block inverses)
    compile: bool = False           # mx.compile the chunked stretch and core (fuses elementwise work)
    replay_graphs: bool = False     # the chunked form (its forward and VJP, or its cores') recorded once per
    #                                 signature and replayed under mx.vjp, where MLX compiles nothing, not built again
    #                                 by its Python each call (``runtime.replay``, ``runtime.pieces``). A replayed graph
    #                                 does not vmap (MLX's rules misread some recorded nodes); neither does a chunk
    #                                 kernel, so it is on where they run
    inverse_base: int = 1           # block size from which the triangular inverse climbs by block levels
    pow2_exp: bool = False          # e^x as 2^(x log2 e): MLX's CPU exp is 2-3x slower than its power
    copy_transposes: bool = False   # materialise a matmul's transposed right operand (the reference BLAS)
    cpu_blas: str | None = None     # "fast" | "reference"; None: measured once (``runtime.probe``)
    segment_budget: int | None = None  # bytes of working set a segment may use; None: by device memory
    # -- generated chunk kernels (GPUs) -------------------------------------------------------------
    chunk_kernels: bool = False     # the inverse, scans, pair matrices as generated kernels
    mma_scan: bool = False          # the scan on fragment multiply-adds (tensor cores) rather than FMAs
    fused_readout: bool = True      # the scalar-decay readout as one fragment kernel (with ``mma_scan``)
    fused_ut: bool = True           # the delta rule's UT transform as one fragment kernel (with ``mma_scan``)
    ut_products: bool = False       # ... the general rank-1 core's forming U = (T B) w itself
    rank1_readout: bool = False     # the general rank-1 core's three readout terms as one kernel
    fused_bwd: bool = True          # the backward after its scan as kernels: a scalar decay's fragment pass (with
    #                                 ``mma_scan``), a key-vector decay's elementwise tail
    factor_reads: bool = True       # the delta rule's u = f·k and b̃ = ρ k read from k by the fused kernels (scalar
    #                                 decays, all kernels fused), never formed
    model_rows: bool = False        # ... q, k, v read by those kernels in the model's layout [B, T, heads, D] (whole chunks)
    #                                 where GQA shares key heads: no layout copies or expanded heads, gradients so
    model_rows_dense: bool = False  # ... and where every value head has its own key head: no layout copies of q, k, v
    #                                 (on CUDA: with asynchronous staging faster at every shape measured, and less memory)
    key_model_backward: bool = False  # ... a key-vector decay's backward without a transition (GLA's) too: its decays'
    #                                 pass, pair gradient (copying raw rows) and key tail read q, k, gk so and the tail
    #                                 writes dq, dk, dgk so, no copies either way (v and dy still copied for MLX's
    #                                 products). H200, GLA 4,4096,16,128 trained, four rounds: 3.862 -> 3.758 ms (every
    #                                 round), peak 2.499 -> 2.312 GiB (on on CUDA; 3.982 -> 4.087 before the tail
    #                                 batched its loads: its model-layout form was the slower one)
    pair_grad_logdecays: bool = False  # ... and its pair gradient reads gk, forming each decay e^gk as it reads it
    #                                 (copied with q's and k's raw rows), so its decays' pass writes no D (a float32
    #                                 [B, H, T, K], 134 MB at 4,4096,16,128, live until that kernel). The same bits;
    #                                 not yet timed (the forward's pair doing the same: a wash in time)
    ut_16bit: bool = False          # ... the UT transform writing U = T w and W = T (b̃ e^G) in the keys' 16-bit type
    #                                 (the scans convert on load), as FLA keeps them: 0.13 GiB less at GDN's training
    #                                 peak (4,4096,16,128), as fast or faster at every shape timed (on on CUDA)
    states_16bit: bool = False      # ... and T, the chunk states, Z (v_new) and M written in that type too, the reverse
    #                                 scan's dS and dZ so, and the backward's MLX products between kernels on them, as
    #                                 FLA keeps h, v_new, A, dh and dv (the recurrence itself runs in float32); without
    #                                 a delta rule (simple GLA) the states and M in the values' type. H100, GDN
    #                                 4,4096,16,128: 4.51 -> 3.79 ms and 2.48 -> 1.48 GiB trained (on on CUDA)
    key_factor_reads: bool = False  # ... for a key-vector decay (KDA) too: its pairs' scaling by β stays in MLX ops,
    #                                 measured slower for training (H100: 11.3 -> 11.9 ms) though faster forward
    roles_16bit: str = "bare"       # roles kept in 16 bits: "bare" (inputs verbatim), "all" or "none"
    key_roles_16bit: bool = False   # ... a key-vector decay's bare roles too (GLA's k and v), read so by its kernels,
    #                                 and without a delta rule its states in 16 bits (with ``states_16bit``). H200,
    #                                 4,4096,16,128 forward: GLA 2.11 -> 1.80 ms, KDA 3.09 -> 2.92, peaks 2.07 -> 1.45
    #                                 and 2.82 -> 2.51 GiB; training within the spread of processes (on on CUDA)
    key_products_16bit: bool = False  # ... and the backward's products over values on those 16-bit states, dy and v,
    #                                 the reverse scan writing dS and dZ so (no delta rule): no float32 copies of them.
    #                                 H200, 4,4096,16,128 trained: GLA 5.40, 5.33 -> 5.10, 4.89 ms, peak 4.09 -> 3.31
    #                                 GiB; HGRN-2 5.68, 5.69 -> 5.30, 5.47 ms, 4.22 -> 3.44 GiB (on on CUDA)
    key_scaled_16bit: bool = False  # ... and the backward's u ⊙ Q and r ⊙ P written in it by its decays' pass, so the
    #                                 reverse scan (GLA's, HGRN-2's) runs on the wide multiply-add. H200, 4,4096,16,128
    #                                 trained: reverse scan 0.66 -> 0.40 ms; GLA 5.12 -> 5.08 ms (medians, spread ±10%),
    #                                 HGRN-2 5.27 -> 5.07, peaks 3.00 -> 2.87 and 3.31 -> 3.19 GiB (on on CUDA)
    logdecay_16bit: bool = False    # ... and a log-decay that is an input verbatim, where only kernels read it (a
    #                                 key-vector decay's, both cores: no float32 cast of it)
    scan_bv: int = 32               # value columns per threadgroup of the fragment scan (most)
    scan_min_groups: int = 0        # ... halved where its threadgroups would be fewer (few (batch, head) pairs, long
    #                                 sequences: a scan is sequential over chunks, so more column groups fill the GPU)
    scan_nw: int = 4                # SIMD groups per threadgroup of the forward fragment scan (most)
    reverse_scan_nw: int = 4        # ... of the reverse (backward) fragment scan
    scan_prefetch: bool = False     # the fragment scan loads A and X a chunk ahead (measured no forward gain and a
    #                                 slower training step: off; docs/design.md)
    scan_ahead_most: int = 0        # the wide forward scan (GDN's, DeltaNet's) of at most this many threadgroups
    #                                 loads every state-free operand of a chunk a whole step ahead, into a second set
    #                                 of registers (``ScanVariant.nx``): one threadgroup an SM has no other warps to
    #                                 run while it waits on its loads; with two an SM the other hides them, and the
    #                                 extra registers (245 a lane) cost more. H200, forward, off -> on: 1,32768,16,128
    #                                 (128 threadgroups) GDN 1.832 -> 1.725 ms, DeltaNet 1.830 -> 1.735; 4,4096
    #                                 (256) GDN 0.781 -> 0.805, DeltaNet 0.796 -> 0.824 (128 on CUDA)
    scan_wide_loads: bool = False   # ... on the wide multiply-add (K a multiple of 32): A's rows 16 bytes a load (the
    #                                 keys of two steps permuted to make a lane's pairs adjacent), Bm's 8, X's and St's
    #                                 4, and the state's, Y's and Pb's threadgroup copies transposed so that each B pair
    #                                 is one word (``ScanVariant.wl``): the scans were bound by L1's load wavefronts
    #                                 (GDN 4,4096,16,128 trained 3.20 -> 2.92 ms on an H200; on on CUDA)
    scan_wide_columns: bool = False  # ... and each lane's columns of X, Y and the chunk states chosen so that its
    #                                 pairs of a row, in four column tiles, are eight adjacent columns: read and written
    #                                 16 bytes a lane, not 4 (half of each 32-byte sector those touched; H100, GDN
    #                                 4,4096,16,128: the forward scan 0.276 -> 0.216 ms, the forward 0.935 -> 0.872)
    scan_hoist: bool = False        # the forward fragment scan (a product term: B or P) loads a chunk's state-free
    #                                 operands at its step's start: their latency overlaps the state copy and Y's product
    reverse_scan_hoist: bool = False  # ... the reverse (backward) one
    scan_hoist_e: bool = False      # ... scans without a product term too (the E-term scans of KDA's, GLA's and simple
    #                                 GLA's backward: A's and X's fragments and E's elements): no gain timed, so off
    scan_hoist_most: int = 264      # ... where the scan has at most this many threadgroups: a hoisted one holds ~250
    #                                 registers a lane, two threadgroups an SM (the H100's 132 take 264 at once);
    #                                 past that, unhoisted ones fit more an SM; hoisting was timed up to 256 only
    scan_products: bool = True      # the fragment scan takes a product term E = Paᵀ Pb as its factors
    scan_products_alone: bool = False  # ... a scan without a B term too (simple GLA's reverse scan: H100, simple GLA
    #                                    4,4096,16,128 trained 4.05 -> 2.90 ms, peak 2.12 -> 1.13 GiB, E never formed
    #                                    in float32 nor its factors cast; on on CUDA)
    mma_pairs: bool = False         # the key-decay pair kernels' other blocks on fragments
    pair_fold: bool = False         # ... their own block's rows t and BS − 1 − t on one thread
    pair_whole: bool = False        # ... the forward's, a whole chunk a threadgroup: each slab's X ⊙ pre and Y ⊙ suf
    #                                 staged once for every block, not again by each later block's threadgroup (H200,
    #                                 4,4096,16,128, forward: GLA 1.454 -> 1.407 ms, KDA 2.567 -> 2.538; not the quad
    #                                 form, RWKV-7's, slower whole; on on CUDA)
    pair_halves: bool = False       # ... each block's second half against its first on fragments too, the exact carries
    #                                 then within 8-token halves (9 steps a column a pair of rows, where 17 were): the
    #                                 carries were most of that kernel's issue slots. H200, 4,4096,16,128, forward:
    #                                 GLA 1.121 -> 1.118 ms, KDA 2.414 -> 2.453 (a slower kernel, more registers): off
    pair_grad_async: bool = False   # ... the gradients' raw rows (decays and operands) copied to threadgroup memory a
    #                                 slab ahead by the dialect's 16-byte copies (CUDA's cp.async), not read by each
    #                                 walk from the kernel's buffers, where they fit. H200, 4,4096,16,128 trained: GLA
    #                                 5.079 -> 4.574 ms, HGRN-2 5.251 -> 4.952, RWKV-6 8.385 -> 8.164 (on on CUDA)
    pair_whole_async: bool = False  # ... and the forward's whole-chunk pairs the same (slabs of 16 columns where 32
    #                                 no longer fit beside the raw rows). H200, 4,4096,16,128, forward, four rounds:
    #                                 GLA 1.206 -> 1.207 ms, KDA 2.448 -> 2.549 (the halved slabs cost what the copies
    #                                 save): off
    bwd_key_running: bool = False   # a key-vector decay's backward tail writes dl as its reverse sum goes, the chunk's
    #                                 last term added after, and stages no dG: 8 KB of threadgroup memory a SIMD group
    #                                 where it took 16 (about 13 groups an SM on sm_90), for its 64 serial steps a
    #                                 column of loads. H200, 4,4096,16,128 trained, four rounds: GLA 4.280 -> 4.662
    #                                 ms (every round slower), KDA 8.493 -> 8.463, RWKV-7 11.075 -> 10.807 (the rounds
    #                                 overlap): off
    bwd_key_batch: int = 4          # tokens whose loads a key-vector decay's backward tail issues together (its
    #                                 stores would otherwise hold each load back to one in flight a thread; the tail
    #                                 was latency-bound, DRAM 22-29% busy). H200, 4,4096,16,128 trained, three rounds
    #                                 of 1 / 4 / 8 / 16: GLA 3.844 / 3.821 / 3.712 / 3.645 ms, KDA 8.565 / 8.356 /
    #                                 8.691 / 8.431, RWKV-7 10.221 / 9.974 / 10.027 / 9.869 (16 on CUDA; 4 elsewhere,
    #                                 16 taking up to 237 registers)
    out_bv: int = 128               # value columns per threadgroup of the fragment readout (most)
    l2_prefetch: bool = False       # a scalar decay's fragment readout and UT transform hint each staging step's
    #                                 next block into L2 (where the dialect has a prefetch) while they multiply this one
    async_staging: bool = False     # a scalar decay's fragment readout and UT transform stage their blocks two deep by
    #                                 the dialect's asynchronous copies (CUDA's cp.async): a block's load overlaps the
    #                                 last one's products (then ``l2_prefetch`` does not apply to them)
    wide_fragments: bool = False    # fragment kernels whose operands share one 16-bit type multiply them by the
    #                                 dialect's wide multiply-add (``Dialect.mma16``: CUDA's m16n8k16 on bf16 or f16),
    #                                 read as they are, not converted to TF32: the readout, the UT transform and both
    #                                 scans (H100, GDN 4,4096,16,128: forward 1.42 -> 1.13 ms, trained 3.98 -> 3.28;
    #                                 on on CUDA)
    ut_bw: int = 128                # columns a pass of the fragment UT transform's products (most)
    bwd_bw: int = 32                # key columns a pass of the fragment backward (most)
    bwd_min_blocks: int = 1         # ... threadgroups an SM its registers must allow (as feature_jac_min_blocks; H100:
    #                                 4 trained GDN in 5.53 ms against 5.18)
    bwd_products: bool = False      # ... forms the products over values that read the states (Z dS_nextᵀ, dy S_cᵀ,
    #                                 Δ S_cᵀ) itself, per pass, not MLX's three GEMMs writing [C, K] each for it to
    #                                 read: on the wide multiply-add with ``bwd_scores`` (H100, GDN 4,4096,16,128
    #                                 trained 3.06-3.13 -> 3.22-3.30 ms, peak 1.42 -> 1.23 GiB; 8,1024,8,64 the same
    #                                 time, 0.173 -> 0.150 GiB; on on CUDA, for memory), else staged on TF32 ones
    bwd_scores: bool = False        # ... forms its pair cotangents dy Zᵀ and Δ Zᵀ itself from the rows of Z, dy and Δ
    #                                 on the wide multiply-add (16-bit operands, ``Dialect.mma16``), not MLX's two
    #                                 GEMMs writing [C, C] each for it to read (H100, GDN 4,4096,16,128: trained
    #                                 3.18 -> 3.04 ms, peak 1.48 -> 1.42 GiB; on on CUDA)
    bwd_wide_loads: bool = False    # ... its wide products' operands read 16 bytes a load (the values permuted within
    #                                 32, V a multiple of 32), not a pair at a time (H100, GDN 4,4096,16,128: trained
    #                                 3.13 -> 2.88 ms, six rounds all won; on on CUDA)
    # -- the recurrent kernels ----------------------------------------------------------------------
    fwd_layout: tuple[int, int, int] | None = None  # force the forward lane mapping (LK, CPL, WV): sweeps

    __hash__ = hash_once  # every op call's caches key on the tuning

    def __post_init__(self):
        if self.feature_attention not in FEATURE_ATTENTION:
            raise InputError(f"tuning: feature_attention={self.feature_attention!r}: "
                             f"expected one of {FEATURE_ATTENTION}")


DEVICE_DEFAULTS = {
    # On the CPU flops dominate (reference BLAS): loops, small chunks, block inverses, the cheap exp.
    "cpu": dict(chunk_size=16, key_chunk_size=16, pow2_exp=True, copy_transposes=True,
                segment_budget=512 * 2**20),
    # On GPUs MLX spends ~16 us a launch: few large ops, one compiled graph, chunks of 64.
    "gpu": dict(chunk_size=64, key_chunk_size=64, feature_chunk_size=256, gpu_forms=True, compile=True, inverse_base=16),
}

# What was measured faster on each dialect's hardware (docs/design.md and BENCHMARKS.md say where and how).
MEASURED = {
    "cuda": dict(chunk_kernels=True, mma_scan=True, chunked_backward_min_t=1024,
                 chunked_forward_min_t=1024, mma_pairs=True, feature_decode=True, reverse_scan_nw=8,
                 pair_fold=True, ut_products=True, rank1_readout=True, logdecay_16bit=True, model_rows=True,
                 scan_hoist=True, reverse_scan_hoist=True, l2_prefetch=True, async_staging=True,
                 model_rows_dense=True, decayed_scores=True, feature_kernels=True, gram_slices=16,
                 kernel_cache=KERNEL_CACHE_DIR, feature_jac_min_blocks=2, feature_states_fragments=2,
                 feature_out_fragments=2, feature_mix=True, feature_keep_states=True,
                 decay_factor_kernels=True, replay_graphs=True, ut_16bit=True, states_16bit=True,
                 wide_fragments=True, bwd_scores=True, bwd_products=True, scan_products_alone=True,
                 scan_wide_loads=True, bwd_wide_loads=True, scan_wide_columns=True, scan_min_groups=128,
                 scan_ahead_most=128, pair_whole=True,
                 key_roles_16bit=True, key_products_16bit=True, key_scaled_16bit=True,
                 pair_grad_async=True, key_model_backward=True, bwd_key_batch=16),
    # (the kernel cache: a first call's compile 31 s -> 2.7 s cold, 0.9 s kept, H100)
    "metal": dict(),  # nothing measured on Apple hardware yet: the recurrent backward, MLX ops in the chunked form
}


def _flag(text: str) -> bool:
    return text not in ("0", "", "false", "False")


def _choice(name: str, allowed: tuple):
    def parse(text: str):
        if text not in allowed:
            raise InputError(f"{name}={text!r}: expected one of {allowed}")
        return text
    return parse


def _int_choice(name: str, allowed: tuple):
    choose = _choice(name, tuple(str(a) for a in allowed))
    return lambda text: int(choose(text))


def _layout(text: str) -> tuple[int, int, int]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 3:
        raise InputError(f"RECGEN_FWD_LAYOUT={text!r}: expected LK,CPL,WV")
    return parts


def _roles(text: str) -> str:
    return {"1": "all", "0": "none"}.get(text, "bare")


# variable -> (field, parser). MLX_ENABLE_TF32=0 asks MLX for exact float32 products; the fragment scan rounds
# its operands to TF32, so it follows MLX's switch.
ENVIRONMENT = {
    "RECGEN_BACKEND": ("backend", _choice("RECGEN_BACKEND", BACKENDS)),
    "RECGEN_BACKWARD": ("backward", _choice("RECGEN_BACKWARD", BACKWARDS)),
    "RECGEN_CHUNKED_FORWARD_MIN_T": ("chunked_forward_min_t", int),  # beyond any T: never
    "RECGEN_KEY_BLOCKS_MAX_T": ("key_blocks_max_t", int),
    "RECGEN_CHUNK": ("chunk_size", int),
    "RECGEN_KEY_CHUNK": ("key_chunk_size", int),
    "RECGEN_DEBUG": ("debug", _flag),
    "RECGEN_KERNEL_CACHE": ("kernel_cache", lambda text: KERNEL_CACHE_DIR if text in ("1", "on", "true")
                            else text if _flag(text) and text != "off" else ""),
    "RECGEN_CHUNK_KERNELS": ("chunk_kernels", _flag),
    "RECGEN_REPLAY_GRAPHS": ("replay_graphs", _flag),
    "RECGEN_MMA_SCAN": ("mma_scan", _flag),
    "MLX_ENABLE_TF32": ("mma_scan", lambda text: None if _flag(text) else False),
    "RECGEN_FUSED_READOUT": ("fused_readout", _flag),
    "RECGEN_FUSED_UT": ("fused_ut", _flag),
    "RECGEN_UT_PRODUCTS": ("ut_products", _flag),
    "RECGEN_RANK1_READOUT": ("rank1_readout", _flag),
    "RECGEN_FUSED_BWD": ("fused_bwd", _flag),
    "RECGEN_BWD_BW": ("bwd_bw", int),
    "RECGEN_BWD_MIN_BLOCKS": ("bwd_min_blocks", int),
    "RECGEN_BWD_PRODUCTS": ("bwd_products", _flag),
    "RECGEN_BWD_SCORES": ("bwd_scores", _flag),
    "RECGEN_OUT_BV": ("out_bv", int),
    "RECGEN_L2_PREFETCH": ("l2_prefetch", _flag),
    "RECGEN_ASYNC_STAGING": ("async_staging", _flag),
    "RECGEN_UT_BW": ("ut_bw", int),
    "RECGEN_WIDE_FRAGMENTS": ("wide_fragments", _flag),
    "RECGEN_SCAN_BV": ("scan_bv", int),
    "RECGEN_SCAN_MIN_GROUPS": ("scan_min_groups", int),
    "RECGEN_SCAN_NW": ("scan_nw", int),
    "RECGEN_REVERSE_SCAN_NW": ("reverse_scan_nw", int),
    "RECGEN_SCAN_PREFETCH": ("scan_prefetch", _flag),
    "RECGEN_SCAN_WIDE_LOADS": ("scan_wide_loads", _flag),
    "RECGEN_BWD_WIDE_LOADS": ("bwd_wide_loads", _flag),
    "RECGEN_SCAN_WIDE_COLUMNS": ("scan_wide_columns", _flag),
    "RECGEN_SCAN_PRODUCTS_ALONE": ("scan_products_alone", _flag),
    "RECGEN_SCAN_HOIST": ("scan_hoist", _flag),
    "RECGEN_SCAN_AHEAD_MOST": ("scan_ahead_most", int),
    "RECGEN_REVERSE_SCAN_HOIST": ("reverse_scan_hoist", _flag),
    "RECGEN_SCAN_HOIST_MOST": ("scan_hoist_most", int),
    "RECGEN_SCAN_HOIST_E": ("scan_hoist_e", _flag),
    "RECGEN_SCAN_PRODUCTS": ("scan_products", _flag),
    "RECGEN_MMA_PAIRS": ("mma_pairs", _flag),
    "RECGEN_PAIR_FOLD": ("pair_fold", _flag),
    "RECGEN_PAIR_WHOLE": ("pair_whole", _flag),
    "RECGEN_PAIR_HALVES": ("pair_halves", _flag),
    "RECGEN_PAIR_GRAD_ASYNC": ("pair_grad_async", _flag),
    "RECGEN_BWD_KEY_RUNNING": ("bwd_key_running", _flag),
    "RECGEN_BWD_KEY_BATCH": ("bwd_key_batch", _int_choice("RECGEN_BWD_KEY_BATCH", (1, 2, 4, 8, 16))),
    "RECGEN_PAIR_WHOLE_ASYNC": ("pair_whole_async", _flag),
    "RECGEN_FACTOR_READS": ("factor_reads", _flag),
    "RECGEN_KEY_FACTOR_READS": ("key_factor_reads", _flag),
    "RECGEN_MODEL_ROWS": ("model_rows", _flag),
    "RECGEN_MODEL_ROWS_DENSE": ("model_rows_dense", _flag),
    "RECGEN_KEY_MODEL_BACKWARD": ("key_model_backward", _flag),
    "RECGEN_PAIR_GRAD_LOGDECAYS": ("pair_grad_logdecays", _flag),
    "RECGEN_UT_16BIT": ("ut_16bit", _flag),
    "RECGEN_STATES_16BIT": ("states_16bit", _flag),
    "RECGEN_16BIT_ROLES": ("roles_16bit", _roles),
    "RECGEN_KEY_ROLES_16BIT": ("key_roles_16bit", _flag),
    "RECGEN_KEY_PRODUCTS_16BIT": ("key_products_16bit", _flag),
    "RECGEN_16BIT_LOGDECAY": ("logdecay_16bit", _flag),
    "RECGEN_KEY_SCALED_16BIT": ("key_scaled_16bit", _flag),
    "RECGEN_INVERSE_BASE": ("inverse_base", int),
    "RECGEN_FEATURE_IDENTITY": ("feature_identity", _flag),
    "RECGEN_FEATURE_CHUNK": ("feature_chunk_size", int),
    "RECGEN_FEATURE_ATTENTION": ("feature_attention", _choice("RECGEN_FEATURE_ATTENTION", FEATURE_ATTENTION)),
    "RECGEN_FEATURE_DECODE": ("feature_decode", _flag),
    "RECGEN_FEATURE_KERNELS": ("feature_kernels", _flag),
    "RECGEN_DECAYED_SCORES": ("decayed_scores", _flag),
    "RECGEN_GRAM_SLICES": ("gram_slices", int),
    "RECGEN_FEATURE_MIX": ("feature_mix", _flag),
    "RECGEN_DECAY_FACTOR_KERNELS": ("decay_factor_kernels", _flag),
    "RECGEN_FEATURE_KEEP_STATES": ("feature_keep_states", _flag),
    "RECGEN_FEATURE_JAC_ROWS": ("feature_jac_rows", _flag),
    "RECGEN_FEATURE_JAC_GROUPS": ("feature_jac_groups", _int_choice("RECGEN_FEATURE_JAC_GROUPS", (8, 4, 2, 1))),
    "RECGEN_FEATURE_JAC_MIN_BLOCKS": ("feature_jac_min_blocks", int),
    "RECGEN_FEATURE_OUT_FRAGMENTS": ("feature_out_fragments", _int_choice("RECGEN_FEATURE_OUT_FRAGMENTS", (1, 2))),
    "RECGEN_FEATURE_STATES_FRAGMENTS": ("feature_states_fragments",
                                        _int_choice("RECGEN_FEATURE_STATES_FRAGMENTS", (1, 2))),
    "RECGEN_SCORES_ROWS": ("scores_rows", int),
    "RECGEN_CHUNKED_BUDGET": ("segment_budget", int),
    "RECGEN_CPU_BLAS": ("cpu_blas", _choice("RECGEN_CPU_BLAS", ("fast", "reference"))),
    "RECGEN_FWD_LAYOUT": ("fwd_layout", _layout),
}


def from_environment(environ=None) -> dict:
    """The fields the environment sets (unset and empty variables set nothing)."""
    environ = os.environ if environ is None else environ
    out = {}
    for var, (field, parse) in ENVIRONMENT.items():
        text = environ.get(var)
        if text:
            value = parse(text)
            if value is not None:
                out[field] = value
    return out


def resolve(device: str, dialect: str | None = None, environ=None, **overrides) -> Tuning:
    """Device defaults -> the dialect's measured table -> the environment -> ``overrides``."""
    if device not in DEVICE_DEFAULTS:
        raise InputError(f"device {device!r}: expected one of {sorted(DEVICE_DEFAULTS)}")
    values = dict(DEVICE_DEFAULTS[device])
    if device == "gpu" and dialect is not None:
        values.update(MEASURED.get(dialect, {}))
    values.update(from_environment(environ))
    values.update(overrides)
    unknown = set(values) - {f.name for f in fields(Tuning)}
    if unknown:
        raise InputError(f"tuning: unknown field(s) {sorted(unknown)}")
    values.setdefault("dialect", dialect)  # on the CPU only tests name one (the Metal emulator)
    return Tuning(device=device, **values)


_overrides: list[dict] = []


@contextlib.contextmanager
def override(**changes):
    """Within the block, ``current()`` gives the tuning with ``changes`` applied (innermost wins)."""
    unknown = set(changes) - {f.name for f in fields(Tuning)}
    if unknown:
        raise InputError(f"tuning.override: unknown field(s) {sorted(unknown)}")
    _overrides.append(changes)
    try:
        yield
    finally:
        _overrides.pop()


@lru_cache(maxsize=1)
def machine_dialect() -> str | None:
    """The kernel dialect of this machine's GPU as MLX sees it (Metal first, then CUDA), or None without one.
    Asked once per process: the hardware does not change, and every op call needs the answer."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


def device() -> tuple[str, str | None]:
    """MLX's default device as ("cpu" | "gpu", the GPU's kernel dialect)."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu", None
    return "gpu", machine_dialect()


def current() -> Tuning:
    """The tuning of MLX's default device, with the active overrides."""
    dev, dialect = device()
    if not _overrides:
        return _plain(dev, dialect)
    merged: dict = {}
    for ch in _overrides:
        merged.update(ch)
    return _cached(dev, dialect, tuple(sorted(merged.items())), environment())


@lru_cache(maxsize=1)
def environment() -> tuple:
    """The ``ENVIRONMENT`` variables as this process set them, read at the first op call (then kept)."""
    return tuple((var, os.environ.get(var)) for var in ENVIRONMENT)


def reload_environment() -> None:
    """Read the environment again (a program or test that changes ``RECGEN_*`` variables after the first op call;
    ``override()`` is the in-process way)."""
    environment.cache_clear()
    _plain.cache_clear()


@lru_cache(maxsize=8)
def _plain(device, dialect) -> Tuning:
    """``current()`` without overrides, looked up by the device alone: a decode step asks for its tuning on every
    call, and hashing the environment's values for the lookup was most of that microsecond or two."""
    return _cached(device, dialect, (), environment())


@lru_cache(maxsize=64)
def _cached(device, dialect, overrides: tuple, env: tuple) -> Tuning:
    return resolve(device, dialect, dict(env), **dict(overrides))


def verify_cache() -> str | None:
    """Where the Metal emulator keeps its compiled kernels (``RECGEN_VERIFY_CACHE``), or None for the default."""
    return os.environ.get("RECGEN_VERIFY_CACHE") or None


def child_environment(**extra) -> dict:
    """This process's environment with ``extra`` set: for a program recgen starts (the emulator)."""
    return {**os.environ, **extra}


def with_changes(t: Tuning, **changes) -> Tuning:
    """``t`` with some fields replaced (a new object)."""
    return replace(t, **changes)
