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
    GPU shapes (C = 64, K = V = 128): inverse, key-vector decay geometry, delta-rule scans (scalar decay) and diagonal scans in both
    frames (FMA, fragment multiply-adds), the forward fragment scans taking u and Q (``ScanVariant.q``) or a product term (the general rank-1 core's u wᵀ), pair kernels (key-vector decay; the quad form at C = 32 on Metal), the sympow feature map, the fragment readout and UT transform (Metal's at C = 32: C = 64 does
    not fit its threadgroup memory), the backward's fragment pass after the scan (Metal's at C = 32), the key-decay backward tail."""
    from helpers import chunk_launches

    launches = chunk_launches(target)
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
