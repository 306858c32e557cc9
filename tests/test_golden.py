"""Goldens of every emitted kernel: a change to generated code shows in review as a diff here.

Regenerate after an intended change with ``RECGEN_UPDATE_GOLDEN=1 pytest tests/test_golden.py``
and read the diff of tests/golden/ before committing.
"""
import os
from pathlib import Path

import pytest

from recgen import specs
from recgen.emit import emit

GOLDEN = Path(__file__).parent / "golden"
KERNEL_SPECS = ["gated_delta_net", "kda", "delta_net", "gla", "simple_gla", "selective_scan", "selective_scan_linear_dt",
                "retnet", "hgrn2", "mamba2", "mamba2_linear_dt", "mlstm", "mlstm_sigmoid", "rwkv6", "rwkv7"]
SIZES = dict(K=64, V=64, H=4, HK=2)  # the reference size of the goldens


@pytest.mark.parametrize("target", ["metal", "cuda"])
@pytest.mark.parametrize("name", KERNEL_SPECS)
def test_emitted_kernels_match_golden(name, target, tmp_path):
    rec = specs.BUILTINS[name]
    sizes = dict(SIZES, HK=SIZES["H"] if name.startswith("selective") else SIZES["HK"])
    paths = emit(rec, target, tmp_path, dtype="float32", command=f"recgen emit {name} --target {target}", **sizes)
    for p in paths:
        text = p.read_text()
        assert text.isascii(), f"{p.name}: generated code must be ASCII"
        assert "double" not in text.replace("double-", ""), f"{p.name}: Metal has no double"
        gold = GOLDEN / name / p.name
        if os.environ.get("RECGEN_UPDATE_GOLDEN"):
            gold.parent.mkdir(parents=True, exist_ok=True)
            gold.write_text(text)
        assert gold.exists(), f"missing golden {gold}: run with RECGEN_UPDATE_GOLDEN=1"
        assert text == gold.read_text(), f"{p.name} differs from its golden (RECGEN_UPDATE_GOLDEN=1 to accept)"


def test_emission_is_deterministic(tmp_path):
    a = emit(specs.gla, "metal", tmp_path / "a", dtype="bfloat16", **SIZES)
    b = emit(specs.gla, "metal", tmp_path / "b", dtype="bfloat16", **SIZES)
    assert [p.read_text() for p in a] == [p.read_text() for p in b]


@pytest.mark.parametrize("target", ["metal", "cuda"])
def test_chunk_kernels_match_golden(target):
    """The generated chunk kernels (MLX form: header and body) with their template constants at the
    GPU shapes (C = 64, K = V = 128): inverse, delta-rule scans (scalar decay) and diagonal scans in both
    frames (FMA, fragment multiply-adds), the forward fragment scans taking u and Q (``ScanVariant.q``) or a product term (the general rank-1 core's u wᵀ), pair kernels (key-vector decay), the sympow feature map, the fragment readout and UT transform (Metal's at C = 32: C = 64 does
    not fit its threadgroup memory), the backward's fragment pass after the scan (Metal's at C = 32), the key-decay backward tail."""
    from recgen.codegen.chunk_sources import ScanVariant
    from recgen.runtime import chunk_kernels as ck

    def scans(F, **terms):  # the same scan on FMAs (16-byte columns) and on fragments
        return [ck.scan_launch(target, ScanVariant(vec=True, **terms), 8, 4, 64, 128, 128, F),
                ck.scan_launch(target, ScanVariant(mma=True, **terms), 8, 4, 64, 128, 128, F)]

    def mma(**terms):
        return ck.scan_launch(target, ScanVariant(mma=True, **terms), 8, 4, 64, 128, 128, 1)

    launches = ([ck.inverse_launch(target, 8, 64)]
                + [x for e in (False, True) for x in scans(1, e=e, reverse=e)]
                + scans(128, a=False, b=True)
                + scans(128, e=True, reverse=True, a=True, b=False)
                + [mma(reverse=True, p=True, dg=True), mma(reverse=True, p=True, dg=True, aq=True, pq=True),
                   mma(reverse=True, e=True, b=False, aq=True), mma(q=True, pf=True),
                   mma(reverse=True, p=True, dg=True, aq=True, pq=True, pf=True), mma(p=True)]
                + [mma(a=a, q=True) for a in (True, False)]
                + [ck.pair_launch(target, 8, 64, 128, strict, grad) for strict in (False, True) for grad in (False, True)]
                + [ck.pair_launch(target, 8, 64, 128, strict, grad, dual=True) for strict in (False, True)
                   for grad in (False, True)]
                + [ck.pair_launch(target, 8, 64, 128, True, grad, dual, mma=True) for grad in (False, True)
                   for dual in (False, True)]
                + [ck.sympow_launch(target, 2, 4096, 8, 8, 64, True, grad) for grad in (False, True)]
                + [ck.out_mma_launch(target, 8, 64, 128, 128), ck.out_mma_launch(target, 8, 64, 128, 128, (2, 2, "bfloat16"))]
                + [ck.out_mma_launch(target, 8, 64, 128, 128, (2, 2, "bfloat16"), key=True)]
                + [ck.ut_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, 128, key=key) for key in (False, True)]
                + [ck.bwd_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, ("bfloat16", "float32", "bfloat16")),
                   ck.bwd_mma_launch(target, 8, 64 if target == "cuda" else 32, 128, ("bfloat16", "bfloat16"))]
                + [ck.bwd_key_launch(target, 8, 64, 128, ("float32",) * n) for n in (2, 3)])
    for launch in launches:
        src = launch.source
        text = (f"// template: {dict(launch.template)}; grid {launch.grid}, threadgroup {launch.threadgroup}\n"
                + src.text)
        assert text.isascii()
        gold = GOLDEN / "chunk" / f"{src.name.rsplit('_', 1)[0]}.{'metal' if target == 'metal' else 'cu'}"
        if os.environ.get("RECGEN_UPDATE_GOLDEN"):
            gold.parent.mkdir(parents=True, exist_ok=True)
            gold.write_text(text)
        assert gold.exists(), f"missing golden {gold}: run with RECGEN_UPDATE_GOLDEN=1"
        assert text == gold.read_text(), f"{gold.name} differs from its golden (RECGEN_UPDATE_GOLDEN=1 to accept)"
