r"""Power retention as ``simple_gla`` heads over blocks of its expanded key rows: the layout that the op
(``ops.PowerRetention``), ``recgen emit`` (its manifest) and ``recgen check`` (the emulated composition) share.

φ's K' = d(d+1)/2 rows exceed the recurrent kernels' register budget from d = 32. No transition mixes rows, so
the rows split into nb blocks of Kb, each block a head of simple_gla: decay e^g, update φ(k)_blk [v, 1]ᵀ (the
normalizer z rides along S as value column V), readout scale²·φ(q)_blk. Kernel head h·nb + b is value head h's
block b. Then o = Σ_b y_b[..., :V] / (Σ_b y_b[..., V] + ε), and the final (S, z) are the blocks' states stacked.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from . import specs
from .codegen.lower import has_kernel
from .errors import UnsupportedKernel
from .spec.features import sympow_pairs
from .spec.layouts import Sizes


@dataclass(frozen=True)
class KeyBlocks:
    rows: int   # K' = d(d+1)/2, φ's rows
    block: int  # Kb rows a block (a divisor of K')

    @property
    def count(self) -> int:
        return self.rows // self.block

    def inner(self, sizes: Sizes) -> Sizes:
        """simple_gla's sizes for power retention's ``sizes``: a key and value head per (value head, block)."""
        H = sizes.H * self.count
        return replace(sizes, H=H, Hk=H, Kin=self.block, K=self.block, V=sizes.V + 1)


@lru_cache(maxsize=64)
def key_blocks(sizes: Sizes, fwd_layout: tuple[int, int, int] | None = None) -> KeyBlocks:
    """The widest blocks of power retention's ``sizes.K`` rows that simple_gla's recurrent kernels take. Cached: a
    decode step asks each call, and the narrower candidates it rejects raise ``UnsupportedKernel`` each time."""
    K = sizes.K
    for nb in range(1, K + 1):
        if K % nb == 0:
            kb = KeyBlocks(K, K // nb)
            if has_kernel(specs.simple_gla, kb.inner(sizes), fwd_layout):
                return kb
    raise UnsupportedKernel(f"power_retention: no block of its K'={K} expanded rows fits the recurrent kernels")


def manifest(kb: KeyBlocks, d: int) -> dict:
    """How a host composes the emitted simple_gla kernels into power retention (``recgen emit``'s manifest)."""
    a, b, c = sympow_pairs(d)
    return {
        "of": "simple_gla", "rows": kb.rows, "block_rows": kb.block, "blocks": kb.count,
        "feature_map": "phi(x)[m] = coef[m] * x[a[m]] * x[b[m]] for the pairs below (q and k, [.., d] -> [.., rows])",
        "pairs": [[int(i), int(j), float(w)] for i, j, w in zip(a, b, c)],
        "heads": "kernel head h*blocks + b: value head h (GQA: key head as the spec's gqa maps it), rows "
                 "b*block_rows .. + block_rows of phi",
        "inputs": "q = phi(q), k = phi(k) by block; v = [v, 1] (V + 1 columns, the last the normalizer's); "
                  "g repeated per block; scale = scale**2",
        "state": "per block [block_rows, V + 1]: S in columns :V, z in column V; S [B,H,rows,V], z [B,H,rows]",
        "output": "o = sum_b y_b[..., :V] / (sum_b y_b[..., V] + eps)",
        "eps": specs.POWER_RETENTION_EPS,
    }
