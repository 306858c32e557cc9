"""Power retention's composition (``recgen.key_blocks``) on the emulated Metal kernels: φ expanded in numpy,
``simple_gla``'s kernels over the blocks of its rows, o = Σ y / (Σ n + ε); the backward chains the cotangents of
that readout into the blocks' kernels and their gradients back through the blocks, the GQA heads and φ."""
from __future__ import annotations

import numpy as np

from .. import specs
from ..key_blocks import KeyBlocks, key_blocks
from ..spec.features import sympow, sympow_vjp
from ..spec.layouts import infer_sizes
from .kernels import Report, emulate


def emulate_key_blocks(inputs: dict, *, initial_state, do, dht, scale: float, kb: KeyBlocks | None = None,
                       sanitizer=None, report: Report | None = None):
    """(o, (S, z), grads) of power retention at ``inputs`` (q, k [B,T,Hk,d], v [B,T,H,V], g [B,T,H], float64)
    through the emulated kernels of its key blocks (``kb``: the op's choice by default; a narrower one checks the
    composition over several blocks at small sizes)."""
    rec = specs.power_retention
    sizes = infer_sizes(rec, {n: np.shape(a) for n, a in inputs.items()})
    kb = kb or key_blocks(sizes)
    B, T, H, Hk, V, nb, Kb = sizes.B, sizes.T, sizes.H, sizes.Hk, sizes.V, kb.count, kb.block
    kh = [sizes.key_head(h, rec.gqa) for h in range(H)]  # the key head each value head reads
    q, k, v, g = (np.asarray(inputs[n], np.float64) for n in ("q", "k", "v", "g"))

    def blocks(x):  # [B,T,Hk,d] -> [B,T,H·nb,Kb]
        return sympow(x)[:, :, kh].reshape(B, T, H * nb, Kb)

    def states(S, z):  # (S [B,H,K',V], z [B,H,K']) -> [B,H·nb,Kb,V+1]
        return np.concatenate([S.reshape(B, H, nb, Kb, V), z.reshape(B, H, nb, Kb, 1)], -1).reshape(B, H * nb, Kb, -1)

    v1 = np.concatenate([v, np.ones((B, T, H, 1))], -1)
    inner = dict(q=blocks(q), k=blocks(k), v=np.repeat(v1, nb, axis=2), g=np.repeat(g, nb, axis=2))
    h0, dh = states(*initial_state), states(*dht)
    zero = np.zeros((B, T, H * nb, V + 1))
    y, _, _ = emulate(specs.simple_gla, inner, initial_state=h0, do=zero, dht=np.zeros_like(h0), scale=scale ** 2,
                      sanitizer=sanitizer)  # the forward, whose output the readout's cotangents need
    Y = y.reshape(B, T, H, nb, V + 1).sum(3)
    den = Y[..., V:] + specs.POWER_RETENTION_EPS
    o = Y[..., :V] / den
    dY = np.concatenate([do / den, -(do * o).sum(-1, keepdims=True) / den], -1)  # o = y / (n + ε)
    _, ht, gr = emulate(specs.simple_gla, inner, initial_state=h0, do=np.repeat(dY, nb, axis=2), dht=dh,
                        scale=scale ** 2, sanitizer=sanitizer, report=report)
    ht = ht.reshape(B, H, nb, Kb, V + 1)
    final = (ht[..., :V].reshape(B, H, kb.rows, V), ht[..., V].reshape(B, H, kb.rows))

    def phi_grad(x, dblocks):  # dφ by block -> dx [B,T,Hk,d]
        dphi = np.zeros((B, T, Hk, kb.rows))
        np.add.at(dphi, (slice(None), slice(None), kh), dblocks.reshape(B, T, H, kb.rows))  # value heads -> key heads
        return sympow_vjp(x, dphi)

    dh0 = gr["initial_state"].reshape(B, H, nb, Kb, V + 1)
    grads = {"q": phi_grad(q, gr["q"]), "k": phi_grad(k, gr["k"]),
             "v": gr["v"].reshape(B, T, H, nb, V + 1).sum(3)[..., :V], "g": gr["g"].reshape(B, T, H, nb).sum(3),
             "initial_state": (dh0[..., :V].reshape(B, H, kb.rows, V), dh0[..., V].reshape(B, H, kb.rows))}
    return o, final, grads
