"""A spec fuzzer: random specs over the space the README claims (``spec_recipes``), declared with the public
decorator, run by the ``mlx`` backend (the chunked form) and compared with the float64 reference: forward output,
final state and every gradient, ``initial_state`` included, under cotangents on both ``o`` and the final state.

- float64 (``compute_dtype=mx.float64``, on the CPU forms and on the GPU forms forced on the CPU): the chunked
  algebra itself; bounds 1e-6 forward, 1e-5 gradients (MLX's CPU sigmoid, exp and log are float32-accurate even in
  float64; a wrong term gives O(1));
- float32 where the spec is well conditioned (no normalizer): the float32 test bounds of the built-ins, 1e-5 / 1e-4;
- recipes the decorator must reject (a transition with a value-indexed decay ...) raise SpecError;
- a small sample through the Metal emulator (specs with kernels, short T).

Examples are derandomized (the same in every run). ``RECGEN_FUZZ_EXAMPLES`` (default 60) sets the chunked budget,
``RECGEN_FUZZ_METAL`` (default 1: a clang build costs ~20 s) the emulator's: e.g. RECGEN_FUZZ_EXAMPLES=2000 for a soak run.
"""
import os

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from spec_check import bad, compare
from spec_recipes import DECAYS, Recipe, build, inputs

import recgen as rg
from recgen import tuning
from recgen.math import reference

PHASES = [Phase.explicit, Phase.generate, Phase.shrink]  # no database, no explain phase (slow, writes files)
EXAMPLES = int(os.environ.get("RECGEN_FUZZ_EXAMPLES", "60"))
METAL_EXAMPLES = int(os.environ.get("RECGEN_FUZZ_METAL", "1"))
F64 = (1e-6, 1e-5)
F32 = (1e-5, 1e-4)

recipes = st.builds(
    Recipe, decay=st.sampled_from(DECAYS), transition=st.sampled_from(["none", "delta", "general"]),
    u=st.sampled_from(["k", "beta_k", "gate_k", "gain_k"]), w=st.sampled_from(["v", "dt_v"]),
    readout=st.sampled_from(["scale_q", "q", "gated_q"]), features=st.booleans(),
    normalizer=st.sampled_from(["none", "same", "own"]), norm_fn=st.sampled_from(["sqrt1", "sq1"]),
    skip=st.sampled_from(["none", "param", "gated"]), gqa=st.sampled_from(["block", "tiled"]),
    default_scale=st.sampled_from(["key", "one"]), readout_at=st.sampled_from(["after", "before"]),
    bonus=st.sampled_from(["none", "param"]), before_decay=st.booleans())


@st.composite
def cases(draw, recipe=recipes, T=(1, 2, 17, 64, 65, 130)):
    r = draw(recipe)
    H = draw(st.sampled_from([2, 4]))
    sizes = dict(B=draw(st.sampled_from([1, 2])), T=draw(st.sampled_from(T)), H=H,
                 Hk=draw(st.sampled_from([h for h in (1, 2, 4) if H % h == 0])),
                 Kin=draw(st.sampled_from([2, 3] if r.features else [3, 4, 8])), V=draw(st.sampled_from([2, 5])))
    return r, sizes, draw(st.sampled_from([None, 8, 16, 64])), draw(st.booleans()), draw(st.integers(0, 2**32 - 1))


def _declare(r: Recipe):
    """The spec, or None after checking the decorator rejects a recipe it must reject."""
    why = r.rejection()
    if why is None:
        return build(r)
    with pytest.raises(rg.SpecError, match=why):
        build(r)
    return None


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_fuzz_chunked_against_reference(case):
    r, sizes, chunk, gpu_forms, seed = case
    rec = _declare(r)
    event("rejected at declaration" if rec is None else f"checked: decay {r.decay}, transition {r.transition}")
    if rec is None:
        return
    xs, h0, do, dht = inputs(rec, np.random.default_rng(seed), **sizes)
    scale = 0.5
    ref = (*reference.run(rec, initial_state=h0, scale=scale, **xs),
           reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs))
    with tuning.override(gpu_forms=gpu_forms, compile=gpu_forms):
        res = compare(rec, xs, h0, do, dht, scale, dtype=mx.float64, chunk_size=chunk, ref=ref)
        assert not bad(res, *F64), (r, sizes, chunk, gpu_forms, "float64", bad(res, *F64))
        if not rec.has_normalizer:
            res = compare(rec, xs, h0, do, dht, scale, dtype=mx.float32, chunk_size=chunk, ref=ref)
            assert not bad(res, *F32), (r, sizes, chunk, gpu_forms, "float32", bad(res, *F32))


kernel_recipes = recipes.filter(lambda r: not r.features and r.rejection() is None)


@pytest.mark.skipif(METAL_EXAMPLES == 0, reason="RECGEN_FUZZ_METAL=0")
@settings(max_examples=max(1, METAL_EXAMPLES), derandomize=True, deadline=None, database=None, phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cases(kernel_recipes, T=(1, 2, 17)))
def test_fuzz_metal_emulator_against_reference(case):
    from recgen.verify.typecheck import clang_problem

    if clang_problem():
        pytest.skip(clang_problem())
    from recgen.verify.kernels import emulate
    from spec_check import rel

    r, sizes, _, _, seed = case
    sizes = dict(sizes, Kin=8, V=min(sizes["V"], 5))  # the kernels' lane mapping wants K a multiple of 8
    rec = build(r)
    xs, h0, do, dht = inputs(rec, np.random.default_rng(seed), **sizes)
    scale = 0.5
    o, ht, g = emulate(rec, xs, initial_state=h0, do=do, dht=dht, scale=scale)
    o_r, ht_r = reference.run(rec, initial_state=h0, scale=scale, **xs)
    g_r = reference.grad(rec, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    parts = lambda a: list(a) if isinstance(a, (tuple, list)) else [a]  # noqa: E731
    errs = {"o": rel(o, o_r)} | {f"state{i}": rel(a, b) for i, (a, b) in enumerate(zip(parts(ht), parts(ht_r)))}
    for n in g_r:
        errs |= {f"d{n}{i}": rel(a, b) for i, (a, b) in enumerate(zip(parts(g[n]), parts(g_r[n])))}
    assert not bad(errs, 1e-5, 1e-4), (r, sizes, bad(errs, 1e-5, 1e-4))
