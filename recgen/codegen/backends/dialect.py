"""The schema of a backend: names, spellings and capabilities only, no logic and no tuning (``recgen.tuning``).

Shared code never asks which backend it renders for; it reads these fields. A field holding
``{x}``-style placeholders is a spelling with holes, filled by ``str.format``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fragments:
    """Where a lane holds its parts of the 16x8x8 fragment multiply-add D += A B (``Dialect.mma``), as the templates'
    index expressions: every fragment frame indexes its operands through these, so one frame serves each layout.
    ``gq`` and ``tq`` are expressions of ``lane`` declared once per kernel; D's four elements are always rows gq,
    gq + 8 by columns 2 tq, 2 tq + 1 (in that order); A's element i (16x8) sits at row offset ``a_row[i]`` and
    column ``a_k[i]`` (of the k0 .. k0 + 7 being contracted), of which there are two per lane, ``a_ks``, element i
    reading ``a_ks[a_kpair[i]]``; B's element j (8x8) at row ``b_row[j]``, column ``b_col[j]``. ``row_xor``: the lane
    masks that join the lanes holding one row of D. Offsets are spelled " + expr" (or "" for 0)."""

    gq: str
    tq: str
    a_row: tuple
    a_kpair: tuple
    a_ks: tuple
    b_row: tuple
    b_col: tuple
    row_xor: tuple

    @property
    def a_k(self) -> tuple:
        return tuple(self.a_ks[i] for i in self.a_kpair)


# PTX m16n8k8 (CUDA's tensor cores): A[gq][tq], A[gq+8][tq], A[gq][tq+4], A[gq+8][tq+4]; B[tq][gq], B[tq+4][gq].
PTX_FRAGMENTS = Fragments(gq="lane >> 2", tq="lane & 3", a_row=("", " + 8", "", " + 8"), a_kpair=(0, 0, 1, 1),
                          a_ks=(" + tq", " + tq + 4"), b_row=(" + tq", " + tq + 4"), b_col=(" + gq", " + gq"),
                          row_xor=(1, 2))
# Metal's simdgroup_matrix 8x8 (the lane layout MLX's steel kernels rely on, BaseMMAFrag::get_coord: lane holds row
# fm, columns fn, fn + 1 of each 8x8, fm = (qid & 4) + (lane / 2) % 4, fn = (qid & 2) * 2 + (lane % 2) * 2 with
# qid = lane / 4): A 16x8 as its top and bottom 8x8 matrices, gq = fm and tq = fn / 2.
SIMDGROUP_FRAGMENTS = Fragments(gq="((lane >> 2) & 4) + ((lane >> 1) & 3)", tq="((lane >> 2) & 2) + (lane & 1)",
                                a_row=("", "", " + 8", " + 8"), a_kpair=(0, 1, 0, 1),
                                a_ks=(" + 2 * tq", " + 2 * tq + 1"),
                                b_row=(" + gq", " + gq"), b_col=(" + 2 * tq", " + 2 * tq + 1"), row_xor=(1, 8))


@dataclass(frozen=True)
class Fragments16:
    """Where a lane holds its parts of the wide fragment multiply-add D += A B on 16-bit operands
    (``Dialect.mma16``: D 16x8 as ``Fragments``' D, A 16x16, B 16x8), each part a pair of elements adjacent in k
    (the first in the pair's low half): A's pair i at row offset ``a_row[i]``, k offset ``a_k[i]``; B's pair j at k
    offset ``b_k[j]``, column ``b_col``. Offsets are spelled " + expr".

    Read wide (``Dialect.load8``), the k of two multiply-adds (32) are permuted so that a lane's pairs of a row in
    both are the eight adjacent elements at ``a_k8``: pair i of the multiply-add over the 16 k from k0 is element
    pair ``2 (k0 / 16 % 2) + a_wide[i][1]`` of row ``a_wide[i][0]``'s eight; B, read wide from a tile stored
    transposed (B[k][n] at n ld + k), has its pair j at element pair ``2 (k0 / 16 % 2) + b_wide[j]`` of the eight at
    ``a_k8`` of its row n + ``b_col``. Or B takes its row k of those 32 from
    a transposed copy's position ``kpos`` ({k}: even; k + 1 next to it), where its pair j is the one word at
    k0 + ``b_k[j]``. A contraction over D's rows (tokens t, t + 8 held by a lane) is permuted likewise: D's row {t}
    goes to position ``tpos`` of a transposed copy (t + 8 next to it), and the pair there at t0 + ``b_k[j]`` holds
    the tokens t0 + ``t_of[2 j]`` and t0 + ``t_of[2 j + 1]``."""

    a_row: tuple
    a_k: tuple
    b_k: tuple
    b_col: str
    a_k8: str = ""
    a_wide: tuple = ()
    b_wide: tuple = ()
    kpos: str = ""
    tpos: str = ""
    t_of: tuple = ()


# PTX m16n8k16 on bf16 or f16: A pairs (gq, 2tq), (gq + 8, 2tq), (gq, 2tq + 8), (gq + 8, 2tq + 8); B pairs (2tq, gq),
# (2tq + 8, gq).
PTX_FRAGMENTS16 = Fragments16(a_row=("", " + 8", "", " + 8"), a_k=(" + 2 * tq", " + 2 * tq", " + 2 * tq + 8",
                                                                    " + 2 * tq + 8"),
                              b_k=(" + 2 * tq", " + 2 * tq + 8"), b_col=" + gq",
                              # wide reads: lane tq's eight keys 8 tq .. of the 32 are, by pairs, (step 0, k 2 tq),
                              # (step 0, 2 tq + 8), (step 1, 2 tq), (step 1, 2 tq + 8); position 2 (tq + 4 pair) + e
                              a_k8=" + 8 * tq", a_wide=(("", 0), (" + 8", 0), ("", 1), (" + 8", 1)), b_wide=(0, 1),
                              kpos="(({k}) & ~31) + 2 * (((({k}) & 31) >> 3) + 4 * ((({k}) & 7) >> 1))",
                              tpos="(({t}) & ~15) + 2 * (({t}) & 7)",
                              t_of=(" + tq", " + tq + 8", " + tq + 4", " + tq + 12"))


@dataclass(frozen=True, eq=False)  # one table per backend: identity is equality, and it hashes for caches
class Dialect:
    name: str
    ext: str                      # file extension of standalone sources
    mlx_factory: str              # mx.fast.<factory> that compiles the body
    lane: str                     # lane index within the SIMD group / warp
    thread_in_tg: str             # linear thread index within the threadgroup / block
    tg_x: str                     # threadgroup / block index, x and y
    tg_y: str
    shfl_xor: str                 # butterfly exchange: {x} value, {m} lane mask
    barrier: str                  # threadgroup-wide barrier with memory fence
    smem: str                     # declaration prefix of threadgroup / shared memory
    int64: str                    # 64-bit index type
    global_space: str             # address-space qualifier of kernel buffers in a pointer cast
    shared_space: str             # address-space qualifier of threadgroup / shared memory in a pointer cast
    smem_bytes: int               # threadgroup / static shared memory one kernel may declare
    fns: dict                     # sympy function name -> emitted function name
    dtypes: dict                  # numpy-style dtype name -> emitted type name
    prelude: str                  # helper functions (gates) pasted into the kernel header
    # One 16x8x8 fragment multiply-add D += A B across a SIMD group, every lane holding its part of
    # each fragment where ``frag`` says: {acc} float[4] of D, {a} float[4] of A, {b} float[2] of B, {lane} the
    # lane index. ``mma_prelude`` defines it.
    mma: str
    mma_prelude: str
    # The same multiply-add on operands already in its input precision, each element rounded once by
    # ``mma_round`` ({x} a float; the result a float again) where the operand is reused by several multiply-adds or
    # staged once for several SIMD groups: the conversions ``mma`` makes on every call are then made once.
    mma_rounded: str
    mma_round: str
    frag: Fragments
    standalone_dtypes: dict       # dtype name -> buffer element type in a standalone source (``recgen emit``)
    constant_space: str = ""      # address space of small read-only buffers in a standalone signature
    float_suffix: str = "f"       # float literal suffix
    # Two adjacent elements {p} and the one after it (of a buffer of type {t}, {p} even-aligned) = floats {a}, {b},
    # converted: as one paired store where the dialect has one (a 16-bit pair is one 32-bit store, not two 16-bit
    # ones: half the store instructions in a scan's step)
    store2: str = "{p} = static_cast<{t}>({a}); (&{p})[1] = static_cast<{t}>({b})"
    # Eight adjacent elements at {p} (of a buffer of type {t}: 16-bit or float; 16-byte aligned) = floats {v}[0..7],
    # converted (``store8f``), and floats {v}[0..7] = those eight (``load8f``): one access of 16 bytes (two of a
    # float buffer) where the dialect can, not four of a pair each, which use half of every 32-byte sector they touch
    store8f: str = "for (int i_ = 0; i_ < 8; ++i_) (&{p})[i_] = static_cast<{t}>({v}[i_])"
    load8f: str = "for (int i_ = 0; i_ < 8; ++i_) {v}[i_] = float((&{p})[i_])"
    # A hint that the cache line holding {p} (a pointer to a kernel buffer) will be read soon, so that a staging
    # loop's next block is on its way while the current one is multiplied; "" where the dialect has none.
    prefetch: str = ""
    # Staging through two buffers: {dst} (threadgroup memory) = the 16 bytes at {src} (a kernel buffer), both
    # 16-byte aligned, started asynchronously where the dialect can (CUDA's cp.async: no registers, the copy lands
    # while the previous block is multiplied); ``copy_commit`` closes the group of copies a thread has started and
    # ``copy_wait`` waits until at most {n} of its groups are still in flight ("" where copies are synchronous).
    # ``copy_prelude`` defines them.
    copy16: str = ""
    copy_prelude: str = ""
    copy_commit: str = ""
    copy_wait: str = ""
    # The wide fragment multiply-add D (float[4]) += A B on 16-bit operands of type {t} (bf16 or f16: half the
    # multiply-adds of ``mma`` over a product, no conversions), where ``frag16`` says: {acc} float[4], {a} ``pair``[4],
    # {b} ``pair``[2], {lane} the lane index (``mma_prelude`` defines it); "" where the dialect has none (the frames
    # then take ``mma``). ``load2``: the pair of elements {p} and the one after it (a 16-bit buffer, {p} even), as
    # one word where the dialect can; ``pack2``: the pair of 16-bit values {a} (first) and {b}; ``pack2f``: the pair
    # of floats {a}, {b} rounded to type {t}; ``pair_lo``, ``pair_hi``: the first elements of pairs {a} and {b} as a
    # pair (a's first), and their second elements.
    mma16: str = ""
    frag16: Fragments16 | None = None
    pair: str = ""
    load2: str = ""
    # ``load8``: the eight 16-bit elements at {p} (16-byte aligned) as four pairs, members x, y, z, w: one 16-byte
    # load where the dialect can ("" where it has no wide multiply-add)
    load8: str = ""
    # ``load4``: the four 16-bit elements at {p} (8-byte aligned) as two pairs, members x, y; ``load2f``: the two
    # elements at {p} (of any type, pair-aligned) as floats, members x, y: one load each where the dialect can
    load4: str = ""
    load2f: str = "float2{{float({p}), float((&{p})[1])}}"
    # Matrix loads from threadgroup memory, each lane's pairs gathered from the whole group's loads (CUDA's
    # ldmatrix: one instruction for what ``load2`` reads in four to eight; "" where the dialect has none, and the
    # frames read pairs): ``ldsm_a``, the A pairs {r}[4] of the 16 x 16 block at {p} (16-bit, row-major, row stride
    # {ld}, rows 16-byte aligned), {lane} the lane index; ``ldsm_b``, the B pairs of two adjacent 8-column tiles
    # ({r}[4]: the first tile's two, then the second's) of the 16 x 16 block at {p} stored transposed (B[k][n] at
    # p[n ld + k]); ``ldsm_bt``, the same of a row-major block (B[k][n] at p[k ld + n]).
    ldsm_a: str = ""
    ldsm_b: str = ""
    ldsm_bt: str = ""
    pack2: str = ""
    pack2f: str = ""
    pair_lo: str = ""
    pair_hi: str = ""
    # mx.fast.<factory> that runs a kernel compiled outside MLX (``recgen.runtime.kernel_binary`` compiles it once and
    # keeps it on disk), "" where the dialect's kernels are compiled by MLX only
    binary_factory: str = ""
