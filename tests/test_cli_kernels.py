"""``recgen check`` and ``recgen emit`` on the specs that broke them (a normalizer spec, a spec without
kernels), and an old clang (< 15): the Metal checks skip, and ``recgen check`` says why first."""
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from recgen.cli import main
from recgen.verify.typecheck import clang_problem, find_clang


def test_check_a_normalizer_spec(capsys):
    if clang_problem():
        pytest.skip(clang_problem())
    assert main(["check", f"{ROOT}/examples/mlstm.py:mlstm", "--T", "3"]) == 0
    out = capsys.readouterr().out
    assert "all layers passed" in out and "final_state.z" in out and "dinitial_state.z" in out


FEATURE_SPEC = """import recgen as rg


@rg.recurrence
def squared(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar):
    return rg.Step(decay=rg.exp(g), update=rg.outer(rg.sympow(k), v), readout=rg.sympow(q))
"""


def test_emit_a_spec_without_kernels_says_so(tmp_path, capsys):
    """A feature map without power retention's composition: no kernels, a clear error, no file written."""
    spec = tmp_path / "squared.py"
    spec.write_text(FEATURE_SPEC)
    out = tmp_path / "out"
    assert main(["emit", f"{spec}:squared", "--all", "-o", str(out)]) == 2
    assert main(["check", f"{spec}:squared"]) == 2
    err = capsys.readouterr().err
    assert "squared has no kernels" in err and "feature maps" in err and "Traceback" not in err
    assert not out.exists()


def test_check_power_retention_by_key_blocks(capsys):
    """Power retention checks as simple_gla's Metal kernels over its key blocks (``recgen.key_blocks``), and its
    feature kernels (decode, the products over φ's rows, the gradient through them, the in-chunk decayed scores and
    their gradient) against float64 numpy."""
    if clang_problem():
        pytest.skip(clang_problem())
    assert main(["check", "power_retention", "--T", "3"]) == 0
    out = capsys.readouterr().out
    assert "over key blocks" in out and "all layers passed" in out and "dinitial_state.z" in out
    for row in ("feature decode: state", "feature decode: readout", "phi(X)^T Y", "phi(X)^T Y, then a tail", "phi(X) S",
                "gradient through phi", "gradient through phi, by rows", "decayed scores", "decayed scores: gradients"):
        assert row in out, row
    assert out.count("recgen_chunk_feature") >= 18  # six kernels, three layers each
    assert out.count("recgen_chunk_decayed_scores") >= 6  # the in-chunk scores and their gradient


@pytest.fixture
def old_clang(tmp_path, monkeypatch):
    """A PATH whose only clang++ says it is clang 14."""
    fake = tmp_path / "clang++"
    fake.write_text("#!/bin/sh\necho 'Debian clang version 14.0.6'\necho 'Target: x86_64-pc-linux-gnu'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    find_clang.cache_clear()
    yield tmp_path
    find_clang.cache_clear()


def test_old_clang_is_named(old_clang, capsys):
    assert find_clang() is None
    problem = clang_problem()
    assert "needs clang >= 15" in problem and "14.0.6" in problem
    assert main(["check", "simple_gla"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("recgen check: error: Metal verification needs clang >= 15") and "unknown type" not in err


def test_metal_tests_skip_with_an_old_clang(old_clang):
    env = dict(os.environ, PATH=str(old_clang))
    res = subprocess.run([sys.executable, "-m", "pytest", "tests/test_kernels_metal.py", "-q", "-rs", "-p",
                          "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "needs clang >= 15" in res.stdout and " passed" not in res.stdout and "failed" not in res.stdout
