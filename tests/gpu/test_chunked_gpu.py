"""The chunked form (backend "mlx") on the GPU, against the float64 reference: there it runs its GPU forms
(the matrix scan over chunks, ``mx.compile``) and the generated chunk kernels (triangular inverse, chunk scans,
key-decay pair matrices, fused readout and UT transform). Every built-in and the mLSTM example, float32 and
bfloat16, at ``op_check.CASES``, with the scans on FMAs (MLX_ENABLE_TF32=0, tests/gpu/conftest.py); and in
bfloat16 once more with the scans on tensor-core fragments.

Power retention gets the inputs of ``op_check.case_inputs`` (K = 8 raw key columns, a reachable initial state),
log-decays down to -20 like the other specs.
"""
from __future__ import annotations

import pytest
from op_check import ALL_SPECS, Case, assert_close, load_spec, op_errors, params

from recgen.spec import ir
from recgen.spec.fns import exp
from recgen.spec.frontend import Key, KeyGate, Scalar, Step, Value, rank1, outer, recurrence

pytestmark = pytest.mark.gpu

# A shape no other test uses: the chunked form's compiled graphs are traced once per shape, and the fragment
# scan is chosen while tracing, so a fresh shape makes sure it is the one traced. Two full chunks and a partial.
FRAGMENT_CASE = Case(1, 130, 4, 2, 64, 40)
# power retention's core uses no chunk scan kernel (its feature map has 36 state rows, no fragment layout)
FRAGMENT_SPECS = tuple(n for n in ALL_SPECS if n != "power_retention")


@pytest.mark.parametrize("name,case,dtype", params(ALL_SPECS))
def test_chunked_form(name, case, dtype, rng):
    assert_close(op_errors(load_spec(name), case, dtype, rng, backend="mlx"), dtype)


@pytest.mark.parametrize("name,case,dtype", params(FRAGMENT_SPECS, dtypes=("bfloat16",), cases=(FRAGMENT_CASE,)))
def test_chunked_form_fragment_scan(name, case, dtype, rng, fragment_scan):
    assert_close(op_errors(load_spec(name), case, dtype, rng, backend="mlx"), dtype)


# the key-vector decays' pair kernels with the earlier blocks on fragments (``Tuning.mma_pairs``, off by default;
# TF32 operands, so with the fragment scan): single (gla), dual strict (kda), dual non-strict (rwkv7)
PAIR_SPECS = ("gla", "kda", "rwkv7")


@pytest.mark.parametrize("name,case,dtype", params(PAIR_SPECS, dtypes=("bfloat16",), cases=(FRAGMENT_CASE,)))
def test_chunked_form_pairs_on_fragments(name, case, dtype, rng):
    from recgen import tuning

    with tuning.override(mma_pairs=True, mma_scan=True):
        assert_close(op_errors(load_spec(name), case, dtype, rng, backend="mlx"), dtype)


@pytest.mark.parametrize("name,case,dtype", params(PAIR_SPECS, dtypes=("bfloat16",), cases=(FRAGMENT_CASE,)))
def test_chunked_form_pairs_with_folded_rows(name, case, dtype, rng):
    """The pair kernels with the own block's rows folded (``Tuning.pair_fold``) and, for rwkv7, the UT kernel forming
    U = (T B) w itself (``Tuning.ut_products``), the readout's three terms as one kernel (``Tuning.rank1_readout``)
    and its log-decay read in bf16 (``Tuning.logdecay_16bit``): on in CUDA's measured table, set here so the
    test holds whatever the table says."""
    from recgen import tuning

    with tuning.override(mma_pairs=True, mma_scan=True, pair_fold=True, ut_products=True, rank1_readout=True,
                         logdecay_16bit=True):
        assert_close(op_errors(load_spec(name), case, dtype, rng, backend="mlx"), dtype)


@recurrence
def dplr_after_key_decay(q: Key, k: Key, kk: Key, v: Value, gk: KeyGate, beta: Scalar):
    """The general rank-1 core after a key-vector decay (RWKV-7 is the one before it): A with M_ra and B with M_ru
    on the strict dual pair kernels."""
    return Step(decay=exp(gk), transition=rank1(-beta * kk, k), update=outer(beta * k, v), readout=ir.SCALE * q)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_general_rank1_after_a_key_decay(dtype, rng):
    assert_close(op_errors(dplr_after_key_decay, FRAGMENT_CASE, dtype, rng, backend="mlx"), dtype)


# Whole chunks (T = 128: two of 64) and GQA (4 value heads over 2 key heads): the shape model-layout reads need
MODEL_ROWS_CASE = Case(2, 128, 4, 2, 64, 40)
DENSE_CASE = Case(2, 128, 4, 4, 64, 40)  # whole chunks without GQA: the model's layout where ``model_rows_dense``


@pytest.mark.parametrize("name,case,dtype", params(("gated_delta_net", "delta_net"), dtypes=("bfloat16",),
                                                   cases=(MODEL_ROWS_CASE,)))
def test_chunked_form_reads_the_model_layout(name, case, dtype, rng, monkeypatch):
    """``Tuning.model_rows``: the five fused kernels read q, k, v as the model passes them (and the backward's pass
    writes dq, dk so), against the float64 reference; the kernels that ran are the model-layout ones. bf16 only, as
    the other fragment tests: the fragments' TF32 operands are outside float32's tolerance."""
    from recgen import tuning
    from recgen.runtime import chunk_kernels as ck

    names, call = [], ck.mlx_call
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: names.append(launch.source.name) or call(launch, *a))
    # replay_graphs off: a graph recorded by an earlier test would replay its kernels, unseen by the patch
    with tuning.override(mma_scan=True, model_rows=True, replay_graphs=False):  # GQA: the default's case
        assert_close(op_errors(load_spec(name), case, dtype, rng, backend="mlx"), dtype)
    # the scans hoisted or not (``Tuning.scan_hoist``), the readout and UT transform with L2 hints or staged by
    # asynchronous copies (``Tuning.async_staging``) or neither, the backward's pass forming its products or not
    # (``Tuning.bwd_products``), the UT transform's outputs in 16 bits or not (``Tuning.ut_16bit``), the states too
    # or not (``Tuning.states_16bit``)
    ran = {n.split("_cuda")[0].replace("_ho", "").replace("_l2", "").replace("_async", "_mma").replace("_o16", "")
           .replace("_s16", "").replace("_w16", "").replace("_wl", "").replace("_nx", "").removesuffix("_pv")
           for n in names}  # ... and the forward scan loading a step ahead or not (``Tuning.scan_ahead_most``)
    assert {"recgen_chunk_ut_mma_uf_ml", "recgen_chunk_scan_mma_q_ml", "recgen_chunk_out_mma_uf_ml_yt",
            "recgen_chunk_scan_mma_aq_p_pq_dg_ml_rev", "recgen_chunk_bwd_mma_delta_uf_ml"} <= ran, ran


@pytest.mark.parametrize("name,case,dtype", params(("gated_delta_net", "delta_net", "simple_gla"), dtypes=("bfloat16",),
                                                   cases=(Case(2, 128, 4, 2, 64, 48), Case(1, 130, 4, 4, 64, 32))))
@pytest.mark.parametrize("products", [False, True])
def test_backward_forms_its_pair_cotangents(name, case, dtype, rng, monkeypatch, products):
    """``Tuning.bwd_scores``: the backward's pass forms dy Zᵀ (and Δ Zᵀ) on the wide multiply-add from the rows of
    Z, dy (Δ) in bf16, V a multiple of 16 (GQA with whole chunks, and a partial last chunk without), and with
    ``Tuning.bwd_products`` its products over values on it too, against the float64 reference, gradients included;
    the pass that ran is that form."""
    from recgen import tuning
    from recgen.runtime import chunk_kernels as ck

    names, call = [], ck.mlx_call
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: names.append(launch.source.name) or call(launch, *a))
    with tuning.override(mma_scan=True, wide_fragments=True, bwd_scores=True, bwd_products=products,
                         replay_graphs=False):
        assert_close(op_errors(load_spec(name), case, dtype, rng, backend="mlx"), dtype)
        names.clear()  # again, the self-tests (which run both forms of the pass) behind it
        assert_close(op_errors(load_spec(name), case, dtype, rng, backend="mlx"), dtype)
    passes = {n.split("_cuda")[0] for n in names if n.startswith("recgen_chunk_bwd_mma")}
    assert passes and all(n.removesuffix("_wl").endswith("_pv_sc" if products else "_sc") for n in passes), passes


@pytest.mark.parametrize("name,case,dtype", params(("gated_delta_net", "delta_net", "simple_gla"), dtypes=("bfloat16",),
                                                   cases=(MODEL_ROWS_CASE, FRAGMENT_CASE, DENSE_CASE)))
@pytest.mark.parametrize("wide", [False, True])
def test_chunked_form_with_async_staging(name, case, dtype, rng, monkeypatch, wide):
    """``Tuning.async_staging``: the scalar decay's readout and the delta rule's UT transform with their blocks copied two
    deep by cp.async (whole chunks in the model's layout, and a partial last chunk in the chunks' layout), against the
    float64 reference; the kernels that ran are the two-buffer ones, the readout on the wide multiply-add where
    ``Tuning.wide_fragments`` says (bf16 operands and states: m16n8k16)."""
    from recgen import tuning
    from recgen.runtime import chunk_kernels as ck

    names, call = [], ck.mlx_call
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: names.append(launch.source.name) or call(launch, *a))
    with tuning.override(mma_scan=True, model_rows=True, model_rows_dense=True, async_staging=True,
                         wide_fragments=wide, replay_graphs=False):  # each kernel call seen by the patch, none replayed
        assert_close(op_errors(load_spec(name), case, dtype, rng, backend="mlx"), dtype)
    ran = {n.split("_cuda")[0] for n in names}  # the self-tests' kernels run once a process too
    delta = name != "simple_gla"  # factor reads (u = β k), and the model's layout where chunks are whole (simple
    uf, ml = ("_uf" if delta else ""), ("_ml" if case.T % 64 == 0 else "")  # GLA's readout reads v so too: zm)
    zm = "_zm" if ml and not delta else ""
    assert f"recgen_chunk_out_async{uf}{ml}{zm}_yt{'_w16' if wide else ''}" in ran, ran
    assert not delta or any(n.startswith(f"recgen_chunk_ut_async{uf}") and n.removesuffix("_w16").endswith(ml)
                            and n.endswith("_w16") == wide for n in ran), ran


@pytest.mark.parametrize("case", [MODEL_ROWS_CASE, DENSE_CASE])
@pytest.mark.parametrize("backward", [False, True])
def test_gla_reads_the_model_layout(case, backward, rng, monkeypatch):
    """GLA's forward with whole chunks reads q, k, v and gk as the model passes them (``parallel._forward_key_model``:
    the decays' pass, the whole-chunk pair, the wide scan's X and the staged key readout), GQA's key heads shared or
    none (``Tuning.model_rows_dense``), on the fragment scan (which MLX_ENABLE_TF32=0, set for these checks, turns
    off by default); against the float64 reference, every gradient (the backward copies them to the chunks'
    layout, or with ``Tuning.key_model_backward`` reads q, k, gk so too); the kernels that ran are the model-layout
    ones."""
    from recgen.runtime import chunk_kernels as ck
    from recgen import tuning

    names, call = [], ck.mlx_call
    monkeypatch.setattr(ck, "mlx_call", lambda launch, *a: names.append(launch.source.name) or call(launch, *a))
    with tuning.override(mma_scan=True, replay_graphs=False, key_model_backward=backward):  # each call seen
        assert_close(op_errors(load_spec("gla"), case, "bfloat16", rng, backend="mlx"), "bfloat16")
    ran = {n.split("_cuda")[0] for n in names}
    assert ("recgen_chunk_bwd_key_ml" in ran) == backward, ran
    assert {"recgen_chunk_decays_nod_noq_q_yt_ml", "recgen_chunk_pair_whole_xs_ml",
            "recgen_chunk_out_async_key_ml_zm_yt"} <= ran, ran
    assert any(n.startswith("recgen_chunk_scan_mma_noa") and n.endswith("_xm") for n in ran), ran
