"""Tests of the GPU-free Metal verification layer (recgen.verify).

They compile small kernels with clang (a few seconds each, cached by source hash) and skip
only when clang++ or mlx is missing.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from recgen.verify.cpu_exec import MSLRuntimeError, run_msl
from recgen.verify.limits import lint
from recgen.verify.typecheck import clang_problem, typecheck

ROOT = Path(__file__).resolve().parents[2]
SEEDS = ROOT.parent / "shared" / "seeds"  # the seed kernels live beside the project, not in it

needs_clang = pytest.mark.skipif(clang_problem() is not None, reason=clang_problem() or "")
needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx not installed (pip install mlx[cpu])")

REDUCE = """
    uint i = thread_position_in_grid.x;
    threadgroup float partial[32];
    float v = i < n ? float(inp[i]) : 0.0f;
    v = simd_sum(v);
    if (thread_index_in_simdgroup == 0) partial[simdgroup_index_in_threadgroup] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (thread_position_in_threadgroup.x == 0) {
        float s = 0.0f;
        uint nsg = (threads_per_threadgroup.x + 31) / 32;
        for (uint k = 0; k < nsg; ++k) s += partial[k];
        out[threadgroup_position_in_grid.x] = s;
    }
"""


def _wrap(source, inputs, names, out_shape, grid, tg, header="", template=None, out_dtype=np.float32):
    from recgen.verify.capture import wrapped_source
    return wrapped_source("t_" + hashlib.sha1(source.encode()).hexdigest()[:10], names, ["out"], source, header, inputs,
                          [out_shape], [out_dtype], grid, tg, template)


# (a) capture --------------------------------------------------------------------------------
@needs_mlx
def test_capture_template_and_constant_input():
    body = "uint i = thread_position_in_grid.x; out[i] = T(inp[i] * small[i % N] * s);"
    src = _wrap(body, [np.ones(64, np.float32), np.ones(3, np.float32), np.float32(2.0)], ["inp", "small", "s"],
                (64,), (64, 1, 1), (32, 1, 1), template=[("T", np.float32), ("N", 3)])
    assert "template <typename T, int N>" in src
    assert "[[kernel]] void custom_kernel_" in src
    assert "const device float* inp [[buffer(0)]]" in src
    assert "const constant float* small [[buffer(1)]]" in src  # < 8 elements -> constant
    assert "const constant float& s [[buffer(2)]]" in src  # 0-d -> constant reference
    assert "uint3 thread_position_in_grid [[thread_position_in_grid]]" in src
    assert "template [[host_name(" in src and "<float, 3>" in src


# (b) type check -----------------------------------------------------------------------------
HELPERS = """
inline float first_dev(const device float* p) { return p[0]; }
inline float first_const(const constant float* p) { return p[0]; }
inline void put_const(constant float* p, float v) { p[0] = v; }
"""


@needs_mlx
@needs_clang
@pytest.mark.parametrize("body,fragment", [
    ("threadgroup float buf[32]; buf[0] = inp[0]; out[0] = first_dev(buf);", "no known conversion"),
    ("put_const(out, inp[0]);", "address space"),
    ("small[0] = 1.0f;", "read-only"),
    ("out[0] = first_dev(small);", "address space"),  # MLX made `small` constant (< 8 elements)
    ("double d = inp[0]; out[0] = d;", "__msl_error_double"),
    ("threadgroup float big[9000]; big[0] = 1; out[0] = big[0];", "32768"),
])
def test_typecheck_rejects(body, fragment):
    src = _wrap(body, [np.ones(64, np.float32), np.ones(3, np.float32)], ["inp", "small"], (64,), (64, 1, 1),
                (32, 1, 1), header=HELPERS)
    res = typecheck(src)
    assert not res.ok, src
    assert fragment in res.output, res.output


@needs_mlx
@needs_clang
def test_typecheck_accepts_valid_kernel():
    body = ("threadgroup float buf[32]; uint i = thread_position_in_grid.x; buf[i % 32] = inp[i];\n"
            "threadgroup_barrier(mem_flags::mem_threadgroup);\n"
            "out[i] = first_dev(inp) + first_const(small) + metal::exp(buf[0]) + simd_sum(1.0f) + float(0.5h);")
    src = _wrap(body, [np.ones(64, np.float32), np.ones(3, np.float32)], ["inp", "small"], (64,), (64, 1, 1),
                (32, 1, 1), header=HELPERS)
    res = typecheck(src)
    assert res.ok, str(res)


# (c) CPU execution --------------------------------------------------------------------------
@needs_mlx
@needs_clang
def test_cpu_reduction_with_partial_edge_group():
    n, tg = 1000, 256  # 4 groups; the last has 232 threads = 7 full SIMD groups + 8 lanes
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    src = _wrap(REDUCE, [x, np.uint32(n)], ["inp", "n"], (4,), (n, 1, 1), (tg, 1, 1))
    tc = typecheck(src)
    assert tc.ok, str(tc)
    out = run_msl(src, None, {"inp": x, "n": np.uint32(n)}, {"out": ((4,), np.float32)}, (n, 1, 1), (tg, 1, 1))["out"]
    ref = np.array([x[i * tg:(i + 1) * tg].astype(np.float64).sum() for i in range(4)])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@needs_mlx
@needs_clang
def test_tsan_flags_missing_barrier():
    n = 64
    body = REDUCE.replace("threadgroup_barrier(mem_flags::mem_threadgroup);", "")
    x = np.ones(n, np.float32)
    src = _wrap(body, [x, np.uint32(n)], ["inp", "n"], (1,), (n, 1, 1), (n, 1, 1))
    with pytest.raises(MSLRuntimeError, match="data race"):
        run_msl(src, None, {"inp": x, "n": np.uint32(n)}, {"out": ((1,), np.float32)}, (n, 1, 1), (n, 1, 1),
                sanitizer="thread")


@needs_mlx
@needs_clang
def test_divergent_barrier_is_reported():
    n = 64
    body = REDUCE.replace("threadgroup_barrier(mem_flags::mem_threadgroup);",
                          "if (simdgroup_index_in_threadgroup == 0) threadgroup_barrier(mem_flags::mem_threadgroup);")
    x = np.ones(n, np.float32)
    src = _wrap(body, [x, np.uint32(n)], ["inp", "n"], (1,), (n, 1, 1), (n, 1, 1))
    with pytest.raises(MSLRuntimeError, match="non-uniform threadgroup_barrier"):
        run_msl(src, None, {"inp": x, "n": np.uint32(n)}, {"out": ((1,), np.float32)}, (n, 1, 1), (n, 1, 1))


@needs_mlx
@needs_clang
@pytest.mark.parametrize("sanitizer", [None, "address"])
def test_deadlock_is_reported(sanitizer, monkeypatch):
    """Lane 0 waits at the threadgroup barrier, the other lanes of its SIMD group at a shuffle, which needs lane 0:
    neither can complete. The fibers' scheduler finds it at once; one std::thread a GPU thread (the sanitizer
    builds) after the emulator's timeout."""
    monkeypatch.setenv("MSL_EMU_TIMEOUT", "2")
    n = 64
    body = REDUCE.replace("threadgroup_barrier(mem_flags::mem_threadgroup);",
                          "if (thread_index_in_simdgroup == 0) threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                          "    else v += simd_shuffle(v, 0);")
    x = np.ones(n, np.float32)
    src = _wrap(body, [x, np.uint32(n)], ["inp", "n"], (1,), (n, 1, 1), (n, 1, 1))
    with pytest.raises(MSLRuntimeError, match="deadlock"):
        run_msl(src, None, {"inp": x, "n": np.uint32(n)}, {"out": ((1,), np.float32)}, (n, 1, 1), (n, 1, 1),
                sanitizer=sanitizer)


@needs_mlx
@needs_clang
def test_half_and_bfloat_round_like_the_gpu():
    import mlx.core as mx
    n = 64
    x = np.random.default_rng(2).standard_normal(n).astype(np.float32) * 3
    body = ("uint i = thread_position_in_grid.x;\n"
            "half h = half(a[i]) * half(1.1h);\n"
            "out[i] = bfloat16_t(float(h) + float(b[i]) / 3.0f);")
    src = _wrap(body, [mx.array(x), mx.array(x).astype(mx.bfloat16)], ["a", "b"], (n,), (n, 1, 1), (32, 1, 1),
                out_dtype=mx.bfloat16)
    assert "const device bfloat16_t* b" in src and "device bfloat16_t* out" in src
    got = run_msl(src, None, {"a": x, "b": x}, {"out": ((n,), None)}, (n, 1, 1), (32, 1, 1))["out"]
    h = mx.array(x).astype(mx.float16) * mx.array(1.1, mx.float16)  # half arithmetic rounds to half
    ref = h.astype(mx.float32) + mx.array(x).astype(mx.bfloat16).astype(mx.float32) / 3.0
    np.testing.assert_array_equal(got, np.array(ref.astype(mx.bfloat16).astype(mx.float32)))


# (d) the handwritten Gated DeltaNet kernel --------------------------------------------------
def _gdn_source():
    paths = sorted(SEEDS.glob("001_*.txt"))
    if not paths:
        pytest.skip(f"seed kernel 001_*.txt not present in {SEEDS} (../shared/seeds from the project root)")
    text = paths[0].read_text(encoding="utf-8")
    return text[text.index("#include <metal_stdlib>"):]


def _gdn_reference(q, k, v, g, beta, state):
    """Plain float64 loop: alpha = exp(-g); S = alpha*S; d = v - S k; S += beta*outer(d, k); o = S q.

    State per (seq, v_head) is [D_v, D_k]; GQA is tiled: k_head = v_head % n_k_heads.
    """
    S_, T, Hv, Dv = v.shape
    Hk = q.shape[2]
    out = np.zeros((S_, T, Hv, Dv))
    st = state.astype(np.float64).copy()
    for s in range(S_):
        for h in range(Hv):
            kh, M = h % Hk, st[s, h]
            for t in range(T):
                M = M * np.exp(-g[s, t, h])
                d = v[s, t, h] - M @ k[s, t, kh]
                M = M + beta[s, t, h] * np.outer(d, k[s, t, kh])
                out[s, t, h] = M @ q[s, t, kh]
            st[s, h] = M
    return out, st


@needs_clang
@pytest.mark.parametrize("sanitizer", [None, "address"])
def test_gdn_kernel_matches_numpy(sanitizer):
    src = _gdn_source()
    assert typecheck(src).ok
    Dk, Dv, Hk, Hv, T, S = 4, 8, 2, 4, 5, 2  # K != V, GQA (tiled), odd T
    rng = np.random.default_rng(0)
    q = rng.standard_normal((S, T, Hk, Dk)).astype(np.float32)
    k = (rng.standard_normal((S, T, Hk, Dk)) * 0.5).astype(np.float32)
    v = rng.standard_normal((S, T, Hv, Dv)).astype(np.float32)
    g = rng.uniform(0.01, 2.0, (S, T, Hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (S, T, Hv)).astype(np.float32)
    state = rng.standard_normal((S, Hv, Dv, Dk)).astype(np.float32)
    params = np.array([Dk, Dv, Hk, Hv, T, S, 0, 0], np.uint32)
    res = run_msl(src, "gated_delta_net_f32", dict(q=q, k=k, v=v, g=g, beta=beta, state_in=state, params=params),
                  dict(output=((S, T, Hv, Dv), np.float32), state_out=((S, Hv, Dv, Dk), np.float32)),
                  grid=(Hv * Dv, S, 1), threadgroup=(Dv, 1, 1), sanitizer=sanitizer,
                  threadgroup_memory={0: (2 * Dk + 2 * Dv) * 4})
    o_ref, s_ref = _gdn_reference(q, k, v, g, beta, state)
    assert np.linalg.norm(res["output"] - o_ref) / np.linalg.norm(o_ref) < 1e-5
    assert np.linalg.norm(res["state_out"] - s_ref) / np.linalg.norm(s_ref) < 1e-5


# (e) limits ---------------------------------------------------------------------------------
def test_limits_flag_each_violation():
    ok = "[[kernel]] void f(device float* a [[buffer(0)]]) {\n  threadgroup float t[256];\n}\n"
    assert lint(ok, (256, 1, 1)) == []
    rules = lambda src, tg=(32, 1, 1), **kw: {i.rule for i in lint(src, tg, **kw)}
    assert rules(ok, (64, 32, 1)) == {"threads"}
    assert rules(ok.replace("256]", "8193]")) == {"threadgroup_memory"}
    tmpl = ("template <typename T, int N>\n[[kernel]] void f(device float* a [[buffer(0)]]) {\n"
            "  threadgroup T t[N * 2];\n}\ntemplate [[host_name(\"f\")]] [[kernel]] decltype(f<half, 9000>) f<half, 9000>;")
    assert rules(tmpl) == {"threadgroup_memory"}  # 2 * 9000 * 2 bytes, after template substitution
    assert rules(ok, threadgroup_memory_bytes=40000) == {"threadgroup_memory"}
    many = "[[kernel]] void f(" + ", ".join(f"device float* a{i} [[buffer({i})]]" for i in range(32)) + ") {}"
    assert rules(many) == {"buffers"}
    assert rules(ok.replace("{\n", "{ // \u00e9\n")) == {"ascii"}
    assert rules(ok.replace("float t", "double t")) == {"double"}
    assert rules(ok.replace("256", "M")) == {"unknown_size"}
