"""The IR and the call checks: malformed specs and malformed inputs are rejected with messages that
name the offending term or argument; spec hashes are stable and distinguish specs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sympy as sp

from helpers import random_inputs, random_state
from recgen.spec import ir
from recgen.math import reference
from recgen.spec.fns import exp, sigmoid
from recgen.spec.frontend import Key, Param, Scalar, Step, Value, normalizer, outer, rank1, recurrence, sympow
from recgen.spec.ir import SCALE as scale
from recgen.spec.layouts import InputError
from recgen.specs import BUILTINS

ROOT = Path(__file__).resolve().parent.parent


def raises_spec(*fragments):
    """pytest.raises(SpecError) whose message must contain every fragment."""
    class _Ctx:
        def __enter__(self):
            self.cm = pytest.raises(ir.SpecError)
            self.info = self.cm.__enter__()
            return self.info

        def __exit__(self, *exc):
            out = self.cm.__exit__(*exc)
            msg = str(self.info.value)
            for f in fragments:
                assert f in msg, f"{f!r} not in {msg!r}"
            return out
    return _Ctx()


# -- well-formed specs -----------------------------------------------------------------------------

def test_builtins_validate_and_repr():
    for name, rec in BUILTINS.items():
        assert rec.validate() is rec
        text = repr(rec)
        assert text.startswith(f"Recurrence {name} [{rec.spec_hash()}]")
        for x in rec.inputs:
            assert f"input {x.name}:" in text


def test_term_kinds_from_free_indices():
    sel = BUILTINS["selective_scan"]
    assert sel.free_indices(sel.step.decay) == ("i", "j")
    assert sel.free_indices(sel.step.update.w) == ("j",)
    gla = BUILTINS["gla"]
    assert gla.free_indices(gla.step.decay) == ("i",)
    assert gla.input("gk").kind == "key_gate"
    gdn = BUILTINS["gated_delta_net"]
    assert gdn.free_indices(gdn.step.decay) == ()
    assert gdn.input("q").key_heads and not gdn.input("v").key_heads
    pr = BUILTINS["power_retention"]
    assert [f.source for f in pr.features] == ["k", "q"] or {f.source for f in pr.features} == {"k", "q"}
    assert pr.features[0].width(4) == 10


def test_param_signatures():
    assert Param["i", "j"].index == ("i", "j")
    assert Param["j", "i"].index == ("i", "j")  # canonical order
    assert Param["j"].index == ("j",)
    assert Param[()].index == ()


# -- malformed specs --------------------------------------------------------------------------------

def test_update_not_an_outer_product():
    with raises_spec("update", "outer"):
        @recurrence
        def bad(q: Key, k: Key, v: Value, beta: Scalar):
            return Step(update=beta * k, readout=q)


def test_update_u_with_value_index():
    with raises_spec("update u", "['j']"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(k * v, v), readout=q)


def test_update_w_with_key_index():
    with raises_spec("update w", "['i']"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(k, v * q), readout=q)


def test_readout_with_value_index():
    with raises_spec("readout r", "['j']"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(k, v), readout=v)


def test_transition_with_value_index():
    with raises_spec("transition a", "['j']"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(transition=rank1(v, k), update=outer(k, v), readout=q)


def test_normalizer_update_with_value_index():
    with raises_spec("normalizer update", "['j']"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(k, v), readout=q, normalizer=normalizer(1, v))


def test_skip_with_key_index():
    with raises_spec("skip s", "['i']"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(k, v), readout=q, skip=k)


def test_bonus_with_value_index():
    with raises_spec("bonus c", "['j']", "summed over the key side"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(k, v), readout=q, readout_before_update=True, bonus=q * v)


def test_readout_before_update_and_bonus_with_a_normalizer():
    with raises_spec("readout_before_update=True with a normalizer is not supported"):
        @recurrence
        def pre(q: Key, k: Key, v: Value, g: Scalar):
            return Step(decay=exp(g), update=outer(k, v), readout=q, readout_before_update=True,
                        normalizer=normalizer(exp(g), k))
    with raises_spec("bonus c", "a bonus with a normalizer is not supported"):
        @recurrence
        def bonus(q: Key, k: Key, v: Value, g: Scalar):
            return Step(decay=exp(g), update=outer(k, v), readout=q, bonus=q * k, normalizer=normalizer(exp(g), k))


def test_readout_before_update_must_be_a_bool():
    with raises_spec("readout_before_update must be True or False", "'yes'"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(k, v), readout=q, readout_before_update="yes")


def test_readout_before_update_changes_the_hash():
    """The flag is structure: the same terms read before or after the update are different specs."""
    def declare(pre):
        @recurrence
        def spec(q: Key, k: Key, v: Value, g: Scalar):
            return Step(decay=exp(g), update=outer(k, v), readout=scale * q, readout_before_update=pre)
        return spec

    assert declare(True).spec_hash() != declare(False).spec_hash()
    assert "before the update" in repr(declare(True)) and "before the update" not in repr(declare(False))


def test_unknown_symbol():
    alpha = sp.Symbol("alpha", real=True)
    with raises_spec("unknown symbols", "alpha", "decay D"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(decay=exp(alpha), update=outer(k, v), readout=q)


@pytest.mark.parametrize("where,fn", [("update u", lambda g: sp.atan(g)), ("normalizer function", lambda g: sp.erf(g)),
                                      ("readout r", lambda g: sp.floor(g))])
def test_a_function_no_backend_computes_is_rejected(where, fn):
    """atan, erf, floor: the reference's numpy would compute them, but the chunked form's MLX table and the kernels'
    dialects have no spelling; the decorator says so, naming the function, instead of a backend failing later."""
    name = type(fn(sp.Symbol("x"))).__name__
    with raises_spec(where, name, "does not compute"):
        @recurrence
        def bad(q: Key, k: Key, v: Value, g: Scalar):
            if where == "update u":
                return Step(decay=sigmoid(g), update=outer(fn(g) * k, v), readout=q)
            if where == "readout r":
                return Step(decay=sigmoid(g), update=outer(k, v), readout=fn(g) * q)
            return Step(decay=sigmoid(g), update=outer(k, v), readout=q, normalizer=normalizer(sigmoid(g), k, fn))


def test_every_backend_spells_every_function():
    """``fns.FUNCTIONS`` is what the decorator admits: the chunked form's MLX table and each kernel dialect's table
    hold each of them."""
    from recgen.codegen.backends import DIALECTS
    from recgen.spec.fns import FUNCTIONS

    for d in DIALECTS.values():
        assert FUNCTIONS <= set(d.fns), (d.name, sorted(FUNCTIONS - set(d.fns)))
    pytest.importorskip("mlx.core")
    from recgen.chunked.terms import mlx_module
    assert FUNCTIONS <= set(mlx_module()), sorted(FUNCTIONS - set(mlx_module()))


def test_missing_annotation():
    with raises_spec("'k'", "annotation"):
        @recurrence
        def bad(q: Key, k, v: Value):
            return Step(update=outer(k, v), readout=q)


def test_wrong_annotation():
    with raises_spec("'v'", "annotation"):
        @recurrence
        def bad(q: Key, k: Key, v: float):
            return Step(update=outer(k, v), readout=q)


def test_not_returning_step():
    with raises_spec("rg.Step", "bad"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return outer(k, v)


def test_normalizer_fn_uses_other_symbols():
    with raises_spec("normalizer function", "g"):
        @recurrence
        def bad(q: Key, k: Key, v: Value, g: Scalar):
            return Step(decay=exp(g), update=outer(k, v), readout=q,
                        normalizer=normalizer(exp(g), k, lambda n: n + g))


def test_mixing_raw_keys_with_sympow():
    with raises_spec("raw key", "feature map", "readout r"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(sympow(k), v), readout=q)


def test_sympow_of_an_expression():
    with raises_spec("sympow()", "key input itself"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(sympow(2 * k), v), readout=sympow(q))


def test_sympow_of_a_value():
    with raises_spec("feature 'phi(v)'", "key input"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(sympow(k), v), readout=sympow(v))


def test_sympow_outside_a_spec():
    with raises_spec("sympow()", "inside"):
        sympow(sp.Symbol("k", real=True))


def test_sympow_degree():
    with raises_spec("degree must be 2, 3 or 4", "1"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(sympow(k, 1), v), readout=sympow(q, 1))

    with raises_spec("state rows must be one space"):  # two degrees: two feature spaces
        @recurrence
        def mixed(q: Key, k: Key, v: Value):
            return Step(update=outer(sympow(k, 3), v), readout=sympow(q, 2))


def test_duplicate_names():
    rec = BUILTINS["simple_gla"]
    dup = ir.Recurrence("dup", "", rec.inputs + (ir.Input("k", "key", ("i",)),), rec.step)
    with raises_spec("duplicate", "'k'"):
        dup.validate()


@pytest.mark.parametrize("reserved", ["scale", "n", "initial_state"])
def test_reserved_names(reserved):
    rec = BUILTINS["simple_gla"]
    bad = ir.Recurrence("bad", "", rec.inputs + (ir.Input(reserved, "scalar", ()),), rec.step)
    with raises_spec(f"'{reserved}'", "reserved"):
        bad.validate()


def test_reserved_name_through_the_decorator():
    with raises_spec("'scale'", "reserved"):
        @recurrence
        def bad(q: Key, k: Key, v: Value, scale: Scalar):
            return Step(decay=exp(scale), update=outer(k, v), readout=q)


@pytest.mark.parametrize("sig", [("k",), ("i", "i"), ("i", "j", "x")])
def test_bad_param_signature(sig):
    with raises_spec("Param", "signature"):
        Param[sig]


def test_index_on_non_param():
    with raises_spec("only Param", "key"):
        Key["i"]


def test_unknown_input_kind():
    rec = BUILTINS["simple_gla"]
    bad = ir.Recurrence("bad", "", rec.inputs + (ir.Input("w", "matrix", ()),), rec.step)
    with raises_spec("'w'", "unknown kind", "matrix"):
        bad.validate()


def test_bad_param_index_in_ir():
    rec = BUILTINS["simple_gla"]
    bad = ir.Recurrence("bad", "", rec.inputs + (ir.Input("w", "param", ("k",)),), rec.step)
    with raises_spec("'w'", "parameter index"):
        bad.validate()


def test_gqa_value():
    with raises_spec("gqa", "'interleaved'"):
        @recurrence(gqa="interleaved")
        def bad(q: Key, k: Key, v: Value):
            return Step(update=outer(k, v), readout=q)


def test_transition_and_normalizer_types():
    with raises_spec("transition", "rank1"):
        @recurrence
        def bad(q: Key, k: Key, v: Value):
            return Step(transition=(k, k), update=outer(k, v), readout=q)
    with raises_spec("normalizer", "rg.normalizer"):
        @recurrence
        def bad2(q: Key, k: Key, v: Value):
            return Step(update=outer(k, v), readout=q, normalizer=k)


# -- spec hash ------------------------------------------------------------------------------------

def test_spec_hash_stable_and_distinct():
    hashes = {name: rec.spec_hash() for name, rec in BUILTINS.items()}
    assert len(set(hashes.values())) == len(hashes)
    assert all(len(h) == 12 for h in hashes.values())

    # the same declaration twice hashes the same; a one-term change does not
    def declare(gate):
        @recurrence
        def spec(q: Key, k: Key, v: Value, g: Scalar):
            return Step(decay=gate(g), update=outer(k, v), readout=scale * q)
        return spec

    a, b, c = declare(exp), declare(exp), declare(sigmoid)
    assert a.spec_hash() == b.spec_hash() and a == b
    assert a.spec_hash() != c.spec_hash()
    # simple_gla differs from `a` only in its name and docstring-free: the name is hashed
    assert a.spec_hash() != BUILTINS["simple_gla"].spec_hash()


def test_spec_hash_stable_across_processes():
    code = ("from recgen.specs import BUILTINS; "
            "print(' '.join(f'{n}={r.spec_hash()}' for n, r in BUILTINS.items()))")
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                             cwd=ROOT, check=True)
        outs.add(res.stdout.strip())
    assert len(outs) == 1
    here = " ".join(f"{n}={r.spec_hash()}" for n, r in BUILTINS.items())
    assert outs == {here}


# -- malformed inputs to reference.run ---------------------------------------------------------------

def _gdn_inputs(rng, **kw):
    return random_inputs(BUILTINS["gated_delta_net"], rng, **kw)


def raises_input(*fragments):
    class _Ctx:
        def __enter__(self):
            self.cm = pytest.raises(InputError)
            self.info = self.cm.__enter__()
            return self.info

        def __exit__(self, *exc):
            out = self.cm.__exit__(*exc)
            msg = str(self.info.value)
            for f in fragments:
                assert f in msg, f"{f!r} not in {msg!r}"
            return out
    return _Ctx()


def test_input_wrong_ndim(rng):
    x = _gdn_inputs(rng)
    x["q"] = x["q"][:, :, 0]
    with raises_input("'q'", "4-d"):
        reference.run(BUILTINS["gated_delta_net"], **x)


def test_input_scalar_wrong_ndim(rng):
    x = _gdn_inputs(rng)
    x["g"] = x["g"][..., None]
    with raises_input("'g'", "3-d"):
        reference.run(BUILTINS["gated_delta_net"], **x)


def test_input_mismatched_T(rng):
    x = _gdn_inputs(rng)
    x["v"] = x["v"][:, :-1]
    with raises_input("'v'", "T="):
        reference.run(BUILTINS["gated_delta_net"], **x)


def test_input_mismatched_B(rng):
    x = _gdn_inputs(rng)
    x["beta"] = x["beta"][:1]
    with raises_input("'beta'", "B="):
        reference.run(BUILTINS["gated_delta_net"], **x)


def test_input_mismatched_K(rng):
    x = _gdn_inputs(rng)
    x["k"] = x["k"][..., :-1]
    with raises_input("'k'", "Kin="):
        reference.run(BUILTINS["gated_delta_net"], **x)


def test_input_param_wrong_shape(rng):
    spec = BUILTINS["selective_scan"]
    x = random_inputs(spec, rng)
    x["A"] = x["A"][:, :, :-1]
    with raises_input("'A'", "V="):
        reference.run(spec, **x)


def test_input_gqa_heads_not_divisible_names_argument(rng):
    x = _gdn_inputs(rng, H=4, Hk=3)
    with raises_input("H % Hk", "'q'"):
        reference.run(BUILTINS["gated_delta_net"], **x)


def test_input_gqa_heads_not_divisible(rng):
    x = _gdn_inputs(rng, H=4, Hk=3)
    with raises_input("H % Hk", "4", "3"):
        reference.run(BUILTINS["gated_delta_net"], **x)


def test_input_missing_argument(rng):
    x = _gdn_inputs(rng)
    del x["beta"]
    with raises_input("missing", "'beta'"):
        reference.run(BUILTINS["gated_delta_net"], **x)


def test_input_extra_argument(rng):
    x = _gdn_inputs(rng)
    x["gk"] = x["g"]
    with raises_input("unexpected", "'gk'"):
        reference.run(BUILTINS["gated_delta_net"], **x)


def test_input_integer_dtype(rng):
    x = _gdn_inputs(rng)
    x["v"] = np.ones(x["v"].shape, dtype=np.int32)
    with raises_input("'v'", "floating", "int32"):
        reference.run(BUILTINS["gated_delta_net"], **x)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_input_nan(rng, bad):
    x = _gdn_inputs(rng)
    x["g"] = x["g"].copy()
    x["g"][0, 3, 1] = bad
    with raises_input("'g'", "NaN or Inf"):
        reference.run(BUILTINS["gated_delta_net"], **x)


def test_initial_state_nan(rng):
    x = _gdn_inputs(rng)
    h0 = random_state(BUILTINS["gated_delta_net"], rng)
    h0[0, 0, 0, 0] = np.nan
    with raises_input("'initial_state'", "NaN"):
        reference.run(BUILTINS["gated_delta_net"], initial_state=h0, **x)


def test_initial_state_wrong_shape(rng):
    x = _gdn_inputs(rng)
    h0 = random_state(BUILTINS["gated_delta_net"], rng)
    with raises_input("'initial_state'", "[B,H,K,V]"):
        reference.run(BUILTINS["gated_delta_net"], initial_state=h0[..., :-1], **x)
    with raises_input("'initial_state'", "[B,H,K,V]"):
        reference.run(BUILTINS["gated_delta_net"], initial_state=np.swapaxes(h0, 2, 3), **x)


def test_power_retention_missing_z(rng):
    spec = BUILTINS["power_retention"]
    x = random_inputs(spec, rng)
    S, z = random_state(spec, rng)
    with raises_input("'initial_state'", "(S, z)"):
        reference.run(spec, initial_state=S, **x)
    with raises_input("'initial_state'", "z"):
        reference.run(spec, initial_state=(S, z[..., :-1]), **x)
    with raises_input("'initial_state'", "[B,H,K,V]"):   # S sized by Kin instead of the feature width
        reference.run(spec, initial_state=(S[:, :, :5], z), **x)


def test_grad_checks_do_and_dht(rng):
    spec = BUILTINS["simple_gla"]
    x = random_inputs(spec, rng)
    do = rng.standard_normal((2, 7, 4, 3))
    with raises_input("'do'"):
        reference.grad(spec, do=do[:, :-1], **x)
    with raises_input("'dht'"):
        reference.grad(spec, do=do, dht=np.ones((2, 4, 3, 5)), **x)


def test_valid_call_shapes(rng):
    """Sanity: the generators produce valid calls for every built-in, outputs in the IR layout."""
    for name, spec in BUILTINS.items():
        x = random_inputs(spec, rng, B=2, T=3, H=4, Hk=2, K=3, V=2)
        o, S = reference.run(spec, **x)
        assert o.shape == (2, 3, 4, 2), name
        Ks = 6 if spec.features else 3
        if spec.has_normalizer:
            S, z = S
            assert z.shape == (2, 4, Ks)
        assert S.shape == (2, 4, Ks, 2), name
        assert np.all(np.isfinite(o))


def test_transition_before_decay_must_be_a_bool():
    with raises_spec("rank1(..., before_decay=) must be True or False", "got 1"):
        @recurrence
        def bad(q: Key, k: Key, v: Value, g: Scalar, a: Key):
            return Step(decay=exp(g), transition=rank1(a, k, before_decay=1), update=outer(k, v), readout=q)


def test_transition_before_decay_with_a_value_indexed_decay_is_accepted():
    """No chunked form, but the kernels, the reference and the stepwise ``mlx`` form compute it."""
    @recurrence
    def ok(q: Key, k: Key, v: Value, g: Value, a: Key):
        return Step(decay=exp(g), transition=rank1(a, k, before_decay=True), update=outer(k, v), readout=q)

    assert ok.transition_before_decay and ok.free_indices(ok.step.decay) == ("j",)


def test_transition_before_decay_is_structure(rng):
    """The flag changes the hash and the repr; a delta-rule-shaped transition before the decay is not the WY core's
    delta rule (analysis sends it to the general form); without a decay the two orders are the same recurrence."""
    from recgen.spec.analysis import analyze

    def declare(before, decayed=True):
        @recurrence
        def spec(q: Key, k: Key, v: Value, g: Scalar, beta: Scalar):
            return Step(decay=exp(g) if decayed else 1, transition=rank1(-beta * k, k, before_decay=before),
                        update=outer(beta * k, v), readout=scale * q)
        return spec

    pre, post = declare(True), declare(False)
    assert pre.spec_hash() != post.spec_hash() and pre != post
    assert "before the decay" in repr(pre) and "before the decay" not in repr(post)
    assert analyze(post).delta_rule and not analyze(pre).delta_rule
    x = random_inputs(post, rng, T=6)
    x["beta"] = 1 / (1 + np.exp(-x["beta"]))
    h0 = random_state(post, rng)
    o_pre, S_pre = reference.run(pre, initial_state=h0, **x)
    o_post, S_post = reference.run(post, initial_state=h0, **x)
    assert np.abs(o_pre - o_post).max() > 1e-3  # the orders differ with a decay
    o_pre, S_pre = reference.run(declare(True, False), initial_state=h0, **x)
    o_post, S_post = reference.run(declare(False, False), initial_state=h0, **x)
    np.testing.assert_allclose(o_pre, o_post, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(S_pre, S_post, rtol=1e-13, atol=1e-13)
