r"""Chunked (matmul) forms of any recurrence spec from MLX ops: the ``mlx`` backend of ``recgen.ops``.
Where the tuning enables them (``Tuning.chunk_kernels``: measured on CUDA) the core's inverse, scans and
key-decay pair matrices run as generated kernels (``recgen.runtime.chunk_kernels``); elsewhere, MLX ops only.

    o, final_state = recgen.chunked.forward(rec, inputs, scale=..., initial_state=None, chunk_size=None)
    o, final_state = recgen.chunked.naive_loop(rec, inputs, scale=..., initial_state=None)

``inputs`` maps each input name of ``rec`` to an ``mx.array`` in the layouts of
``recgen.spec.layouts`` (FLA's). ``final_state`` is S [B,H,K,V] float32, or (S, z) with a normalizer.
Everything is computed in float32; ``o`` is cast back to the dtype of the first value input.
``mx.grad`` / ``mx.vjp`` give gradients for every input and ``initial_state``, with cotangents
accepted for ``final_state``.

The forms, by the spec's terms:

- Scalar or key-vector decay, no transition or a delta-rule one (a = ρ·u, ρ free of i): the
  chunk-parallel core of ``recgen.chunked.parallel`` with a hand-derived VJP (every built-in but
  the selective scan). The roles (r, u, w, b̃, log-decays) are evaluated elementwise from the
  inputs by MLX ops and differentiated by MLX autodiff; the core's matmul algebra has its own VJP.
- Any other rank-1 transition with a scalar or key-vector decay, one before the decay (RWKV-7's DPLR) included:
  ``rank1``'s core, the WY/UT form with two key vectors (a, u), with a hand-derived VJP.
- A feature map read and updated through its kernel identity (power retention: r = c·φ(q), u = φ(k), a scalar
  decay; ``Analysis.feature_identity``): ``features``, scores (qᵀk)^p inside chunks, the expanded state only between
  them (``feature_rows``), with a written VJP; a decode step on the feature decode kernel where the tuning asks.
- Full (i, j) or value-indexed decays (selective scan): ``core.scan_full``, a two-level scan
  (~2√T sequential elementwise steps per segment) with a written VJP (the reverse recurrence by the
  same scan). With a rank-1 transition as well no chunked form exists (``_stepwise``): the roles are
  formed at once, the state steps token by token, MLX autodiff through the steps (T sequential steps;
  the GPU kernels are the fast path for such a spec).

Memory: a sequence whose working set fits the budget (``segment_budget``) runs as one piece. A
longer one runs in segments: the forward keeps only each segment's entry state, the backward
recomputes segments in reverse, ordered with ``mx.depends`` so one segment's intermediates are
alive at a time (MLX calls a VJP under ``RetainGraph``: an ``eval`` inside it would free nothing).
The budget bounds that working set only: a training step also holds the inputs, their gradients and
the per-token cotangents, O(T) bytes that no segmenting removes (on the CPU about 27 KB a token for GDN at
B=2, H=4, K=V=64, so a 64k-token step peaks well above a 512 MiB budget).
Second-order gradients are not supported.

Decays enter through their exact logarithm (``recgen.spec.decay``; a decay of 0 is a reset). What no form
computes is rejected by the decorator (``SpecError``): decays that can be negative, for one.
"""
from __future__ import annotations

from functools import lru_cache, partial

import mlx.core as mx

from ..spec import ir
from ..spec.analysis import analyze
from ..spec.features import sympow_width
from ..spec.layouts import InputError, check_state, infer_sizes
from ..codegen.chunk_sources import decayed_scores_layout, pair_supported, sympow_supported
from ..runtime import chunk_kernels as ck
from ..runtime import pieces
from ..runtime.probe import checked_for
from ..tuning import Tuning
from . import core, feature_rows, features, parallel, rank1
from .core import pow2_ceil
from .terms import KEY_ROLES, bind, evaluate, expand_heads, plan

__all__ = ["forward", "naive_loop", "supported", "fast_form", "segment_budget"]

# Peak fwd+bwd bytes per token ≈ factor × 4·B·H·(K + V + C), inputs and gradients included, measured on the CPU
# (C = 16, K = V = 64, one segment): about 22-27 for scalar decays and 27-29 for key-vector ones. An overestimate
# cuts a sequence into more segments than needed, and every extra segment is recomputed in the backward.
WORKSET_FACTOR = {"scalar": 27, "key": 30, "full": 40}  # full: × 4·B·H·K·V (per-token states)


def supported(rec: ir.Recurrence) -> None:
    """Raise NotImplementedError naming the term when ``rec`` has no form here (today every spec the decorator
    accepts has one; the guard stays for the normalizer's decay, which ``validate`` already restricts)."""
    p = analyze(rec)
    if p.zdecay_class == "full":  # validate() forbids it; guard anyway
        raise NotImplementedError(f"{rec.name}: normalizer decay {rec.step.normalizer.decay} is value-indexed")


def fast_form(rec: ir.Recurrence) -> bool:
    """Whether ``rec``'s chunked form runs on a matmul core (``Analysis.matmul_core``: the parallel core, or the
    general rank-1 core): it measured faster than the recurrent kernels from a T on GPUs, so a kernel op takes it
    from there (``recgen.ops``). On the H100 (bf16, 4,4096,16,128) RWKV-7's rank-1 core took forward+backward from
    the recurrent kernels' 81.7 ms to 22.8 ms; a full decay has only the two-level and stepwise scans."""
    return analyze(rec).matmul_core


def segment_budget(t: Tuning) -> int:
    """Bytes of working set one segment may use: ``t.segment_budget`` if set (512 MiB on the CPU), else a third of
    the GPU's memory. On GPUs MLX allocates for work queued ahead of the device, so segments bound memory only
    loosely there while their recomputation costs time (measured on the H100: GLA in three segments was slower
    and peaked nearly as high as in one), hence a large GPU budget."""
    if t.segment_budget:
        return t.segment_budget
    total = _device_memory(str(mx.default_device()))
    return total // 3 if total else 512 * 2**20


@lru_cache(maxsize=8)
def _device_memory(device: str) -> int:
    """The memory of the default device (named by ``device``), read once: ``mx.device_info`` took about 60 µs of
    every GPU call's host work."""
    info = mx.device_info()
    return int(info.get("total_memory") or info.get("memory_size") or 0)


def _out_dtype(rec, inputs):
    for x in rec.inputs:
        if x.kind == "value":
            return inputs[x.name].dtype
    return mx.float32


def _prepare(rec, inputs, initial_state, dtype=mx.float32):
    for name, a in inputs.items():
        if not isinstance(a, mx.array):
            raise InputError(f"argument {name!r}: expected an mx.array, got {type(a).__name__}")
    sizes = infer_sizes(rec, {k: tuple(v.shape) for k, v in inputs.items()})
    if initial_state is None:
        S = mx.zeros(sizes.state_shape, dtype=dtype)
        z = mx.zeros(sizes.state_shape[:3], dtype=dtype) if rec.has_normalizer else None
    else:
        check_state(rec, sizes, initial_state)
        if rec.has_normalizer:
            S, z = initial_state
            S, z = S.astype(dtype), z.astype(dtype)
        else:
            S, z = initial_state.astype(dtype), None
    return sizes, S, z


def _readout(p, rec, t, y, n):
    """o = y / N(n) + skip + (Σ_i bonus_i) w, [B,H,T,V] -> [B,T,H,V]."""
    if rec.has_normalizer:
        y = y / p.N(n)[..., None]
    if "skip" in t:
        y = y + t["skip"]
    if "bonus" in t:
        y = y + t["bonus"].sum(-1, keepdims=True) * t["w"]
    return y.transpose(0, 2, 1, 3)


def _pre_shift(rec, t, S):
    """``readout_before_update`` (y_t = S_{t-1}ᵀ r_t) on a core that reads y'_s = S_sᵀ r'_s: with r' = r one token
    earlier (r'_s = r_{s+1}, r'_{T-1} = 0), y_t = y'_{t-1} for t >= 1, and y_0 = S_entryᵀ r_0. Returns (r', y_0), or
    (r, None) for a post-update readout. Exact, no division by a decay; the core and its VJP are unchanged."""
    r = t["r"]
    if not rec.step.readout_before_update:
        return r, None
    y0 = r[:, :, :1] @ S.astype(r.dtype)  # [B,H,1,K] @ [B,H,K,V]
    return mx.concatenate([r[:, :, 1:], mx.zeros_like(r[:, :, :1])], axis=2), y0


def _pre_unshift(y, y0):
    """y [B,H,T,V] of the shifted readout -> y_t = S_{t-1}ᵀ r_t (see ``_pre_shift``); y0 None: y itself."""
    return y if y0 is None else mx.concatenate([y0.astype(y.dtype), y[:, :, :-1]], axis=2)


def _to_chunks(x, n, C):
    """[B,H,T,F] -> [B,H,n,C,F], padding time with zeros (identity tokens: l = 0, roles 0)."""
    T = x.shape[2]
    if n * C != T:
        x = mx.pad(x, [(0, 0), (0, 0), (0, n * C - T), (0, 0)])
    return x.reshape(x.shape[0], x.shape[1], n, C, x.shape[-1])


def _as_f(x):
    """A log-decay [B,H,T] (scalar) or [B,H,T,K] -> [B,H,T,F]."""
    return x if x.ndim == 4 else x[..., None]


def _diag_scan(tun, S, r, u, w, l, C, key: bool, delta_bt=None, out=None, rfac=None, rho=None, model_rows=None):
    """The parallel core over a whole stretch [B,H,T,·]: returns (y [B,H,T,V'], S_end), or with ``out`` (a
    dtype) y as [B,T,H,V'] of that type, the model's layout (``parallel.core_fn``). With ``rfac`` (a float) the
    readout role is rfac·r. With ``rho`` (a float: factor reads, ``_keyed_input``) u is a key x and ``delta_bt``
    the factor f [B,H,T,1] of u = f ⊙ x, b̃ = ρ x. With ``model_rows`` (GQA's head map: ``_model_inputs``) r, u and
    w are the model's inputs [B,T,heads,·] as they are, and a key-vector decay's l [B,T,H,K] too."""
    key_rows = key and model_rows is not None and delta_bt is None  # l [B, T, H, K] as well (``_model_inputs``)
    B, H, T = (l.shape[0], l.shape[2], l.shape[1]) if key_rows else l.shape[:3]
    n = -(-T // C)
    ch = lambda x: _to_chunks(x, n, C)  # noqa: E731
    keep = (lambda x: x) if model_rows is not None else ch  # noqa: E731
    compose = 2 * C >= r.shape[-1]
    fn = parallel.core_fn(key, delta_bt is not None, compose, tun, out, rfac, rho, model_rows)
    extra = [ch(delta_bt)] if delta_bt is not None else []
    y, S_end = fn(S, keep(r), keep(u), keep(w), l.reshape(B, n, C, H, -1) if key_rows else ch(l), *extra)[:2]
    if out is not None:
        return y[:, :T], S_end
    return y.reshape(B, H, n * C, y.shape[-1])[:, :, :T], S_end


def _roles(tun, p, names, scale, sizes, S, arrays, raw=None, roles=None):
    """(T, roles); ``raw``: see ``terms.bind``. Feature maps run on the chunk kernels where they are on (float32).
    ``roles``: only these (none of which reads a feature map), else every role."""
    chunk = dict(zip(names, arrays))  # upcast by ``bind``, after the layout views: fused with the role math
    T = next(chunk[x.name].shape[1] for x in p.rec.inputs if x.per_token)
    kern = (tun.chunk_kernels and S.dtype == mx.float32
            and all(sympow_supported(tun.dialect, chunk[f.source].shape[-1]) for f in p.rec.features))
    vals = bind(p, chunk, sizes.H, S.dtype, raw, (lambda x, H, gqa: ck.sympow_fn(tun, H, gqa)(x)) if kern else None,
                features=roles is None)
    return T, evaluate(p, vals, scale, sizes.B, sizes.H, T, sizes.K, sizes.V, S.dtype, roles)


def _z_scan(tun, p, t, z, C):
    """A normalizer with its own decay (not fused into S): z_t = d_t ⊙ z_{t-1} + u'_t, n_t = z_tᵀ r_t,
    through the parallel core with a single value column. Returns (n [B,H,T], z_end)."""
    B, H, T = t["r"].shape[:3]
    ones = mx.ones((B, H, T, 1), dtype=z.dtype)
    yz, zs = _diag_scan(tun, z[..., None], t["r"], t["zupdate"], ones, _as_f(t["zlogdecay"]), C,
                        p.zdecay_class == "key")
    return yz[..., 0], zs[..., 0]


def _role_as(p, role, x, raw, pick, dtype, factor=1.0):
    """``x`` = ``factor`` × role ``role``, in the type ``pick`` (``parallel.role_dtype`` but for its dtype and bare
    arguments) chooses: from ``dtype`` (the values') in general, from the input's own type where the role is an
    input verbatim and ``factor`` a constant ±2^e (None: not one; b̃ = ρ b with the delta rules' ρ = -1). Such a
    role, kept in its input's type, is formed from the input's row-major copy (``terms.bind``) itself: exact."""
    sym = dict(p.bare_roles).get(role) if factor is not None else None
    if sym not in raw:
        return x.astype(pick(dtype, bare=False))
    a = raw[sym]
    if pick(a.dtype, bare=True) != a.dtype:
        return x.astype(pick(a.dtype, bare=True))
    a = a[..., 0] if role in KEY_ROLES else a[..., 0, :]  # [B,H,T,K,1] / [B,H,T,1,V] -> role layout
    return a if factor == 1.0 else a * factor  # a Python scalar keeps the array's type


def _readout_role(p, r, raw, pick, kern, scale):
    """(x, c) where r = c·x for an input x (``Plan.r_scaled``: r = scale·q) and chunk kernels run: the core takes x,
    in the type ``pick`` chooses for an input verbatim, and applies c inside (the fused readout as it reads x), so
    r is never formed in memory (forming scale·q in float32, and the layout copy that follows it, was a measurable
    part of a scalar-decay forward on the H100). Else (r, None)."""
    sym = p.r_scaled[0] if p.r_scaled and kern else None
    if sym not in raw:
        return r, None
    x = raw[sym][..., 0]  # [B,H,T,K,1] -> [B,H,T,K]
    return x.astype(pick(x.dtype, bare=True)), float(p.r_scaled[1](scale))


def _keyed_input(p, raw, kern, key: bool, C: int, K: int, V: int):
    """The key input x where the delta rule's roles can be read from it by the fused kernels (factor reads,
    ``Tuning.factor_reads``): u = f·x with a factor per token (``Analysis.u_factor``: GDN's β k) and b̃ = ρ x with
    ρ constant (b = x verbatim), and every kernel that reads u or b̃ fused: the UT transform, the fragment scans, the
    readout and, for a scalar decay, the backward's pass; for a key-vector decay (KDA, with ``key_factor_reads``) the
    pair kernels (which pair x with itself and with r, their columns scaled by f after) and the backward's tail (K a
    multiple of 32). Then neither role is formed in memory (u = β k in float32 and b̃ = −k were a cast, a strided
    product and a negation before the kernels, and their cotangents' products after them). Else None."""
    a = p.analysis
    if not (kern and kern.factor_reads and a.u_factor and a.rho is not None and a.rho.is_Number):
        return None
    x = a.u_factor[0]
    if dict(a.bare_roles).get("b") != x or x not in raw:
        return None
    fused = (ck.use_mma(kern, C, K, V) and ck.fuses_ut(kern, C, K, V) and ck.fuses_readout(kern, C, K, V)
             and ck.scan_supported(kern, C, K))
    if key:  # ``Tuning.key_factor_reads``: measured slower for training, off by default
        fused = (fused and kern.key_factor_reads and K % 32 == 0 and ck.fuses_key_tail(kern, C)
                 and pair_supported(kern.dialect, C, K, dual=True))
    else:
        fused = fused and ck.fuses_bwd(kern, C, K, True)
    return x if fused else None


def _model_inputs(kern, p, chunk: dict, x, rfac, native: bool, T: int, C: int, bt=None, K: int = 0, V: int = 0,
                  raw: dict | None = None):
    """(r's, x's and w's inputs) as the model passed them, [B, T, HK, K] twice and [B, T, H, V], where the fused
    kernels read them so (``Tuning.model_rows``): factor reads of the key x, or no delta rule (``bt`` None: simple
    GLA's scalar decay, u a key input verbatim, its scan fusing products), the readout role a constant times a key
    input (``rfac``), w a value input verbatim, y written as o (``native``), T a multiple of C (whole chunks:
    the kernels read no padding) and GQA's key heads shared (``Tuning.model_rows_dense``: also without GQA). Then
    q, k and v are never copied to [B, H, T, D], nor the key heads expanded, and their gradients come back in that
    layout. Without GQA only the copies go, and the scans' strided reads of the rows cost about what they saved
    (docs/design.md). Without a delta rule the backward makes the copies the forward no longer does. A key-vector
    decay without a transition (GLA: ``parallel.key_model_rows``) reads its log-decay input so too, when the
    log-decay is that input verbatim (``raw``: ``terms.bind``'s), returned fourth. Else None."""
    key = p.decay_class == "key"
    if x is None and bt is None and p.decay_class == "scalar" and kern and ck.scan_fuses_products(kern, C, K, V, True) \
            and ck.fuses_readout(kern, C, K, V):
        x = dict(p.bare_roles).get("u")
    elif key and (x is not None or bt is not None or p.logdecay_input not in (raw or {})
                  or not parallel.key_model_rows(kern, C, K, V)):
        return None  # a key decay's delta rule reads the chunks' layout; the other fused kernels, where they run
    elif key:
        x = dict(p.bare_roles).get("u")
    if not (kern and kern.model_rows and x is not None and rfac is not None and native and T % C == 0):
        return None
    inputs = {i.symbol: i for i in p.rec.inputs}
    syms = (p.r_scaled[0], x, dict(p.bare_roles).get("w")) + ((p.logdecay_input,) if key else ())
    if tuple(inputs[s].kind if s in inputs else None for s in syms[:3]) != ("key", "key", "value"):
        return None
    arrays = tuple(chunk[inputs[s].name] for s in syms)
    return arrays if kern.model_rows_dense or arrays[1].shape[2] < arrays[2].shape[2] else None


def _y_is_o(t, has_z: bool, y0) -> bool:
    """Whether the core's y is the output o itself (no normalizer, skip or bonus term, no pre-update shift), so a
    core whose readout kernel writes the model's layout and type may return o directly."""
    return not has_z and "skip" not in t and "bonus" not in t and y0 is None


def _fast(tun, p, names, scale, sizes, has_z, C, out_dtype, S, *rest):
    """Scalar or key-vector decay, no transition or a = ρ·u: (S[, z], *inputs) -> (o, S[, z]). Without a
    normalizer or skip term the core writes o in its layout and type (``out_dtype``) itself."""
    z = rest[0] if has_z else None
    raw = {}
    arrays = rest[1:] if has_z else rest
    T, t = _roles(tun, p, names, scale, sizes, S, arrays, raw)
    V, key = sizes.V, p.decay_class == "key"
    nz = None
    if p.fuse_z:  # z rides along as the extra value column of S (same decay and update)
        ones = mx.ones((sizes.B, sizes.H, T, 1), dtype=S.dtype)
        ya, Sa = _diag_scan(tun, mx.concatenate([S, z[..., None]], axis=-1), t["r"], t["u"],
                            mx.concatenate([t["w"], ones], axis=-1), _as_f(t["logdecay"]), C, key)
        (y, nz), (S, z) = core.split_last(ya), core.split_last(Sa)
    else:
        bt = t["rho"][..., None] * t["b"] if "rho" in t else None
        kern = tun if tun.chunk_kernels else None
        kw = (kern, key, bt is not None, C, sizes.K, V)
        pick = lambda dtype, bare: parallel.role_dtype(*kw, dtype, S.dtype, bare=bare)  # noqa: E731
        r_in, y0 = _pre_shift(p.rec, t, S)
        r = r_in.astype(pick(out_dtype, bare=False)) if y0 is not None else _role_as(p, "r", r_in, raw, pick, out_dtype)
        w = _role_as(p, "w", t["w"], raw, pick, out_dtype)  # out_dtype: the values'
        x, rho = _keyed_input(p, raw, kern, key, C, sizes.K, V), None
        if x is not None:  # u = f ⊙ x and b̃ = ρ x, read so by the kernels
            u = raw[x][..., 0]
            u, bt, rho = u.astype(pick(u.dtype, bare=True)), t["ufac"][..., None], float(p.analysis.rho)
        else:
            u = _role_as(p, "u", t["u"], raw, pick, out_dtype)
            bt = None if bt is None else _role_as(p, "b", bt, raw, pick, out_dtype, p.rho_pow2)
        r, rfac = _readout_role(p, r, raw, pick, kern if y0 is None else None, scale)  # shifted r: no raw input
        native = _y_is_o(t, has_z, y0)
        model = _model_inputs(kern, p, dict(zip(names, arrays)), x, rfac, native, T, C, bt, sizes.K, V, raw)
        if model is not None:  # the same types as the row-major roles above, in the model's layout
            r, u, w = (a.astype(b.dtype) for a, b in zip(model, (r, u, w)))
        l = _as_f(t["logdecay"])
        lin = raw.get(p.logdecay_input)  # the log-decay as input, row-major in its own type, where verbatim
        if lin is not None and lin.dtype in (mx.bfloat16, mx.float16) and rank1.logdecay_16bit(kern, key, C, sizes.K):
            l = lin[..., 0]  # [B,H,T,K,1] -> [B,H,T,K]: the kernels convert as they read it (no float32 cast)
        if model is not None and key:  # [B,T,H,K] as given, in the type l would have had
            l = model[3].astype(l.dtype)
        y, S = _diag_scan(tun, S, r, u, w, l, C, key, bt, out_dtype if native else None, rfac, rho,
                          p.rec.gqa if model is not None else None)
        if native:
            return y, S
        y = _pre_unshift(y, y0)
        if has_z:
            nz, z = _z_scan(tun, p, t, z, C)
    o = _readout(p, p.rec, t, y, nz)
    return (o, S, z) if has_z else (o, S)


def _features(tun, p, names, scale, sizes, has_z, C, out_dtype, S, *rest):
    """A feature-map spec through its kernel identity (``features``; ``Analysis.feature_identity``): the scores
    inside chunks from the raw keys, the expanded state only between chunks. z rides along as S's value column V."""
    fi = p.analysis.feature_identity
    q, k, W, gam, state, t = _feature_operands(tun, p, names, scale, sizes, has_z, S, rest)
    T, d = q.shape[2], q.shape[-1]
    c = fi.constant(scale)
    rows = feature_rows.rows_for(tun, d, S.dtype, C, W.shape[-1], fi.degree)  # as ``forward`` chose them
    scores, factors = _feature_kernels(tun, fi.degree, C, T)
    Y, S_end = features.chunk_form(q, k, W, gam, rows.to_rows(state), c, C, tun.pow2_exp, rows, fi.degree,
                                   scores, tun.gram_slices, tun if tun.feature_mix else None,
                                   tun.feature_keep_states and rows.count == 1, factors,
                                   tun if tun.replay_graphs else None)  # tiles bound memory
    return _feature_outputs(p, t, Y, rows.from_rows(S_end), has_z)


def _feature_attention(tun, p, names, scale, sizes, has_z, C, out_dtype, S, *rest):
    """A feature-map spec from a zero initial state as attention (``features.attention_form``): no expanded state but
    the final one, a graph of its own (``features.final_state``), so a caller who never reads it never forms it."""
    return _attention(tun, p, names, scale, sizes, has_z, C, S, rest, False)


def _feature_attention_from(tun, p, names, scale, sizes, has_z, C, out_dtype, S, *rest):
    """``_feature_attention`` from a given initial state, read as e^{Γ_t} φ(q_t)ᵀS0 (``features.initial_read``)."""
    return _attention(tun, p, names, scale, sizes, has_z, C, S, rest, True)


def _attention(tun, p, names, scale, sizes, has_z, C, S, rest, read_state: bool):
    fi = p.analysis.feature_identity
    q, k, W, gam, state, t = _feature_operands(tun, p, names, scale, sizes, has_z, S, rest)
    T, BH, budget = q.shape[2], sizes.B * sizes.H, segment_budget(tun)
    rows = feature_rows.rows_for(tun, q.shape[-1], S.dtype, C, W.shape[-1], fi.degree)
    S0 = rows.to_rows(state) if read_state else None
    # a slice of tokens' φ(q), its product with S0 and their gradients within the budget, about; whole chunks where
    # it holds one (the kernels' rows have layouts for chunks of C)
    slice_tokens = max(1, budget // (4 * BH * (S0.shape[-2] if read_state else 1) * 6))
    slice_tokens = slice_tokens // C * C or slice_tokens
    scores, factors = _feature_kernels(tun, fi.degree, C, T)
    group = features.attention_groups(BH, -(-T // C) * C, C, budget)
    Y = features.attention_form(q, k, W, gam, fi.constant(scale), C, tun.pow2_exp, fi.degree, scores, factors, group,
                                tun if tun.replay_graphs else None, S0, rows, slice_tokens)
    S_end = features.final_state(k, W, gam, rows, C, tun.pow2_exp, S0)
    return _feature_outputs(p, t, Y, rows.from_rows(S_end), has_z)


def _feature_outputs(p, t, Y, S_end, has_z):
    """(o, S_end[, z_end]) from Y [B,H,T,V'] and the final state [B,H,R,V'] in the spec's layout, where a normalizer
    rode along as value column V of both."""
    if not has_z:
        return _readout(p, p.rec, t, Y, None), S_end
    (y, nz), (S_end, z_end) = core.split_last(Y), core.split_last(S_end)
    return _readout(p, p.rec, t, y, nz), S_end, z_end


def _feature_kernels(tun, degree: int, C: int, T: int):
    """(the in-chunk scores, the decay factors) as functions on the generated kernels where the tuning runs them,
    else None each (MLX ops)."""
    scores = (ck.decayed_scores_fn(tun, degree) if tun.chunk_kernels and tun.decayed_scores
              and decayed_scores_layout(tun.dialect, C, tun.scores_rows) else None)
    return scores, ck.decay_factors_fn(tun) if ck.factors_on_kernels(tun, -(-T // C)) else None


def _feature_operands(tun, p, names, scale, sizes, has_z, S, rest):
    """(q, k [B,H,T,d], W [B,H,T,V'], the log-decays [B,H,T], the state [B,H,R,V'], the roles) of a feature-map spec
    from a body's S and rest (z where there is a normalizer, then the inputs), in S's type: W the values and the
    state S, each with a column where a normalizer rides along as value column V (ones; z)."""
    fi = p.analysis.feature_identity
    arrays = rest[1:] if has_z else rest
    chunk = dict(zip(names, arrays))
    T, t = _roles(tun, p, names, scale, sizes, S, arrays, roles=("w", "logdecay"))
    # [B, H, T, d] made row-major once, in the inputs' type, before the cast (which keeps a transposed view's
    # strides): every kernel reading the chunks would otherwise copy the view again (eight copies a training step)
    q, k = (core.row_major(expand_heads(chunk[nm], sizes.H, p.rec.gqa, 2).transpose(0, 2, 1, 3)).astype(S.dtype)
            for nm in (fi.q, fi.k))
    W, state = t["w"], S
    if has_z:
        W = mx.concatenate([W, mx.ones((sizes.B, sizes.H, T, 1), dtype=S.dtype)], axis=-1)
        state = mx.concatenate([S, rest[0][..., None]], axis=-1)
    return q, k, W, t["logdecay"], state, t


@lru_cache(maxsize=32)
def _features_decode_fn(rec, tun: Tuning, scale: float, sizes, has_z: bool, out_dtype):
    """``_features_decode`` for one spec, tuning and call signature as one compiled function (S[, z], *inputs) ->
    (o, S[, z]): the role math and the readout around the kernel are a dozen small ops, host time every token."""
    names = [x.name for x in rec.inputs]

    def step(S, *rest):
        z = rest[0] if has_z else None
        o, state = _features_decode(tun, plan(rec, tun.pow2_exp), scale, sizes, S, z,
                                    dict(zip(names, rest[1:] if has_z else rest)))
        return (o.astype(out_dtype), *(state if has_z else (state,)))

    return mx.compile(step) if tun.compile else step


def _features_decode(tun, p, scale, sizes, S, z, inputs):
    """One token of a feature-map spec through its kernel identity on the feature decode kernel: (o, state)."""
    fi = p.analysis.feature_identity
    names = [x.name for x in p.rec.inputs]
    _, t = _roles(tun, p, names, scale, sizes, S, [inputs[n] for n in names], roles=("w", "logdecay"))
    B, H, V = sizes.B, sizes.H, sizes.V
    BH, F = B * H, S.shape[-2]
    q, k = (expand_heads(inputs[nm][:, 0], H, p.rec.gqa, 1).astype(S.dtype).reshape(BH, -1) for nm in (fi.q, fi.k))
    decay = core.exp(t["logdecay"][:, :, 0], tun.pow2_exp).reshape(BH)
    zs = [z.reshape(BH, F)] if z is not None else []
    outs = features.decode_fn(tun, z is not None)(q, k, t["w"][:, :, 0].reshape(BH, V), decay, S.reshape(BH, F, V), *zs)
    c = fi.constant(scale)
    n = c * outs[3].reshape(B, H, 1) if z is not None else None
    o = _readout(p, p.rec, t, c * outs[1].reshape(B, H, 1, V), n)
    S1 = outs[0].reshape(B, H, F, V)
    return o, ((S1, outs[2].reshape(B, H, F)) if z is not None else S1)


def _general(tun, p, names, scale, sizes, has_z, C, out_dtype, S, *rest):
    """A rank-1 transition with a ≠ ρ·u or one before the decay (scalar or key decay): ``rank1``'s core."""
    z = rest[0] if has_z else None
    raw = {}
    T, t = _roles(tun, p, names, scale, sizes, S, rest[1:] if has_z else rest, raw)
    n = -(-T // C)
    ch = lambda x: _to_chunks(x, n, C)  # noqa: E731
    key = p.decay_class == "key"
    kern = tun if tun.chunk_kernels else None
    keep = rank1.roles_16bit(kern, key, C, sizes.K)  # inputs verbatim stay 16-bit where every reader converts
    pick = lambda dtype, bare: dtype if keep and bare and dtype in (mx.bfloat16, mx.float16) else S.dtype  # noqa: E731
    u, w, a, b = (_role_as(p, role, t[role], raw, pick, S.dtype) for role in ("u", "w", "a", "b"))
    r, y0 = _pre_shift(p.rec, t, S)
    r, rfac = _readout_role(p, r, raw, pick, kern if y0 is None else None, scale)  # a shifted r has no raw input
    # a scale of 1 (RWKV-7's) needs no pass over dy: MLX multiplies by 1.0 as by any other number. Where the readout
    # is y alone and its kernel runs, the core writes o in the model's layout and type itself
    native = _y_is_o(t, has_z, y0) and kern is not None and kern.rank1_readout
    fn = rank1.core_fn(key, p.rec.transition_before_decay, tun, None if rfac == 1.0 else rfac,
                       out_dtype if native else None)
    l = _as_f(t["logdecay"])
    lin = raw.get(p.logdecay_input)  # the log-decay as input, row-major in its own type, where verbatim
    if lin is not None and lin.dtype in (mx.bfloat16, mx.float16) and rank1.logdecay_16bit(kern, key, C, sizes.K):
        l = lin[..., 0]  # [B,H,T,K,1] -> [B,H,T,K]: the kernels convert as they read it, no float32 cast is made
    y, S = fn(S, *(ch(x) for x in (r, u, w, a, b, l)))[:2]
    if native:
        return y[:, :T], S
    y = _pre_unshift(y.reshape(sizes.B, sizes.H, n * C, sizes.V)[:, :, :T], y0)
    nz, z = _z_scan(tun, p, t, z, C) if has_z else (None, z)
    o = _readout(p, p.rec, t, y, nz)
    return (o, S, z) if has_z else (o, S)


def _full(tun, p, names, scale, sizes, has_z, C, out_dtype, S, *rest):
    """A stretch with a full (i, j) or value-indexed decay: ``core.scan_full`` (its written VJP); a
    normalizer (scalar or key decay) through the parallel core with chunk C."""
    z = rest[0] if has_z else None
    _, t = _roles(tun, p, names, scale, sizes, S, rest[1:] if has_z else rest)
    r, y0 = _pre_shift(p.rec, t, S)
    y, S = core.scan_full(S, r, t["u"], t["w"], t["logdecay"], tun.pow2_exp)
    y = _pre_unshift(y, y0)
    nz, z = _z_scan(tun, p, t, z, C) if has_z else (None, z)
    o = _readout(p, p.rec, t, y, nz)
    return (o, S, z) if has_z else (o, S)


def _stepwise(tun, p, names, scale, sizes, has_z, C, out_dtype, S, *rest):
    """A rank-1 transition with a value-indexed or full (i, j) decay. No chunked form exists: the transition mixes
    the state's rows (bᵀP sums over i) while the decay scales each element on its own, so no product of a
    chunk's steps factors into matmuls. The roles are formed for the whole stretch at once, then the state steps
    token by token (MLX autodiff through the steps; O(T·K·V) memory, bounded by the caller's segments)."""
    z = rest[0] if has_z else None
    T, t = _roles(tun, p, names, scale, sizes, S, rest[1:] if has_z else rest)
    r, a, b, u, w = (t[k][:, :, :, None] for k in ("r", "a", "b", "u", "w"))  # [B,H,T,1,F]: rows of one token
    D = core.exp(t["logdecay"], tun.pow2_exp)                                    # [B,H,T,K|1,V]
    flags = dict(before_decay=p.rec.transition_before_decay, readout_before=p.rec.step.readout_before_update)
    ys = []
    for s in range(T):
        y, S = core.state_step(S, D[:, :, s], r[:, :, s], u[:, :, s], w[:, :, s], a[:, :, s], b[:, :, s], **flags)
        ys.append(y)                                                             # [B,H,1,V]
    y = mx.concatenate(ys, axis=2) if ys else mx.zeros((sizes.B, sizes.H, 0, sizes.V), S.dtype)
    nz, z = _z_scan(tun, p, t, z, C) if has_z else (None, z)
    o = _readout(p, p.rec, t, y, nz)
    return (o, S, z) if has_z else (o, S)


@lru_cache(maxsize=64)
def _body(body, rec, names, scale, sizes, has_z, C, out_dtype, tun: Tuning, compile: bool, whole: bool = False):
    """``body`` bound to one spec and shape, its output cast to ``out_dtype``. With ``compile`` the
    whole stretch (input casts, layout copies, role math, the chunk core, the readout, the output
    cast) is one ``mx.compile``d graph, so the elementwise work around the core fuses into few
    kernels (on GPUs each MLX launch costs ~16 µs and a pass over HBM). ``whole`` (a body of pieces and recordable
    glue), where the tuning replays graphs: the stretch as one custom function whose forward and VJP are each one
    recorded graph (``pieces.whole``), so no eager training call runs its Python. Cached: a call must not
    retrace; keyed on the tuning, whose choices a trace bakes in."""
    bound = partial(body, tun, plan(rec, tun.pow2_exp), names, scale, sizes, has_z, C, out_dtype)

    def fn(*arrays):
        outs = bound(*arrays)
        return (outs[0].astype(out_dtype), *outs[1:])

    if whole and tun.replay_graphs:
        fn = pieces.whole(fn, body.__name__.strip("_"), lambda: ck.replaying(tun))
    return mx.compile(fn) if compile else fn


def _segmented(rec, fn, bounds, ns):
    """``fn`` over consecutive segments of time (split at ``bounds``) as one custom function.

    Forward: segment after segment, keeping only each segment's entry state (returned as extra
    outputs after (o, *state); callers drop them). Backward: segments in reverse, each recomputed
    from its entry state and differentiated with ``mx.vjp``; each recomputation is made to depend on
    the later segment's state cotangent, so MLX evaluates one segment's intermediates at a time."""
    per_token = [x.per_token for x in rec.inputs]
    n = len(bounds) + 1

    def pieces(xs):
        cols = [(mx.split(x, bounds, axis=1) if tok else [x] * n) for x, tok in zip(xs, per_token)]
        return [[c[k] for c in cols] for k in range(n)]

    @mx.custom_function
    def run(*arrays):
        state, outs, entry = list(arrays[:ns]), [], []
        for args in pieces(arrays[ns:]):
            entry.extend(state)
            res = fn(*state, *args)
            outs.append(res[0])
            state = list(res[1:])
        return (mx.concatenate(outs, axis=1), *state, *entry)

    @run.vjp
    def run_vjp(primals, cotangents, outputs):
        cots = [mx.zeros_like(o) if c is None else c for c, o in zip(cotangents[:1 + ns], outputs[:1 + ns])]
        entry = outputs[1 + ns:]
        dos = mx.split(cots[0], bounds, axis=1)
        dstate = cots[1:]
        grads = [[] for _ in per_token]
        for k, args in reversed(list(enumerate(pieces(primals[ns:])))):
            prim = [*entry[k * ns:(k + 1) * ns], *args]
            if k < n - 1:
                prim = mx.depends(prim, dstate)
            g = mx.vjp(fn, prim, [dos[k], *dstate])[1]
            dstate = list(g[:ns])
            for j, gj in enumerate(g[ns:]):
                if per_token[j] or not grads[j]:
                    grads[j].append(gj)
                else:
                    grads[j][0] = grads[j][0] + gj
        out = [mx.concatenate(gl[::-1], axis=1) if per_token[j] else gl[0] for j, gl in enumerate(grads)]
        return (*dstate, *out)

    return run


def forward(rec: ir.Recurrence, inputs: dict, *, scale: float, initial_state=None, chunk_size: int | None = None,
            compute_dtype=None, tuning: Tuning | None = None):
    """Chunked forward of ``rec``: returns (o [B,T,H,V], final_state); see the module docstring.

    ``chunk_size`` (default: the tuning's, 64 on GPUs, 16 on the CPU) is rounded up to a power of two for scalar and
    key decays; it changes speed and memory, not the result. ``compute_dtype`` (default float32)
    exists for verification: ``mx.float64`` on the CPU runs the same chunked algebra in double
    precision, so tests can separate the algorithm's exactness from float32 rounding amplified by
    an ill-conditioned spec (a ratio readout with a tiny floor). ``o`` and the state then stay float64.
    ``tuning``: the dispatcher's (``recgen.ops``); by default that of MLX's default device, checked once."""
    dtype = compute_dtype or mx.float32
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise InputError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
    supported(rec)
    p = analyze(rec)
    tun = tuning or checked_for(p)
    sizes, S, z = _prepare(rec, inputs, initial_state, dtype)
    out_dtype = dtype if compute_dtype is not None else _out_dtype(rec, inputs)
    T = sizes.T
    has_z = rec.has_normalizer
    if T == 0 or sizes.B == 0:
        return _finish(rec, [], S, z, out_dtype, sizes, dtype)
    identity = p.feature_identity is not None and tun.feature_identity
    names = [x.name for x in rec.inputs]
    if (T == 1 and identity and compute_dtype is None
            and features.decodes(tun, sizes.Kin, sizes.V, p.feature_identity.degree)):
        outs = _features_decode_fn(rec, tun, float(scale), sizes, has_z, out_dtype)(
            S, *([z] if has_z else []), *(inputs[n] for n in names))
        return outs[0], ((outs[1], outs[2]) if has_z else outs[1])
    if T == 1 and compute_dtype is None and not tun.chunk_kernels:
        # decode without chunk kernels (the CPU): one step in MLX ops, fewer than the chunk algebra at C = 1
        return naive_loop(rec, inputs, scale=scale, initial_state=initial_state, tuning=tun)
    state = [S, z] if has_z else [S]
    args = [inputs[nm] for nm in names]  # cast to ``dtype`` inside the bodies (``_roles``): fused there
    C = chunk_size or (tun.key_chunk_size if p.decay_class == "key" else
                       tun.feature_chunk_size if identity else tun.chunk_size)
    C = pow2_ceil(min(C, T))  # speed and memory only, not the result
    degree, V1 = (p.feature_identity.degree, sizes.V + has_z) if identity else (0, 0)
    given = initial_state is not None
    if identity and features.attends(tun.feature_attention, degree, sizes.B * sizes.H, -(-T // C) * C, C,
                                     sympow_width(sizes.Kin, degree), sizes.Kin, V1, segment_budget(tun), given):
        body = _feature_attention_from if given else _feature_attention
        fn = _body(body, rec, tuple(names), float(scale), sizes, has_z, C, out_dtype, tun, tun.compile)
        seg = T  # its memory is a group of queries' scores (``attention_groups``); segments would carry the state
    elif identity:  # one tile of the expanded space at a time
        rows = feature_rows.rows_for(tun, sizes.Kin, dtype, C, V1, degree)
        # not ``whole``: on the H100 it held 0.16 GiB more at the training peak (1.58 against 1.42) for no measured
        # gain (4.41 against 4.35 ms, within the spread); its pieces (``inter``, the factors, the scores) replay
        fn = _body(_features, rec, tuple(names), float(scale), sizes, has_z, C, out_dtype, tun, tun.compile)
        per_token = features.workset_per_token(rows, sizes.B * sizes.H, sizes.Kin, sizes.V + has_z, C)
        seg = max(1, segment_budget(tun) // (per_token * C)) * C
    elif p.decay_class == "full":  # O(T·K·V) working set: the segment budget sets the stretch
        body = _full if rec.step.transition is None else _stepwise
        fn = _body(body, rec, tuple(names), float(scale), sizes, has_z, C, out_dtype, tun, False)
        per_token = 4 * sizes.B * sizes.H * sizes.K * sizes.V * WORKSET_FACTOR["full"]
        seg = max(1, segment_budget(tun) // per_token)
    else:
        body = _fast if p.parallel_core else _general
        fn = _body(body, rec, tuple(names), float(scale), sizes, has_z, C, out_dtype, tun, tun.compile, True)
        per_token = 4 * sizes.B * sizes.H * (sizes.K + sizes.V + C) * WORKSET_FACTOR[p.decay_class]
        seg = max(1, segment_budget(tun) // (per_token * C)) * C
    if seg >= T:
        outs = fn(*state, *args)
    else:
        outs = _segmented(rec, fn, list(range(seg, T, seg)), len(state))(*state, *args)
    o = outs[0]
    return o, ((outs[1], outs[2]) if has_z else outs[1])


def _time_splitter(bounds):
    """Split along T with a VJP that is one concatenation (MLX's own split/slice VJPs scatter
    each piece's cotangent into a full-size zero array: O(T²/C) memory and time)."""

    @mx.custom_function
    def split(x):
        return tuple(mx.split(x, bounds, axis=1))

    @split.vjp
    def split_vjp(primals, cotangents, outputs):
        cots = [mx.zeros_like(o) if c is None else c for c, o in zip(cotangents, outputs)]
        return (mx.concatenate(cots, axis=1),)

    return split


def _split_time(rec, xs, bounds):
    """Per-token inputs split along T once; parameters repeated per chunk."""
    n = len(bounds) + 1
    split = _time_splitter(bounds) if bounds else None
    parts = {}
    for x in rec.inputs:
        if x.per_token:
            parts[x.name] = list(split(xs[x.name])) if bounds else [xs[x.name]]
        else:
            parts[x.name] = [xs[x.name]] * n
    return parts


def _finish(rec, ys, S, z, out_dtype, sizes, dtype=mx.float32):
    if ys:
        o = ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)
    else:
        o = mx.zeros((sizes.B, sizes.T, sizes.H, sizes.V), dtype=dtype)  # B = 0 or T = 0
    return o.astype(out_dtype), ((S, z) if rec.has_normalizer else S)


def naive_loop(rec: ir.Recurrence, inputs: dict, *, scale: float, initial_state=None, tuning: Tuning | None = None):
    """The per-token MLX loop of the same spec (the benchmark baseline; memory grows with T)."""
    tun = tuning or checked_for(analyze(rec))
    p = plan(rec, tun.pow2_exp)
    sizes, S, z = _prepare(rec, inputs, initial_state)
    xs = {k: v.astype(S.dtype) for k, v in inputs.items()}
    out_dtype = _out_dtype(rec, inputs)
    T, B, H, K, V = sizes.T, sizes.B, sizes.H, sizes.K, sizes.V
    parts = _split_time(rec, xs, list(range(1, T)))
    ys = []
    for step in range(T):
        chunk = {nm: parts[nm][step] for nm in parts}
        t = evaluate(p, bind(p, chunk, H), float(scale), B, H, 1, K, V, S.dtype)
        ld = t["logdecay"]
        if p.decay_class == "scalar":
            D = core.exp(ld, tun.pow2_exp)[..., None]                   # [B,H,1,1]
        elif p.decay_class == "key":
            D = core.exp(ld, tun.pow2_exp)[:, :, 0, :, None]            # [B,H,K,1]
        else:
            D = core.exp(ld, tun.pow2_exp)[:, :, 0]                     # [B,H,K|1,V]
        y, S = core.state_step(S, D, t["r"], t["u"], t["w"], t.get("a"), t.get("b"), rec.transition_before_decay,
                               rec.step.readout_before_update)  # y [B,H,1,V]
        n = None
        if rec.has_normalizer:
            zl = t["zlogdecay"]
            d = core.exp(zl, tun.pow2_exp)[..., 0][..., None] if p.zdecay_class == "scalar" else core.exp(zl, tun.pow2_exp)[:, :, 0]
            z = d * z + t["zupdate"][:, :, 0]
            n = (t["r"][:, :, 0] * z).sum(-1)[..., None]  # [B,H,1]
        ys.append(_readout(p, rec, t, y, n))
    return _finish(rec, ys, S, z, out_dtype, sizes)
