r"""Sources and layouts of the chunk kernels: the pieces of the chunked core that MLX ops cannot make fast.

They are spec-free matrix algebra, so each is a jinja frame (``templates/chunk_*.j2``) rendered through a
``Dialect`` with no printed math. What each computes, and where the core uses it: ``recgen.runtime.chunk_kernels``.

- ``inverse_source``: (I − L)^{-1} of a strictly lower C×C block per threadgroup, by forward substitution.
- ``scan_source``: carried_c = S,  Y_c = X_c + A_c S,  S ← g_c ⊙ S + B_cᵀ Y_c (+ E_c), over the chunks in order
  or in reverse; its ``ScanVariant`` says which terms exist and which frame runs it: ``chunk_scan_mma.j2`` on
  the dialect's 16×8×8 fragment multiply-add (tensor cores on CUDA), else ``chunk_scan.j2`` on FMAs.
- ``pair_source`` / ``pair_grad_source``: M[t, s] = Σ_i X_ti Y_si Γ_i(t, s) of a key-vector decay and its
  gradients, Γ factored over blocks of 16 tokens into products of decays (the diagonal blocks carried along a
  row by one multiplication per step; the other blocks' products on FMAs, or with ``mma`` on fragments).
- ``sympow_source``: the degree-2 symmetric power feature map φ(x) (``recgen.spec.features.sympow``) and its
  gradient, elementwise, for the chunked form of feature-map specs (MLX forms φ by gathers, and its gradient by a
  scatter-add with D + 1 writers an entry).
- ``decayed_scores_source``: a scalar decay's scores between each chunk's tokens, P^p ⊙ e^{Σ_{s<τ≤t} l_τ}, the
  exponent a sum of the spanned log-decays, and their gradients (the feature-map form's in-chunk scores, (qᵀk)^p
  decayed; in MLX ops a broadcast, a scan down the rows, selects and products over [C, C] a chunk, each way).
- ``feature_decode_source``: one decode step of a feature map's state in φ's packed rows, split over K (blocks of
  rows a threadgroup, each block's partial readout summed by the caller), for specs through the kernel identity.
- ``feature_states_source`` / ``feature_out_source`` / ``feature_jac_source`` (fragment frames): a chunk's products
  over a feature map's packed rows, φ(X)ᵀY and φ(X)S, with φ formed as the A fragments are read (never written), and
  the gradient through them, dX = 2 M X with M the symmetric matrix of the state's quadratic form.
- ``decay_factors_source``: a scalar decay's factors in that form (to each token from its chunk's start, from each
  token to its chunk's end, and between chunks [L | l0]) and their gradient, one threadgroup a chunk.
- ``feature_mix_source``: the backward's products over chunks of that form, the entry states LL X, their cotangents
  LLᵀ F and the decays' gradient F Xᵀ, in one pass over the expanded states (each element read once).
- ``ut_mma_source`` and ``out_mma_source`` (fragment frames): the delta rule's UT transform
  (A = M_b̃u, T = (I − A)^{-1}, T w, T (b̃ ⊙ P)) and the readout y = (r ⊙ P) S_c + M_ru Z, each one kernel per
  chunk; for a scalar decay A or M_ru is formed in threadgroup memory (shared helpers in ``_fragments.j2``), for a
  key-vector decay (``key``) it comes from the pair kernels and P is per key element. ``out_async_source`` and
  ``ut_async_source``: the scalar decay's readout and UT transform with their blocks staged two deep by
  asynchronous copies (``Dialect.copy16``); the readout a key-vector decay's too (``key``).
- ``bwd_mma_source`` (scalar decays, fragment frame): the backward's pass after its reverse scan, per chunk: the
  pair gradients through Γ and the elementwise tail (dr, du, db̃ and the log-decays' reverse cumulative sum).
- ``bwd_key_source`` (key-vector decays): the backward's elementwise tail after the pair kernels' gradients, one
  thread a key column of a chunk.

A ``*_layout`` gives a kernel's template constants for a size, or says it has none (then the core keeps MLX
ops). Layout constants that were tuned on hardware (columns per threadgroup) come in as arguments from the
``recgen.tuning.Tuning``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

from ..version import __version__
from .backends import get
from .render import KernelSource, template_env

BV = 32           # value columns per FMA-scan threadgroup (4 per thread)
MAX_NR = 16       # row groups of the FMA scan (threads = row groups × BV/4): 128 threads at K = 128
MMA_NW = 4        # SIMD groups per threadgroup of the fragment scan (most; fewer where K needs)


@dataclass(frozen=True)
class ScanVariant:
    """Which terms a chunk scan has and which frame runs it.

    ``a``: Y = X + A S (without it Y = X: the forward diagonal scan writes no Y); ``b``: the B term of the
    update (without it S <- g S + E: the backward diagonal scan); ``e``: an E term given as a product;
    ``p``: one more term Pa_cᵀ Pb_c given as its factors; ``dg``: also the row sums of carried ⊙ St (the
    backward's decay gradient, never formed); ``q``: B's rows scaled as read (the forward's u ⊙ Q); ``aq``, ``pq``:
    A's and Pa's rows scaled as read (the backward's u ⊙ Q and r ⊙ P); ``pf``: each group's fragments of A and X
    loaded a chunk ahead (needs one item of Y a group: ``scan_prefetches``); ``hoist``: every operand that does
    not depend on the state (A's and X's fragments where there is an A term, as ``pf`` needs them; the products'
    transposed rows; E's and St's elements) loaded into registers at the start of a chunk's step, so their latency overlaps the state
    copy and Y's product instead of stalling the loops that use them; ``reverse``: over the chunks in
    reverse; ``vec``: 16-byte column accesses (FMA frame, V % 4 == 0); ``mma``: the fragment frame; ``ml``: the
    row-scaled operands (those of q, aq, pq: roles read from the model's key inputs) read in the model's layout
    [B, n C, HK, K] (template constants H, HK, GB); ``s16``: carried and Y written in type ST (template constant, a
    16-bit type: the chunk states and Z kept as FLA keeps h and v_new), S itself in float; ``w16`` (the hoisted
    scans with s16: forward with B and q, A or not, or A-free without q, or in reverse with A and B, P or both): the
    products on the dialect's wide multiply-add, their operands in type ST (``Dialect.mma16``); ``wl`` (with w16, K a
    multiple of 32): A's rows read 16 bytes a load (``Dialect.load8``, the keys permuted as ``Fragments16`` says) and
    the state's and Y's threadgroup copies transposed (template constants LDK, LDY), each B pair one word; ``vc`` (with
    wl; BV a multiple of 32 and YCT of 4: ``scan_value_quads``): the columns of X, Y and the states a lane holds, in
    each four column tiles, are eight adjacent ones in memory, read and written 16 bytes at a time (the threadgroup
    copies keep the tiles' order); ``xm`` (the A-free forward on w16, with ml: simple GLA's): X the model's value
    input as it is, [B, n C, H, V]; ``nx`` (the wide forward scan with A, B and q, not ``pf``): every state-free
    operand of a chunk (A's and X's fragments, B's rows, the decays, Bq's scales of Y) loaded a whole step ahead
    into a second set of registers. p, dg, q, aq, pq, pf, hoist, ml, s16, w16, wl, vc, xm and nx exist on the
    fragment frame only."""

    a: bool = True
    b: bool = True
    e: bool = False
    reverse: bool = False
    p: bool = False
    dg: bool = False
    q: bool = False
    aq: bool = False
    pq: bool = False
    pf: bool = False
    hoist: bool = False
    vec: bool = False
    mma: bool = False
    ml: bool = False
    s16: bool = False
    w16: bool = False
    wl: bool = False
    vc: bool = False
    xm: bool = False
    nx: bool = False

    def __post_init__(self):
        if not (self.a or self.b):
            raise ValueError("chunk_scan: needs A or B")
        if self.q and not self.b:
            raise ValueError("chunk_scan: row scales Bq need a B term")
        if (self.aq or self.pf) and not self.a:
            raise ValueError("chunk_scan: row scales Aq and prefetching need an A term")
        if self.pq and not self.p:
            raise ValueError("chunk_scan: row scales Pq need a P term")
        if (self.p or self.dg or self.q or self.aq or self.pf or self.hoist or self.ml or self.s16) and not self.mma:
            raise ValueError("chunk_scan: P, dg, Bq, Aq terms, prefetching, hoisting, the model's layout and 16-bit "
                             "outputs need the fragment frame")
        if self.ml and not (self.q or self.aq or self.pq or self.xm):
            raise ValueError("chunk_scan: the model's layout (ml) is the row-scaled operands' and X's: needs Bq, Aq, "
                             "Pq or xm")
        forward = not (self.reverse or self.p or self.dg or self.aq) and self.b and (self.q or not self.a)
        reverse = self.reverse and not self.q and (self.b or self.p)
        if self.w16 and not (self.hoist and self.s16 and self.mma and not self.e and (forward or self.a and reverse)):
            raise ValueError("chunk_scan: the wide multiply-add (w16) is the hoisted scans' with 16-bit states, no E: "
                             "forward with B and Bq (or A-free without), or in reverse with A and without Bq "
                             "(with B, P or both)")
        if self.wl and not self.w16:
            raise ValueError("chunk_scan: wide loads (wl) are the wide multiply-add's (w16)")
        if self.vc and not self.wl:
            raise ValueError("chunk_scan: columns a lane's eight in memory (vc) go with wide loads (wl)")
        if self.xm and not (self.ml and self.w16 and not self.a):
            raise ValueError("chunk_scan: X in the model's layout (xm) is the A-free wide scan's, with ml")
        if self.nx and not (self.w16 and forward and self.a and not self.pf):
            raise ValueError("chunk_scan: loading a step ahead (nx) is the wide forward scan's with A, B and Bq, "
                             "without pf")

    @property
    def kind(self) -> str:
        """The kernel name's variant part."""
        return (("scan_mma" if self.mma else "scan") + ("" if self.a else "_noa") + ("" if self.b else "_nob")
                + ("_q" if self.q else "") + ("_aq" if self.aq else "") + ("_e" if self.e else "")
                + ("_p" if self.p else "") + ("_pq" if self.pq else "") + ("_pf" if self.pf else "")
                + ("_ho" if self.hoist else "")
                + ("_dg" if self.dg else "") + ("_ml" if self.ml else "") + ("_s16" if self.s16 else "")
                + ("_w16" if self.w16 else "") + ("_wl" if self.wl else "") + ("_vc" if self.vc else "")
                + ("_xm" if self.xm else "") + ("_nx" if self.nx else "") + ("_rev" if self.reverse else "")
                + ("_v4" if self.vec else ""))

    @property
    def inputs(self) -> tuple[str, ...]:
        return (("S0",) + (("A",) if self.a else ()) + (("Aq",) if self.aq else ()) + ("X",)
                + (("Bm",) if self.b else ()) + (("Bq",) if self.q else ()) + ("g",) + (("E",) if self.e else ())
                + (("Pa", "Pb") if self.p else ()) + (("Pq",) if self.pq else ()) + (("St",) if self.dg else ())
                + ("rt",))

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("carried", "Y", "S_end") + (("dgp",) if self.dg else ())


def has_layout(layout, *args, **kwargs) -> bool:
    """Whether ``layout(*args, **kwargs)`` gives a layout (each kernel family's layout raises ValueError where it has
    none: sizes past its tiles or the dialect's threadgroup memory)."""
    try:
        layout(*args, **kwargs)
    except ValueError:
        return False
    return True


# -- sources ---------------------------------------------------------------------------------------
def _source(d, template: str, kind: str, banner: str, inputs: tuple, outputs: tuple, template_args: tuple,
            helpers: str = "", **ctx) -> KernelSource:
    body = template_env().get_template(template).render(d=d, banner=banner, **ctx)
    header = f"// generated by recgen {__version__}: chunk kernel {kind}: do not edit\n" + helpers
    digest = hashlib.sha256((header + body).encode()).hexdigest()[:10]
    return KernelSource(f"recgen_chunk_{kind}_{d.name}_{digest}", header, body, inputs, outputs, template_args)


def _wide_dialect(d, kernel: str, w16: bool):
    """Refuse ``w16`` (the wide multiply-add) where the dialect has none (``Dialect.mma16``)."""
    if w16 and not d.mma16:
        raise ValueError(f"{kernel}: the {d.name} dialect has no wide multiply-add (w16)")


@lru_cache(maxsize=None)
def scan_source(dialect: str, v: ScanVariant) -> KernelSource:
    """The chunk scan of variant ``v`` (see ``ScanVariant``) in its frame."""
    d = get(dialect)
    _wide_dialect(d, "chunk_scan_mma", v.w16)
    flags = dict(has_e=v.e, reverse=v.reverse, has_a=v.a, has_b=v.b)
    if v.mma:
        return _source(d, "chunk_scan_mma.j2", v.kind, "chunk scan of the chunked core, fragment multiply-adds",
                       v.inputs, v.outputs, (), helpers=d.mma_prelude, has_p=v.p, has_dg=v.dg, has_q=v.q,
                       has_aq=v.aq, has_pq=v.pq, pf=v.pf, hoist=v.hoist, ml=v.ml, s16=v.s16, w16=v.w16, wl=v.wl,
                       vc=v.vc, xm=v.xm, nx=v.nx, **flags)
    return _source(d, "chunk_scan.j2", v.kind, "chunk scan of the chunked core", v.inputs, v.outputs, (),
                   vec=v.vec, **flags)


@lru_cache(maxsize=None)
def inverse_source(dialect: str) -> KernelSource:
    return _source(get(dialect), "chunk_inverse.j2", "tril_inverse",
                   "(I - L)^{-1} of strictly lower chunk blocks", ("L",), ("Tm",), ())


@lru_cache(maxsize=None)
def decayed_scores_source(dialect: str, grad: bool = False) -> KernelSource:
    """A scalar decay's scores between each chunk's tokens, A = P^PW ⊙ Γ with Γ[t, s] = e^{Σ_{s<τ≤t} l_τ} for s ≤ t
    (0 above), from P [N, C, C] and the log-decays l [N, C] (template constants C, PW, RB, NB, NT); or its gradients
    (P, dA, l -> dP [N, C, C] and Dl [N, NB, C], each row block's part of the log-decays' gradient)."""
    if grad:
        return _source(get(dialect), "chunk_decayed_scores.j2", "decayed_scores_grad",
                       "gradients of the decayed scores between a chunk's tokens", ("P", "dA", "l"), ("dP", "Dl"), (),
                       grad=True)
    return _source(get(dialect), "chunk_decayed_scores.j2", "decayed_scores", "decayed scores between a chunk's tokens",
                   ("P", "l"), ("A",), (), grad=False)


@lru_cache(maxsize=None)
def decays_source(dialect: str, before: bool = False, scaled: tuple = (), pq: bool = True, d: bool = True,
                  lanes: bool = False, q: bool = True, yt: bool = False, ml: bool = False) -> KernelSource:
    """A decay's geometry from its log-decays l [N, C, F] (template constants C, F and U or E, NT): G [N, F], the
    chunk's decay; with ``d`` the per-token decays D; with ``pq`` P and Q from sums anchored at the chunk's start and
    end; ``before``: also Pe_t = P_{t-1} (Pe_0 = 1). ``scaled``: one of "P", "Q", "Pe" for each role X_i [N, C, F] given
    (any float type), Y_i = X_i ⊙ that decay in float32 (``yt``: in type YT, a template constant). ``lanes``
    (F = 1): a SIMD group a chunk (template constant E = ceil(C / 32), its tokens a lane), else a thread a (chunk,
    column), U tokens' loads at a time. ``q`` off (with ``pq``): P without Q (a forward that reads no Q). ``ml`` (not
    ``lanes``): l and the roles read in the model's layout, l [B, T, H, F] and X_i [B, T, HK, F] (template constants
    H, HK, NCH, GB; ``chunk_kernels._model_consts``), the outputs in the chunks'."""
    if any(w not in ("P", "Q", "Pe") for w in scaled):
        raise ValueError(f"decays: scaled roles take P, Q or Pe, not {scaled}")
    if ml and lanes:
        raise ValueError("decays: the model's layout (ml) is the per-column form's (F > 1), not lanes'")
    xs = tuple(f"X{i}" for i in range(len(scaled)))
    q = q and pq
    kind = ("decays" + ("_lanes" if lanes else "") + ("" if d else "_nod") + ("" if pq else "_g")
            + ("_noq" if pq and not q else "")
            + ("_pe" if before else "") + "".join("_" + w.lower() for w in scaled) + ("_yt" if yt else "")
            + ("_ml" if ml else ""))
    outs = ("D",) * d + ("P",) * pq + ("Q",) * q + ("G",) + ("Pe",) * before + tuple(f"Y{i}" for i in range(len(xs)))
    return _source(get(dialect), "chunk_decays.j2", kind, "decay geometry over chunks", ("l",) + xs + ("rt",),
                   outs, (), before=before, scaled=scaled, pq=pq, with_d=d, with_q=q, lanes=lanes, yt=yt, ml=ml,
                   fwd_x=[i for i, w in enumerate(scaled) if w != "Q"],  # the roles each walk loads
                   bwd_x=[i for i, w in enumerate(scaled) if w == "Q"])


@lru_cache(maxsize=None)
def out_mma_source(dialect: str, yt: bool = False, key: bool = False, m2: bool = False, uf: bool = False,
                   ml: bool = False, l2: bool = False, s16: bool = False) -> KernelSource:
    """``yt``: y written in the model's layout [B, T, H, V] and its type (template constants H, NCH, OT); ``key``: a
    key-vector decay's readout, M given (from the pair kernels) and P per key element, y the only output; ``m2``
    (with ``key``): the general rank-1 core's, R given scaled by its decays and a second pair M2 with values Z2;
    ``uf`` (a scalar decay's): U is a key x read with a factor per token Uf, u = Uf ⊙ x (never formed); ``ml`` (with
    ``uf`` and ``yt``): R and U read in the model's layout [B, T, HK, K] (template constants HK, GB); ``l2``: each
    staging step hints the next one's lines into L2 (``Dialect.prefetch``); ``s16`` (a scalar decay's): M written in
    type ST (template constant), the 16-bit states' (``Tuning.states_16bit``)."""
    if ml and not (uf and yt):
        raise ValueError("chunk_out_mma: the model's layout (ml) is the factor-read form's, writing y so (uf, yt)")
    if s16 and key:
        raise ValueError("chunk_out_mma: M in 16 bits (s16) is the scalar decay form's (a key-vector decay's is given)")
    if m2 and not key:
        raise ValueError("chunk_out_mma: a second pair (m2) is the key-vector decay form's")
    if uf and key:
        raise ValueError("chunk_out_mma: factor reads (uf) are the scalar decay form's")
    d = get(dialect)
    l2 = l2 and bool(d.prefetch)  # no hints where the dialect has none: the same kernel
    ins = (("R", "Mi", "Z", "St", "M2", "Z2", "Rs") if m2 else ("R", "Mi", "Z", "St", "Pk", "Rs")) if key else \
        (("R", "U", "Uf") if uf else ("R", "U")) + ("Z", "St", "logd", "Rs")
    kind = ("out_mma" + ("_key" if key else "") + ("_m2" if m2 else "") + ("_uf" if uf else "") + ("_ml" if ml else "")
            + ("_yt" if yt else "") + ("_l2" if l2 else "") + ("_s16" if s16 else ""))
    return _source(d, "chunk_out_mma.j2", kind, "chunk readout of the chunked core, fragment multiply-adds", ins,
                   ("Y",) if key else ("Y", "M"), (), helpers=d.mma_prelude, yt=yt, key=key, m2=m2, uf=uf, ml=ml, l2=l2,
                   s16=s16)


@lru_cache(maxsize=None)
def out_async_source(dialect: str, yt: bool = False, uf: bool = False, ml: bool = False,
                     w16: bool = False, zm: bool = False, key: bool = False) -> KernelSource:
    """The scalar-decay readout of ``out_mma_source`` with its operands staged two buffers deep by the dialect's
    16-byte copies (``chunk_out_async.j2``; on CUDA cp.async): each block's load overlaps the previous block's
    products. ``yt``, ``uf``, ``ml`` as there; the types RT, UT, ZT of R, U and Z are template constants
    (``out_async_layout``). ``w16``: R, U, Z and S_c in one 16-bit type RT, multiplied by the dialect's wide
    multiply-add (``Dialect.mma16``). ``zm`` (with ``ml``): Z is the model's value input [B, n C, H, V] as it is
    (simple GLA's z = v; without factor reads, ``ml`` needs it). ``key``: a key-vector decay's readout as
    ``out_mma_source``'s (M given, P per key element staged beside R, in U's slot: type UT; y the only output);
    with ``ml`` (and ``zm``) R and Z read in the model's layout, M and P in the chunks'."""
    if key and (uf or w16):
        raise ValueError("chunk_out_async: a key-vector decay's readout (key) reads float32 fragments, no factors "
                         "(no uf or w16)")
    if ml and not (yt and (uf or zm)):
        raise ValueError("chunk_out_async: the model's layout (ml) writes y so (yt), with factor reads (uf) or Z in it "
                         "too (zm)")
    if zm and not ml:
        raise ValueError("chunk_out_async: Z in the model's layout (zm) goes with r and u in it (ml)")
    d = get(dialect)
    keys = ("R", "U", "Uf") if uf else ("R", "U")
    ins = ("R", "Mi", "Z", "St", "Pk", "Rs") if key else keys + ("Z", "St", "logd", "Rs")
    _wide_dialect(d, "chunk_out_async", w16)
    kind = ("out_async" + ("_key" if key else "") + ("_uf" if uf else "") + ("_ml" if ml else "")
            + ("_zm" if zm else "") + ("_yt" if yt else "") + ("_w16" if w16 else ""))
    return _source(d, "chunk_out_async.j2", kind, "chunk readout of the chunked core, fragment multiply-adds, "
                   "operands staged by asynchronous copies", ins, ("Y",) if key else ("Y", "M"), (),
                   helpers=d.mma_prelude + d.copy_prelude, yt=yt, uf=uf, ml=ml, w16=w16, zm=zm, key=key)


@lru_cache(maxsize=None)
def ut_mma_source(dialect: str, key: bool = False, tb: bool = False, uf: bool = False, o16: bool = False,
                  ml: bool = False, l2: bool = False, s16: bool = False) -> KernelSource:
    """``key``: a key-vector decay's UT transform, A given (from the pair kernels) and P per key element; ``tb``
    (with ``key``): the general rank-1 core's, Uw = Tm (B w) from B given (``chunked.rank1``); ``uf``: both roles
    read from one key x, u = Uf ⊙ x with a factor per token and b̃ = Bf[0] x (with ``key``, A given: Bt is x, read
    with Bf[0]); ``o16`` (with ``uf``, a scalar decay's): Uw and Wb written in type OT (template constant); ``ml``
    (with ``uf``, a scalar decay's): x and W read in the model's layout (template constants H, HK, NCH, GB); ``l2``:
    each staging step hints the next one's lines into L2 (``Dialect.prefetch``); ``s16`` (with ``o16``): Tm written
    in type ST (template constant, ``Tuning.states_16bit``)."""
    if ml and (key or not uf):
        raise ValueError("chunk_ut_mma: the model's layout (ml) is the scalar decay's factor-read form's")
    if o16 and (key or not uf):
        raise ValueError("chunk_ut_mma: 16-bit outputs (o16) are the scalar decay's factor-read form's")
    if s16 and not o16:
        raise ValueError("chunk_ut_mma: a 16-bit Tm (s16) comes with 16-bit U and W (o16)")
    if tb and not key:
        raise ValueError("chunk_ut_mma: B given (tb) is the key-vector decay form's")
    if uf and tb:
        raise ValueError("chunk_ut_mma: factor reads (uf) are the delta rule's form, not the general rank-1 core's")
    d = get(dialect)
    l2 = l2 and bool(d.prefetch)  # no hints where the dialect has none: the same kernel
    ins = (("Ai", "Bm", "W", "Bt", "Pk") if tb else ("Ai", "W", "Bt", "Pk") + (("Bf",) if uf else ())) if key else \
        (("U", "Uf", "Bf", "W", "logd") if uf else ("Bt", "U", "W", "logd"))
    kind = ("ut_mma" + ("_key" if key else "") + ("_tb" if tb else "") + ("_uf" if uf else "") + ("_o16" if o16 else "")
            + ("_s16" if s16 else "") + ("_ml" if ml else "") + ("_l2" if l2 else ""))
    return _source(d, "chunk_ut_mma.j2", kind, "UT transform of the chunked core's delta rule, fragment multiply-adds",
                   ins, ("Tm", "Uw", "Wb"), (), helpers=d.mma_prelude, key=key, tb=tb, uf=uf, o16=o16, ml=ml, l2=l2,
                   s16=s16)


@lru_cache(maxsize=None)
def ut_async_source(dialect: str, uf: bool = False, o16: bool = False, ml: bool = False,
                    s16: bool = False, w16: bool = False) -> KernelSource:
    """The scalar-decay UT transform of ``ut_mma_source`` with its operands staged two buffers deep by the dialect's
    16-byte copies (``chunk_ut_async.j2``; on CUDA cp.async). ``uf``, ``o16``, ``ml``, ``s16`` as there; the types
    UT, WT (and BT without ``uf``) of the inputs are template constants (``ut_async_layout``). ``w16``: the inputs in
    one 16-bit type, multiplied by the dialect's wide multiply-add (``Dialect.mma16``)."""
    if ml and not uf:
        raise ValueError("chunk_ut_async: the model's layout (ml) is the factor-read form's")
    if o16 and not uf:
        raise ValueError("chunk_ut_async: 16-bit outputs (o16) are the factor-read form's")
    if s16 and not o16:
        raise ValueError("chunk_ut_async: a 16-bit Tm (s16) comes with 16-bit U and W (o16)")
    d = get(dialect)
    _wide_dialect(d, "chunk_ut_async", w16)
    ins = ("U", "Uf", "Bf", "W", "logd") if uf else ("Bt", "U", "W", "logd")
    kind = ("ut_async" + ("_uf" if uf else "") + ("_o16" if o16 else "") + ("_s16" if s16 else "")
            + ("_ml" if ml else "") + ("_w16" if w16 else ""))
    return _source(d, "chunk_ut_async.j2", kind, "UT transform of the chunked core's delta rule, fragment multiply-adds, "
                   "operands staged by asynchronous copies", ins, ("Tm", "Uw", "Wb"), (),
                   helpers=d.mma_prelude + d.copy_prelude, uf=uf, o16=o16, ml=ml, s16=s16, w16=w16)


@lru_cache(maxsize=None)
def bwd_mma_source(dialect: str, delta: bool, uf: bool = False, ml: bool = False, prods: bool = False,
                   scores: bool = False, wl: bool = False) -> KernelSource:
    """The backward pass after the reverse scan (``chunk_bwd_mma.j2``); ``delta``: with the delta rule's b̃ terms;
    ``uf`` (with ``delta``): u = Uf ⊙ x and b̃ = Bf[0] x read from one key x, and the gradients of x and Uf written;
    ``ml`` (with ``uf``, or without the delta rule): R and x (U) read in the model's layout [B, T, HK, K], dR and dX
    (dU) written in it per value head [B, T, H, K] (template constants H, HK, NCH, GB); ``prods``: the products over
    values DUQ = Z dS_nextᵀ, DRP = dy S_cᵀ (DR = Δ S_cᵀ) formed in the pass from Zv, dYv (Dv) [C, V] and Sv, dSv
    [K, V] (template constant V);
    ``scores``: the pair cotangents dMR = dy Zᵀ (dMA = Δ Zᵀ) formed in the pass from Zv, dYv (Dv) [C, V] of the
    16-bit type ZT on the dialect's wide multiply-add (``Dialect.mma16``), not read; ``wl`` (with ``scores``, V a
    multiple of 32): those wide products read 16 bytes a load (``Dialect.load8``)."""
    if uf and not delta:
        raise ValueError("chunk_bwd_mma: factor reads (uf) are the delta rule's form")
    if ml and delta and not uf:
        raise ValueError("chunk_bwd_mma: the model's layout (ml) with the delta rule is the factor-read form's")
    if wl and not scores:
        raise ValueError("chunk_bwd_mma: wide loads (wl) are the wide products' (scores)")
    d = get(dialect)
    _wide_dialect(d, "chunk_bwd_mma", scores)
    roles = ("U", "Uf", "Bf") if uf else ("U", "Bt") if delta else ("U",)
    rows = ("Zv", "dYv", "Dv") if delta else ("Zv", "dYv")  # [C, V] each, read by the scores or the products
    formed = ("DUQ", "DRP", "DR") if delta else ("DUQ", "DRP")  # MLX's products, read
    products = ((() if scores else rows) + ("Sv", "dSv")) if prods else formed
    ins = (rows if scores else ("dMA", "dMR") if delta else ("dMR",)) + ("R",) + roles + products + ("logd", "DG", "Rs")
    outs = ("dRo", "dXo", "dFo", "dl") if uf else ("dRo", "dUo", "dBo", "dl") if delta else ("dRo", "dUo", "dl")
    kind = ("bwd_mma" + ("_delta" if delta else "") + ("_uf" if uf else "") + ("_ml" if ml else "")
            + ("_pv" if prods else "") + ("_sc" if scores else "") + ("_wl" if wl else ""))
    return _source(d, "chunk_bwd_mma.j2", kind, "backward of the chunked core after its reverse scan, fragment "
                   "multiply-adds", ins, outs, (), helpers=d.mma_prelude, delta=delta, uf=uf, ml=ml, prods=prods,
                   scores=scores, wl=wl)


@lru_cache(maxsize=None)
def bwd_key_source(dialect: str, delta: bool, rank1: bool = False, before: bool = False, uf: bool = False,
                   running: bool = False, ml: bool = False) -> KernelSource:
    """A key-vector decay's backward tail (``chunk_bwd_key.j2``); ``delta``: with the delta rule's b̃ terms; ``rank1``:
    the general rank-1 core's (a and b, ``before``: the transition before the decay); ``uf`` (with ``delta``): u =
    Uf ⊙ x and b̃ = Bf[0] x read from one key x, the gradients of x and (a part of) Uf written; ``running``: dl
    written as its reverse sum goes, the chunk's last term added after (no dG staged). ``ml`` (the plain form): R and
    U read in the model's layout [B, T, HK, K], L read and dR, dU, dl written in it per value head [B, T, H, K]
    (template constants H, HK, NCH, GB)."""
    if uf and (rank1 or not delta):
        raise ValueError("chunk_bwd_key: factor reads (uf) are the delta rule's form")
    if ml and (delta or rank1 or uf or running):
        raise ValueError("chunk_bwd_key: the model's layout (ml) is the plain form's (no delta, rank1, uf, running)")
    if uf:
        ins = ("R", "U", "Uf", "Bf", "L", "DRX", "DUX", "DBX", "DRP", "DUQ", "DR", "DG", "Rs")
        outs = ("dRo", "dXo", "dFp", "dl")
        kind = "bwd_key_delta_uf"
    elif rank1:
        ins = ("R", "U", "A", "B", "L", "DRX", "DUX", "DAX", "DBX", "DRP", "DUQ", "DAQ", "DBP", "DG", "Rs")
        outs = ("dRo", "dUo", "dAo", "dBo", "dl")
        kind = "bwd_key_rank1" + ("_before" if before else "")
    else:
        ins = (("R", "U", "Bt", "L", "DRX", "DUX", "DBX", "DRP", "DUQ", "DR") if delta
               else ("R", "U", "L", "DRX", "DUX", "DRP", "DUQ")) + ("DG", "Rs")
        outs = ("dRo", "dUo", "dBo", "dl") if delta else ("dRo", "dUo", "dl")
        kind = "bwd_key" + ("_delta" if delta else "")
    return _source(get(dialect), "chunk_bwd_key.j2", kind + ("_run" if running else "") + ("_ml" if ml else ""),
                   "elementwise tail of the chunked core's backward, key-vector decay", ins, outs, (),
                   delta=delta and not rank1, rank1=rank1, before=before, uf=uf, running=running, ml=ml)


def bwd_key_supported(dialect: str, C: int) -> bool:
    """Whether the key-decay tail has a layout for chunks of C tokens: P and dG of 32 columns staged (2 × 32 C floats)
    fit the dialect's threadgroup memory (C ≤ 64 on both)."""
    return 1 <= C <= 64 and 2 * 32 * C * 4 <= get(dialect).smem_bytes


def _pair_suffix(strict: bool, dual: bool, quad: bool, mma: bool, fold: bool) -> str:
    """The pair kernels' name suffix: the dual form's first pair is strict unless named otherwise (the delta rule's
    A); a transition before the decay pairs b one token earlier with s <= t (``chunked.rank1``); the quad form pairs
    both X operands with a second Y too; then the fragment and folded forms."""
    if quad:
        form = "_quad" if strict else "_quad_nonstrict"
    elif dual:
        form = "_dual" if strict else "_dual_nonstrict"
    else:
        form = "_strict" if strict else ""
    return form + ("_mma" if mma else "") + ("_fold" if fold else "")


def _pair_operands(dual: bool, quad: bool) -> tuple[tuple, tuple]:
    """(X operands, Y operands) of the pair kernels: quad is the dual form with a second Y (Yb)."""
    return ("X", "X2") if dual or quad else ("X",), ("Y", "Yb") if quad else ("Y",)


def _pair_forward_io(dual: bool, quad: bool, scaled: bool) -> tuple[tuple, tuple]:
    """(inputs, outputs) of the forward pair kernels, both forms: every X and Y, the decays, X's scale where
    ``scaled``, the chunk count; a pair M for each (Y, X)."""
    xs, ys = _pair_operands(dual, quad)
    return (xs + ys + ("dk",) + (("Xsc",) if scaled else ()) + ("rt",),
            tuple("M" + x[1:] + y[1:] for y in ys for x in xs))


@lru_cache(maxsize=None)
def pair_source(dialect: str, strict: bool, dual: bool = False, mma: bool = False, quad: bool = False,
                fold: bool = False, scaled: bool = False) -> KernelSource:
    """M of X (pairs s < t where ``strict``); ``dual``: also M2 of X2 (s <= t) beside M of X; ``quad``: the dual
    form's two pairs with Y and with Yb (M, M2, Mb, M2b: the X pairs strict where ``strict``); ``mma``: the earlier
    blocks' products on fragment multiply-adds (blocks of 16 tokens; template constant FI: items a SIMD group);
    ``fold``: the own block's rows t and BS − 1 − t carried by one thread (BS even: ``pair_folds``); ``scaled``: X
    read times a scalar Xsc[0] (the readout's rfac: M of rfac·r, no pass over M after)."""
    d = get(dialect)
    ins, outs = _pair_forward_io(dual, quad, scaled)
    kind = "pair" + _pair_suffix(strict, dual, quad, mma, fold) + ("_xs" if scaled else "")
    return _source(d, "chunk_pair.j2", kind, "key-vector decay pair matrix of a chunk", ins, outs,
                   (), helpers=d.mma_prelude if mma else "", strict=strict, dual=dual or quad, mma=mma, quad=quad,
                   fold=fold, xs=scaled)


@lru_cache(maxsize=None)
def pair_whole_source(dialect: str, strict: bool, dual: bool = False, quad: bool = False,
                      scaled: bool = False, halves: bool = False, async_: bool = False,
                      ml: bool = False) -> KernelSource:
    """``pair_source``'s pairs (single, ``dual`` or ``quad``; ``scaled``), the whole chunk one threadgroup
    (``chunk_pair_whole.j2``): each slab's X ⊙ pre and Y ⊙ suf staged once for every block, the pairs of blocks on
    fragments, the blocks between applied as A is read (template constants of ``pair_whole_layout``); ``halves``:
    each block's second half against its first on fragments too, the carries within the halves only; ``async_``:
    each slab's raw rows copied to threadgroup memory a slab ahead by the dialect's 16-byte copies, the operands'
    types XT, X2T, YT, YbT and their bytes XB, X2B, YB, YbB template constants. ``ml`` (not ``async_``): the operands
    read in the model's layout [B, T, HK, K] (template constants H, HK, NCH, GB), and dk too, then the log-decays
    l [B, T, H, K] (e^l formed as read); the pairs in the chunks' layout."""
    if ml and async_:
        raise ValueError("chunk_pair_whole: the model's layout (ml) is read from the buffers, not copied ahead "
                         "(async_)")
    d = get(dialect)
    ins, outs = _pair_forward_io(dual, quad, scaled)
    kind = ("pair" + _pair_suffix(strict, dual, quad, False, False) + "_whole" + ("_h8" if halves else "")
            + ("_xs" if scaled else "") + ("_async" if async_ else "") + ("_ml" if ml else ""))
    return _source(d, "chunk_pair_whole.j2", kind, "key-vector decay pair matrix of a chunk, one threadgroup a chunk",
                   ins, outs, (), helpers=d.mma_prelude + (d.copy_prelude if async_ else ""), strict=strict,
                   dual=dual or quad, quad=quad, xs=scaled, halves=halves, async_=async_, ml=ml)


@lru_cache(maxsize=None)
def pair_grad_source(dialect: str, strict: bool, dual: bool = False, mma: bool = False,
                     quad: bool = False, fold: bool = False, scaled: bool = False,
                     async_: bool = False, ml: bool = False, ld: bool = False) -> KernelSource:
    """(dX, dY) for dM; ``dual``: (dX, dX2, dY) for the pair of ``pair_source``'s dual form (dY summed); ``quad``:
    (dX, dX2, dY, dYb) for the cotangents dM, dM2, dMb, dM2b of its quad form (each gradient summed over the pairs
    its operand is in); ``mma``: the other blocks' parts on fragment multiply-adds; ``fold``: the own block's rows
    t and BS − 1 − t computed by one thread (``pair_source``); ``scaled``: the pair of Xsc[0]·X (dX is that of the
    scaled X: it reads no X); ``async_``: each slab's raw rows copied to threadgroup memory a slab ahead by the
    dialect's 16-byte copies (on CUDA cp.async), the operands' types XT, X2T, YT, YbT template constants and OB
    the widest one's bytes (``pair_grad_async_layout``); ``ml`` (with ``async_``): those raw rows copied from the
    operands in the model's layout [B, T, HK, K] (template constants H, HK, NCH, GB), the cotangents and gradients
    in the chunks'; ``ld`` (with ``async_``): dk holds the log-decays l (type LT, a template constant), their raw
    rows copied so and each decay e^l formed as read (with ``ml`` l [B, T, H, K] in the model's layout) where dk
    was D = e^l in float32."""
    if (ml or ld) and not async_:
        raise ValueError("chunk_pair_grad: the model's layout (ml) and log-decays (ld) are read by the raw rows' "
                         "copies (async_)")
    d = get(dialect)
    xs, ys = _pair_operands(dual, quad)
    cots = tuple("dM" + x[1:] + y[1:] for y in ys for x in xs)
    kind = ("pair_grad" + _pair_suffix(strict, dual, quad, mma, fold) + ("_xs" if scaled else "")
            + ("_async" if async_ else "") + ("_ml" if ml else "") + ("_ld" if ld else ""))
    ins = cots + xs + ys + ("dk",) + (("Xsc",) if scaled else ()) + ("rt",)
    return _source(d, "chunk_pair_grad.j2", kind, "gradients of the key-vector decay pair matrix",
                   ins, tuple("d" + x for x in xs + ys), (),
                   helpers=(d.mma_prelude if mma else "") + (d.copy_prelude if async_ else ""), strict=strict,
                   dual=dual or quad, mma=mma, quad=quad, fold=fold, xs=scaled, async_=async_, ml=ml, ld=ld)


@lru_cache(maxsize=None)
def sympow_source(dialect: str, grad: bool = False) -> KernelSource:
    """φ (inputs x and the pair tables pa, pb; output phi) or its gradient (dphi, x -> dx)."""
    if grad:
        return _source(get(dialect), "features_sympow_grad.j2", "sympow_grad", "gradient of the sympow feature map",
                       ("dphi", "x", "rt"), ("dx",), ())
    return _source(get(dialect), "features_sympow.j2", "sympow", "sympow feature map", ("x", "pa", "pb", "rt"), ("phi",), ())


@lru_cache(maxsize=None)
def feature_decode_source(dialect: str, has_z: bool) -> KernelSource:
    """(q, k [BH, D], w [BH, V], decay [BH], S [BH, F, V][, z [BH, F]], pair tables pa, pb) -> (S', [z',] part
    [BH, NB, V + has_z]): one decode step of a feature map's state, a block of its rows a threadgroup."""
    ins = ("q", "k", "w", "decay", "S") + (("z",) if has_z else ()) + ("pa", "pb")
    outs = ("S_out",) + (("z_out",) if has_z else ()) + ("part",)
    return _source(get(dialect), "features_decode.j2", "feature_decode" + ("_z" if has_z else ""),
                   "decode step of a feature-map state, split over its rows", ins, outs, (), has_z=has_z)


@lru_cache(maxsize=None)
def feature_states_source(dialect: str, tail: bool = False) -> KernelSource:
    """dS = φ(X)ᵀ Y of each chunk (X [N, C, D], Y [N, C, V], pair tables pa, pb -> dS [N, F, V]); with ``tail``
    (T0 [sequences, F, V], ns = (chunks, chunks + 1, N)) each sequence's chunks then its T0: dS [N + sequences, F, V]."""
    d = get(dialect)
    ins = ("X", "Y", "T0", "pa", "pb", "ns") if tail else ("X", "Y", "pa", "pb")
    return _source(d, "features_states_mma.j2", "feature_states_tail" if tail else "feature_states",
                   "a chunk's phi(X)^T Y, phi formed as read" + (", then a sequence's tail" if tail else ""),
                   ins, ("dS",), (), helpers=d.mma_prelude, tail=tail)


@lru_cache(maxsize=None)
def feature_out_source(dialect: str) -> KernelSource:
    """Z = φ(X) S of each chunk (X [N, C, D], S [N', F, V] with ns = (chunks, states) a sequence, pair tables pa,
    pb -> Z [N, C, V])."""
    d = get(dialect)
    return _source(d, "features_out_mma.j2", "feature_out", "a chunk's phi(X) S, phi formed as read",
                   ("X", "S", "pa", "pb", "ns"), ("Z",), (), helpers=d.mma_prelude)


@lru_cache(maxsize=None)
def feature_jac_source(dialect: str, rows: bool = False) -> KernelSource:
    """dX of Σ_t Σ_r (S_r · Y_t) φ_r(x_t) per chunk (X [N, C, D], S [N', F, V] with ns = (chunks, states) a
    sequence, Y [N, C, V] -> dX [N, C, D]), no [T, F] cotangent formed: through the symmetric matrix of the quadratic
    form (D² multiply-adds a token, features_jac_mma.j2), or with ``rows`` by the rows of φ's pairs (the packed count,
    features_jac_rows_mma.j2)."""
    d = get(dialect)
    if rows:
        return _source(d, "features_jac_rows_mma.j2", "feature_jac_rows",
                       "a chunk's gradient through phi's rows, by rows", ("X", "S", "Y", "ns"), ("dX",), (),
                       helpers=d.mma_prelude)
    return _source(d, "features_jac_mma.j2", "feature_jac", "a chunk's gradient through phi's rows",
                   ("X", "S", "Y", "ns"), ("dX",), (), helpers=d.mma_prelude)


FACTOR_CHUNKS = 256  # chunks a sequence the decay factors' kernels take at most (their sums between chunks are serial)
FACTOR_NT = 128      # threads a chunk


@lru_cache(maxsize=None)
def decay_factors_source(dialect: str, grad: bool = False) -> KernelSource:
    """A scalar decay's factors from its log-decays l [N, n C] (rt = (n)): to_t, to_end [N, n C] and LL [N, n + 1,
    n + 1] (template constants C, NT, E, NMAX); or their gradient from those factors and their cotangents
    (to_t, to_end, LL, dto_t, dto_end, dLL -> dl [N, n C])."""
    if grad:
        return _source(get(dialect), "features_decay_factors.j2", "decay_factors_grad",
                       "gradient of a scalar decay's factors in the feature-map form",
                       ("to_t", "to_end", "LL", "dto_t", "dto_end", "dLL", "rt"), ("dl",), (), grad=True)
    return _source(get(dialect), "features_decay_factors.j2", "decay_factors",
                   "a scalar decay's factors in the feature-map form", ("l", "rt"), ("to_t", "to_end", "LL"), (),
                   grad=False)


@lru_cache(maxsize=None)
def feature_mix_source(dialect: str) -> KernelSource:
    """The backward's products over chunks (LL [N, M, M], X [N, M, K], F [N, M, K], rt = (M, K, blocks a sequence)
    -> Sh = LL X, dX = LLᵀ F [N, M, K], part [N, blocks, M, M] of F Xᵀ over each block's columns)."""
    return _source(get(dialect), "features_mix_grad.j2", "feature_mix_grad",
                   "products over chunks of the feature-map form's backward", ("LL", "X", "F", "rt"),
                   ("Sh", "dX", "part"), ())


# -- which sizes have a kernel, and their layouts --------------------------------------------------
@lru_cache(maxsize=None)
def feature_mma_layout(dialect: str, C: int, D: int, V: int, jac_groups: int = 8,
                       states_fragments: int = 1, out_fragments: int = 1) -> dict | None:
    """Template constants of the feature product kernels, {"states": ..., "out": ..., "jac": ...}, or None where they
    have no layout: C a multiple of 16; VP = V rounded up to 8 columns in fragments; the states kernel's token
    staging TB (32, 16 or 8 dividing C), the readout's SIMD groups NG (4, 2 or 1, 16 NG TF dividing C, TF =
    ``out_fragments`` fragments of 16 tokens a SIMD group where they fit, else 1) and row staging RB (32, 16 or 8),
    the first that fit the dialect's threadgroup memory (x staged at row stride LDX, y or S at LDB; the states
    kernel's RF = ``states_fragments`` fragments of 16 rows a SIMD group); the gradient's NG, the first of 8, 4, 2, 1
    up to ``jac_groups`` with 16 NG dividing C (fewer SIMD groups
    a threadgroup let more threadgroups share an SM, each staging the state itself; x and y in registers, its one staged
    operand a DP x VP block of the state at LDB, DP = D rounded up to 8, which must fit; NB = 2 buffers of it
    where they fit, else 1); the row-wise gradient's ("jac_rows", None where its block at LDT does not fit) the same
    with the block's rows read transposed (LDT)."""
    if C % 16:
        return None
    room, VP, F = get(dialect).smem_bytes // 4, -(-V // 8) * 8, D * (D + 1) // 2
    ldx, ldb = a_stride(D), b_stride(VP)
    base = {"C": C, "D": D, "F": F, "V": V, "VP": VP, "LDX": ldx, "LDB": ldb}
    tb = next((tb for tb in (32, 16, 8) if C % tb == 0 and tb * (ldx + ldb) <= room), None)
    out = next(((ng, rb, tf) for tf in dict.fromkeys((out_fragments, 1)) for ng in (4, 2, 1)
                if C % (16 * ng * tf) == 0 for rb in (32, 16, 8) if 16 * ng * tf * ldx + rb * (ldb + 3) <= room), None)
    dp = -(-D // 8) * 8
    jac = (next((ng for ng in (8, 4, 2, 1) if ng <= jac_groups and C % (16 * ng) == 0), None)
           if dp * ldb <= room else None)
    if tb is None or out is None or jac is None:
        return None
    jac_base = {k: v for k, v in base.items() if k not in ("LDX", "LDB")}
    # the row-wise gradient reads its staged rows of S transposed (8 rows by 4 columns a fragment in either lane
    # layout): a stride of 4 mod 8 puts them on 32 distinct banks, as a_stride's 4 mod 32 does, in less room
    ldt = next(x for x in range(VP, VP + 8) if x % 8 == 4)
    rows = ({"DP": dp, "NG": jac, "LDT": ldt, "NB": 2 if 2 * dp * ldt <= room else 1} if dp * ldt <= room else None)
    return {"states": base | {"TB": tb, "RF": states_fragments},
            "out": base | {"NG": out[0], "RB": out[1], "TF": out[2]},
            "jac": jac_base | {"LDB": ldb, "DP": dp, "NG": jac, "NB": 2 if 2 * dp * ldb <= room else 1},
            "jac_rows": jac_base | rows if rows else None}


MIX_STAGES = 4  # stages of a threadgroup's columns in the products over chunks: fewer partial tiles to sum


@lru_cache(maxsize=None)
def feature_mix_layout(dialect: str, M: int) -> dict | None:
    """Template constants of the products over M chunk states (``feature_mix_source``): MP = M rounded up to 4 (a
    template constant, so sequence lengths share a kernel within 4 C tokens), NT threads (128, else 64) with a 4x4
    tile of F Xᵀ for each of (MP / 4)² at least, XP staged floats a column (MP, at least 16 for the final sums), SB
    stages; None where LL twice and a stage's columns pass the dialect's threadgroup memory (M past 36 on CUDA, 32 on
    Metal: long sequences keep MLX's products)."""
    MP = -(-M // 4) * 4
    XP = max(MP, 16)
    for NT in (128, 64):
        if (MP // 4) ** 2 <= NT and 4 * (2 * MP * MP + NT * (XP + MP)) <= get(dialect).smem_bytes:
            return {"MP": MP, "XP": XP, "NT": NT, "SB": MIX_STAGES}
    return None


def feature_decode_layout(dialect: str, D: int, V: int, has_z: bool) -> dict:
    """Template constants of the feature decode kernel: F = D (D + 1) / 2 rows in blocks of RB, NT = 128 threads as
    RL row lanes by CL column lanes (CL = 32 from V = 32: a SIMD group reads a row's consecutive columns), VJ
    columns a lane; q, k, w and the row lanes' partials in threadgroup memory (raises ValueError past it)."""
    F, NT = D * (D + 1) // 2, 128
    CL = 32 if V >= 32 else max(1, 1 << (V - 1).bit_length())
    RL = NT // CL
    V1 = V + has_z
    if 4 * (2 * D + V + RL * V1) > get(dialect).smem_bytes:
        raise ValueError(f"feature decode: D={D}, V={V} pass {dialect}'s threadgroup memory")
    RB = 64
    return {"D": D, "F": F, "V": V, "V1": V1, "NT": NT, "CL": CL, "RL": RL, "VJ": -(-V // CL), "RB": RB,
            "NB": -(-F // RB)}


@lru_cache(maxsize=None)
def feature_decode_supported(dialect: str, D: int, V: int) -> bool:
    """Whether the feature decode kernel has a layout for (D, V) in ``dialect``."""
    return has_layout(feature_decode_layout, dialect, D, V, True)


def sympow_layout(dialect: str, D: int, grad: bool = False) -> dict:
    """Template constants of the sympow kernels: F = D (D + 1) / 2 features, NT threads a row (the forward's 128
    along φ's row; the gradient's one an entry of x, at least a SIMD group). Raises ValueError where the gradient's
    staged row of dφ (F + D floats) passes the dialect's threadgroup memory (Metal at D = 128)."""
    F = D * (D + 1) // 2
    if grad and 4 * (F + D) > get(dialect).smem_bytes:
        raise ValueError(f"sympow: a row of D={D} features ({F} floats) passes {dialect}'s threadgroup memory")
    return {"F": F, "NT": max(32, -(-D // 32) * 32) if grad else 128}


def sympow_supported(dialect: str, D: int) -> bool:
    """Whether the sympow kernels (forward and gradient) have a layout for D in ``dialect``."""
    return has_layout(sympow_layout, dialect, D, grad=True)


def decayed_scores_layout(dialect: str, C: int, rows: int) -> dict | None:
    """Template constants of the decayed-scores kernels at chunks of C, blocks of ``rows`` rows a threadgroup (RB, NB
    blocks a chunk, NT threads: one a column, at most 256), or None where the chunk's log-decays and the gradient's
    column sums (C floats each) and its SIMD groups' sums pass the dialect's threadgroup memory."""
    nt, rb = min(256, -(-C // 32) * 32), min(rows, C)
    if 4 * (2 * C + rb * nt // 32) > get(dialect).smem_bytes:
        return None
    return {"C": C, "RB": rb, "NB": -(-C // rb), "NT": nt}


def inverse_supported(C: int) -> bool:
    """One thread per column: C threads a threadgroup, C² floats of threadgroup memory."""
    return 1 <= C <= 64


def scan_supported(dialect: str, C: int, K: int) -> bool:
    """Whether the scan has a layout for (C, K): K a multiple of 4 (4-row reads) and the tiles fit the
    dialect's threadgroup memory (``scan_layout``)."""
    return has_layout(scan_layout, dialect, C, K)


@lru_cache(maxsize=None)
def scan_layout(dialect: str, C: int, K: int) -> dict:
    """Template constants of the scan: NR row groups (C and K/4 multiples of NR), NT threads, and the
    staging depths KB (key columns of A_c) and TB (tokens of B_c), the largest (≤ 32) whose slab fits
    the dialect's threadgroup memory beside the state and Y tiles (Metal: 32 KiB, CUDA: 48 KiB)."""
    if K % 4:
        raise ValueError(f"chunk_scan: K={K} must be a multiple of 4")
    nr = next(r for r in (MAX_NR, 8, 4, 2, 1) if C % r == 0 and K % (4 * r) == 0)
    room = get(dialect).smem_bytes // 4 - BV * (K + C)                     # floats left for the slab
    kb = next((b for b in (32, 16, 8, 4) if K % b == 0 and C * (b + 1) <= room), None)  # K % 4 == 0: 4 divides
    tb = next((t for t in (32, 16, 8, 4, 2, 1) if C % t == 0 and t * (K + 4) <= room), None)
    if kb is None or tb is None:
        raise ValueError(f"chunk_scan: C={C}, K={K} leave no room for staging in {dialect}'s threadgroup memory")
    slab = -(-max(C * (kb + 1), tb * (K + 4)) // 4) * 4
    return {"NR": nr, "NT": nr * BV // 4, "KB": kb, "TB": tb, "SLAB": slab}


def a_stride(n: int) -> int:
    """The row stride (≥ n) of a threadgroup tile read as A fragments: 4 mod 32, so a fragment's 8 rows × 4
    columns hit 32 distinct banks."""
    return next(x for x in range(n, n + 32) if x % 32 == 4)


def t_stride(n: int) -> int:
    """The row stride (≥ n 16-bit elements) of a transposed threadgroup copy read as the wide multiply-add's B pairs,
    one word each (``ScanVariant.wl``): 8 mod 16, so a read's 8 rows × 4 words hit 32 distinct banks, and so do Y's
    stores into its copy (4 columns 2 tq of 8 rows, rows t and t + 8 a word); the state's stores (rows r and r + 1
    a word, at ``Fragments16.kpos``) conflict two ways."""
    return next(x for x in range(n, n + 16) if x % 16 == 8)


def b_stride(n: int) -> int:
    """The row stride (≥ n) of a threadgroup tile read as B fragments: 8 or 24 mod 32, so a fragment's 4 rows ×
    8 columns hit 32 distinct banks. In 16-bit elements the same strides serve the wide multiply-add's B pairs
    packed from two rows (``Dialect.frag16``: rows 2 tq and 2 tq + 1, columns gq): each of the two reads' 4 rows ×
    4 words hits 16 distinct banks, and a row is whole 16-byte words (copies land on it)."""
    return next(x for x in range(n, n + 32) if x % 32 in (8, 24))


@lru_cache(maxsize=None)
def scan_mma_layout(C: int, K: int, V: int, most_bv: int = 32, most_nw: int = MMA_NW) -> dict | None:
    """Template constants of the fragment scan, or None where it has no layout: C and K multiples of
    16 (fragment rows), V a multiple of 8 (fragment columns; BV the largest of ``most_bv``, 16, 8 dividing V),
    NW groups (``most_nw``, else the most of 4, 2, 1) sharing K / 16 state blocks evenly, the row stride LD of the threadgroup
    copies (≥ BV, 8 or 24 mod 32: conflict-free B fragments), YCT column tiles per item of Y_c (all BV / 8
    unless C / 16 row blocks would leave groups idle). Threadgroup memory: (K + C) LD floats,
    at most 30 KiB at K = 128, C = 64 (both dialects)."""
    if C % 16 or K % 16 or V % 8:
        return None
    bv = next(b for b in (most_bv, 16, 8) if V % b == 0)
    nw = next(w for w in dict.fromkeys((most_nw, 4, 2, 1)) if (K // 16) % w == 0)
    ld = b_stride(bv)
    ct = bv // 8
    yct = next((y for y in range(ct, 0, -1) if ct % y == 0 and (C // 16) * (ct // y) >= nw), 1)
    return {"BV": bv, "NW": nw, "LD": ld, "YCT": yct}


def scan_value_quads(C: int, K: int, V: int, most_bv: int = 32, most_nw: int = MMA_NW) -> bool:
    """Whether the fragment scan's layout groups its column tiles by four, in each threadgroup and each item of Y
    (``ScanVariant.vc`` needs it)."""
    lay = scan_mma_layout(C, K, V, most_bv, most_nw)
    return lay is not None and lay["BV"] % 32 == 0 and lay["YCT"] % 4 == 0


def scan_prefetches(C: int, K: int, V: int, most_bv: int = 32, most_nw: int = MMA_NW) -> bool:
    """Whether the fragment scan's layout gives each group exactly one item of Y (``ScanVariant.pf`` needs it)."""
    lay = scan_mma_layout(C, K, V, most_bv, most_nw)
    return lay is not None and (C // 16) * (lay["BV"] // 8 // lay["YCT"]) == lay["NW"]


@lru_cache(maxsize=None)
def out_mma_layout(dialect: str, C: int, K: int, V: int, most_bv: int = 128) -> dict | None:
    """Template constants of the fragment readout, or None where it has no layout: C one of 16, 32, 64
    (C / 16 SIMD groups of 16 rows), K and V multiples of 8; the first (BV, KB) whose tiles fit the
    dialect's threadgroup memory, BV from ``most_bv``, 64, 32, 16, 8 dividing V (columns per threadgroup), KB
    from 32, 16, 8 dividing C and K (staging depth). Threadgroup memory: M (C × LD), R's staged block
    (C × LDA) and one block of U, S_c or Z (XB = C × LDA or KB × LDB): 44 KiB at C = 64, BV = 128 (CUDA)."""
    if C not in (16, 32, 64) or K % 8 or V % 8:
        return None
    room = get(dialect).smem_bytes // 4
    ld = a_stride(C)
    for bv in (b for b in dict.fromkeys((most_bv, 64, 32, 16, 8)) if V % b == 0):
        for kb in (b for b in (32, 16, 8) if C % b == 0 and K % b == 0):
            lda, ldb = kb + 4, b_stride(bv)
            if C * ld + C + C * lda + max(C * lda, kb * ldb) <= room:
                return {"BV": bv, "KB": kb, "LD": ld, "LDA": lda, "LDB": ldb, "XB": max(C * lda, kb * ldb)}
    return None


def copy_stride(n: int, esize: int, rows: int) -> int:
    """The row stride (≥ n elements of esize bytes) of a threadgroup tile filled by 16-byte copies: whole 16-byte
    words a row, and bank-conflict free where ``rows`` = 8 (A fragments, or B fragments read transposed: 8 rows ×
    4 columns a read, rows 4 words mod 8 apart) or 4 (B fragments: 4 rows × 8 columns, rows 8 or 24 words mod 32
    apart). For floats these are ``a_stride``'s and ``b_stride``'s conditions, relaxed for the A rows to 4 mod 8."""
    ok = (lambda b: b % 32 == 16) if rows == 8 else (lambda b: b % 128 in (32, 96))
    return next(x for x in range(n, n + 64) if ok(x * esize))


@lru_cache(maxsize=None)
def out_async_layout(dialect: str, C: int, K: int, V: int, sizes: tuple = (4, 4, 4, 4),
                     most_bv: int = 128, w16: bool = False, key: bool = False) -> dict | None:
    """Template constants of the two-buffer readout (``out_async_source``), or None where it has none: C one of 16, 32,
    64, K and V multiples of 8; ``sizes`` the bytes an element of R, U, Z and S_c (their blocks are copied
    verbatim). The first (BV, KB) as ``out_mma_layout`` whose buffers fit the dialect's threadgroup memory: M (C × LD floats) and
    e^G, then a staging area SQ 16-byte words large for the largest of the three products' two buffers each: R's
    and U's blocks (C × LDR, C × LDU), R's and S_c's (C × LDR, KB × LDB), Z's (KB × LDZ). At C = 64, K = V = 128
    with 16-bit keys that is 40.25 KiB on CUDA (KB 16, BV 128). ``w16`` (16-bit operands, the wide multiply-add): KB
    16, B's row-major blocks at ``b_stride``, and M in 16 bits too (C × LDH). ``key`` (U's size that of P): no
    product M = R Uᵀ, and loop 2's buffers hold P's blocks beside R's and S_c's (C × LDU each)."""
    if C not in (16, 32, 64) or K % 8 or V % 8 or (w16 and K % 16):
        return None
    er, eu, ez, es = sizes
    ld = a_stride(C)
    for bv in (b for b in dict.fromkeys((most_bv, 64, 32, 16, 8)) if V % b == 0):
        # blocks of 16 (or 8), not 32: only 16-bit states fit 32 at CUDA's 48 KiB, and there its larger staging
        # area (one threadgroup an H100 SM fewer) went with GDN's forward readout at 0.45 ms against 0.42
        for kb in (b for b in ((16,) if w16 else (16, 8)) if C % b == 0 and K % b == 0):
            ldr, ldu = copy_stride(kb, er, 8), copy_stride(kb, eu, 8)
            ldb, ldz = ((b_stride(bv),) * 2 if w16 else (copy_stride(bv, es, 4), copy_stride(bv, ez, 4)))
            loop2 = C * ldr * er + kb * ldb * es + (C * ldu * eu if key else 0)
            stage = max(0 if key else 2 * C * (ldr * er + ldu * eu), 2 * loop2, 2 * kb * ldz * ez)
            sq = -(-stage // 16)
            wide = {"LDH": copy_stride(C, 2, 8)} if w16 else {}
            if 4 * (C * ld + C) + 2 * C * wide.get("LDH", 0) + 16 * sq <= get(dialect).smem_bytes:
                return {"BV": bv, "KB": kb, "LD": ld, "LDR": ldr, "LDU": ldu, "LDB": ldb, "LDZ": ldz, "SQ": sq} | wide
    return None


@lru_cache(maxsize=None)
def ut_mma_layout(dialect: str, C: int, K: int, V: int, most_bw: int = 128) -> dict | None:
    """Template constants of the fragment UT transform, or None where it has no layout: C one of 16, 32, 64,
    K and V multiples of 8; BW the first of ``most_bw``, 64, 32, 16, 8 dividing K and V (columns a pass of Tm W and
    Tm (Bt ⊙ e^G)); the deepest KB of 32, 16, 8 dividing C and K whose tiles fit the dialect's threadgroup
    memory: A and Tm (C × LD each) and the staging buffer XS (Bt's and U's blocks, C × LDA each, or KB rows of
    BW columns, or the block inverse's products). At C = 64 that is 45 KiB (KB 16): CUDA only."""
    if C not in (16, 32, 64) or K % 8 or V % 8:
        return None
    room = get(dialect).smem_bytes // 4
    ld = a_stride(C)
    bw = next(b for b in dict.fromkeys((most_bw, 64, 32, 16, 8)) if K % b == 0 and V % b == 0)
    ldb = b_stride(bw)
    for kb in (b for b in (32, 16, 8) if C % b == 0 and K % b == 0):
        xs = max(2 * C * (kb + 4), kb * ldb, 20 * C)  # 20 C: the inverse's X blocks (C / 2m of m × (m + 8), m ≤ 32)
        if 2 * C * ld + C + xs <= room:
            return {"BW": bw, "KB": kb, "LD": ld, "LDA": kb + 4, "LDB": ldb, "XS": xs}
    return None


@lru_cache(maxsize=None)
def ut_async_layout(dialect: str, C: int, K: int, V: int, sizes: tuple, most_bw: int = 128,
                    w16: bool = False) -> dict | None:
    """Template constants of the two-buffer UT transform (``ut_async_source``), or None where it has none: C one of
    16, 32, 64, K and V multiples of 8; ``sizes`` the bytes an element of U, W and Bt (or of x, W with factor
    reads: two sizes). The first (BW, KB), BW from ``most_bw``, 64, 32, 16, 8 dividing K and V, KB from 32, 16, 8,
    whose buffers fit the dialect's threadgroup memory: A and Tm (C × LD floats each) and e^G, then a staging area
    SQ 16-byte words large for the largest of: two blocks of the keys (C × LDU, and C × LDU2 of Bt), the inverse's
    products (20 C floats), two blocks of W (KB × LDW), two of the key (KB × LDX). At C = 64, K = V = 128 with
    16-bit inputs that is 44.2 KiB on CUDA (BW 128, KB 16). ``w16`` (16-bit operands, the wide multiply-add): KB 32
    or 16, the blocks of W and the key at ``b_stride``, and Tm in 16 bits (C × LDH, in A's memory)."""
    if C not in (16, 32, 64) or K % 8 or V % 8 or (w16 and K % 16):
        return None
    eu, ew = sizes[:2]
    eb = sizes[2] if len(sizes) > 2 else None
    ld = a_stride(C)
    for bw in (b for b in dict.fromkeys((most_bw, 64, 32, 16, 8)) if K % b == 0 and V % b == 0):
        for kb in (b for b in ((32, 16) if w16 else (32, 16, 8)) if C % b == 0 and K % b == 0):
            ldu, ldu2 = copy_stride(kb, eu, 8), copy_stride(kb, eb or eu, 8)
            ldw, ldx = (b_stride(bw),) * 2 if w16 else (copy_stride(bw, ew, 4), copy_stride(bw, eb or eu, 4))
            keys = 2 * C * (ldu * eu + (ldu2 * eb if eb else 0))
            stage = max(keys, 20 * C * 4, 2 * kb * ldw * ew, 2 * kb * ldx * (eb or eu))
            sq = -(-stage // 16)
            if 4 * (2 * C * ld + C) + 16 * sq <= get(dialect).smem_bytes:
                return ({"BW": bw, "KB": kb, "LD": ld, "LDU": ldu, "LDU2": ldu2, "LDW": ldw, "LDX": ldx, "SQ": sq}
                        | ({"LDH": copy_stride(C, 2, 8)} if w16 else {}))
    return None


@lru_cache(maxsize=None)
def bwd_mma_layout(dialect: str, C: int, K: int, delta: bool, most_bw: int = 32) -> dict | None:
    """Template constants of the backward's fragment pass, or None where it has no layout: C one of 16, 32, 64,
    K a multiple of 8; BW the widest of ``most_bw``, 16, 8 dividing K whose tiles fit the dialect's threadgroup
    memory: the E tile (C × LD), the staging area XS (the staged blocks of U, r and, with ``delta``, b̃: C × LDB
    each; at least C × LD, as it holds Γ first) and 3 C + C / 16 floats. CUDA's 48 KiB take C = 64 at BW 32;
    Metal's 32 KiB take C = 32."""
    if C not in (16, 32, 64) or K % 8:
        return None
    room = get(dialect).smem_bytes // 4
    ld, nx = a_stride(C), 3 if delta else 2
    for bw in (b for b in dict.fromkeys((most_bw, 16, 8)) if b <= most_bw and K % b == 0):
        ldb = b_stride(bw)
        xs = max(nx * C * ldb, C * ld)
        if C * ld + xs + 3 * C + C // 16 <= room:
            return {"BW": bw, "LD": ld, "LDB": ldb, "XS": xs}
    return None


@lru_cache(maxsize=None)
def bwd_products_layout(dialect: str, C: int, K: int, delta: bool, V: int, most_bw: int = 32) -> dict | None:
    """Template constants of the backward's pass where it forms its products over V values (``bwd_mma_source``'s
    ``prods``), in place of ``bwd_mma_layout``'s, or None: V a multiple of 8; VH the widest of V, 64, 32, 16, 8
    dividing V whose two staged blocks of BW rows (S_c's and dS_next's, row stride LDS = 4 mod 32) fit the staging
    area XS, which grows for them where the dialect's threadgroup memory has room."""
    lay = bwd_mma_layout(dialect, C, K, delta, most_bw)
    if lay is None or V <= 0 or V % 8:
        return None
    room = get(dialect).smem_bytes // 4 - C * lay["LD"] - 3 * C - C // 16  # floats the staging area may take
    for vh in dict.fromkeys((V, 64, 32, 16, 8)):
        xs = max(lay["XS"], 2 * lay["BW"] * a_stride(vh))
        if V % vh == 0 and xs <= room:
            return lay | {"XS": xs, "VH": vh, "LDS": a_stride(vh)}
    return None


PAIR_KS = 32      # key columns a slab of the pair kernels stages


def pair_tiles(lay: dict, C: int, dual: bool, quad: bool = False) -> int:
    """Floats of threadgroup memory of the pair kernels' tiles at layout ``lay`` (the gradient's, the larger): a
    staged operand slot per X (dY) or Y (dX), and every pair's cotangent."""
    nx, ny = (2 if dual or quad else 1), (2 if quad else 1)
    return (lay["LDS"] * lay["BS"] * (max(nx, ny) * (lay["NBM"] + 1) + 2) + lay["NB"] * lay["KS"]
            + nx * ny * (lay["BS"] * C + C))


def pair_grad_async_layout(dialect: str, C: int, K: int, dual: bool, quad: bool, sizes: tuple) -> dict:
    """Template constants of the pair gradient's ``async_`` form: ``pair_layout``'s and OB, the widest operand's
    bytes (``sizes``: each operand's, X, X2, Y, Yb as the form has them), the raw slab's decays (C KS floats) and
    operand slots (C KS elements of OB bytes each) beside the tiles. Raises ValueError where those pass the
    dialect's threadgroup memory."""
    lay = pair_layout(dialect, C, K, dual, quad)
    xs, ys = _pair_operands(dual, quad)
    if len(sizes) != len(xs + ys):
        raise ValueError(f"chunk_pair_grad: {len(xs + ys)} operand sizes ({', '.join(xs + ys)}), got {sizes}")
    ob = max(sizes)
    raw = lay["KS"] * C * (4 + max(len(xs), len(ys)) * ob)
    if 4 * pair_tiles(lay, C, dual, quad) + raw > get(dialect).smem_bytes:
        raise ValueError(f"chunk_pair_grad: C={C} with raw slabs of {ob}-byte operands passes {dialect}'s "
                         "threadgroup memory")
    return lay | {"OB": ob}


def pair_grad_async_supported(dialect: str, C: int, K: int, dual: bool, quad: bool, sizes: tuple) -> bool:
    """Whether the pair gradient's ``async_`` form has a layout (``pair_grad_async_layout``)."""
    return has_layout(pair_grad_async_layout, dialect, C, K, dual, quad, sizes)


def pair_supported(dialect: str, C: int, K: int, dual: bool = False, quad: bool = False) -> bool:
    """Whether the pair kernels have a layout for (C, K) in ``dialect`` (``pair_layout``)."""
    return has_layout(pair_layout, dialect, C, K, dual, quad)


def pair_fragments(dialect: str, C: int, K: int, dual: bool = False, quad: bool = False) -> bool:
    """Whether the pair kernels' other blocks can run on fragments: blocks of 16 tokens (C a multiple of 16) where the
    pair kernels have a layout (the fragments use no threadgroup memory of their own)."""
    return C >= 16 and C % 16 == 0 and pair_supported(dialect, C, K, dual, quad)


def pair_folds(dialect: str, C: int, K: int, dual: bool = False, quad: bool = False) -> bool:
    """Whether the pair kernels can fold the own block's rows (one thread rows t and BS − 1 − t, 16 lanes a pair of
    rows): an even block of rows where they have a layout (NT = 8 BS threads then hold BS / 2 groups of 16)."""
    return pair_supported(dialect, C, K, dual, quad) and pair_layout(dialect, C, K, dual, quad)["BS"] % 2 == 0


@lru_cache(maxsize=None)
def pair_whole_layout(dialect: str, C: int, K: int, dual: bool = False, quad: bool = False,
                      halves: bool = False, sizes: tuple = ()) -> dict:
    """Template constants of ``pair_whole_source``: NB blocks of BS = 16 rows (C a multiple of 16, at most 64: NT =
    4 C threads, 8 a pair of rows), slabs of the widest KS of 32, 16, 8 whose tiles (every X' and Y', Y as it is and
    the decays, C rows at stride LDS = KS + 4: a fragment's 8 rows by 4 columns hit 32 banks) fit the dialect's
    threadgroup memory (``halves``: X'' and Y'' of half the rows too), FI fragment items (pair of blocks, 8-column
    tile; ``halves``: and a block's quarter) a SIMD group; ``sizes`` (the ``async_`` form): each operand's bytes (X,
    X2, Y, Yb as the form has them), the slab's raw decays and operands beside the tiles. Raises ValueError where
    none does or C does not suit."""
    if C % 16 or not 16 <= C <= 64 or K % 8:
        raise ValueError(f"chunk_pair_whole: C={C} must be 16, 32, 48 or 64 and K={K} a multiple of 8")
    nx, ny = (2 if dual or quad else 1), (2 if quad else 1)
    if sizes and len(sizes) != nx + ny:
        raise ValueError(f"chunk_pair_whole: {nx + ny} operand sizes, got {sizes}")
    nb, nt = C // 16, 4 * C
    for ks in (32, 16, 8):
        tiles = C * (ks + 4) * (nx + 2 * ny + 1) + nb * ks + (C // 2 * (ks + 4) * (nx + ny) if halves else 0)
        raw = C * ks * (4 + sum(sizes)) if sizes else 0
        if K % ks == 0 and 4 * tiles + raw <= get(dialect).smem_bytes:
            return {"BS": 16, "NB": nb, "KS": ks, "LDS": ks + 4, "NT": nt,
                    "FI": max(1, -(-nb * (nb - 1 + halves) // (nt // 32)))}
    raise ValueError(f"chunk_pair_whole: C={C}, K={K} pass {dialect}'s threadgroup memory")


def pair_whole_supported(dialect: str, C: int, K: int, dual: bool = False, quad: bool = False,
                         halves: bool = False, sizes: tuple = ()) -> bool:
    """Whether ``pair_whole_layout`` has a layout for (C, K)."""
    return has_layout(pair_whole_layout, dialect, C, K, dual, quad, halves, sizes)


@lru_cache(maxsize=None)
def pair_layout(dialect: str, C: int, K: int, dual: bool = False, quad: bool = False) -> dict:
    """Template constants of the pair kernels: blocks of BS = min(16, C) rows (NB a chunk, one threadgroup each;
    NBM the most earlier or later blocks one meets, at least 1), NT = 8 BS threads (at least a SIMD group: the
    forward reduces over 8 lanes), BS8 columns of an earlier block per thread, slabs of KS columns at row stride
    LDS (odd: a column read by 8 rows hits 8 banks), dM staged at row stride LDM (rows) or LDT (columns). Raises
    ValueError where K is not a multiple of 32 or the tiles (the gradient's, the larger; ``dual``: two operands,
    ``quad``: two of each side, four cotangents: 38 KiB at C = 64, past Metal's 32) pass the dialect's threadgroup
    memory."""
    if K % PAIR_KS:
        raise ValueError(f"chunk_pair: K={K} must be a multiple of {PAIR_KS}")
    bs = min(16, C)
    if C % bs:
        raise ValueError(f"chunk_pair: C={C} must be a multiple of 16 or at most 16")
    nb, ks = C // bs, PAIR_KS
    lay = {"BS": bs, "NB": nb, "NBM": max(nb - 1, 1), "BS8": max(bs // 8, 1), "KS": ks, "LDS": ks + 1,
           "LDM": C + 1, "LDT": bs + 1, "NT": max(32, 8 * bs)}
    if 4 * pair_tiles(lay, C, dual, quad) > get(dialect).smem_bytes:
        raise ValueError(f"chunk_pair: C={C}, K={K} pass {dialect}'s threadgroup memory")
    return lay
