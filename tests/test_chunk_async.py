"""The scalar decay's readout (and a key-vector decay's) and UT transform staged two buffers deep by 16-byte copies
(``chunk_out_async.j2``, ``chunk_ut_async.j2``, ``Tuning.async_staging``) on the Metal CPU emulator (the copies are
synchronous there, so the buffers' indexing and barriers are what is checked; CUDA's cp.async waits run on the GPU
tests): GDN's 16-bit calls in the model's layout against float64, under ASan and TSan too, their layouts'
bank-conflict conditions, and the chunked core end to end with them. Their float32 forms in both lane layouts:
``test_chunk_kernels``' readout and UT tests."""
import numpy as np
import pytest

from recgen import tuning
from recgen.codegen import chunk_sources as cs
from recgen.codegen.backends.dialect import PTX_FRAGMENTS
from recgen.runtime import chunk_kernels as ck

verify = pytest.importorskip("recgen.verify.kernels")
from recgen.verify.typecheck import clang_problem  # noqa: E402

from test_chunk_kernels import _emulated_call, _out_ref, _rel, _ut_ref  # noqa: E402

pytestmark = pytest.mark.skipif(clang_problem() is not None, reason=clang_problem() or "")


def _chunks(a, H: int, N: int, C: int):
    """A model-layout input [B, T, heads, F] (mx) as float64 chunks [B H n, C, F] (N = B H n), its heads repeated
    to the H value heads (GQA's key heads shared)."""
    import mlx.core as mx

    a = np.array(a.astype(mx.float32), np.float64)
    return np.repeat(a, H // a.shape[2], 2).transpose(0, 2, 1, 3).reshape(N, C, -1)


@pytest.mark.parametrize("sanitizer", [None, "address", "thread"])
@pytest.mark.parametrize("zt", ["float32", "bfloat16"])
def test_chunk_out_async_reads_16bit_keys_in_the_model_layout(zt, sanitizer):
    """GDN's call: r and the key x in bf16, read in the model's layout [B, T, HK, K] (two value heads over one key
    head, two chunks a sequence), u = Uf ⊙ x applied to M's columns after the product, Z in float32 or bf16, y
    written [B, T, H, V]; against float64 on the bf16 values (the products are float32 on the emulator), plain,
    under ASan+UBSan and under TSan (the two buffers' barriers). With bf16 Z the states S_c are bf16 too, staged in
    their type, and M is written in it (``Tuning.states_16bit``)."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(5)
    B, H, HK, n, C, K, V = 2, 2, 1, 2, 16, 32, 24
    N, T = B * H * n, n * C
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    bf = lambda a: mx.array(a).astype(mx.bfloat16)  # noqa: E731
    q, k, Z = bf(f(B, T, HK, K)), bf(f(B, T, HK, K)), f(N, C, V)
    Zin = bf(Z) if zt == "bfloat16" else Z
    uf, logd = rng.uniform(size=(N, C)).astype(np.float32), (-6 * rng.uniform(size=(N, C))).astype(np.float32)
    St = f(N, K, V)
    ins = {"R": q, "U": k, "Uf": uf, "Z": Zin, "St": bf(St) if zt == "bfloat16" else St, "logd": logd,
           "Rs": np.array([0.5], np.float32)}
    launch = ck.out_async_launch("metal", N, C, K, V, ("bfloat16", "bfloat16", zt, zt), (H, n, "float32"), uf=True,
                                 ml=(H, HK, n, True))
    assert [dt for _, dt in launch.outputs] == ["float32", zt]
    assert dict(launch.template)["LDR"] * 2 % 16 == 0
    y, M = verify.run_launch(launch, ins, sanitizer=sanitizer)

    z, st = ((np.array(a.astype(mx.float32)) for a in (Zin, ins["St"])) if zt == "bfloat16" else (Z, St))
    want_y, want_M = _out_ref(0.5 * _chunks(q, H, N, C), _chunks(k, H, N, C) * uf[..., None], z, st, logd)
    want_y = want_y.reshape(B, H, T, V).transpose(0, 2, 1, 3)
    m_tol = 4e-3 if zt == "bfloat16" else 1e-5  # M rounded to bf16 once
    assert _rel(y, want_y) < 1e-5 and _rel(np.asarray(M, np.float64), want_M) < m_tol, (_rel(y, want_y), _rel(M, want_M))


@pytest.mark.parametrize("sanitizer", [None, "address", "thread"])
@pytest.mark.parametrize("st", ["float32", "bfloat16"])
@pytest.mark.parametrize("yt", [False, True])
def test_chunk_out_async_key_decay(st, yt, sanitizer):
    """A key-vector decay's readout staged two deep (``key``: GLA's call): M given (lower, carrying the readout's
    scale), r in bf16 with P per key element in float32 staged beside it and multiplied as R's fragments are read,
    v (Z) and the states in float32 or bf16, y in the chunks' layout or the model's [B, T, H, V] in bf16; against
    float64 (decays down to e^-20 within a chunk), plain, under ASan+UBSan and under TSan. No M is written."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(8)
    B, H, n, C, K, V = 1, 2, 3, 16, 48, 40
    N = B * H * n
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    cast = lambda a: mx.array(a).astype(mx.bfloat16) if st == "bfloat16" else a  # noqa: E731
    back = lambda a: np.array(mx.array(a).astype(mx.float32), np.float64)  # noqa: E731
    r = mx.array(f(N, C, K)).astype(mx.bfloat16)
    P = np.exp(np.cumsum(-20 / C * rng.uniform(size=(N, C, K)), 1)).astype(np.float32)
    M = np.tril(f(N, C, C))
    Z, St = cast(f(N, C, V)), cast(f(N, K, V))
    types = ("bfloat16", "float32", st, st)
    launch = ck.out_async_launch("metal", N, C, K, V, types, (H, n, "bfloat16") if yt else None, key=True)
    assert launch.source.name.startswith("recgen_chunk_out_async_key"), launch.source.name
    assert [dt for _, dt in launch.outputs] == ["bfloat16" if yt else "float32"]
    (y,) = verify.run_launch(launch, {"R": r, "Mi": M, "Z": Z, "St": St, "Pk": P, "Rs": np.array([0.5], np.float32)},
                             sanitizer=sanitizer)
    want = 0.5 * (back(r) * P) @ back(St) + M @ back(Z)
    if yt:
        want = want.reshape(B, H, n * C, V).transpose(0, 2, 1, 3)
    y = np.array(mx.array(y).astype(mx.float32), np.float64) if yt else y
    assert _rel(y, want) < (4e-3 if yt else 1e-5), _rel(y, want)


@pytest.mark.parametrize("sanitizer", [None, "address", "thread"])
@pytest.mark.parametrize("C,V", [(16, 24), (32, 48), (16, 64)])
def test_chunk_out_async_wide_fragments(C, V, sanitizer):
    """The readout on the wide multiply-add (``Tuning.wide_fragments``: CUDA's m16n8k16 on bf16 pairs, its lane
    layout spelled by SIMD shuffles in ``metal_ptx``, ldmatrix's results as ``Dialect.ldsm_a``, ``ldsm_b``, ``ldsm_bt``
    say): GDN's call with every operand in bf16, K and V not multiples of the wide product's 16 columns where they
    need not be (V = 24: one 8-column tile a threadgroup, read alone; 48: two, read together; 64: eight, y's rows
    stored by four tiles, each lane's eight columns of a row at once), against float64 on the bf16 values. M enters
    y's product in bf16, as it is written: y within that rounding."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(7)
    B, H, HK, n, K = 2, 2, 1, 2, 32
    N, T = B * H * n, n * C
    bf = lambda a: mx.array(a).astype(mx.bfloat16)  # noqa: E731
    f = lambda *s: bf(rng.normal(size=s).astype(np.float32))  # noqa: E731
    q, k, Z, St = f(B, T, HK, K), f(B, T, HK, K), f(N, C, V), f(N, K, V)
    uf, logd = rng.uniform(size=(N, C)).astype(np.float32), (-3 * rng.uniform(size=(N, C))).astype(np.float32)
    ins = {"R": q, "U": k, "Uf": uf, "Z": Z, "St": St, "logd": logd, "Rs": np.array([0.5], np.float32)}
    launch = ck.out_async_launch("metal_ptx", N, C, K, V, ("bfloat16",) * 4, (H, n, "float32"), uf=True,
                                 ml=(H, HK, n, True), wide=True)
    assert launch.source.name.startswith("recgen_chunk_out_async_uf_ml_yt_w16"), launch.source.name
    assert ck.out_async_launch("metal", N, C, K, V, ("bfloat16",) * 4, (H, n, "float32"), uf=True,
                               ml=(H, HK, n, True), wide=True).source.name.find("w16") < 0  # Metal has none
    y, M = verify.run_launch(launch, ins, sanitizer=sanitizer)

    z, st = (np.array(a.astype(mx.float32), np.float64) for a in (Z, St))
    want_y, want_M = _out_ref(0.5 * _chunks(q, H, N, C), _chunks(k, H, N, C) * uf[..., None], z, st, logd)
    want_y = want_y.reshape(B, H, T, V).transpose(0, 2, 1, 3)
    assert _rel(np.asarray(M, np.float64), want_M) < 4e-3 and _rel(y, want_y) < 4e-3, (_rel(y, want_y),
                                                                                       _rel(M, want_M))
    assert np.abs(np.triu(np.asarray(M, np.float64), 1)).max() == 0.0  # above the diagonal: 0, not Mh_'s leftovers


@pytest.mark.parametrize("sanitizer", [None, "address", "thread"])
@pytest.mark.parametrize("ot", [None, "bfloat16"])
def test_chunk_ut_async_reads_16bit_keys_in_the_model_layout(ot, sanitizer):
    """GDN's call: the key x and v in bf16 in the model's layout (two value heads over one key head, two chunks a
    sequence), u = Uf ⊙ x and b̃ = Bf x applied to A's elements and columns and to Tm's columns; Uw and Wb in float32
    or bf16 (``o16``); against float64 on the bf16 values, plain, under ASan+UBSan and under TSan."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(6)
    B, H, HK, n, C, K, V = 2, 2, 1, 2, 16, 32, 24
    N, T = B * H * n, n * C
    bf16 = lambda a: mx.array(a.astype(np.float32)).astype(mx.bfloat16)  # noqa: E731
    x, w = bf16(rng.normal(size=(B, T, HK, K)) / np.sqrt(K)), bf16(rng.normal(size=(B, T, H, V)))
    uf, logd = rng.uniform(size=(N, C)).astype(np.float32), (-6 * rng.uniform(size=(N, C))).astype(np.float32)
    ins = {"U": x, "Uf": uf, "Bf": np.array([-1.0], np.float32), "W": w, "logd": logd}
    launch = ck.ut_async_launch("metal", N, C, K, V, ("bfloat16", "bfloat16"), uf=True, ot=ot, ml=(H, HK, n, True))
    outs = verify.run_launch(launch, ins, sanitizer=sanitizer)

    xc = _chunks(x, H, N, C)
    want = _ut_ref(-xc, uf[..., None] * xc, _chunks(w, H, N, C), logd)
    for got, ref in zip(outs, want):
        tol = 1e-5 if ot is None or got.shape[-1] == C else 1e-2  # bf16 outputs: within bf16's rounding
        assert _rel(got, ref) < tol, (got.shape, _rel(got, ref))


@pytest.mark.parametrize("sanitizer", [None, "address", "thread"])
@pytest.mark.parametrize("C,ot,V,K", [(16, None, 24, 32), (32, "bfloat16", 48, 32), (16, None, 64, 64),
                                      (32, "bfloat16", 64, 64)])
def test_chunk_ut_async_wide_fragments(C, ot, V, K, sanitizer):
    """The UT transform on the wide multiply-add (``Tuning.wide_fragments``, CUDA's lane layout in ``metal_ptx``):
    GDN's call, x and v in bf16 in the model's layout, Uw and Wb in float32 or bf16, against float64 on the bf16
    values; V = 24 makes its products' passes one 8-column tile wide (read alone), 48 two (read together), 64 eight
    (at K = 64: Uw's and Wb's rows stored by four tiles, each lane's eight columns of a row at once). Tm leaves in
    float32 from the inverse; Uw's and Wb's products take it in bf16, as FLA's do: those within that rounding."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(8)
    B, H, HK, n = 2, 2, 1, 2
    N, T = B * H * n, n * C
    bf16 = lambda a: mx.array(a.astype(np.float32)).astype(mx.bfloat16)  # noqa: E731
    x, w = bf16(rng.normal(size=(B, T, HK, K)) / np.sqrt(K)), bf16(rng.normal(size=(B, T, H, V)))
    uf, logd = rng.uniform(size=(N, C)).astype(np.float32), (-3 * rng.uniform(size=(N, C))).astype(np.float32)
    ins = {"U": x, "Uf": uf, "Bf": np.array([-1.0], np.float32), "W": w, "logd": logd}
    launch = ck.ut_async_launch("metal_ptx", N, C, K, V, ("bfloat16", "bfloat16"), uf=True, ot=ot,
                                ml=(H, HK, n, True), wide=True)
    assert launch.source.name.split("_metal")[0].endswith("_w16"), launch.source.name
    outs = verify.run_launch(launch, ins, sanitizer=sanitizer)

    xc = _chunks(x, H, N, C)
    want = _ut_ref(-xc, uf[..., None] * xc, _chunks(w, H, N, C), logd)
    for i, (got, ref) in enumerate(zip(outs, want)):
        tol = 1e-5 if i == 0 else 1e-2  # Tm in float32; Uw and Wb through Tm's bf16
        assert _rel(got, ref) < tol, (i, _rel(got, ref))


def _banks(x: int, esize: int, rows: int) -> bool:
    """Whether a warp's fragment read of a tile of row stride x (elements of esize bytes) in CUDA's lane layout
    touches each bank through one word only: A fragments (8 rows gq x 4 columns tq) where rows = 8, B fragments (4
    rows tq x 8 columns gq) where 4."""
    words = set()
    for lane in range(32):
        gq, tq = lane >> 2, lane & 3
        r, c = (gq, tq) if rows == 8 else (tq, gq)
        words.add((r * x + c) * esize // 4)
    return len({w % 32 for w in words}) == len(words)


def _pair_banks(x: int, packed: bool) -> bool:
    """Whether a warp's reads of the wide multiply-add's pairs (``PTX_FRAGMENTS16``) from a 16-bit tile of row stride
    x touch each bank through one word only: as one word (rows gq, k pair 2 tq) where not ``packed``, else two 16-bit
    reads (rows 2 tq and 2 tq + 1, column gq), each read on its own."""
    reads = [[(gq * x + 2 * tq) // 2 for gq in range(8) for tq in range(4)]] if not packed else [
        [((2 * tq + e) * x + gq) // 2 for gq in range(8) for tq in range(4)] for e in (0, 1)]
    return all(len({w % 32 for w in set(r)}) == len(set(r)) for r in reads)


def _matrix_rows_banks(x: int) -> bool:
    """Whether a matrix load's 8 rows of 16 bytes (ldmatrix: one 8 x 8 16-bit matrix a phase) from a tile of row
    stride x 16-bit elements fall on 8 distinct groups of 4 banks."""
    return len({(r * x * 2 // 16) % 8 for r in range(8)}) == 8


@pytest.mark.parametrize("n", [8, 16, 24, 32, 64, 128])
def test_wide_pair_strides_are_conflict_free(n):
    """The wide multiply-add's tiles: A pairs (and B pairs read transposed) at ``copy_stride(n, 2, 8)``, B pairs
    packed from two rows at ``b_stride`` (in 16-bit elements), each a whole number of 16-byte words a row; read by
    matrix loads (``Dialect.ldsm_a``, ..) both are conflict-free too."""
    a, b = cs.copy_stride(n, 2, 8), cs.b_stride(n)
    assert a >= n and b >= n and a * 2 % 16 == 0 and b * 2 % 16 == 0
    assert _pair_banks(a, False) and _pair_banks(b, True), (n, a, b)
    assert _matrix_rows_banks(a) and _matrix_rows_banks(b) and not _matrix_rows_banks(64), (n, a, b)
    assert not _pair_banks(cs.copy_stride(128, 2, 4), True)  # the TF32 frames' B stride would conflict here


@pytest.mark.parametrize("esize", [2, 4])
@pytest.mark.parametrize("n", [8, 16, 32, 64, 128])
def test_copy_strides_are_whole_words_and_conflict_free(esize, n):
    for rows in (8, 4):
        x = cs.copy_stride(n, esize, rows)
        assert x >= n and x * esize % 16 == 0 and _banks(x, esize, rows), (n, esize, rows, x)
    assert PTX_FRAGMENTS.gq == "lane >> 2" and PTX_FRAGMENTS.tq == "lane & 3"  # the layout _banks models


def test_chunk_out_async_layouts():
    """CUDA's 48 KiB: GDN's bf16 keys take BV 128 at KB 16 (M 17.4 KB, two blocks of R and S_c 23 KB); float32 keys
    the same depth; Metal's 32 KiB a shallower one; sizes outside the layouts have none."""
    bf = cs.out_async_layout("cuda", 64, 128, 128, (2, 2, 4, 4))
    assert bf == {"BV": 128, "KB": 16, "LD": 68, "LDR": 24, "LDU": 24, "LDB": 136, "LDZ": 136, "SQ": 1472}
    assert 4 * (64 * 68 + 64) + 16 * bf["SQ"] == 41216  # what ptxas reports for the kernel
    assert cs.out_async_layout("cuda", 64, 128, 128, (4, 4, 4, 4))["KB"] == 16
    s16 = cs.out_async_layout("cuda", 64, 128, 128, (2, 2, 2, 2))  # 16-bit states: blocks of 16 still, half the room
    assert s16["KB"] == 16 and s16["LDB"] * 2 % 128 in (32, 96) and s16["SQ"] < bf["SQ"]
    metal = cs.out_async_layout("metal", 64, 128, 128, (2, 2, 4, 4))
    assert metal["KB"] == 8 and 4 * (64 * 68 + 64) + 16 * metal["SQ"] <= 32 * 1024
    assert cs.out_async_layout("cuda", 48, 128, 128) is None and cs.out_async_layout("cuda", 64, 12, 128) is None


def test_chunk_ut_async_layouts():
    """CUDA's 48 KiB: GDN's bf16 x and v take BW 128 at KB 16 (A and Tm 34.8 KB, two blocks of 16 rows of W 9.2 KB);
    float32 roles a shallower depth; Metal's 32 KiB C = 32 only; sizes outside the layouts have none."""
    assert cs.ut_async_layout("cuda", 64, 128, 128, (2, 2)) == {"BW": 128, "KB": 16, "LD": 68, "LDU": 24, "LDU2": 24,
                                                                 "LDW": 144, "LDX": 144, "SQ": 576}
    assert cs.ut_async_layout("cuda", 64, 128, 128, (4, 4, 4))["KB"] == 8
    assert cs.ut_async_layout("metal", 64, 128, 128, (2, 2)) is None and cs.ut_async_layout("metal", 32, 128, 128, (2, 2))
    assert cs.ut_async_layout("cuda", 48, 128, 128, (2, 2)) is None


@pytest.mark.parametrize("name,T,dtype", [("gated_delta_net", 48, None), ("gated_delta_net", 40, "bf16"),
                                          ("gated_delta_net/formed", 40, None), ("simple_gla", 40, None),
                                          ("gla", 40, "bf16"), ("gla", 33, None)])
def test_chunked_core_with_async_kernels_matches_reference(name, T, dtype, monkeypatch):
    """The chunked core end to end with ``async_staging``: GDN (factor reads; whole chunks in the model's layout at T =
    48, a partial last chunk at 40, bf16 inputs; "/formed": the roles formed by MLX, Bt and u read as given) and simple
    GLA (u = k, no factors, no UT transform) and GLA (a key-vector decay: its readout, M given, in 16 and 32 bits);
    forward, final state and every gradient against the float64 reference, the readout and UT transform run by the
    two-buffer kernels."""
    pytest.importorskip("mlx.core")
    import dataclasses

    import mlx.core as mx
    from recgen import specs
    from test_chunked import assert_close, compare

    calls = []
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: calls.append(launch.source.name) or _emulated_call(launch, *a))
    name, _, formed = name.partition("/")
    t = tuning.resolve("cpu", environ={}, dialect="metal", chunk_kernels=True, mma_scan=True, model_rows=True,
                       async_staging=True, factor_reads=not formed)
    rec = specs.BUILTINS[name]
    rec = dataclasses.replace(rec, gqa="block") if name == "gated_delta_net" else rec
    assert_close(compare(rec, T, chunk=16, K=16, V=8, seed=3, tuning=t, in_dtype=mx.bfloat16 if dtype else None),
                 *((1e-2, 1e-2) if dtype else ()))
    staged = {c.split("_metal")[0] for c in calls if "_out_" in c or "_ut_" in c}
    delta = name == "gated_delta_net"
    uf, ml = ("" if formed else "_uf"), ("_ml" if T % 16 == 0 else "")
    plain = {"recgen_chunk_out_async_key_yt"} if name == "gla" else {"recgen_chunk_out_async_yt"}
    staged_delta = {f"recgen_chunk_out_async{uf}{ml}_yt", f"recgen_chunk_ut_async{uf}{ml}"}
    assert staged == (staged_delta if delta else plain), staged


def test_copies_render_by_the_dialects_table():
    """The same frames, spelled by each dialect's table: CUDA starts cp.async copies, commits a group a block and waits
    for all but the newest; Metal moves the 16 bytes itself and neither commits nor waits (its barriers order the
    copies). CUDA's measured table turns the frames on; Metal's does not."""
    for src in (cs.out_async_source("cuda", True, True, True), cs.ut_async_source("cuda", True, False, True)):
        assert "cp.async.cg.shared.global" in src.header and "rg_cp16(" in src.source
        # three pipelined loops each (the readout's three products; the UT transform's A and its two products with
        # Tm), each with one wait a block and a commit before its loop as well as in it
        assert src.source.count("cp.async.wait_group 1") == 3
        assert src.source.count("cp.async.commit_group") == 6
    for src in (cs.out_async_source("metal", True, True, True), cs.ut_async_source("metal", True, False, True)):
        assert not any(w in src.text for w in ("cp.async.cg", "commit_group", "wait_group"))
        assert "threadgroup uint4*" in src.header and "rg_cp16(" in src.source
    assert tuning.resolve("gpu", "cuda", environ={}).async_staging
    assert not tuning.resolve("gpu", "metal", environ={}).async_staging


@pytest.mark.parametrize("kernel", ["readout", "ut"])
def test_wide_kernels_without_matrix_loads_read_the_same_pairs(kernel, monkeypatch):
    """A dialect with the wide multiply-add but no matrix loads (``Dialect.ldsm_a``, ``ldsm_b``, ``ldsm_bt`` empty)
    takes ``a16_tile``'s and ``b16_tiles``' pair reads instead: the readout and the UT transform (GDN's calls, V = 48:
    tiles read two at a time and one alone) give bit for bit what the matrix loads give."""
    from dataclasses import replace

    import mlx.core as mx

    from recgen.codegen import backends

    monkeypatch.setitem(backends.DIALECTS, "metal_pairs", replace(backends.get("metal_ptx"), name="metal_pairs",
                                                                  ldsm_a="", ldsm_b="", ldsm_bt=""))
    rng = np.random.default_rng(9)
    B, H, HK, n, C, K, V = 2, 2, 1, 2, 32, 32, 48
    N, T = B * H * n, n * C
    f = lambda *s: mx.array(rng.normal(size=s).astype(np.float32)).astype(mx.bfloat16)  # noqa: E731
    uf, logd = rng.uniform(size=(N, C)).astype(np.float32), (-3 * rng.uniform(size=(N, C))).astype(np.float32)
    if kernel == "readout":
        ins = {"R": f(B, T, HK, K), "U": f(B, T, HK, K), "Uf": uf, "Z": f(N, C, V), "St": f(N, K, V), "logd": logd,
               "Rs": np.array([0.5], np.float32)}
        launch = lambda d: ck.out_async_launch(d, N, C, K, V, ("bfloat16",) * 4, (H, n, "float32"),  # noqa: E731
                                               uf=True, ml=(H, HK, n, True), wide=True)
    else:
        ins = {"U": f(B, T, HK, K), "Uf": uf, "Bf": np.array([-1.0], np.float32), "W": f(B, T, H, V), "logd": logd}
        launch = lambda d: ck.ut_async_launch(d, N, C, K, V, ("bfloat16", "bfloat16"), uf=True,  # noqa: E731
                                              ot="bfloat16", ml=(H, HK, n, True), wide=True)
    loads, pairs = launch("metal_ptx"), launch("metal_pairs")
    assert "rg_ldsm" in loads.source.source and "rg_ldsm" not in pairs.source.source
    for a, b in zip(verify.run_launch(loads, ins), verify.run_launch(pairs, ins)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
