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


def assert_standalone_typechecks(paths):
    """Every standalone .metal file among ``paths`` passes the clang type check with Metal's address spaces."""
    from recgen.verify.typecheck import typecheck

    for p in paths:
        if p.suffix == ".metal" and ".mlx." not in p.name:
            r = typecheck(p.read_text())
            assert r.ok, f"{p.name}:\n{r}"


def test_standalone_metal_typechecks_and_runs(tmp_path):
    from recgen.verify.cpu_exec import run_msl

    rec = specs.gated_delta_net
    assert_standalone_typechecks(emit(rec, "metal", tmp_path, K=8, V=12, H=4, HK=2, dtype="float32"))
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


@pytest.mark.parametrize("name", [n for n in specs.BUILTINS if n != "power_retention"])
def test_every_builtins_standalone_kernels_build(name, tmp_path):
    """Each standalone kernel declares every buffer its body reads (a normalizer's z0, ckptz, dhtz, ydo_in too):
    the Metal files type-check; the CUDA files compile with nvcc for sm_90 where nvcc is installed."""
    import shutil
    import subprocess

    rec = specs.BUILTINS[name]
    assert_standalone_typechecks(emit(rec, "metal", tmp_path, K=16, V=16, H=2, HK=1, dtype="bfloat16"))
    nvcc = shutil.which("nvcc")
    if nvcc is None or name not in ("mlstm", "gated_delta_net"):  # nvcc takes ~10 s a file: two specs
        return
    for p in emit(rec, "cuda", tmp_path, K=16, V=16, H=2, HK=1, dtype="bfloat16"):
        if p.suffix == ".cu" and ".mlx." not in p.name:
            r = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-c", str(p), "-o", str(tmp_path / "k.o")],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, f"{p.name}:\n{r.stderr[-3000:]}"


def test_emit_rejects_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        emit(specs.gla, "metal", tmp_path, K=8, V=8, H=1, HK=1, dtype="float64")


def test_power_retention_emits_its_key_blocks_and_a_host_composes_them(tmp_path):
    """``recgen emit power_retention``: simple_gla's kernels at the block sizes and the composition in the manifest;
    a host that follows the manifest (φ from its pairs, [v, 1], scale², o = Σ y / (Σ n + ε)) with the standalone
    forward gets the reference's output and state."""
    from recgen.verify.cpu_exec import run_msl

    rec = specs.power_retention
    assert_standalone_typechecks(emit(rec, "metal", tmp_path, K=4, V=5, H=2, HK=1, dtype="float32"))
    manifest = json.loads((tmp_path / "power_retention.metal.manifest.json").read_text())
    comp = manifest["composition"]
    assert manifest["spec"] == "power_retention" and comp["rows"] == 10 and len(comp["pairs"]) == 10
    nb, Kb = comp["blocks"], comp["block_rows"]
    fwd = next(k for k in manifest["kernels"] if k["kind"] == "fwd")
    assert fwd["entry"].startswith("recgen_power_retention_blocks_fwd")

    sizes = Sizes(B=2, T=5, H=2, Hk=1, Kin=4, K=10, V=5)
    xs, _, _, _, scale = kernel_inputs(rec, sizes, np.random.default_rng(3))
    a, b, c = (np.array([p[i] for p in comp["pairs"]]) for i in range(3))
    phi = lambda x: np.repeat(c * x[..., a.astype(int)] * x[..., b.astype(int)], 2, axis=2)  # noqa: E731  GQA: block
    B, T, H, V = 2, 5, 2, 5
    blocks = lambda x: phi(x).reshape(B, T, H * nb, Kb).astype(np.float32)  # noqa: E731
    v1 = np.concatenate([xs["v"], np.ones((B, T, H, 1))], -1)
    ins = {"q_in": blocks(xs["q"]), "k_in": blocks(xs["k"]), "v_in": np.repeat(v1, nb, 2).astype(np.float32),
           "g_in": np.repeat(xs["g"], nb, 2).astype(np.float32), "rt": np.array([T, B], np.int32),
           "scale_in": np.array([scale ** 2], np.float32), "h0": np.zeros((B, H * nb, Kb, V + 1), np.float32)}
    tg = fwd["threadgroup"]
    grid = (int(fwd["grid_threadgroups"][0]) * tg[0], B * H * nb, 1)
    outs = run_msl((tmp_path / fwd["file"]).read_text(), fwd["entry"], ins,
                   {"o": ((B, T, H * nb, V + 1), np.float32), "ht": ((B, H * nb, Kb, V + 1), np.float32),
                    "ckpt": ((1,), np.float32)}, grid, tuple(tg))
    Y = outs["o"].astype(np.float64).reshape(B, T, H, nb, V + 1).sum(3)
    o = Y[..., :V] / (Y[..., V:] + comp["eps"])
    ht = outs["ht"].astype(np.float64).reshape(B, H, nb, Kb, V + 1)
    o_r, (S_r, z_r) = reference.run(rec, scale=scale, **xs)
    assert rel_err(o, o_r) < 1e-5
    assert rel_err(ht[..., :V].reshape(B, H, 10, V), S_r) < 1e-5 and rel_err(ht[..., V].reshape(B, H, 10), z_r) < 1e-5


def test_power_retention_emits_its_decode_kernel_and_a_host_steps_with_it(tmp_path):
    """The feature decode kernel in ``recgen emit power_retention``'s manifest: a host that follows its note (one
    head a row, the partials summed, the ratio readout) steps the reference's state on the standalone kernel."""
    import shutil
    import subprocess

    from recgen.spec.features import sympow
    from recgen.verify.cpu_exec import run_msl

    rec = specs.power_retention
    assert_standalone_typechecks(emit(rec, "metal", tmp_path, K=4, V=5, H=2, HK=1, dtype="float32"))
    if shutil.which("nvcc"):  # and the CUDA files (the key blocks' kernels and the decode kernel) compile for sm_90
        cu = [str(p) for p in emit(rec, "cuda", tmp_path / "cu", K=64, V=64, H=8, HK=8) if p.name.endswith("_cuda_float32.cu")]
        r = subprocess.run(["nvcc", "-arch=sm_90", "-c", *cu], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert len(cu) == 4 and r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((tmp_path / "power_retention.metal.manifest.json").read_text())
    dec = next(k for k in manifest["kernels"] if k["kind"] == "decode")
    H, D, V, F = 2, 4, 5, 10
    rng = np.random.default_rng(5)
    sizes = Sizes(B=1, T=1, H=H, Hk=1, Kin=D, K=F, V=V)
    xs, _, _, _, scale = kernel_inputs(rec, sizes, rng)
    S0, z0 = (np.float32(x).astype(np.float64) for x in (sympow(rng.standard_normal((1, H, 3, D))).swapaxes(-1, -2)
                                                        @ rng.standard_normal((1, H, 3, V)),
                                                        sympow(rng.standard_normal((1, H, 3, D))).sum(2)))
    q, k = (np.repeat(xs[n][0, 0], H, 0).astype(np.float32) for n in ("q", "k"))  # GQA: the key head for both
    ins = {"q": q, "k": k, "w": xs["v"][0, 0].astype(np.float32), "decay": np.exp(xs["g"][0, 0]).astype(np.float32),
           "S": S0[0].astype(np.float32), "z": z0[0].astype(np.float32)}
    pairs = np.array(manifest["composition"]["pairs"])  # the tables as the manifest gives them
    ins |= {"pa": pairs[:, 0].astype(np.int32), "pb": pairs[:, 1].astype(np.int32)}
    outs = {bf["name"]: (tuple(json.loads(bf["shape"])), np.float32) for bf in dec["buffers"] if not bf["input"]}
    tg = dec["threadgroup"]
    nb = dec["template"]["NB"]
    got = run_msl((tmp_path / dec["file"]).read_text(), dec["entry"], ins, outs, (H * nb * tg[0], 1, 1), tuple(tg))
    part = got["part"].astype(np.float64).sum(1)
    o = scale ** 2 * part[:, :V] / (scale ** 2 * part[:, V:] + 1e-2)
    o_r, (S_r, z_r) = reference.run(rec, initial_state=(S0, z0), scale=scale, **xs)
    assert rel_err(o, o_r[0, 0]) < 1e-5
    assert rel_err(got["S_out"], S_r[0]) < 1e-5 and rel_err(got["z_out"], z_r[0]) < 1e-5
