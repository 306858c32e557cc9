"""``recgen bench``: the chain really chains, the JSON carries what it claims, the CLI runs, FLA skips cleanly."""
from __future__ import annotations

import importlib.util
import json

import mlx.core as mx
import numpy as np
import pytest

from recgen import bench, cli
from recgen.errors import InputError
from recgen.spec.layouts import infer_sizes
from recgen.spec.resolve import resolve_spec
from recgen.specs import BUILTINS

from test_cli import run_cli

TINY = bench.Shape(1, 12, 2, 8, 8)


@pytest.fixture(scope="module")
def result():
    return bench.run(BUILTINS["gated_delta_net"], TINY, dtype="float32", baselines=("naive", "fla"), repeat=2)


def fake_forward(seen):
    """A stand-in op: records the id of each call's smallest input (the tie), o = v·(1 + beta)."""
    def forward(xs):
        seen.append(id(xs["beta"]))
        return xs["v"] * (1 + xs["beta"][..., None])
    return forward


def small_inputs(rng):
    xs = {"v": mx.array(rng.standard_normal((1, 5, 2, 3)).astype(np.float32)),
          "beta": mx.array(rng.uniform(0.1, 0.9, (1, 5, 2)).astype(np.float32))}
    return xs, mx.array(rng.standard_normal((1, 5, 2, 3)).astype(np.float32))


def test_each_call_takes_the_previous_calls_link(rng):
    """Forward: the ids the op sees (under mx.vjp it sees tracers; the next test covers forward+backward)."""
    xs, do = small_inputs(rng)
    seen, returned, starts = [], [], []
    s = bench.steps(fake_forward(seen), xs, do)
    assert bench.tie_input(xs) == "beta"
    step = s.fwd_step

    def recording(carry):
        out = step(carry)
        returned.append(out)
        return out

    def start():
        starts.append(s.start())
        return starts[-1]

    bench.time_chained(recording, start, calls=4, rounds=2)
    for r in range(2):
        ids, outs = seen[4 * r:4 * r + 4], returned[4 * r:4 * r + 4]
        assert ids[0] == id(starts[r])
        assert ids[1:] == [id(o) for o in outs[:-1]]  # call i+1 ran on what the link made of call i
    assert np.array_equal(np.array(returned[-1]), np.array(xs["beta"]))  # the link adds an exact zero


@pytest.mark.parametrize("kind", ["fwd", "fwdbwd"])
def test_the_link_depends_on_every_output(kind, rng, monkeypatch):
    """With the link's zero replaced by the sum it is made from, the carried value shows that call i+1's input
    was computed from call i's output (forward) or from the output and every gradient (forward+backward)."""
    xs, do = small_inputs(rng)
    monkeypatch.setattr(bench, "dependency", lambda els: sum(e.astype(mx.float32) for e in els))
    s = bench.steps(fake_forward([]), xs, do)
    t = s.start()
    v, b0 = np.array(xs["v"]), np.array(xs["beta"])
    want = b0.copy()
    for _ in range(3):
        t = (s.fwd_step if kind == "fwd" else s.fwdbwd_step)(t)
        if kind == "fwd":
            first = v[0, 0, 0, 0] * (1 + want[0, 0, 0])
        else:  # o, then d/dv = do·(1 + beta), d/dbeta = Σ_V do·v: the output is evaluated as a model's loss reads it
            dov = np.array(do)
            first = ((v[0, 0, 0, 0] + dov[0, 0, 0, 0]) * (1 + want[0, 0, 0])
                     + (dov * v).sum(-1)[0, 0, 0])
        want[0, 0, 0] += first
    np.testing.assert_allclose(np.array(t), want, rtol=1e-5)


def test_time_chained_counts_calls_and_rounds():
    calls = []
    out = bench.time_chained(lambda c: calls.append(1) or c + 1, lambda: mx.zeros((2,)), calls=3, rounds=4)
    assert len(out) == 4 and all(ms > 0 for ms in out) and len(calls) == 12


def test_json_has_the_fields(result, tmp_path):
    d = json.loads(json.dumps(result.to_json()))
    for key in ("spec", "spec_hash", "shape", "dtype", "backend", "backend_used", "device", "mlx_version",
                "recgen_version", "date", "method", "tuning", "results", "ratios"):
        assert key in d, key
    assert d["shape"] == {"B": 1, "T": 12, "H": 2, "K": 8, "V": 8, "Hk": None} and d["dtype"] == "float32"
    assert d["mlx_version"] == mx.__version__ and d["device"]["default_device"] == str(mx.default_device())
    assert d["backend"] == "auto" and d["backend_used"] in ("metal", "cuda", "mlx")
    assert {"fwd", "fwdbwd", "peak", "naive", "fla"} <= set(d["method"])
    got = {(r["impl"], r["kind"]): r for r in d["results"]}
    for impl in ("recgen", "naive"):
        for kind, unit in (("fwd", "ms"), ("fwdbwd", "ms"), ("peak_fwd", "GiB"), ("peak_fwdbwd", "GiB")):
            r = got[(impl, kind)]
            assert r["unit"] == unit and r["value"] > 0, r
    rec_fwd = got[("recgen", "fwd")]
    assert rec_fwd["calls"] == 2 and len(rec_fwd["rounds_ms"]) == bench.ROUNDS and rec_fwd["link_ms"] > 0
    assert rec_fwd["first_call_s"] > 0 and got[("recgen", "fwdbwd")]["first_call_s"] > 0
    assert d["ratios"]["fwd/naive"] == pytest.approx(rec_fwd["value"] / got[("naive", "fwd")]["value"])
    assert {k for (impl, k) in got if impl == "fla"} == {"fwd", "fwdbwd", "peak_fwd", "peak_fwdbwd"}


def test_fla_skips_cleanly_here(result):
    torch_cuda = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("fla") is not None
    if torch_cuda:
        import torch  # noqa: F401 - only to ask whether this machine can run FLA
        if torch.cuda.is_available():
            pytest.skip("FLA can run here")
    flas = [m for m in result.measures if m.impl == "fla"]
    assert flas and all(m.value is None and m.note for m in flas)
    if importlib.util.find_spec("torch") is None:
        assert all(m.note == "torch is not installed" for m in flas)  # said by the worker process


def test_fla_has_no_op_for_other_specs(tmp_path):
    """Another built-in, and a user's spec that is only named like one of FLA's."""
    f = tmp_path / "mine.py"
    f.write_text("import recgen as rg\n\n@rg.recurrence\ndef gla(q: rg.Key, k: rg.Key, v: rg.Value, gk: rg.KeyGate):\n"
                 "    return rg.Step(decay=rg.exp(gk), update=rg.outer(k, v), readout=q)\n")
    for rec in (BUILTINS["selective_scan"], resolve_spec(f"{f}:gla")):
        ms = bench.fla_measures(rec, TINY, "bfloat16", ("fwd", "peak"), timeout=60)
        assert [m.kind for m in ms] == ["fwd", "peak_fwd"]
        assert all(m.value is None and m.note == f"FLA has no chunk op for {rec.name}" for m in ms)


def test_naive_is_skipped_past_its_budget(monkeypatch):
    monkeypatch.setattr(bench, "NAIVE_BUDGET_S", 0.0)
    r = bench.run(BUILTINS["simple_gla"], TINY, dtype="float32", passes=("fwd",), baselines=("naive",), repeat=1)
    m = r.get("naive", "fwd")
    assert m.value is None and m.note.startswith("skipped: about") and "T=12" in m.note
    assert r.get("recgen", "fwd").value > 0 and r.ratio("fwd", "naive") is None


def test_inputs_follow_the_laws():
    rec = BUILTINS["gated_delta_net"]
    xs, do = bench.make_inputs(rec, bench.Shape(2, 33, 3, 16, 8), "float32", seed=3)
    sizes = infer_sizes(rec, {k: v.shape for k, v in xs.items()})
    assert (sizes.B, sizes.T, sizes.H, sizes.Hk, sizes.K, sizes.V) == (2, 33, 3, 3, 16, 8)
    assert do.shape == (2, 33, 3, 8)
    np.testing.assert_allclose(np.linalg.norm(np.array(xs["k"]), axis=-1), 1.0, rtol=1e-5)
    g, beta = np.array(xs["g"]), np.array(xs["beta"])
    assert g.min() >= -20 and g.max() <= 0 and g.min() < -5 and 0 < beta.min() and beta.max() < 1
    assert np.abs(np.array(xs["q"])).max() > 0


def test_shapes_and_arguments_are_checked():
    assert bench.Shape.parse("4,4096,16,128") == bench.Shape(4, 4096, 16, 128, 128)
    assert bench.Shape.parse("1,8,2,16,64").text() == "1,8,2,16,64"
    for bad in ("4,4096,16", "4,0,16,128", "a,b,c,d"):
        with pytest.raises(InputError, match="--shape"):
            bench.Shape.parse(bad)
    with pytest.raises(InputError, match="--passes"):
        bench.check_args(("fwd", "bwd"), (), "float32", "auto")
    with pytest.raises(InputError, match="--baseline"):
        bench.check_args(("fwd",), ("torch",), "float32", "auto")
    with pytest.raises(InputError, match="--backend"):
        bench.check_args(("fwd",), (), "float32", "triton")
    for gpu in ("metal", "cuda"):
        if not getattr(mx, gpu).is_available():
            with pytest.raises(InputError, match=f"--backend {gpu}: MLX has no {gpu} device"):
                bench.check_args(("fwd",), (), "float32", gpu)


def test_cli_runs_a_tiny_shape_with_the_naive_baseline(tmp_path):
    path = tmp_path / "out" / "b.json"
    code, out, err = run_cli("bench", "simple_gla", "--shape", "1,8,2,8", "--dtype", "float32",
                             "--baseline", "naive", "--repeat", "2", "--json", str(path))
    assert code == 0, err
    assert "fwd+bwd ms" in out and "recgen/naive" in out and "peak fwd GiB" in out
    assert "first calls (kernel builds, tracing): fwd " in out and "fwd+bwd " in out
    d = json.loads(path.read_text())
    assert d["spec"] == "simple_gla" and d["shape"]["T"] == 8
    assert {(r["impl"], r["kind"]) for r in d["results"]} >= {("recgen", "fwd"), ("naive", "fwdbwd")}


def test_cli_rejects_bad_arguments():
    code, out, err = run_cli("bench", "simple_gla", "--shape", "1,8,2")
    assert code == 2 and "--shape" in err
    code, out, err = run_cli("bench", "simple_gla", "--passes", "fwd,backward")
    assert code == 2 and "--passes" in err
    code, out, err = run_cli("bench", "simple_gla", "--shape", "1,8,2,8", "--fla-timeout", "0")
    assert code == 2 and "--fla-timeout" in err


def test_bench_is_registered():
    assert "bench" in cli.COMMANDS


def test_compiled_steps_compute_the_same_values(rng):
    """``compiled=True`` runs each call as one compiled function: same output and gradients as the eager calls,
    and the chained steps still link to the previous call."""
    from recgen import specs

    rec = specs.gated_delta_net
    shape = bench.Shape.parse("1,19,2,8")
    xs, do = bench.make_inputs(rec, shape, "float32")
    fwd = bench.recgen_forward(rec, "auto")
    eager, compiled = bench.steps(fwd, xs, do), bench.steps(fwd, xs, do, compiled=True)
    for a, b in zip(eager.fwdbwd(), compiled.fwdbwd()):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(eager.fwd()), np.array(compiled.fwd()), rtol=1e-5, atol=1e-6)
    t0 = compiled.start()
    np.testing.assert_array_equal(np.array(compiled.fwdbwd_step(compiled.fwd_step(t0))), np.array(t0))


def test_decode_chains_steps_through_the_state(monkeypatch):
    """``--passes decode``: every step's initial state is the previous step's final state (a normalizer's (S, z)
    pair too), o is evaluated with it, and the measure carries the copy it is compared with."""
    from recgen import ops

    seen = []
    real_load = ops.load

    def recording_load(rec, backend=None):
        op = real_load(rec, backend=backend)

        def call(**kw):
            o, st = op(**kw)
            seen.append((kw["initial_state"], st))
            return o, st
        return call

    monkeypatch.setattr(bench, "load", recording_load)
    for name in ("gated_delta_net", "mlstm_sigmoid"):
        seen.clear()
        m = bench.measure_decode(BUILTINS[name], bench.Shape(2, 7, 2, 8, 8), "float32", tokens=3)
        assert m.kind == "decode" and m.unit == "ms" and m.value > 0 and m.extra["copy_ms"] > 0
        assert len(seen) == bench.DECODE_WARM + 3
        for (_, before), (after, _) in zip(seen, seen[1:]):
            assert after is before  # the state handed on, not a fresh one
        assert isinstance(seen[0][1], tuple) == (name == "mlstm_sigmoid")


def test_cli_decode_pass(tmp_path):
    path = tmp_path / "d.json"
    code, out, err = run_cli("bench", "gated_delta_net", "--shape", "2,1,2,8", "--dtype", "float32", "--passes",
                             "decode", "--json", str(path))
    assert code == 0, err
    assert "decode ms a step" in out and "of copy bandwidth" in out
    d = json.loads(path.read_text())
    (r,) = d["results"]
    assert r["kind"] == "decode" and r["value"] > 0 and r["of_copy"] > 0 and "decode" in d["method"]


@pytest.mark.parametrize("passes", [("decode",), ("fwd", "peak", "decode")])
def test_steps_reported_are_the_plan(passes):
    """``on_step`` sees exactly ``plan``'s labels in order (the CLI's progress bar counts them); a decode-only run
    times nothing at the shape's T, the naive loop included."""
    seen = []
    r = bench.run(BUILTINS["simple_gla"], bench.Shape(1, 6, 2, 8, 8), "float32", passes=passes,
                  baselines=("naive",), repeat=1, on_step=seen.append)
    assert seen == bench.plan(passes, ("naive",))
    assert {m.kind for m in r.measures if m.impl == "recgen"} == (
        {"decode"} if passes == ("decode",) else {"fwd", "peak_fwd", "decode"})


def test_key_heads_shape_the_inputs():
    """``--key-heads``: GQA's key heads (a divisor of H) shape the key inputs; anything else is refused by name."""
    from recgen import specs

    shape = bench.Shape.parse("1,8,4,16").with_key_heads(2)
    assert shape.sizes(specs.gated_delta_net).Hk == 2 and "2 key heads" in shape.text()
    assert shape.with_t(4).Hk == 2 and bench.Shape.parse("1,8,4,16").with_key_heads(None).Hk is None
    xs, _ = bench.make_inputs(specs.gated_delta_net, shape, "float32")
    assert xs["q"].shape == (1, 8, 2, 16) and xs["v"].shape == (1, 8, 4, 16)
    with pytest.raises(InputError, match="--key-heads 3"):
        bench.Shape.parse("1,8,4,16").with_key_heads(3)
