r"""Lowering: Recurrence + Adjoint -> KernelPlan, the dialect-free description of the kernels.

The recurrent kernels map one SIMD group (32 lanes) onto a ``K × (CPL·32/LK)`` tile of the state
of one (batch, value head): ``LK`` lanes split the rows (lane row ``i = klane + LK·r``, r < RK),
the other ``32/LK`` lanes each own ``CPL`` columns. Reductions over rows are butterflies over the
``LK`` lanes of a group. Everything that shapes registers is a template constant; T and B are
runtime values.

The plan holds sympy expressions; ``render`` prints them through a dialect.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import sympy as sp

from ..errors import UnsupportedKernel
from .backends import DIALECTS
from .printer import kprint
from ..math import adjoint as adj
from ..spec import ir
from ..spec.layouts import Sizes


@dataclass(frozen=True)
class Layout:
    """Lane mapping of one kernel: LK lanes over rows, CPL columns per lane, WV warps per threadgroup."""

    LK: int
    CPL: int
    WV: int

    def rows_per_lane(self, K: int) -> int:
        return K // self.LK

    def cols_per_warp(self) -> int:
        return self.CPL * (32 // self.LK)

    def cols_per_tg(self) -> int:
        return self.cols_per_warp() * self.WV


@dataclass(frozen=True, eq=False)  # plans are interned by _plan: identity hashing keeps per-call cost low
class KernelPlan:
    rec: ir.Recurrence
    adjoint: adj.Adjoint
    K: int
    KIN: int
    V: int
    H: int
    HK: int
    C: int
    fwd: Layout
    bwd: Layout

    @property
    def normalized_skip(self) -> bool:
        """A normalizer and a skip term: the forward also writes y / N(n) (``yn``) when it saves for the backward,
        whose normalizer gradient needs sum_j do_j y_j / N without the skip term (o minus skip would cancel)."""
        return self.rec.has_normalizer and self.rec.step.skip is not None

    def template(self, layout: Layout) -> dict[str, int]:
        """Template constants of a kernel (shape registers; a change recompiles)."""
        return {"K": self.K, "KIN": self.KIN, "V": self.V, "H": self.H, "HK": self.HK, "C": self.C,
                "LK": layout.LK, "RK": layout.rows_per_lane(self.K), "CPL": layout.CPL, "WV": layout.WV}

    def grid(self, layout: Layout, B: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(grid in threads, threadgroup) as mx.fast.*_kernel take them."""
        ntg = -(-self.V // layout.cols_per_tg())
        return (ntg * 32 * layout.WV, B * self.H, 1), (32 * layout.WV, 1, 1)

    def n_partials(self) -> int:
        """Backward threadgroups along V: each writes one partial of the column-summed gradients."""
        return -(-self.V // self.bwd.cols_per_tg())


def _pow2_divisor(n: int, cap: int = 32) -> int:
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def choose_layouts(K: int, V: int) -> tuple[Layout, Layout, int]:
    """Lane mappings and checkpoint interval C by size (measured on the H100).

    Forward: 8 row lanes for K >= 64 (2-step butterflies over rows), 4 adjacent columns per lane:
    the fastest of 11 mappings swept on the H100 at both benchmark shapes (``Tuning.fwd_layout`` forces
    one for such sweeps): more columns per lane amortize the key loads and give the scheduler
    independent chains.
    Backward: its C recomputed states live in registers (C·RK floats per lane, kept <= 64), one
    column per lane, 16 row lanes, 8 warps per threadgroup (each partial of a column-summed gradient
    leaves the kernel once per threadgroup).
    """
    lk_f = _pow2_divisor(K, 8 if K >= 64 else 32)
    cpl_f = next((c for c in (4, 2) if V % c == 0 and V >= c * (32 // lk_f)), 1)
    lk_b = _pow2_divisor(K, 16 if K >= 32 else 32)
    rk_b = K // lk_b
    if rk_b > 32:
        raise UnsupportedKernel(f"K={K}: {rk_b} rows per lane exceed the register budget of the recurrent "
                                "backward; use backend='mlx'")
    C = max(2, min(16, 64 // rk_b))
    wv_f = max(1, min(4, -(-V // (cpl_f * (32 // lk_f)))))
    wv_b = max(1, min(8, -(-V // (32 // lk_b))))  # 256 threads: ~200 registers each still fit an SM
    return Layout(lk_f, cpl_f, wv_f), Layout(lk_b, 1, wv_b), C


def plan(rec: ir.Recurrence, sizes: Sizes, decode: bool | None = None,
         fwd_layout: tuple[int, int, int] | None = None) -> KernelPlan:
    """The kernel plan of ``rec`` for the register-shaping sizes of a call (B and T are runtime;
    decoding, T = 1 unless ``decode`` says otherwise, gets its own memory-bound lane mapping).
    ``fwd_layout`` (LK, CPL, WV) forces the forward's lane mapping (``Tuning.fwd_layout``: layout sweeps)."""
    return _plan(rec, sizes.K, sizes.Kin, sizes.V, sizes.H, sizes.Hk, sizes.T == 1 if decode is None else decode,
                 fwd_layout)


def has_kernel(rec: ir.Recurrence, sizes: Sizes, fwd_layout: tuple[int, int, int] | None = None) -> bool:
    """Whether ``rec`` lowers to recurrent kernels at ``sizes`` (not for feature maps, nor for K > 512)."""
    try:
        plan(rec, sizes, fwd_layout=fwd_layout)
    except UnsupportedKernel:
        return False
    return True


@lru_cache(maxsize=128)
def unsupported(rec: ir.Recurrence) -> str | None:
    """Why ``rec`` has no recurrent kernels (the message of ``UnsupportedKernel``), or None when it has them: a
    feature map, or a term, partial or normalizer of the spec that some dialect cannot spell (a function outside its
    table, a power that is not a small integer or a square root), found here rather than when a kernel is rendered."""
    if rec.features:
        return (f"{rec.name}: feature maps ({', '.join(f.name for f in rec.features)}) have no recurrent kernel "
                "yet; use backend='mlx'")
    ad = adj.derive(rec)
    exprs = list(rec.terms().values()) + [p.expr for p in ad.partials]
    if rec.step.normalizer is not None:
        exprs += [rec.step.normalizer.fn, ad.dN]
    for d in DIALECTS.values():
        for e in exprs:
            try:
                kprint(e, d, _AnyName())
            except NotImplementedError as err:
                return f"{rec.name}: {err}, so it has no recurrent kernels; use backend='mlx'"
    return None


class _AnyName(dict):
    """A printer's names for any symbol: its own name (``unsupported`` asks only whether a term prints)."""

    def __contains__(self, s) -> bool:
        return True

    def __getitem__(self, s) -> str:
        return str(s)


@lru_cache(maxsize=128)
def _plan(rec: ir.Recurrence, K: int, Kin: int, V: int, H: int, Hk: int, decode: bool = False,
          fwd_layout: tuple | None = None) -> KernelPlan:
    why = unsupported(rec)
    if why:
        raise UnsupportedKernel(why)
    fwd, bwd, C = choose_layouts(K, V)
    if rec.has_normalizer:  # the backward also keeps the chunk's normalizer states in registers
        C = max(2, C // 2)
    if decode and K % 4 == 0 and V % 4 == 0:
        # one step: only the state's read and write matter. 4 row lanes x 8 column lanes with 4 adjacent
        # columns each, moved as 16-byte vectors (the fastest of the decode mappings swept on the H100)
        fwd = Layout(4, 4, max(1, min(4, -(-V // 32))))
    if fwd_layout:
        fwd = Layout(*fwd_layout)
    return KernelPlan(rec, adj.derive(rec), K, Kin, V, H, Hk, C, fwd, bwd)


# -- names: what each symbol is called inside a kernel ----------------------------------------------
def register_name(x: ir.Input) -> str:
    """The register holding input x's element at the current row r / column c."""
    sub = "".join({"i": "[r]", "j": "[c]"}[ix] for ix in x.index)
    return f"{x.name}_v{sub}"


def names(rec: ir.Recurrence) -> dict[sp.Symbol, str]:
    table = {x.symbol: register_name(x) for x in rec.inputs}
    table[ir.SCALE] = "scale_"
    return table
