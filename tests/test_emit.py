"""Standalone kernels from ``recgen emit``: they type-check as MSL with full signatures and
buffer indices, and the standalone forward runs on the CPU emulator with the reference's result."""
import json

import numpy as np
import pytest

from recgen.math import reference

from recgen import specs
from recgen.emit import emit
from recgen.spec.layouts import Sizes
from recgen.verify.typecheck import clang_problem

from recgen.testing import kernel_inputs, rel_err

pytestmark = pytest.mark.skipif(clang_problem() is not None, reason=clang_problem() or "")


def test_standalone_metal_typechecks_and_runs(tmp_path):
    from recgen.verify.cpu_exec import run_msl
    from recgen.verify.typecheck import typecheck

    rec = specs.gated_delta_net
    paths = emit(rec, "metal", tmp_path, K=8, V=12, H=4, HK=2, dtype="float32")
    for p in paths:
        if p.suffix == ".metal" and ".mlx." not in p.name:
            r = typecheck(p.read_text())
            assert r.ok, f"{p.name}:\n{r}"
    manifest = json.loads((tmp_path / "gated_delta_net.metal.manifest.json").read_text())
    fwd = next(k for k in manifest["kernels"] if k["kind"] == "fwd")
    assert [b["index"] for b in fwd["buffers"]] == list(range(len(fwd["buffers"])))
    sizes = Sizes(B=2, T=5, H=4, Hk=2, Kin=8, K=8, V=12)
    xs, h0, _, _, scale = kernel_inputs(rec, sizes, np.random.default_rng(7))
    ins = {f"{n}_in": v.astype(np.float32) for n, v in xs.items()}
    ins.update(rt=np.array([sizes.T, sizes.B], np.int32), scale_in=np.array([scale], np.float32), h0=h0.astype(np.float32))
    tg = fwd["threadgroup"]
    grid = (int(fwd["grid_threadgroups"][0]) * tg[0], sizes.B * sizes.H, 1)
    outs = run_msl((tmp_path / fwd["file"]).read_text(), fwd["entry"], ins,
                   {"o": ((2, 5, 4, 12), np.float32), "ht": ((2, 4, 8, 12), np.float32), "ckpt": ((1,), np.float32)},
                   grid, tuple(tg))
    o_r, ht_r = reference.run(rec, initial_state=h0, scale=scale, **xs)
    assert rel_err(outs["o"], o_r) < 1e-5 and rel_err(outs["ht"], ht_r) < 1e-5


def test_emit_rejects_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        emit(specs.gla, "metal", tmp_path, K=8, V=8, H=1, HK=1, dtype="float64")
