"""The chunk kernels called from MLX: launch recipes (shared with the Metal emulator) and the calls.

Which kernels run is read from the ``Tuning`` passed as ``t`` (the dispatcher's, after the self-test of
``recgen.runtime.probe``): ``t.dialect`` renders them, ``t.mma_scan`` puts the scan on fragments where a layout
exists, ``t.fused_readout`` / ``t.fused_ut`` fuse the scalar-decay readout and UT transform, and the tuned layout
constants (``scan_bv``, ``out_bv``, ``ut_bw``) shape them. What each kernel computes:
``recgen.codegen.chunk_sources``.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, replace
from functools import lru_cache

from ..codegen.backends import get
from ..codegen.chunk_sources import (BV, FACTOR_CHUNKS, FACTOR_NT, MMA_NW, ScanVariant, b_stride, bwd_key_source,
                                     bwd_key_supported, bwd_mma_layout, bwd_mma_source, bwd_products_layout,
                                     decay_factors_source, decayed_scores_layout, decayed_scores_source,
                                     decays_source, feature_decode_layout, feature_decode_source, feature_jac_source,
                                     feature_mix_layout, feature_mix_source, feature_mma_layout,
                                     feature_out_source, feature_states_source,
                                     inverse_source, out_async_layout, out_async_source, out_mma_layout,
                                     out_mma_source, pair_folds, pair_fragments, pair_grad_async_layout,
                                     pair_grad_async_supported, pair_grad_source, pair_layout,
                                     pair_source, pair_whole_layout, pair_whole_source, pair_whole_supported,
                                     scan_layout, scan_mma_layout, scan_prefetches, scan_source,
                                     scan_value_quads,
                                     sympow_layout, sympow_source, t_stride, ut_async_layout, ut_async_source,
                                     ut_mma_layout, ut_mma_source)
from ..codegen.chunk_sources import scan_supported as dialect_scan_supported
from ..spec.features import sympow_pairs
from ..tuning import Tuning
from .launch import Launch, dtype_name, mlx_call
from .pieces import Piece
from .replay import Replay


# -- which kernels run ----------------------------------------------------------------------------
def use_mma(t: Tuning, C: int, K: int, V: int) -> bool:
    """The scan on fragments: where the tuning asks for it, a fragment layout exists for (C, K, V) and it fits
    threadgroup memory."""
    lay = scan_mma_layout(C, K, V, t.scan_bv, t.scan_nw)
    return t.mma_scan and lay is not None and (K + C) * lay["LD"] * 4 <= get(t.dialect).smem_bytes


def fuses_readout(t: Tuning, C: int, K: int, V: int) -> bool:
    """Whether the readout y = (r ⊙ P) S_c + M_ru Z runs as the fragment kernel (``chunk_out``; a key-vector decay's,
    with M_ru formed by the pair kernels: ``chunk_out_key``)."""
    return t.mma_scan and t.fused_readout and out_mma_layout(t.dialect, C, K, V, t.out_bv) is not None


def fuses_ut(t: Tuning, C: int, K: int, V: int) -> bool:
    """Whether the delta rule's UT transform (A = M_b̃u, T = (I − A)^{-1}, U = T w, W = T (b̃ ⊙ P)) runs as the
    fragment kernel (``chunk_ut``; a key-vector decay's, with A formed by the pair kernels: ``chunk_ut_key``)."""
    return t.mma_scan and t.fused_ut and ut_mma_layout(t.dialect, C, K, V, t.ut_bw) is not None


def fuses_bwd(t: Tuning, C: int, K: int, delta: bool) -> bool:
    """Whether a scalar decay's backward after the reverse scan (the pair gradients through Γ and the elementwise
    tail) runs as the fragment kernel (``chunk_bwd``)."""
    return t.mma_scan and t.fused_bwd and bwd_mma_layout(t.dialect, C, K, delta, t.bwd_bw) is not None


def fuses_key_tail(t: Tuning, C: int) -> bool:
    """Whether a key-vector decay's backward tail after its pair gradients runs as a kernel (``chunk_bwd_key``)."""
    return t.chunk_kernels and t.fused_bwd and bwd_key_supported(t.dialect, C)


def pairs_on_fragments(t: Tuning, C: int, K: int, dual: bool = False, quad: bool = False) -> bool:
    """Whether the pair kernels run their other blocks on fragments (``Tuning.mma_pairs``, with the fragment frames
    on, blocks of 16 tokens: ``chunk_sources.pair_fragments``)."""
    return t.mma_scan and t.mma_pairs and pair_fragments(t.dialect, C, K, dual, quad)


def pairs_whole(t: Tuning, C: int, K: int, dual: bool = False, quad: bool = False) -> bool:
    """Whether the forward pair kernels run a whole chunk a threadgroup (``Tuning.pair_whole``, with the pairs on
    fragments, where ``chunk_sources.pair_whole_layout`` has a layout), but for the quad form: its four pairs' sums
    take 168 registers a thread there, one threadgroup an SM (RWKV-7's forward measured 3.586 -> 3.644 ms, H200)."""
    return (t.pair_whole and not quad and pairs_on_fragments(t, C, K, dual, quad)
            and pair_whole_supported(t.dialect, C, K, dual, quad))


def scan_fuses_products(t: Tuning, C: int, K: int, V: int, has_b: bool) -> bool:
    """Whether ``chunk_scan`` takes an E term as its factors (the fragment frame, with a B term) rather than as a
    product MLX forms first. Without B the scan is otherwise elementwise and the fused product only adds latency
    to its sequential steps (measured slower with TF32 fragments and float32 states; ``Tuning.scan_products_alone``
    takes it so there too); with B (delta rules) it is faster and saves E's memory. ``Tuning.scan_products`` off:
    always formed first."""
    return t.scan_products and (has_b or t.scan_products_alone) and use_mma(t, C, K, V)


def scan_supported(t: Tuning, C: int, K: int) -> bool:
    """Whether the FMA scan has a layout for (C, K) in the tuning's dialect (``chunk_sources.scan_supported``)."""
    return dialect_scan_supported(t.dialect, C, K)


# -- launch recipes (shared with the Metal emulator) -----------------------------------------------
@lru_cache(maxsize=256)
def inverse_launch(dialect: str, N: int, C: int) -> Launch:
    src = inverse_source(dialect)
    return Launch(src, (), (((N, C, C), "float32"),), (N * C, 1, 1), (C, 1, 1), (("C", C),))


DECAYS_NT = 128  # threads a threadgroup of the decay-geometry kernel: one a (chunk, key column), or 32 a chunk (F = 1)
DECAYS_U = 16  # tokens a thread of it loads at once (F > 1): the loads in flight, 16 registers a role


@lru_cache(maxsize=256)
def decays_launch(dialect: str, N: int, C: int, F: int, before: bool = False, scaled: tuple = (),
                  pq: bool = True, d: bool = True, q: bool = True, yt: str | None = None,
                  ml: tuple | None = None) -> Launch:
    """The decay geometry over N chunks of C tokens from the log-decays [N, C, F] (``decays_source``): D (``d``),
    P and Q (``pq``) [N, C, F], G [N, F], Pe (``before``) and each given role times its decay ("P", "Q" or "Pe"),
    in that order, those in float32 or the dtype named ``yt``; ``q`` off: no Q. A scalar decay (F = 1) runs a SIMD
    group a chunk (``lanes``). ``ml`` (``_model_consts``, F > 1): l and the roles read in the model's layout."""
    lanes = F == 1
    full = ((N, C, F), "float32")
    q = q and pq
    outs = ((full,) * d + (full,) * (pq + q) + (((N, F), "float32"),) + (full,) * before
            + (((N, C, F), yt or "float32"),) * len(scaled))
    src = decays_source(dialect, before, scaled, pq, d, lanes, q, bool(yt), ml is not None)
    if lanes:
        groups = -(-N * 32 // DECAYS_NT)
        consts = (("C", C), ("E", -(-C // 32)), ("NT", DECAYS_NT))
    else:
        groups = -(-N * F // DECAYS_NT)
        consts = (("C", C), ("F", F), ("NT", DECAYS_NT), ("U", DECAYS_U))
    consts += ((("YT", yt),) if yt else ()) + _model_consts(ml)
    return Launch(src, (("rt", (N,), "int32"),), outs, (groups * DECAYS_NT, 1, 1), (DECAYS_NT, 1, 1), consts)


@lru_cache(maxsize=64)
def decayed_scores_launch(dialect: str, N: int, C: int, power: int, grad: bool = False, rows: int = 16) -> Launch:
    """A [N, C, C] = P^power ⊙ Γ of P [N, C, C] and a scalar decay's log-decays l [N, C] (``decayed_scores_source``),
    a threadgroup a block of ``rows`` rows of a chunk (``Tuning.scores_rows``; ``decayed_scores_layout``); or its
    gradients dP [N, C, C] and each block's part of dl, [N, NB, C]."""
    lay = decayed_scores_layout(dialect, C, rows)
    if lay is None:
        raise ValueError(f"decayed scores: chunks of {C} pass {dialect}'s threadgroup memory")
    full = ((N, C, C), "float32")
    outs = (full, ((N, lay["NB"], C), "float32")) if grad else (full,)
    return Launch(decayed_scores_source(dialect, grad), (), outs, (N * lay["NB"] * lay["NT"], 1, 1), (lay["NT"], 1, 1),
                  (("C", C), ("PW", power), ("RB", lay["RB"]), ("NB", lay["NB"]), ("NT", lay["NT"])))


def _scan_outputs(BH: int, n: int, C: int, K: int, V: int, v: ScanVariant, dgp_cols: int = 0,
                  st: str | None = None) -> tuple:
    """carried, Y (in type ``st`` where given, else float32), S_end and with ``v.dg`` dg's partial sums."""
    outs = (((BH, n, K, V), st or "float32"), ((BH, n, C, V) if v.a else (1,), st or "float32"),
            ((BH, K, V), "float32"))
    return outs + ((((BH, n, dgp_cols, K), "float32"),) if v.dg else ())


def _model_consts(ml: tuple | None, names=("H", "HK", "NCH", "GB")) -> tuple:
    """A kernel's template constants of the model's layout (``ml`` = (H, HK, NCH, GB): value heads, key heads, chunks
    a sequence, GQA's block map), those named; () without it."""
    return () if ml is None else tuple((k, v) for k, v in zip(("H", "HK", "NCH", "GB"), ml) if k in names)


@lru_cache(maxsize=256)
def scan_launch(dialect: str, v: ScanVariant, BH: int, n: int, C: int, K: int, V: int, F: int,
                most_bv: int = 32, most_nw: int = MMA_NW, ml: tuple | None = None, st: str | None = None) -> Launch:
    """The scan of variant ``v`` over BH (batch, head) pairs of n chunks: the fragment frame where ``v.mma``
    (``most_bv``: its widest column tile, ``most_nw``: its most SIMD groups), else the FMA frame; ``ml`` (with
    ``v.ml``): (H, HK, NCH, GB), see ``_model_consts``; ``st`` (with ``v.s16``): the 16-bit dtype name of carried
    and Y."""
    if v.ml != (ml is not None):
        raise ValueError("chunk_scan_mma: the model's layout (ml) needs its constants (H, HK, NCH, GB), and only it")
    if v.s16 != (st is not None):
        raise ValueError("chunk_scan_mma: 16-bit outputs (s16) need their type (st), and only they")
    src = scan_source(dialect, v)
    if v.mma:
        lay = scan_mma_layout(C, K, V, most_bv, most_nw)
        if lay is None:
            raise ValueError(f"chunk_scan_mma: C={C}, K={K} must be multiples of 16 and V={V} of 8")
        if (v.pf or (v.hoist and v.a) or v.w16) and not scan_prefetches(C, K, V, most_bv, most_nw):
            raise ValueError(f"chunk_scan_mma: prefetching and hoisting need one item of Y a group, not so at C={C}, "
                             f"K={K}, V={V}")
        if v.wl and K % 32:
            raise ValueError(f"chunk_scan_mma: wide loads (wl) read 32 keys at a time: K={K} must be a multiple of 32")
        if v.vc and not scan_value_quads(C, K, V, most_bv, most_nw):
            raise ValueError(f"chunk_scan_mma: a lane's eight columns (vc) need column tiles by four, in each "
                             f"threadgroup and item of Y: not so at C={C}, K={K}, V={V}")
        nt = 32 * lay["NW"]
        strides = (("LDK", t_stride(K)), ("LDY", t_stride(C))) if v.wl else (("LDS", b_stride(lay["BV"])),)
        tmpl = ((("C", C), ("K", K), ("V", V), ("F", F)) + tuple(lay.items()) + _model_consts(ml, ("H", "HK", "GB"))
                + ((("ST", st),) if st else ()) + (strides if v.w16 else ()))
        return Launch(src, (("rt", (n,), "int32"),), _scan_outputs(BH, n, C, K, V, v, V // lay["BV"], st),
                      (V // lay["BV"] * nt, BH, 1), (nt, 1, 1), tmpl)
    lay = scan_layout(dialect, C, K)
    tmpl = (("C", C), ("K", K), ("V", V), ("F", F), ("BV", BV)) + tuple(lay.items())
    return Launch(src, (("rt", (n,), "int32"),), _scan_outputs(BH, n, C, K, V, v), (-(-V // BV) * lay["NT"], BH, 1),
                  (lay["NT"], 1, 1), tmpl)


@lru_cache(maxsize=256)
def out_mma_launch(dialect: str, N: int, C: int, K: int, V: int, yt: tuple | None = None, most_bv: int = 128,
                   key: bool = False, m2: bool = False, uf: bool = False, ml: tuple | None = None,
                   l2: bool = False, st: str | None = None) -> Launch:
    """``yt`` = (H, n, dtype name): y as [N / (H n), n C, H, V] of that type (N = B H n chunks), else [N, C, V] float32;
    ``key``: a key-vector decay's readout (M given: y is the only output); ``m2``: the general rank-1 core's
    (``chunk_out_rank1``); ``uf``: u read as a key times a factor per token; ``ml`` (with ``uf`` and ``yt``, the same H
    and n): r and the key read in the model's layout, (H, HK, NCH, GB) as ``_model_consts``; ``l2``: the staging
    steps hint their next blocks into L2 (``Tuning.l2_prefetch``); ``st``: the 16-bit dtype name M is written in
    (the states', ``Tuning.states_16bit``), else float32."""
    y, consts = _readout_y("chunk_out_mma", N, C, V, yt, ml)
    lay = out_mma_layout(dialect, C, K, V, most_bv)
    if lay is None:
        raise ValueError(f"chunk_out_mma: C={C} must be 16, 32 or 64 and K={K}, V={V} multiples of 8")
    tmpl = (("C", C), ("K", K), ("V", V)) + tuple(lay.items()) + consts + ((("ST", st),) if st else ())
    nt = 2 * C  # C / 16 SIMD groups of 32
    return Launch(out_mma_source(dialect, yt is not None, key, m2, uf, ml is not None, l2, st is not None), (),
                  (y,) if key else (y, ((N, C, C), st or "float32")),
                  (N * (V // lay["BV"]) * nt, 1, 1), (nt, 1, 1), tmpl)


def _readout_y(kernel: str, N: int, C: int, V: int, yt: tuple | None, ml: tuple | None) -> tuple:
    """A readout's y ((shape, dtype name): [N, C, V] float32, or with ``yt`` the model's layout and type) and the
    template constants that layout adds; ``ml`` must read the same H and n as y is written in."""
    if ml is not None and (yt is None or (ml[0], ml[2]) != tuple(yt[:2])):
        raise ValueError(f"{kernel}: the model's layout {ml} needs y written in it, of the same H and n ({yt})")
    if yt is None:
        return ((N, C, V), "float32"), ()
    H, n, dt = yt
    return ((N // (H * n), n * C, H, V), dt), (("H", H), ("NCH", n), ("OT", dt)) + _model_consts(ml, ("HK", "GB"))


def _ut_outputs(N: int, C: int, K: int, V: int, ot: str | None, st: str | None = None) -> tuple:
    """The UT transform's Tm [N, C, C] (in type ``st`` where given), U [N, C, V] and W [N, C, K] (in type ``ot``
    where given), else float32."""
    return ((N, C, C), st or "float32"), ((N, C, V), ot or "float32"), ((N, C, K), ot or "float32")


def _itemsize(dtype_name: str) -> int:
    return 4 if dtype_name == "float32" else 2


def _wide_types(dialect: str, wide: bool, types: tuple) -> bool:
    """Whether a staged kernel takes the wide multiply-add (``Tuning.wide_fragments``): asked, the dialect has one
    and its operands (dtype names ``types``) share one 16-bit type."""
    return wide and bool(get(dialect).mma16) and len(set(types)) == 1 and _itemsize(types[0]) == 2


@lru_cache(maxsize=256)
def out_async_launch(dialect: str, N: int, C: int, K: int, V: int, types: tuple, yt: tuple | None = None,
                     most_bv: int = 128, uf: bool = False, ml: tuple | None = None,
                     wide: bool = False, zm: bool = False, key: bool = False) -> Launch | None:
    """The two-buffer readout (``out_async_source``) with ``out_mma_launch``'s arguments; ``types``: the dtype names
    of R, U, Z and S_c, whose blocks it copies verbatim (M is written in S_c's). ``wide`` (``Tuning.wide_fragments``):
    the wide multiply-add where the dialect has one and all four share a 16-bit type. None where its buffers have no
    layout (then the synchronous frame runs). ``zm``: Z in the model's layout too (``out_async_source``). ``key``: a
    key-vector decay's readout (``chunk_out_key``'s), ``types`` naming R, P, Z and S_c; y the only output."""
    if len(types) != 4:
        raise ValueError(f"chunk_out_async: types {types} must name R, U, Z and S_c")
    y, consts = _readout_y("chunk_out_async", N, C, V, yt, ml)
    w16 = _wide_types(dialect, wide, types) and not key
    lay = out_async_layout(dialect, C, K, V, tuple(_itemsize(t) for t in types), most_bv, w16, key)
    if lay is None and w16:
        return out_async_launch(dialect, N, C, K, V, types, yt, most_bv, uf, ml, zm=zm)
    if lay is None:
        return None
    tmpl = (("C", C), ("K", K), ("V", V)) + tuple(lay.items()) + tuple(zip(("RT", "UT", "ZT", "ST"), types)) + consts
    nt = 2 * C
    return Launch(out_async_source(dialect, yt is not None, uf, ml is not None, w16, zm, key), (),
                  (y,) if key else (y, ((N, C, C), types[3])),
                  (N * (V // lay["BV"]) * nt, 1, 1), (nt, 1, 1), tmpl)


@lru_cache(maxsize=256)
def ut_async_launch(dialect: str, N: int, C: int, K: int, V: int, types: tuple, most_bw: int = 128, uf: bool = False,
                    ot: str | None = None, ml: tuple | None = None, st: str | None = None,
                    wide: bool = False) -> Launch | None:
    """The two-buffer UT transform (``ut_async_source``) with ``ut_mma_launch``'s arguments; ``types``: the dtype
    names of U (the key x where ``uf``), W and, without ``uf``, Bt, whose blocks it copies verbatim. ``wide``
    (``Tuning.wide_fragments``): the wide multiply-add where the dialect has one and all share a 16-bit type. None
    where its buffers have no layout (then the synchronous frame runs)."""
    if len(types) != (2 if uf else 3):
        raise ValueError(f"chunk_ut_async: types {types} must name U, W{'' if uf else ' and Bt'}")
    w16 = _wide_types(dialect, wide, types)
    lay = ut_async_layout(dialect, C, K, V, tuple(_itemsize(t) for t in types), most_bw, w16)
    if lay is None and w16:
        return ut_async_launch(dialect, N, C, K, V, types, most_bw, uf, ot, ml, st)
    if lay is None:
        return None
    tmpl = ((("C", C), ("K", K), ("V", V)) + tuple(lay.items()) + tuple(zip(("UT", "WT", "BT"), types))
            + ((("OT", ot),) if ot else ()) + ((("ST", st),) if st else ()) + _model_consts(ml))
    return Launch(ut_async_source(dialect, uf, ot is not None, ml is not None, st is not None, w16), (),
                  _ut_outputs(N, C, K, V, ot, st),
                  (N * 2 * C, 1, 1), (2 * C, 1, 1), tmpl)


@lru_cache(maxsize=256)
def ut_mma_launch(dialect: str, N: int, C: int, K: int, V: int, most_bw: int = 128, key: bool = False,
                  tb: bool = False, uf: bool = False, ot: str | None = None, ml: tuple | None = None,
                  l2: bool = False, st: str | None = None) -> Launch:
    """``key``: a key-vector decay's UT transform (A given); ``tb``: and B given, Uw = Tm (B w) (``chunk_ut_key``);
    ``uf``: both roles read from one key with their factors (``chunk_ut``'s ``uf``); ``ot`` (with ``uf``): the dtype
    name Uw and Wb are written in (a 16-bit one), else float32; ``ml`` (with ``uf``): the key and w read in the model's
    layout, (H, HK, NCH, GB) as ``_model_consts``; ``l2``: the staging steps hint their next blocks into L2
    (``Tuning.l2_prefetch``); ``st`` (with ``ot``): the 16-bit dtype name Tm is written in (``Tuning.states_16bit``)."""
    lay = ut_mma_layout(dialect, C, K, V, most_bw)
    if lay is None:
        raise ValueError(f"chunk_ut_mma: C={C} must be 16, 32 or 64 and K={K}, V={V} multiples of 8, "
                         f"and the tiles must fit {dialect}'s threadgroup memory")
    if tb:  # Tm B's columns a pass: a multiple of 8 dividing C, within the staging rows of BW columns
        lay = dict(lay, BC=8 * math.gcd(C // 8, lay["BW"] // 8))
    tmpl = ((("C", C), ("K", K), ("V", V)) + tuple(lay.items()) + ((("OT", ot),) if ot else ())
            + ((("ST", st),) if st else ()) + _model_consts(ml))
    return Launch(ut_mma_source(dialect, key, tb, uf, ot is not None, ml is not None, l2, st is not None), (),
                  _ut_outputs(N, C, K, V, ot, st), (N * 2 * C, 1, 1), (2 * C, 1, 1), tmpl)


@lru_cache(maxsize=256)
def bwd_mma_launch(dialect: str, N: int, C: int, K: int, types: tuple, most_bw: int = 32, uf: bool = False,
                   ml: tuple | None = None, min_blocks: int = 0, V: int = 0, scores: tuple | None = None,
                   wide_loads: bool = False) -> Launch:
    """N chunks, one threadgroup each; ``types``: the dtype names of R, U (and b̃: the delta rule's form), which the
    gradients dR, dU (dBt) are written in; ``uf`` (the delta rule's, ``types`` those of R and the key x): u and b̃
    read from x with their factors, the gradients written dR, dX and dF (of the factor, [N, C] float32); ``ml`` (with
    ``uf``, or no b̃): r and x (u) read in the model's layout, dR, dX (dU) written in it per value head
    [N / (H NCH), NCH C, H, K],
    (H, HK, NCH, GB) as ``_model_consts``; ``min_blocks`` as ``Launch``'s; ``V`` (a multiple of 8; 0: none): the
    products over V values formed in the pass (``bwd_mma_source``'s ``prods``); ``scores`` (``scores_in_pass``): None,
    or (V, the 16-bit dtype name of Z, dy and Δ) where the pass forms its pair cotangents from them, and with ``V``
    its products too on the wide multiply-add (S_c and dS_next then of that type as well); ``wide_loads`` (with
    ``scores``, V a multiple of 32): their operands read 16 bytes a load."""
    delta = len(types) == 3 or uf
    lay = bwd_mma_layout(dialect, C, K, delta, most_bw)
    if lay is None:
        raise ValueError(f"chunk_bwd_mma: C={C} must be 16, 32 or 64 and K={K} a multiple of 8, "
                         f"and the tiles must fit {dialect}'s threadgroup memory")
    if V and scores is None:  # (with the scores the products stage nothing: the base layout)
        lay = bwd_products_layout(dialect, C, K, delta, V, most_bw)
        if lay is None:
            raise ValueError(f"chunk_bwd_mma: V={V} values must be a multiple of 8 for the products in the pass, "
                             f"their staged states within {dialect}'s threadgroup memory")
    if scores is not None and (scores[0] % 16 or V not in (0, scores[0]) or _itemsize(scores[1]) != 2):
        raise ValueError(f"chunk_bwd_mma: scores {scores} in the pass need V a multiple of 16 (the products' {V} if "
                         f"formed too) and a 16-bit type")  # and a wide multiply-add: ``bwd_mma_source`` refuses
    if wide_loads and (scores is None or scores[0] % 32):
        raise ValueError(f"chunk_bwd_mma: wide loads read 32 values at a time: they need scores {scores} in the pass, "
                         f"V a multiple of 32")
    sv = (("V", scores[0]), ("ZT", scores[1])) if scores is not None else (("V", V),) * (V > 0)
    tmpl = ((("C", C), ("K", K)) + sv + tuple(lay.items()) + tuple(zip(("RT", "UT", "BT"), types))
            + _model_consts(ml))
    rows = (N, C, K) if ml is None else (N // (ml[0] * ml[2]), ml[2] * C, ml[0], K)
    outs = tuple((rows, dt) for dt in types) + (((N, C), "float32"),) * (2 if uf else 1)
    return Launch(bwd_mma_source(dialect, delta, uf, ml is not None, V > 0, scores is not None, wide_loads), (), outs,
                  (N * 2 * C, 1, 1), (2 * C, 1, 1), tmpl, min_blocks)


@lru_cache(maxsize=256)
def bwd_key_launch(dialect: str, N: int, C: int, K: int, types: tuple, before: bool | None = None,
                   uf: bool = False, running: bool = False, ml: tuple | None = None, batch: int = 4,
                   dl_type: str = "float32") -> Launch:
    """N chunks of C tokens, one threadgroup of 32 threads a block of 32 key columns; ``types`` as ``bwd_mma_launch``,
    or with ``before`` given (True or False) the general rank-1 core's tail: ``types`` those of R, U, A, B; ``uf``
    (factor reads, ``types`` those of R and the key x; K a multiple of 32): the outputs dR, dX, a part of dUf per
    group of 32 columns [N, K / 32, C] and dl. ``running`` (``Tuning.bwd_key_running``): dl written as its sum goes
    (``chunk_sources.bwd_key_source``). ``ml`` (``_model_consts``, the plain form): R and U in the model's layout
    [B, T, HK, K], L and the outputs dR, dU, dl in it per value head [B, T, H, K]. ``batch``: tokens whose loads
    are issued together (``Tuning.bwd_key_batch``). ``dl_type``: dl's dtype name (16-bit only where its sum is
    written once, not ``running``)."""
    if not bwd_key_supported(dialect, C):
        raise ValueError(f"chunk_bwd_key: C={C} must be at most 64")
    if uf and K % 32:
        raise ValueError(f"chunk_bwd_key: factor reads sum over groups of 32 key columns, K={K} is not a multiple of 32")
    if running and dl_type != "float32":
        raise ValueError(f"chunk_bwd_key: running sums add to dl after, so it is float32, not {dl_type}")
    ng = -(-K // 32)
    rank1 = before is not None
    names = ("RT", "UT", "AT", "BT") if rank1 else ("RT", "UT", "BT")
    tmpl = ((("C", C), ("K", K), ("NG", ng), ("UB", batch)) + tuple(zip(names, types)) + (("LT", dl_type),)
            + _model_consts(ml))
    outs = tuple(((N, C, K), dt) for dt in types) + ((((N, ng, C), "float32"),) if uf else ()) + (((N, C, K), dl_type),)
    src = bwd_key_source(dialect, len(types) == 3 and not rank1 or uf, rank1, bool(before), uf, running, ml is not None)
    return Launch(src, (), outs, (N * ng * 32, 1, 1), (32, 1, 1), tmpl)


@lru_cache(maxsize=256)
def pair_launch(dialect: str, N: int, C: int, K: int, strict: bool, grad: bool = False, dual: bool = False,
                mma: bool = False, quad: bool = False, fold: bool = False, scaled: bool = False,
                whole: bool = False, halves: bool = False, types: tuple = (), ml: tuple | None = None,
                ld: bool = False, dk_type: str = "float32") -> Launch:
    """N chunks, one threadgroup a block of rows (and, for the gradients, a second for the columns); ``dual``: two
    operands X (pairs s < t where ``strict``) and X2 (s <= t) sharing Y and the decays (``chunk_sources.pair_source``);
    ``quad``: both with a second Y as well (four pairs); ``mma``: the other blocks' products on fragments
    (``chunk_sources.pair_fragments``); ``fold``: the own block's rows paired, one thread rows t and BS − 1 − t
    (``chunk_sources.pair_folds``); ``scaled``: X read times the scalar Xsc [1] given after the decays; ``whole``
    (the forward on fragments): a whole chunk a threadgroup (``chunk_sources.pair_whole_source``; ``halves``: each
    block's halves paired on fragments too). ``types`` (the gradients, or the whole form): the operands' dtype names
    (X, X2, Y, Yb as the form has them): each slab's raw rows copied a slab ahead
    (``chunk_sources.pair_grad_async_layout``, ``pair_whole_layout``). ``ml`` (``_model_consts``): the operands in
    the model's layout [B, T, HK, K]; for the whole form dk the log-decays [B, T, H, K], each decay formed as read;
    for the gradients the cotangents and gradients in the chunks' layout. ``ld`` (the gradients copying their raw
    rows ahead): dk the log-decays, of type ``dk_type`` (with ``ml`` [B, T, H, K]), each decay formed as read."""
    if ld and not (grad and types):
        raise ValueError("chunk_pair: log-decays (ld) are the gradients' read with their raw rows (types)")
    if ml is not None and not (whole and not types or grad and types):
        raise ValueError("chunk_pair: the model's layout (ml) is the whole form's, its operands read from their "
                         "buffers, or the gradients' copying their raw rows ahead")
    if types and not (grad or whole):
        raise ValueError("chunk_pair: raw slabs copied ahead (types) are the gradients' and the whole form's")
    if halves and not whole:
        raise ValueError("chunk_pair: halves are the whole-chunk form's")
    if whole:
        if grad or not mma or fold:
            raise ValueError("chunk_pair: a whole chunk a threadgroup is the forward's form on fragments, unfolded")
        lay = pair_whole_layout(dialect, C, K, dual, quad, halves, tuple(_itemsize(t) for t in types))
        src = pair_whole_source(dialect, strict, dual, quad, scaled, halves, bool(types), ml is not None)
        groups = N
    else:
        lay = dict(pair_grad_async_layout(dialect, C, K, dual, quad, tuple(_itemsize(t) for t in types)) if types
                   else pair_layout(dialect, C, K, dual, quad))
        if mma and not pair_fragments(dialect, C, K, dual, quad):
            raise ValueError(f"chunk_pair: fragments need blocks of 16 tokens, C a multiple of 16 (C={C})")
        if fold and not pair_folds(dialect, C, K, dual, quad):
            raise ValueError(f"chunk_pair: folded rows need an even block of rows (C={C})")
        if mma and not grad:
            lay["FI"] = -(-2 * lay["NBM"] // (lay["NT"] // 32))  # fragment items of a SIMD group, at most
        src = (pair_grad_source(dialect, strict, dual, mma, quad, fold, scaled, bool(types), ml is not None, ld) if grad
               else pair_source(dialect, strict, dual, mma, quad, fold, scaled))
        groups = N * lay["NB"] * (2 if grad else 1)
    operands = [n for n in src.inputs if n in ("X", "X2", "Y", "Yb")]
    lay |= dict(zip([n + "T" for n in operands], types))  # the operands' types and (the whole form's) bytes
    lay |= {"LT": dk_type} if ld else {}  # the raw log-decays' type
    lay |= {n + "B": _itemsize(dt) for n, dt in zip(operands, types)} if whole else {}
    outs = (((N, C, K) if grad else (N, C, C), "float32"),) * len(src.outputs)
    tmpl = (("C", C), ("K", K)) + tuple(lay.items()) + _model_consts(ml)
    return Launch(src, (("rt", (N,), "int32"),), outs, (groups * lay["NT"], 1, 1), (lay["NT"], 1, 1), tmpl)


def _pair_tables(D: int) -> tuple:
    """φ's row-major pairs a <= b (``recgen.spec.features.sympow_pairs``) as the runtime tables pa, pb."""
    a, b, _ = sympow_pairs(D)
    return (("pa", tuple(int(i) for i in a), "int32"), ("pb", tuple(int(i) for i in b), "int32"))


@lru_cache(maxsize=256)
def sympow_launch(dialect: str, B: int, T: int, H: int, Hk: int, D: int, block: bool, grad: bool = False) -> Launch:
    """φ of x [B, T, Hk, D] into [B, H, T, F], value heads expanded from key heads (``block``: h // (H / Hk), else
    h % Hk), one threadgroup a row of φ; or its gradient, one threadgroup a row of dx [B, T, Hk, D]
    (``sympow_layout``). The pair tables (``recgen.spec.features.sympow_pairs``) and (B, T) are runtime inputs, so
    a new T compiles nothing."""
    lay = sympow_layout(dialect, D, grad)
    rt = ("rt", (B, T), "int32")
    runtime = (rt,) if grad else _pair_tables(D) + (rt,)
    out = (B, T, Hk, D) if grad else (B, H, T, lay["F"])
    rows = B * T * (Hk if grad else H)
    tmpl = (("D", D), ("H", H), ("HK", Hk), ("BLOCK", block)) + tuple(lay.items())
    return Launch(sympow_source(dialect, grad), runtime, ((out, "float32"),), (rows * lay["NT"], 1, 1),
                  (lay["NT"], 1, 1), tmpl)


@lru_cache(maxsize=64)
def feature_decode_launch(dialect: str, BH: int, D: int, V: int, has_z: bool) -> Launch:
    """One decode step of a feature map's state (``feature_decode_source``), BH heads, one threadgroup a block of RB
    of φ's D (D + 1) / 2 packed rows; the pair tables are runtime inputs."""
    lay = feature_decode_layout(dialect, D, V, has_z)
    F = lay["F"]
    runtime = _pair_tables(D)
    outs = (((BH, F, V), "float32"),) + ((((BH, F), "float32"),) if has_z else ()) + \
        (((BH, lay["NB"], lay["V1"]), "float32"),)
    return Launch(feature_decode_source(dialect, has_z), runtime, outs, (BH * lay["NB"] * lay["NT"], 1, 1),
                  (lay["NT"], 1, 1), tuple(lay.items()))


@lru_cache(maxsize=64)
def feature_states_launch(dialect: str, N: int, C: int, D: int, V: int, seqs: int = 0, fragments: int = 1) -> Launch:
    """dS = φ(X)ᵀ Y of N chunks (``feature_states_source``): a threadgroup 64 ``fragments`` of the F packed rows of a
    chunk (``Tuning.feature_states_fragments``: 16-row fragments a SIMD group); with ``seqs`` sequences (of N / seqs
    chunks each) a tail T0 [seqs, F, V] after each one's chunks."""
    lay = feature_mma_layout(dialect, C, D, V, states_fragments=fragments)["states"]
    blocks = -(-lay["F"] // (64 * lay["RF"]))
    runtime = _pair_tables(D) + ((("ns", (N // seqs, N // seqs + 1, N), "int32"),) if seqs else ())
    return Launch(feature_states_source(dialect, bool(seqs)), runtime, (((N + seqs, lay["F"], V), "float32"),),
                  ((N + seqs) * blocks * 128, 1, 1), (128, 1, 1), tuple(lay.items()))


def _by_tokens(src, runtime: tuple, out: tuple, N: int, C: int, lay: dict, min_blocks: int = 0) -> Launch:
    """A feature kernel a threadgroup of 16 NG TF tokens of a chunk (NG SIMD groups, TF fragments each: 1 where the
    layout names none), over N chunks of C; ``min_blocks`` as ``Launch``'s."""
    NT = 32 * lay["NG"]
    return Launch(src, runtime, ((out, "float32"),), (N * C // (16 * lay["NG"] * lay.get("TF", 1)) * NT, 1, 1),
                  (NT, 1, 1), tuple(lay.items()), min_blocks)


@lru_cache(maxsize=64)
def decay_factors_launch(dialect: str, N: int, n: int, C: int, grad: bool = False) -> Launch:
    """A scalar decay's factors of N sequences of n chunks of C (``decay_factors_source``), a threadgroup a
    chunk; or their gradient."""
    if not 1 <= n <= FACTOR_CHUNKS:
        raise ValueError(f"decay factors: {n} chunks a sequence, the kernels take 1 to {FACTOR_CHUNKS}")
    tokens = ((N, n * C), "float32")
    outs = (tokens,) if grad else (tokens, tokens, ((N, n + 1, n + 1), "float32"))
    template = (("C", C), ("NT", FACTOR_NT), ("E", -(-C // FACTOR_NT)), ("NMAX", FACTOR_CHUNKS))
    return Launch(decay_factors_source(dialect, grad), (("rt", (n,), "int32"),), outs, (N * n * FACTOR_NT, 1, 1),
                  (FACTOR_NT, 1, 1), template)


@lru_cache(maxsize=64)
def feature_mix_launch(dialect: str, N: int, M: int, K: int) -> Launch:
    """The backward's products over M chunk states of N sequences, K entries each (``feature_mix_source``): a
    threadgroup NT SB consecutive entries of one sequence, each block's part of F Xᵀ [N, blocks, M, M]."""
    lay = feature_mix_layout(dialect, M)
    if lay is None:
        raise ValueError(f"products over chunks: {M} chunk states pass {dialect}'s threadgroup memory")
    NB = -(-K // (lay["NT"] * lay["SB"]))
    full = ((N, M, K), "float32")
    return Launch(feature_mix_source(dialect), (("rt", (M, K, NB), "int32"),), (full, full, ((N, NB, M, M), "float32")),
                  (N * NB * lay["NT"], 1, 1), (lay["NT"], 1, 1), tuple(lay.items()))


@lru_cache(maxsize=64)
def feature_out_launch(dialect: str, N: int, C: int, D: int, V: int, seq: tuple = (1, 1), fragments: int = 1) -> Launch:
    """Z = φ(X) S of N chunks (``feature_out_source``): a threadgroup 16 NG TF tokens of a chunk (TF: ``fragments``,
    ``Tuning.feature_out_fragments``, where they fit); ``seq`` = (chunks, states) a sequence, where its states run
    past its chunks (chunk g reads state g // c * s + g % c)."""
    lay = feature_mma_layout(dialect, C, D, V, out_fragments=fragments)["out"]
    return _by_tokens(feature_out_source(dialect), _pair_tables(D) + (("ns", seq, "int32"),), (N, C, V), N, C, lay)


@lru_cache(maxsize=64)
def feature_jac_launch(dialect: str, N: int, C: int, D: int, V: int, seq: tuple = (1, 1),
                       rows: bool = False, groups: int = 8, min_blocks: int = 0) -> Launch:
    """dX through φ's rows of N chunks (``feature_jac_source``; ``rows``: by the rows of φ's pairs, where
    ``feature_mma_layout`` has a "jac_rows" layout): a threadgroup 16 NG tokens of a chunk (NG at most ``groups``,
    ``Tuning.feature_jac_groups``); ``seq`` as ``feature_out_launch``'s; ``min_blocks`` as ``Launch``'s."""
    lay = feature_mma_layout(dialect, C, D, V, groups)["jac_rows" if rows else "jac"]
    return _by_tokens(feature_jac_source(dialect, rows), (("ns", seq, "int32"),), (N, C, D), N, C, lay, min_blocks)


def features_on_kernels(t: Tuning, C: int, D: int, V: int) -> bool:
    """Whether a feature map's products over its rows run as the fragment kernels (``Tuning.feature_kernels``, with
    the fragment frames on: on CUDA their operands are TF32, which ``MLX_ENABLE_TF32=0`` declines)."""
    return (t.feature_kernels and t.mma_scan and t.dialect is not None
            and feature_mma_layout(t.dialect, C, D, V) is not None)


# -- MLX calls -------------------------------------------------------------------------------------
def model_chunks(x, n: int, ml: tuple | None = None):
    """An input in the model's layout [B, n C, heads, D] -> the chunks' [B, H, n, C, D], row-major (an MLX copy); with
    ``ml`` (``_model_consts``) a key input whose HK heads GQA shares among H, expanded. The copy is a flattening, not
    ``mx.contiguous``, which MLX cannot record for replay (``chunked.core.row_major``)."""
    import mlx.core as mx

    B, T, Hx, D = x.shape
    if ml is not None and ml[0] != Hx:
        x = mx.repeat(x, ml[0] // Hx, axis=2) if ml[3] else mx.tile(x, (1, 1, ml[0] // Hx, 1))
    x = x.reshape(B, n, T // n, x.shape[2], D).transpose(0, 3, 1, 2, 4)
    return x.reshape(-1).reshape(x.shape)


def _lead(x, tail: int) -> int:
    """The number of matrices in x: the product of its shape but the last ``tail`` axes."""
    return math.prod(x.shape[:-tail])


_recording: contextvars.ContextVar = contextvars.ContextVar("recgen_chunk_recording", default=None)


@contextlib.contextmanager
def recording():
    """Record chunk-kernel calls instead of launching them (``recgen emit --chunked``): yields the list that fills
    with (launch, ((shape, dtype name) of each user buffer)) in call order; each call returns zeros of its
    outputs' shapes, so the MLX algebra around it runs on and the next calls are reached."""
    calls: list = []
    token = _recording.set(calls)
    try:
        yield calls
    finally:
        _recording.reset(token)


def _call(t: Tuning, launch: Launch, user: list):
    calls = _recording.get()
    if calls is not None:
        import mlx.core as mx

        calls.append((launch, tuple((tuple(a.shape), dtype_name(a.dtype)) for a in user)))
        return [mx.zeros(shape, getattr(mx, dt)) for shape, dt in launch.outputs]
    return mlx_call(launch, get(t.dialect), user, [], t.debug, t.kernel_cache)


def replaying(t: Tuning) -> bool:
    """Whether recorded graphs replay now (``Tuning.replay_graphs``): not while kernel calls are recorded
    (``recording``: each call must be seen), nor in the debug mode (which prints each kernel as it is built)."""
    return t.replay_graphs and not t.debug and _recording.get() is None


def replayed(fn, name: str, t: Tuning):
    """``fn`` as a ``replay.Replay`` where the tuning replays graphs (``Tuning.replay_graphs``), else itself; it runs
    as Python where ``replaying`` says no."""
    if not t.replay_graphs:
        return fn
    return Replay(fn, name, lambda: replaying(t))


def piece(fwd, vjp, name: str, t: Tuning | None) -> Piece:
    """A ``pieces.Piece`` of ``fwd`` and ``vjp``, both ``replayed`` where the tuning replays graphs (``t`` None:
    never)."""
    if t is None:
        return Piece(fwd, vjp, name=name)
    return Piece(fwd, vjp, lambda f, n: replayed(f, n, t), name)


@dataclass(frozen=True)
class DecayPass:
    """What one pass of the decay geometry wrote (``key_decays``), None where it was not asked for: the per-token
    decays d, P and Q [..., C, F], the chunk's decay g [..., F], P one token earlier ``pe`` [..., C, F] and the
    scaled roles, in the order given."""

    d: object
    P: object
    Q: object
    g: object
    pe: object
    scaled: tuple

    def written(self) -> list:
        """The arrays written, in the kernel's output order (``decays_launch``)."""
        return [x for x in (self.d, self.P, self.Q, self.g, self.pe) if x is not None] + list(self.scaled)


def key_decays(l, t: Tuning, before: bool = False, scaled: tuple = (), pq: bool = True, d: bool = True,
               q: bool = True, st=None, ml: tuple | None = None) -> DecayPass:
    """The decay geometry of the log-decays l [..., C, F] (float32, F = 1 or K) in one pass (``chunk_decays.j2``):
    the chunk's decay g (P's last row) always; ``d``: D = e^l; ``pq``: P and Q from sums anchored at the chunk's start
    and end; ``before``: P_{t−1} (1 at t = 0), the decay a transition before the decay meets; ``scaled``:
    ((x, "P" | "Q" | "Pe"), ...), roles x [..., C, F] of any float type: and x ⊙ that decay for each, in float32 (the
    scans' u ⊙ Q, the readout's r ⊙ P: one pass, where a cast and a product were two per role). Leaving out what no
    reader takes saves its [..., C, F] write (and g is no strided copy of P's last row); ``q`` off: P without Q;
    ``st`` (a 16-bit mx dtype): the scaled roles written in it (rounded as their readers would round them).
    ``ml`` (``_model_consts``: (H, HK, NCH, GB)): l [B, NCH C, H, F] and the roles [B, NCH C, HK, F] in the model's
    layout, read so; the outputs then [B, H, NCH, C, F] (G [B, H, NCH, F])."""
    if ml is None:
        N, (C, F) = _lead(l, 2), l.shape[-2:]
        shape = l.shape
    else:
        (B, T, H, F), n = l.shape, ml[2]
        N, C, shape = B * H * n, T // n, (B, H, n, T // n, F)
    launch = decays_launch(t.dialect, N, C, F, before, tuple(w for _, w in scaled), pq, d, q,
                           None if st is None else dtype_name(st), ml)
    user = [l if ml else l.reshape(N, C, F)] + [x if ml else x.reshape(N, C, F) for x, _ in scaled]
    outs = [x.reshape(shape if x.ndim == 3 else (*shape[:-2], F)) for x in _call(t, launch, user)]
    take = lambda on: outs.pop(0) if on else None  # noqa: E731
    D, P, Q, g, pe = take(d), take(pq), take(pq and q), take(True), take(before)
    return DecayPass(D, P, Q, g, pe, tuple(outs))


def tril_inverse(L, t: Tuning):
    """(I − L)^{-1} for strictly lower L [..., C, C] (float32), by the generated kernel."""
    N, C = _lead(L, 2), L.shape[-1]
    (T,) = _call(t, inverse_launch(t.dialect, N, C), [L.reshape(N, C, C)])
    return T.reshape(L.shape)


def _scan_schedule(t: Tuning, BH: int, C: int, K: int, V: int, reverse: bool, mma: bool, has_a: bool,
                   has_products: bool) -> tuple[int, bool, bool]:
    """How a scan of BH (batch, head) pairs runs: (SIMD groups, ``pf``, ``hoist``). Twice the groups (one 16-row
    state block each) measured faster for the reverse scans and slower for the forward one on the H100 (docs/design.md):
    a choice per direction. A hoisted scan (at most ``scan_hoist_most`` threadgroups; ``scan_hoist`` and
    ``reverse_scan_hoist`` for scans with a product term, ``scan_hoist_e`` for those without) holds a chunk's
    operands in registers (214 a lane at eight groups: one threadgroup an SM), so it keeps the forward's count in
    reverse too. Loading A's and X's fragments early (``pf``, ``hoist``) needs one item of Y a group."""
    lay = scan_mma_layout(C, K, V, t.scan_bv, t.scan_nw) if mma else None
    wants = (t.reverse_scan_hoist if reverse else t.scan_hoist) if has_products else t.scan_hoist_e
    hoists = lay is not None and wants and BH * (V // lay["BV"]) <= t.scan_hoist_most
    nw = t.reverse_scan_nw if reverse and not hoists else t.scan_nw
    one_item = scan_prefetches(C, K, V, t.scan_bv, nw)
    return nw, mma and has_a and t.scan_prefetch and one_item, hoists and (not has_a or one_item)


def _ahead(t: Tuning, BH: int, V: int, wide_forward: bool) -> bool:
    """Whether the wide forward scan (with A) loads a step ahead (``ScanVariant.nx``): at most
    ``Tuning.scan_ahead_most`` threadgroups (BH·V/BV), too few for an SM to run two."""
    return wide_forward and BH * (V // t.scan_bv) <= t.scan_ahead_most


def scan_tuning(t: Tuning, BH: int, V: int) -> Tuning:
    """The tuning a scan of BH (batch, head) pairs and V value columns runs with: half the columns a threadgroup where
    the scan would otherwise have fewer than ``Tuning.scan_min_groups`` threadgroups (long prefill with few heads: the
    GPU is filled by column groups only, each sequential over the chunks)."""
    if t.scan_bv >= 16 and BH * -(-V // t.scan_bv) < t.scan_min_groups:
        return replace(t, scan_bv=t.scan_bv // 2)
    return t


def chunk_scan(S0, A, X, Bm, g, E, t: Tuning, reverse: bool, P=None, St=None, Bq=None, Aq=None, Pq=None, ml=None,
               st=None, x_model: bool = False):
    """carried_c = S,  Y_c = X_c + A_c S,  S ← g_c ⊙ S + B_cᵀ Y_c (+ E_c) over [..., n, ·, ·] operands (leading
    axes flattened to one (b, h) axis), in order or in reverse.
    S0 [.., K, V], A (None: Y = X) and Bm (None: no B term) [.., n, C, K], X [.., n, C, V], g [.., n, F] (F = 1 or K),
    Bq None or row scales of Bm [.., n, C, 1] (the B term is then (Bq ⊙ Bm)ᵀ Y: formed as read where the
    fragment frame runs, by MLX first otherwise),
    E None or [.., n, K, V]; P None or the factors (Pa [.., n, C, K], Pb [.., n, C, V]) of one more E term
    Paᵀ Pb (read as factors by the fragment frame, ``scan_fuses_products``; multiplied out by MLX first
    otherwise). ``Aq``, ``Pq``: None or row scales [.., n, C, 1] of A and of Pa, applied as read on the fragment
    frame (A and Pa may then be 16-bit), by MLX first otherwise.
    Returns (carried [.., n, K, V], Y [.., n, C, V], S_end [.., K, V]), float32 (carried and Y: ``st``), and with
    ``St`` [.., n, K, V] also dg = Σ_j carried ⊙ St [.., n, K] (in the kernel where it fuses products).
    ``ml`` = (H, HK, NCH, GB) (``_model_consts``): the row-scaled operands (A with Aq, Bm with Bq, Pa with Pq) are
    the model's key inputs [B, n C, HK, K] as they are, read so by the fragment frame (which must run). ``st`` (a
    16-bit mx dtype, ``Tuning.states_16bit``): carried and Y are written in it (the fragment frame must run).
    ``x_model`` (with ``ml``, A None): X is the model's value input [B, n C, H, V] as it is, read so where the A-free
    scan runs on the wide multiply-add (``ScanVariant.xm``), copied to the chunks' layout first otherwise; Y is X
    as given."""
    import mlx.core as mx

    lead = S0.shape[:-2]
    K, V = S0.shape[-2:]
    BH = _lead(S0, 2)
    t = scan_tuning(t, BH, V)
    n = g.shape[-2]
    C = X.shape[1] // n if x_model else X.shape[-2]
    if x_model and (ml is None or A is not None):
        raise ValueError("chunk_scan: X in the model's layout (x_model) is the A-free scan's, with ml")
    F = g.shape[-1]
    fuse = scan_fuses_products(t, C, K, V, Bm is not None)
    if ml is not None and not (fuse or (Bm is None and P is None and use_mma(t, C, K, V))):
        raise ValueError("chunk_scan: the model's layout (ml) needs the fragment frame fusing its products")
    if Bq is not None and not fuse:
        Bm, Bq = Bq * Bm, None
    if Aq is not None and not use_mma(t, C, K, V):
        A, Aq = Aq * A, None
    if Pq is not None and not fuse:
        P, Pq = (Pq * P[0], P[1]), None
    if P is not None and not fuse:
        Pe = P[0].swapaxes(-1, -2) @ P[1]
        E, P = (Pe if E is None else E + Pe), None
    dg_here = St is not None and fuse
    mma = P is not None or dg_here or Bq is not None or Aq is not None or st is not None or use_mma(t, C, K, V)
    nw, pf, hoist = _scan_schedule(t, BH, C, K, V, reverse, mma, A is not None, Bm is not None or P is not None)
    # the wide multiply-add (``Tuning.wide_fragments``): the hoisted scans whose product operands share the states'
    # 16-bit type, forward with B and Bq (GDN's; simple GLA's, A-free: each group copies its item of X as it would
    # Y, one item a group) or A-free without Bq (GLA's: u ⊙ Q given, a decay per key), or in reverse without Bq
    # (GDN's backward; simple GLA's, B-free)
    sixteen = [x for x in (A, Bm) if x is not None] + (list(P) if P is not None else [])
    w16 = (t.wide_fragments and bool(get(t.dialect).mma16) and hoist and st is not None
           and E is None and C % 16 == 0 and K % 16 == 0 and all(x.dtype == st for x in sixteen)
           and ((not reverse and Bm is not None and (Bq is not None or A is None) and P is None and Aq is None
                 and not dg_here
                 and (A is not None or scan_prefetches(C, K, V, t.scan_bv, nw)))
                or (reverse and A is not None and Bq is None and (Bm is not None or P is not None))))
    wl = w16 and t.scan_wide_loads and K % 32 == 0
    if not (Bq is not None or Aq is not None or Pq is not None or x_model and w16):
        ml = None  # nothing read in the model's layout: X (x_model) is copied below
    v = ScanVariant(a=A is not None, b=Bm is not None, e=E is not None, reverse=reverse, p=P is not None,
                    dg=dg_here, q=Bq is not None, aq=Aq is not None, pq=Pq is not None, pf=pf,
                    hoist=hoist, vec=not mma and V % 4 == 0, mma=mma, ml=ml is not None, s16=st is not None, w16=w16,
                    wl=wl, vc=wl and t.scan_wide_columns and scan_value_quads(C, K, V, t.scan_bv, nw),
                    xm=x_model and w16, nx=_ahead(t, BH, V, w16 and not reverse and A is not None and not pf))
    flat = lambda x, *tail: x.reshape(BH, *tail)  # noqa: E731
    # a row-scaled operand in the model's layout goes as it is; X too where the variant reads it so
    rows = lambda x, scaled: x if scaled and ml is not None else flat(x, n, C, K)  # noqa: E731
    xs = X if v.xm else flat(model_chunks(X, n) if x_model else X, n, C, V)
    user = ([flat(S0, K, V)] + ([rows(A, Aq is not None)] if A is not None else [])
            + ([flat(Aq, n, C)] if Aq is not None else [])
            + [xs] + ([rows(Bm, Bq is not None)] if Bm is not None else [])
            + ([flat(Bq, n, C)] if Bq is not None else []) + [flat(g, n, F)]
            + ([flat(E, n, K, V)] if E is not None else [])
            + ([rows(P[0], Pq is not None), flat(P[1], n, C, V)] if P is not None else [])
            + ([flat(Pq, n, C)] if Pq is not None else []) + ([flat(St, n, K, V)] if dg_here else []))
    outs = _call(t, scan_launch(t.dialect, v, BH, n, C, K, V, F, t.scan_bv, nw, ml,
                                None if st is None else dtype_name(st)), user)
    carried, Y, S_end = outs[0].reshape(*lead, n, K, V), outs[1], outs[2].reshape(*lead, K, V)
    Y = Y.reshape(*lead, n, C, V) if A is not None else X
    if St is None:
        return carried, Y, S_end
    # 16-bit states (``st``): the sum over them in float32, as the kernel's
    dg = outs[3].reshape(*lead, n, -1, K).sum(-2) if dg_here else (carried.astype(mx.float32) * St).sum(-1)
    return carried, Y, S_end, dg


def chunk_out(r, u, Z, states, l, t: Tuning, out=None, rs=None, uf=None, ml=None, z_model: bool = False):
    """y = (r ⊙ P) S_c + M_ru Z per chunk for a scalar decay (P_t = e^{G_t}, M_ru[t, s] = (r_t · u_s) Γ(t, s),
    s ≤ t, 0 above), by the fragment kernel: r, u [.., n, C, K], Z [.., n, C, V], states [.., n, K, V], l
    (log-decays) [.., n, C, 1]. Returns (y [.., n, C, V] float32, M_ru [.., n, C, C]), or with ``out`` (an
    mx dtype; r then [B, H, n, C, K]) y in the model's layout [B, n C, H, V] and that type. With ``rs`` (a
    float) the readout role is rs·r, scaled by the kernel (y and M_ru are linear in r). With ``uf`` [.., n, C, 1]
    (float32) ``u`` is a key x and the role uf ⊙ x, formed as read; with ``ml`` (``chunk_scan``'s, and ``out``) r and x
    are the model's key inputs [B, n C, HK, K] as they are. 16-bit states (``Tuning.states_16bit``) give M_ru in
    their type. ``z_model`` (with ``ml``, no ``uf``): Z is the model's value input [B, n C, H, V] too, read so by the
    staged readout; where it does not run, r, u and Z are copied to the chunks' layout first."""
    import mlx.core as mx

    n, (K, V) = states.shape[-3], states.shape[-2:]
    C = l.shape[-2]
    N = _lead(states, 2)
    yt = None if out is None else (states.shape[-4], n, dtype_name(out))
    launch = None
    if t.async_staging:
        types = tuple(dtype_name(x.dtype) for x in (r, u, Z, states))
        launch = out_async_launch(t.dialect, N, C, K, V, types, yt, t.out_bv, uf=uf is not None, ml=ml,
                                  wide=t.wide_fragments, zm=z_model)
    if launch is None and z_model:  # only the staged readout reads Z so
        r, u, Z, ml = model_chunks(r, n, ml), model_chunks(u, n, ml), model_chunks(Z, n), None
    keys = [r, u] if ml is not None else [r.reshape(N, C, K), u.reshape(N, C, K)]
    if launch is None:
        st = None if states.dtype == mx.float32 else dtype_name(states.dtype)
        launch = out_mma_launch(t.dialect, N, C, K, V, yt, t.out_bv, uf=uf is not None, ml=ml, l2=t.l2_prefetch, st=st)
    y, M = _call(t, launch,
                    keys + ([] if uf is None else [uf.reshape(N, C)])
                    + [Z if z_model and ml is not None else Z.reshape(N, C, V), states.reshape(N, K, V),
                       l.reshape(N, C), mx.array([1.0 if rs is None else rs], dtype=mx.float32)])
    return (y if out is not None else y.reshape(*states.shape[:-2], C, V)), M.reshape(*states.shape[:-2], C, C)


def chunk_ut(bt, u, w, l, t: Tuning, uf=None, bf: float | None = None, out=None, ml=None, st=None):
    """The delta rule's UT transform per chunk for a scalar decay, by the fragment kernel: A[t, s] =
    (b̃_t · u_s) Γ(t, s) for s < t, Tm = (I − A)^{-1}, U = Tm w, W = Tm (b̃ ⊙ P). bt, u [.., n, C, K], w
    [.., n, C, V], l (log-decays) [.., n, C, 1]. Returns (Tm [.., n, C, C], U [.., n, C, V], W [.., n, C, K]).
    Factor reads: with ``uf`` [.., n, C, 1] (float32) and ``bf`` (a float), ``bt`` is None and ``u`` a key x; the
    roles are uf ⊙ x and bf·x, formed as read; ``out`` (a 16-bit mx dtype) then writes U and W in it, and ``st``
    (``Tuning.states_16bit``, a 16-bit mx dtype, with ``out``) Tm in it. With ``ml``
    (``chunk_scan``'s) x and w are the model's inputs [B, n C, HK, K] and [B, n C, H, V] as they are."""
    import mlx.core as mx

    C, K, V = l.shape[-2], u.shape[-1], w.shape[-1]
    N, lead = _lead(l, 2), l.shape[:-1]
    x = u if ml is not None else u.reshape(N, C, K)
    roles = ([bt.reshape(N, C, K), x] if uf is None else [x, uf.reshape(N, C), mx.array([bf], dtype=mx.float32)])
    ot, st = (None if x is None else dtype_name(x) for x in (out, st))
    launch = None
    if t.async_staging:
        types = tuple(dtype_name(a.dtype) for a in ((u, w) if uf is not None else (u, w, bt)))
        launch = ut_async_launch(t.dialect, N, C, K, V, types, t.ut_bw, uf=uf is not None, ot=ot, ml=ml, st=st,
                                 wide=t.wide_fragments)
    if launch is None:
        launch = ut_mma_launch(t.dialect, N, C, K, V, t.ut_bw, uf=uf is not None, ot=ot, ml=ml, l2=t.l2_prefetch,
                               st=st)
    Tm, U, W = _call(t, launch,
                     roles + [w if ml is not None else w.reshape(N, C, V), l.reshape(N, C)])
    return Tm.reshape(*lead, C), U.reshape(*lead, V), W.reshape(*lead, K)


def chunk_out_key(r, M, Z, states, P, t: Tuning, out=None, rs=None, ml: tuple | None = None):
    """``chunk_out`` for a key-vector decay: y = (r ⊙ P) S_c + M Z per chunk with M [.., n, C, C] formed (by the pair
    kernels, of rs·r where ``rs``) and P [.., n, C, K] per key element (float32). Returns y [.., n, C, V] float32, or
    with ``out`` y in the model's layout [B, n C, H, V] and that type. ``ml`` (``_model_consts``, with ``out``): r and
    Z are the model's inputs [B, n C, HK, K] and [B, n C, H, V] as they are, read so by the staged readout (copied to
    the chunks' layout first where it does not run)."""
    if ml is not None and out is None:
        raise ValueError("chunk_out_key: the model's layout (ml) writes y so (out)")
    return _out_key(r, M, Z, states, (P,), t, out, rs, ml=ml)


def chunk_out_rank1(rP, Mra, X, states, Mru, w, t: Tuning, out=None, rs=None):
    """The general rank-1 core's readout y = rs ((r ⊙ P) S_c + M_ra X + M_ru w) per chunk in one kernel: rP [.., n, C,
    K] (r scaled by its decays), the pairs [.., n, C, C] of r itself, X [.., n, C, V] (float32), w [.., n, C, V] in
    any type. Returns y [.., n, C, V] float32, or with ``out`` y in the model's layout [B, n C, H, V] and that
    type."""
    return _out_key(rP, Mra, X, states, (Mru, w), t, out, rs, m2=True)


def _out_key(r, M, Z, states, extra: tuple, t: Tuning, out, rs, m2: bool = False, ml: tuple | None = None):
    """The key readout frame, shared by ``chunk_out_key`` (``extra`` = (P,)) and ``chunk_out_rank1`` (``m2``: (M2,
    Z2)); every operand but the states is [.., n, C, F], but with ``ml`` (``chunk_out_key``'s) r and Z."""
    import mlx.core as mx

    (n, C), K, V = extra[0].shape[-3:-1], r.shape[-1], Z.shape[-1]
    N = _lead(extra[0], 2)
    yt = None if out is None else (extra[0].shape[-4], n, dtype_name(out))
    flat = lambda x: x.reshape(N, C, x.shape[-1])  # noqa: E731
    launch = None
    if t.async_staging and not m2:  # staged two deep (``chunk_out_async.j2``), else the synchronous frame
        types = tuple(dtype_name(x.dtype) for x in (r, extra[0], Z, states))
        launch = out_async_launch(t.dialect, N, C, K, V, types, yt, t.out_bv, ml=ml, zm=ml is not None, key=True)
    if launch is None and ml is not None:  # only the staged readout reads the model's layout
        r, Z, ml = model_chunks(r, n, ml), model_chunks(Z, n), None
    (y,) = _call(t, launch or out_mma_launch(t.dialect, N, C, K, V, yt, t.out_bv, key=True, m2=m2),
                 [r if ml else flat(r), flat(M), Z if ml else flat(Z), states.reshape(N, K, V),
                  *(flat(x) for x in extra), mx.array([1.0 if rs is None else rs], dtype=mx.float32)])
    return y if out is not None else y.reshape(*Z.shape)


def chunk_ut_key(A, w, bt, P, t: Tuning, B=None, bf: float | None = None):
    """``chunk_ut`` for a key-vector decay: A [.., n, C, C] formed (strictly lower, by the pair kernels), P [.., n, C,
    K] per key element. Returns (Tm = (I − A)^{-1}, U = Tm w, W = Tm (b̃ ⊙ P)); with B [.., n, C, C] (strictly
    lower) U = Tm (B w), formed in the kernel as (Tm B) w. With ``bf`` (a float: factor reads) ``bt`` is a key x and
    b̃ = bf·x, formed as read."""
    import mlx.core as mx

    (C, K), V = bt.shape[-2:], w.shape[-1]
    N = _lead(bt, 2)
    given = [A.reshape(N, C, C)] + ([] if B is None else [B.reshape(N, C, C)])
    Tm, U, W = _call(t, ut_mma_launch(t.dialect, N, C, K, V, t.ut_bw, key=True, tb=B is not None, uf=bf is not None),
                     given + [w.reshape(N, C, V), bt.reshape(N, C, K), P.reshape(N, C, K)]
                     + ([] if bf is None else [mx.array([bf], dtype=mx.float32)]))
    return Tm.reshape(A.shape), U.reshape(w.shape), W.reshape(bt.shape)


def chunk_bwd(dMA, dMR, r, u, bt, DUQ, DRP, DR, l, DG, t: Tuning, rs=None, uf=None, bf: float | None = None, ml=None,
              prods=None, scores=None):
    """A scalar decay's backward after the reverse scan, per chunk, by the fragment kernel (``chunk_bwd_mma.j2``):
    from the pair cotangents dMR = dy Zᵀ and (delta rule) dMA = Δ Zᵀ [.., n, C, C], the roles r, u (b̃) [.., n, C, K]
    as the core got them (16-bit ones read so), DUQ = d(u ⊙ Q), DRP = d(r ⊙ P) (and DR = d(b̃ ⊙ P) before the pair
    term) [.., n, C, K], the log-decays l [.., n, C, 1] and DG = Σ_i dg [.., n] (the scan's decay gradient).
    ``rs``: the readout role is rs·r. Returns (dr, du, db̃ or None, dl [.., n, C, 1]); dr, du, db̃ in their roles'
    types. Factor reads (``uf`` [.., n, C, 1] float32 and ``bf`` a float, ``bt`` None, ``u`` a key x: u = uf ⊙ x,
    b̃ = bf·x): returns (dr, dx, duf [.., n, C, 1] float32, dl). With ``ml`` (``chunk_scan``'s) r and x are the model's
    key inputs [B, n C, HK, K] as they are, and dr, dx come in the model's layout per value head [B, n C, H, K].
    ``prods`` = (Z, dy, Δ or None, S, dS_next) (Z, dy, Δ [.., n, C, V], the states [.., n, K, V];
    ``products_in_pass``): the kernel forms DUQ, DRP (DR) itself from them, and those arguments are None.
    ``scores`` = (Z, dy, Δ or None) as ``prods``' (``scores_in_pass``): the kernel forms dMR (dMA) from them, and
    those arguments are None."""
    import mlx.core as mx

    C, K, N = l.shape[-2], r.shape[-1], _lead(l, 2)
    delta = bt is not None or uf is not None
    flat = lambda x: x.reshape(N, C, K)  # noqa: E731
    roles = (r, u, bt) if bt is not None else (r, u)
    types = tuple(dtype_name(x.dtype) for x in roles)
    factors = [] if uf is None else [uf.reshape(N, C), mx.array([bf], dtype=mx.float32)]
    rows = [] if scores is None else [x.reshape(N, C, -1) for x in scores if x is not None]
    if rows and prods is not None and len({x.dtype for x in rows + list(prods[3:])}) > 1:
        raise ValueError("chunk_bwd: the pass's wide products take the states in the type of Z, dy and Δ")
    user = ((rows if scores is not None else ([dMA.reshape(N, C, C)] if delta else []) + [dMR.reshape(N, C, C)])
            + [x if ml is not None else flat(x) for x in roles] + factors
            + (_products(prods, N, C, K)[len(rows):] if prods is not None
               else [flat(DUQ), flat(DRP)] + ([flat(DR)] if delta else []))
            + [l.reshape(N, C), DG.reshape(N), mx.array([1.0 if rs is None else rs], dtype=mx.float32)])
    sc = None if scores is None else (scores[0].shape[-1], dtype_name(scores[0].dtype))
    outs = _call(t, bwd_mma_launch(t.dialect, N, C, K, types, t.bwd_bw, uf=uf is not None, ml=ml,
                                   min_blocks=t.bwd_min_blocks, V=0 if prods is None else prods[0].shape[-1],
                                   scores=sc, wide_loads=t.bwd_wide_loads and sc is not None and sc[0] % 32 == 0),
                user)
    dr, du = (outs[0], outs[1]) if ml is not None else (outs[0].reshape(r.shape), outs[1].reshape(u.shape))
    third = outs[2].reshape((bt if uf is None else uf).shape) if delta else None  # db̃, or duf with factor reads
    return dr, du, third, outs[-1].reshape(l.shape)


def scores_in_pass(t: Tuning, rows: tuple) -> bool:
    """Whether the backward's fragment pass forms its pair cotangents dy Zᵀ (Δ Zᵀ) itself (``Tuning.bwd_scores``):
    ``rows`` = (Z, dy, Δ or None) [.., C, V] (and S_c, dS_next [.., K, V] where it forms its products too) share one
    16-bit type, V a multiple of 16, and the dialect has the wide multiply-add."""
    given = [x for x in rows if x is not None]
    types = tuple(dtype_name(x.dtype) for x in given)
    return given[0].shape[-1] % 16 == 0 and _wide_types(t.dialect, t.bwd_scores, types)


def products_in_pass(t: Tuning, C: int, K: int, V: int, delta: bool, wide: bool = False) -> bool:
    """Whether the backward's fragment pass forms its products over V values itself (``Tuning.bwd_products``): on the
    wide multiply-add with its pair cotangents (``wide``: ``scores_in_pass`` of every operand), else where
    ``bwd_products_layout`` has a layout for their staging."""
    return t.bwd_products and (wide or bwd_products_layout(t.dialect, C, K, delta, V, t.bwd_bw) is not None)


def _products(prods, N: int, C: int, K: int) -> list:
    """``chunk_bwd``'s ``prods`` as the kernel reads them: Z, dy (Δ) [N, C, V], S, dS_next [N, K, V]."""
    Z, dy, Delta, S, dSn = prods
    V = Z.shape[-1]
    return [x.reshape(N, C, V) for x in (Z, dy) + ((Delta,) if Delta is not None else ())] + [
        x.reshape(N, K, V) for x in (S, dSn)]


def chunk_bwd_key(r, u, bt, l, dRX, dUX, dBX, DRP, DUQ, DR, dg, t: Tuning, rs=None, uf=None, bf: float | None = None,
                  ml: tuple | None = None):
    """A key-vector decay's backward tail after the pair gradients, by the generated kernel (``chunk_bwd_key.j2``):
    the roles r, u (b̃) [.., n, C, K] as the core got them, the log-decays l [.., n, C, K], the pair gradients dRX,
    dUX (dBX) and the products DRP = d(r ⊙ P), DUQ = d(u ⊙ Q) (DR = d(b̃ ⊙ P) before its pair term) [.., n, C, K],
    the scan's decay gradient dg [.., n, K]. ``rs``: the readout role is rs·r (dRX then of rs·r). Returns (dr, du,
    db̃ or None, dl [.., n, C, K]); dr, du, db̃ in their roles' types, dl in l's (``_key_tail``). Factor reads (``uf``
    [.., n, C, 1] float32, ``bf`` a float, ``bt`` None, ``u`` a key x: u = uf ⊙ x, b̃ = bf·x; dUX and dBX of x as the
    second and first operand of the pairs, which the caller scaled by uf and bf): returns (dr, dx, this pass's part
    of duf [.., n, C, 1], dl). ``ml`` (``_model_consts``; no delta rule, no factor reads): r and u the model's key
    inputs [B, T, HK, K] and l the log-decays [B, T, H, K] as they are; dr, du and dl returned per value head [B, T,
    H, K] (the caller sums dr and du over GQA's groups)."""
    if ml is not None:
        if bt is not None or uf is not None:
            raise ValueError("chunk_bwd_key: the model's layout (ml) is the plain form's (no b̃, no factor reads)")
        dr, du, dl = _key_tail((r, u), l, (dRX, dUX, DRP, DUQ), dg, t, rs, ml=ml)
        return dr, du, None, dl
    if uf is not None:
        dr, dx, dfp, dl = _key_tail((r, u), l, (dRX, dUX, dBX, DRP, DUQ, DR), dg, t, rs, factors=(uf, bf))
        return dr, dx, dfp.sum(-2).reshape(uf.shape), dl
    delta = bt is not None
    roles = (r, u, bt) if delta else (r, u)
    grads = (dRX, dUX, dBX, DRP, DUQ, DR) if delta else (dRX, dUX, DRP, DUQ)
    outs = _key_tail(roles, l, grads, dg, t, rs)
    return outs[0], outs[1], (outs[2] if delta else None), outs[-1]


def _key_tail(roles, l, grads, dg, t: Tuning, rs=None, before: bool | None = None, factors: tuple | None = None,
              ml: tuple | None = None):
    """The key-decay backward tail kernel on flattened chunks: the roles, the log-decays, the gradients in the
    kernel's input order, dg, the readout scale ``rs``; ``before`` selects the rank-1 form (``bwd_key_launch``);
    ``factors`` = (uf, bf) the factor-read form (roles r and the key x). Returns the roles' gradients in their shapes
    and types (with ``factors`` then the factor's parts per group of columns [.., n, NG, C]), then dl in l's type
    (float32 with ``Tuning.bwd_key_running``): every caller hands it back as l's gradient, which a cast after would
    round the same way. ``ml``: the roles and l in the model's layout, the gradients [B, T, H, K] per value head
    (``chunk_bwd_key``)."""
    import mlx.core as mx

    (C, K), N = grads[0].shape[-2:], _lead(grads[0], 2)
    types = tuple(dtype_name(x.dtype) for x in roles)
    flat = (lambda x: x) if ml is not None else (lambda x: x.reshape(N, C, K))  # the model's layout: as they are
    given = [flat(x) for x in roles]
    if factors is not None:
        given += [factors[0].reshape(N, C), mx.array([factors[1]], dtype=mx.float32)]
    user = (given + [flat(l)] + [x.reshape(N, C, K) for x in grads]
            + [dg.reshape(N, K), mx.array([1.0 if rs is None else rs], dtype=mx.float32)])
    running = t.bwd_key_running and ml is None  # the model-layout tail has no running form
    outs = _call(t, bwd_key_launch(t.dialect, N, C, K, types, before, uf=factors is not None, running=running,
                                   ml=ml, batch=t.bwd_key_batch,
                                   dl_type="float32" if running else dtype_name(l.dtype)), user)
    if ml is not None:
        return tuple(o.reshape(*l.shape[:2], ml[0], K) for o in outs)
    shapes = [x.shape for x in roles] + ([(*l.shape[:-2], -1, C)] if factors is not None else []) + [l.shape]
    return tuple(o.reshape(shape) for o, shape in zip(outs, shapes))


def chunk_bwd_rank1(r, u, a, b, l, dRX, dUX, dAX, dBX, DRP, DUQ, DAQ, DBP, dg, t: Tuning, before: bool):
    """The general rank-1 core's backward tail (``chunked.rank1``) for a key-vector decay, by the generated kernel
    (``chunk_bwd_key.j2``, ``rank1``): the roles r, u, a, b and the log-decays l [.., n, C, K]; the pairs' gradients
    dRX, dUX, dAX and dBX (of b as the pairs took it: one token earlier where ``before``); the products DRP = d(r ⊙ P),
    DUQ = d(u ⊙ Q), DAQ = d(a ⊙ Q), DBP = d(b ⊙ P') [.., n, C, K] (P' = P, or P one token earlier where ``before``);
    the scan's decay gradient dg [.., n, K]. Returns (dr, du, da, db, dl [.., n, C, K]), the roles' gradients in
    their types."""
    return _key_tail((r, u, a, b), l, (dRX, dUX, dAX, dBX, DRP, DUQ, DAQ, DBP), dg, t, before=before)


def _pair_call(t: Tuning, strict: bool, operands: tuple, dk, cots: tuple = (), dual: bool = False,
               quad: bool = False, scale: float | None = None, ml: tuple | None = None, ld: bool = False) -> tuple:
    """The pair kernels (``pair_launch``) on flattened chunks: the cotangents [.., C, C] (the gradients' kernels) and
    the operands [.., C, K] in the kernel's input order, the decays dk; ``scale``: the first operand read times it.
    Returns the pairs [.., C, C], or the gradients [.., C, K], shaped as the first operand's chunks. ``ml``
    (``pair_reads_model``): the operands in the model's layout [B, T, HK, K] and dk the log-decays [B, T, H, K], the
    pairs [B, H, n, C, C]; with the cotangents (``pair_grad_reads_model``) dk the decays in the chunks' layout [B, H,
    n, C, K], or with ``ld`` (the gradients reading log-decays) the log-decays [B, T, H, K], the gradients [B, H, n,
    C, K] (per value head)."""
    import mlx.core as mx

    model_dk = ml is not None and (ld or not cots)  # dk: the log-decays [B, T, H, K]
    if model_dk:
        (B, T, H, K), n = dk.shape, ml[2]
        N, C = B * H * n, T // n
    else:  # dk in the chunks' layout
        N, (C, K) = _lead(dk, 2), dk.shape[-2:]
    whole = not cots and pairs_whole(t, C, K, dual, quad)
    halves = whole and t.pair_halves and pair_whole_supported(t.dialect, C, K, dual, quad, True)
    types = tuple(dtype_name(a.dtype) for a in operands)
    sizes = tuple(_itemsize(d) for d in types)
    ahead = (t.pair_grad_async and pair_grad_async_supported(t.dialect, C, K, dual, quad, sizes) if cots
             else whole and ml is None and t.pair_whole_async
             and pair_whole_supported(t.dialect, C, K, dual, quad, halves, sizes))
    launch = pair_launch(t.dialect, N, C, K, strict, grad=bool(cots), dual=dual,
                         mma=pairs_on_fragments(t, C, K, dual, quad), quad=quad,
                         fold=not whole and t.pair_fold and pair_folds(t.dialect, C, K, dual, quad),
                         scaled=scale is not None, whole=whole, halves=halves, types=types if ahead else (), ml=ml,
                         ld=ld, dk_type=dtype_name(dk.dtype))
    outs = _call(t, launch, [m.reshape(N, C, C) for m in cots]
                 + [a.reshape(N, C, K) if ml is None else a for a in operands]
                 + [dk if model_dk else dk.reshape(N, C, K)]
                 + ([] if scale is None else [mx.array([scale], mx.float32)]))
    if ml is not None:  # the pairs, or the gradients per value head, in the chunks' layout [B, H, n, C, ..]
        return tuple(o.reshape(-1, ml[0], ml[2], C, K if cots else C) for o in outs)
    X = operands[0]
    shape = X.shape if cots else (*X.shape[:-1], C)
    return tuple(o.reshape(shape) for o in outs)


def pair(X, Y, dk, strict: bool, t: Tuning, scale: float | None = None, ml: tuple | None = None):
    """M [.., C, C] of the key-vector decay pair (see chunk_pair.j2) from X, Y, per-token decays dk [.., C, K];
    ``scale``: of scale·X; ``ml`` (``pair_reads_model``): X and Y the model's key inputs [B, T, HK, K] as they are,
    dk the log-decays [B, T, H, K] (any float type), each decay formed as read."""
    return _pair_call(t, strict, (X, Y), dk, scale=scale, ml=ml)[0]


def pair_reads_model(t: Tuning, C: int, K: int) -> bool:
    """Whether the single forward pair reads its operands in the model's layout (``pair``'s ``ml``): the whole-chunk
    form reading its buffers (not copying its slabs ahead)."""
    return pairs_whole(t, C, K, False, False) and not t.pair_whole_async


def pair_grad(dM, X, Y, dk, strict: bool, t: Tuning, scale: float | None = None, ml: tuple | None = None,
              ld: bool = False):
    """(dX, dY) [.., C, K] for the cotangent dM [.., C, C] of ``pair`` (``scale``: of scale·X, dX that of scale·X);
    ``ml`` (``pair_grad_reads_model``): X and Y the model's key inputs [B, T, HK, K] as they are, dX and dY per value
    head in the chunks' layout [B, H, n, C, K]; ``ld``: dk the log-decays (with ``ml`` [B, T, H, K] as they are),
    each decay formed as read (``Tuning.pair_grad_logdecays``), where it was D = e^l in the chunks' layout."""
    return _pair_call(t, strict, (X, Y), dk, (dM,), scale=scale, ml=ml, ld=ld)


def pair_grad_reads_model(t: Tuning, C: int, K: int, types: tuple) -> bool:
    """Whether the single pair's gradient can read its operands (dtype names ``types``) in the model's layout: it
    copies their raw rows ahead (``Tuning.pair_grad_async``, where they fit)."""
    return t.pair_grad_async and pair_grad_async_supported(t.dialect, C, K, False, False,
                                                           tuple(_itemsize(d) for d in types))


def pair_dual(X, X2, Y, dk, t: Tuning, strict: bool = True):
    """(M of X for s < t (s <= t unless ``strict``), M2 of X2 for s <= t) in one pass over Y and the decays (the delta
    rule's A and M_ru)."""
    return _pair_call(t, strict, (X, X2, Y), dk, dual=True)


def pair_dual_grad(dM, dM2, X, X2, Y, dk, t: Tuning, strict: bool = True):
    """(dX, dX2, dY) for the cotangents of ``pair_dual`` (dY of both pairs, summed)."""
    return _pair_call(t, strict, (X, X2, Y), dk, (dM, dM2), dual=True)


def pair_quad(X, X2, Y, Yb, dk, t: Tuning, strict: bool = True):
    """(M of X, M2 of X2, Mb of X, M2b of X2) [.., C, C]: ``pair_dual``'s two pairs with Y and with Yb in one pass
    over the decays and X, X2 (the X pairs strict where ``strict``)."""
    return _pair_call(t, strict, (X, X2, Y, Yb), dk, dual=True, quad=True)


def pair_quad_grad(dM, dM2, dMb, dM2b, X, X2, Y, Yb, dk, t: Tuning, strict: bool = True):
    """(dX, dX2, dY, dYb) for the cotangents of ``pair_quad`` (each summed over the pairs its operand is in)."""
    return _pair_call(t, strict, (X, X2, Y, Yb), dk, (dM, dM2, dMb, dM2b), dual=True, quad=True)


def feature_states(X, Y, t: Tuning, tail=None):
    """φ(X)ᵀ Y for each chunk: X [..., n, C, D], Y [..., n, C, V] (float32) -> [..., n, F, V], φ formed as read;
    with ``tail`` [..., F, V] (the same leading axes): [..., n + 1, F, V], each sequence's chunks then its tail."""
    N, (C, D), V = _lead(X, 2), X.shape[-2:], Y.shape[-1]
    user = [X.reshape(N, C, D), Y.reshape(N, C, V)]
    if tail is None:
        (dS,) = _call(t, feature_states_launch(t.dialect, N, C, D, V, 0, t.feature_states_fragments), user)
        return dS.reshape(*X.shape[:-2], dS.shape[-2], V)
    if X.ndim < 3 or tail.shape[:-2] != X.shape[:-3] or tail.shape[-1] != V:
        raise ValueError(f"feature_states: a tail {tail.shape} for chunks {X.shape} and values {Y.shape}")
    seqs = _lead(tail, 2)
    (dS,) = _call(t, feature_states_launch(t.dialect, N, C, D, V, seqs, t.feature_states_fragments),
                  user + [tail.reshape(seqs, -1, V)])
    return dS.reshape(*X.shape[:-3], X.shape[-3] + 1, dS.shape[-2], V)


def _states_per_sequence(X, S) -> tuple[int, int]:
    """(chunks, states) a sequence of X [..., n, C, D] and S [..., m, F, V] (m >= n, the same leading axes): a
    sequence's chunks read the first n of its m states in place, so a slice of them is never copied."""
    if X.ndim < 3 or X.shape[:-3] != S.shape[:-3] or S.shape[-3] < X.shape[-3]:
        raise ValueError(f"feature kernels: states {S.shape} do not cover the chunks {X.shape}")
    return X.shape[-3], S.shape[-3]


def feature_out(X, S, t: Tuning):
    """φ(X) S for each chunk: X [..., n, C, D], S [..., m, F, V] (float32, m >= n: a chunk reads its sequence's
    state of its index) -> [..., n, C, V], φ formed as read."""
    N, (C, D), (F, V) = _lead(X, 2), X.shape[-2:], S.shape[-2:]
    seq = _states_per_sequence(X, S)
    (Z,) = _call(t, feature_out_launch(t.dialect, N, C, D, V, seq, t.feature_out_fragments),
                 [X.reshape(N, C, D), S.reshape(-1, F, V)])
    return Z.reshape(*X.shape[:-2], C, V)


def feature_jac(X, S, Y, t: Tuning):
    """The gradient dX of Σ_t Σ_r (S_r · Y_t) φ_r(x_t) for each chunk: X [..., n, C, D], S [..., m, F, V] (m >= n,
    as ``feature_out``'s), Y [..., n, C, V] (float32) -> [..., n, C, D], no [C, F] cotangent formed."""
    N, (C, D), (F, V) = _lead(X, 2), X.shape[-2:], S.shape[-2:]
    seq = _states_per_sequence(X, S)
    by_rows = t.feature_jac_rows and feature_mma_layout(t.dialect, C, D, V)["jac_rows"] is not None
    (dX,) = _call(t, feature_jac_launch(t.dialect, N, C, D, V, seq, by_rows, t.feature_jac_groups,
                                        t.feature_jac_min_blocks),
                  [X.reshape(N, C, D), S.reshape(-1, F, V), Y.reshape(N, C, V)])
    return dX.reshape(X.shape)


def mixes(t: Tuning, M: int) -> bool:
    """Whether the backward's products over M chunk states run on the generated kernel (``Tuning.feature_mix``,
    with the chunk kernels, a layout for M)."""
    return t.chunk_kernels and t.feature_mix and t.dialect is not None and feature_mix_layout(t.dialect, M) is not None


def feature_mix_grad(LL, X, F, t: Tuning):
    """(LL X, LLᵀ F, F Xᵀ) of LL [..., M, M] and X, F [..., M, ...] (float32, the same leading axes as LL, any
    trailing ones: K entries a state) by one kernel reading X and F once; F Xᵀ [..., M, M] from each block's part,
    summed in order."""
    M, N = LL.shape[-1], _lead(LL, 2)
    if X.shape != F.shape or X.shape[:LL.ndim - 1] != LL.shape[:-1]:
        raise ValueError(f"feature_mix_grad: states {X.shape} and cotangents {F.shape} for decays {LL.shape}")
    K = math.prod(X.shape[LL.ndim - 1:])
    Sh, dX, part = _call(t, feature_mix_launch(t.dialect, N, M, K),
                         [LL.reshape(N, M, M), X.reshape(N, M, K), F.reshape(N, M, K)])
    return Sh.reshape(X.shape), dX.reshape(X.shape), part.sum(1).reshape(LL.shape)


def factors_on_kernels(t: Tuning, n: int) -> bool:
    """Whether a scalar decay's factors over n chunks run on the generated kernels (``Tuning.decay_factor_kernels``
    with the chunk kernels, n within their bound)."""
    return t.chunk_kernels and t.decay_factor_kernels and t.dialect is not None and 1 <= n <= FACTOR_CHUNKS


@lru_cache(maxsize=16)
def decay_factors_fn(t: Tuning):
    """l [..., n, C] (log-decays, any float type) -> (to_t [..., n, C], to_end [..., n, C], LL [..., n + 1, n + 1])
    in float32 by the generated kernel (``decay_factors_launch``), with its VJP by the gradient kernel: the same
    numbers as ``recgen.chunked.features.decay_factors`` in two launches where MLX ops took some 35."""
    import mlx.core as mx

    def flat(l):
        n, C = l.shape[-2:]
        return _lead(l, 2), n, C, l.reshape(-1, n * C)

    def forward(l):
        N, n, C, lf = flat(l)
        to_t, to_end, LL = _call(t, decay_factors_launch(t.dialect, N, n, C), [lf])
        return to_t.reshape(l.shape), to_end.reshape(l.shape), LL.reshape(*l.shape[:-2], n + 1, n + 1)

    def backward(l, to_t, to_end, LL, d_t, d_end, dLL):
        N, n, C, _ = flat(l)
        (dl,) = _call(t, decay_factors_launch(t.dialect, N, n, C, grad=True),
                      [to_t.reshape(N, -1), to_end.reshape(N, -1), LL.reshape(N, n + 1, n + 1),
                       d_t.reshape(N, -1).astype(mx.float32), d_end.reshape(N, -1).astype(mx.float32),
                       dLL.reshape(N, n + 1, n + 1).astype(mx.float32)])
        return (dl.reshape(l.shape).astype(l.dtype),)

    return piece(forward, lambda args, outs, cots: backward(*args, *outs, *cots), "factors", t)


def feature_decode(q, k, w, decay, S, z, t: Tuning):
    """One decode step of a feature map's state by the generated kernel: q, k [BH, D], w [BH, V], decay [BH],
    S [BH, F, V], z [BH, F] or None (float32) -> (S', z' or None, y [BH, V], n [BH] or None), y and n the readout's
    sums over φ(q)'s rows before its constant (the blocks' partials summed here, in order)."""
    BH, D = q.shape
    V = w.shape[-1]
    has_z = z is not None
    outs = _call(t, feature_decode_launch(t.dialect, BH, D, V, has_z), [q, k, w, decay, S] + ([z] if has_z else []))
    part = outs[-1].sum(1)
    return outs[0], outs[1] if has_z else None, part[:, :V], part[:, V] if has_z else None


@lru_cache(maxsize=16)
def decayed_scores_fn(t: Tuning, power: int):
    """(P [..., C, C], l [..., C]) -> A = P^power ⊙ Γ in float32, Γ[t, s] = e^{Σ_{s<τ≤t} l_τ} for s ≤ t, 0 above, by
    the generated kernel (``decayed_scores_launch``), with its VJP by the gradient kernel: dP, and dl_τ =
    Σ_{t≥τ>s} G[t, s] (G = A ⊙ dA) as the sum of its row blocks' parts (fixed orders: deterministic)."""
    import mlx.core as mx

    def flat(P, l):
        C = l.shape[-1]
        return _lead(l, 1), C, [P.reshape(-1, C, C).astype(mx.float32), l.reshape(-1, C)]

    def forward(P, l):
        N, C, user = flat(P, l)
        (A,) = _call(t, decayed_scores_launch(t.dialect, N, C, power, rows=t.scores_rows), user)
        return (A.reshape(P.shape),)

    def backward(P, l, dA):
        N, C, user = flat(P, l)
        dP, parts = _call(t, decayed_scores_launch(t.dialect, N, C, power, grad=True, rows=t.scores_rows),
                          [user[0], dA.reshape(-1, C, C).astype(mx.float32), user[1]])
        return dP.reshape(P.shape).astype(P.dtype), parts.sum(1).reshape(l.shape).astype(l.dtype)

    scores = piece(forward, lambda args, outs, cots: backward(*args, cots[0]), "scores", t)
    return lambda P, l: scores(P, l)[0]


@lru_cache(maxsize=16)
def sympow_fn(t: Tuning, H: int, gqa: str):
    """x [B, T, Hk, D] float32 -> φ = sympow(x) as [B, H, T, D (D + 1) / 2], value heads expanded (``gqa``: "block"
    or "tile", as ``recgen.chunked.terms.expand_heads``), by the generated kernels, with their VJP."""
    import mlx.core as mx

    def launch(x, grad=False):
        B, T, Hk, D = x.shape
        return sympow_launch(t.dialect, B, T, H, Hk, D, gqa == "block", grad)

    @mx.custom_function
    def sympow(x):
        return _call(t, launch(x), [x])[0]

    @sympow.vjp
    def sympow_vjp(x, dphi, phi):  # one argument, one output: MLX passes the arrays themselves
        return _call(t, launch(x, grad=True), [dphi.astype(mx.float32), x])[0].astype(x.dtype)

    return sympow
