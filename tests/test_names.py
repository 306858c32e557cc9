"""Name hygiene: a user's names never collide with internal symbols (feature maps, scale, n), sympy
functions and constants, kernel buffers and registers, or op keywords; spec and input names are ASCII
identifiers, checked at declaration; sympy constants print as literals in both kernel dialects."""
from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import sympy as sp
from helpers import rel_err, sigmoid

import recgen as rg
from recgen import chunked
from recgen.codegen.backends import get
from recgen.codegen.printer import kprint
from recgen.math import reference
from recgen.spec import ir
from recgen.spec.features import sympow

B, T, H, K, V = 2, 6, 2, 3, 4


def _run_both(rec, xs, scale=1.0):
    o_r, s_r = reference.run(rec, scale=scale, **xs)
    o_m, s_m = chunked.forward(rec, {k: mx.array(v, dtype=mx.float64) for k, v in xs.items()}, scale=scale,
                               compute_dtype=mx.float64)
    return (o_r, s_r), (np.array(o_m), np.array(s_m))


def _loop(xs, decay, update_k, readout_q):
    """A plain numpy loop: S_t = decay_t S + update_k_t v_tᵀ, o_t = S_tᵀ readout_q_t (per b, h)."""
    S = np.zeros((B, H, update_k.shape[-1], V))
    o = np.zeros((B, T, H, V))
    for t in range(T):
        S = decay[:, t][..., None, None] * S + update_k[:, t][..., None] * xs["v"][:, t][:, :, None, :]
        o[:, t] = np.einsum("bhk,bhkv->bhv", readout_q[:, t], S)
    return o, S


def _check_against(rec, xs, want, tol=1e-10):
    for o, s in _run_both(rec, xs):
        assert rel_err(o, want[0]) <= tol and rel_err(s, want[1]) <= tol


def test_input_named_like_a_feature_map(rng):
    """An input called phi_q next to sympow(q) is its own symbol, not the feature map's."""
    @rg.recurrence
    def feat(q: rg.Key, k: rg.Key, v: rg.Value, phi_q: rg.Scalar):
        return rg.Step(decay=rg.exp(phi_q), update=rg.outer(rg.sympow(k), v), readout=rg.sympow(q))

    xs = {"q": rng.standard_normal((B, T, H, K)), "k": rng.standard_normal((B, T, H, K)),
          "v": rng.standard_normal((B, T, H, V)), "phi_q": -rng.uniform(0.1, 2, (B, T, H))}
    _check_against(feat, xs, _loop(xs, np.exp(xs["phi_q"]), sympow(xs["k"]), sympow(xs["q"])))


def test_inputs_named_like_sympy_constants_and_functions(rng):
    """Inputs called pi, E, exp, sigmoid next to sympy.pi, sympy.E and the gates they are named after."""
    @rg.recurrence
    def consts(q: rg.Key, k: rg.Key, v: rg.Value, pi: rg.Scalar, E: rg.Scalar, exp: rg.Scalar, sigmoid: rg.Scalar):
        return rg.Step(decay=rg.sigmoid(sigmoid) * rg.exp(-exp ** 2),
                       update=rg.outer(sp.pi * pi * k, v), readout=sp.E * E * q)

    xs = {n: rng.standard_normal((B, T, H, K)) for n in ("q", "k")}
    xs |= {"v": rng.standard_normal((B, T, H, V))} | {n: rng.standard_normal((B, T, H)) for n in
                                                        ("pi", "E", "exp", "sigmoid")}
    decay = sigmoid(xs["sigmoid"]) * np.exp(-xs["exp"] ** 2)
    want = _loop(xs, decay, np.pi * xs["pi"][..., None] * xs["k"], np.e * xs["E"][..., None] * xs["q"])
    _check_against(consts, xs, want, 1e-7)  # MLX's float64 sigmoid on the CPU is accurate to ~3e-8


@pytest.mark.parametrize("name", ["scale", "n", "initial_state", "output_final_state", "backend",
                                  "check_finite", "do", "dht", "ydo"])
def test_reserved_input_names_are_rejected_at_declaration(name):
    src = (f"def f(q: rg.Key, k: rg.Key, v: rg.Value, {name}: rg.Scalar):\n"
           f"    return rg.Step(decay=rg.exp(-{name}**2), update=rg.outer(k, v), readout=q)")
    scope = {"rg": rg}
    exec(src, scope)
    with pytest.raises(rg.SpecError, match=f"input '{name}'.*reserved"):
        rg.recurrence(scope["f"])


def test_kernel_names_derived_from_inputs_never_collide():
    """Every identifier of the kernel frames that a user input's derived names (x_in, x_v, x_n, x_g, d_x)
    could equal is reserved; and two inputs whose derived names meet (a_v and d_a: d_a_v) are rejected."""
    root = Path(rg.__file__).parent / "codegen"
    text = "".join(p.read_text() for p in [*root.glob("templates/*.j2"), *root.glob("*.py"),
                                           *root.glob("backends/*.py")])
    text += get("metal").prelude + get("cuda").prelude
    text = re.sub(r"\{#.*?#\}|/\*.*?\*/|//[^\n]*", "", text, flags=re.S)
    stems = set()
    for ident in set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)):
        stems |= {ident[:-len(s)] for s in ir.DERIVED_SUFFIXES if ident.endswith(s) and len(ident) > len(s)}
        stems |= {ident[len(p):] for p in ir.DERIVED_PREFIXES if ident.startswith(p) and len(ident) > len(p)}
    assert stems and stems <= set(ir.RESERVED_NAMES), sorted(stems - set(ir.RESERVED_NAMES))

    with pytest.raises(rg.SpecError, match="'a_v'.*'d_a'|'d_a'.*'a_v'"):
        @rg.recurrence
        def clash(q: rg.Key, k: rg.Key, v: rg.Value, a_v: rg.Scalar, d_a: rg.Scalar):
            return rg.Step(decay=rg.exp(-a_v ** 2 - d_a ** 2), update=rg.outer(k, v), readout=q)


def _simple(q: rg.Key, k: rg.Key, v: rg.Value):
    return rg.Step(update=rg.outer(k, v), readout=q)


@pytest.mark.parametrize("name", ["x\n#error boom", "../../x", "my-gdn v2", "", "gdn.v2", "délai", "1st"])
def test_spec_names_must_be_identifiers(name):
    with pytest.raises(rg.SpecError, match="identifier"):
        rg.recurrence(_simple, name=name)
    ok = rg.recurrence(_simple, name="my_gdn_v2")
    with pytest.raises(rg.SpecError, match="identifier"):
        ir.Recurrence(name, "", ok.inputs, ok.step).validate()


def test_input_names_must_be_ascii_identifiers():
    ok = rg.recurrence(_simple)
    bad = (ir.Input("q k", "key", ("i",)),) + ok.inputs[1:]
    with pytest.raises(rg.SpecError, match="identifier"):
        ir.Recurrence("s", "", bad, ok.step).validate()

    def f(q: rg.Key, k: rg.Key, vé: rg.Value):
        return rg.Step(update=rg.outer(k, vé), readout=q)

    with pytest.raises(rg.SpecError, match="ASCII identifier"):
        rg.recurrence(f)


def test_op_keywords_and_positional_names_do_not_clash(rng):
    """Inputs called self and rec reach the op and the reference by keyword."""
    @rg.recurrence
    def named(q: rg.Key, self: rg.Key, v: rg.Value, rec: rg.Scalar):
        return rg.Step(decay=rg.exp(-rec ** 2), update=rg.outer(self, v), readout=q)

    xs = {"q": rng.standard_normal((B, T, H, K)), "self": rng.standard_normal((B, T, H, K)),
          "v": rng.standard_normal((B, T, H, V)), "rec": rng.standard_normal((B, T, H))}
    o_r, _ = reference.run(named, scale=1.0, **xs)
    o, _ = rg.load(named)(**{k: mx.array(v.astype(np.float32)) for k, v in xs.items()}, backend="mlx")
    assert rel_err(np.array(o), o_r) <= 1e-5
    g = reference.grad(named, do=np.ones((B, T, H, V)), **xs)
    assert set(g) == {"q", "self", "v", "rec", "initial_state"}


@pytest.mark.parametrize("dialect", ["metal", "cuda"])
def test_sympy_constants_print_as_literals(dialect):
    x = sp.Symbol("x", real=True)
    text = kprint(sp.pi * x + sp.E + sp.GoldenRatio * x, get(dialect), {x: "x_v"})
    assert "M_PI" not in text and "M_E" not in text and "pi" not in text.lower().replace("x_v", "")
    for c in (np.pi, np.e, (1 + 5 ** 0.5) / 2):
        assert repr(float(c))[:10] in text


def test_sympy_constants_in_metal_kernels_run_on_the_emulator():
    """A spec using sympy.pi and sympy.E builds, type-checks and matches the reference on the Metal emulator."""
    verify = pytest.importorskip("recgen.verify.kernels")
    from recgen.verify.typecheck import clang_problem

    if clang_problem():
        pytest.skip(clang_problem())
    from recgen.spec.layouts import Sizes
    from recgen.testing import kernel_inputs, rel_err as rel

    @rg.recurrence
    def consts(q: rg.Key, k: rg.Key, v: rg.Value, g: rg.Scalar):
        return rg.Step(decay=rg.exp(-rg.softplus(g) / sp.pi), update=rg.outer(sp.E * k, v), readout=rg.scale * q)

    xs, h0, do, dht, scale = kernel_inputs(consts, Sizes(B=1, T=3, H=2, Hk=1, Kin=8, K=8, V=8),
                                           np.random.default_rng(0))
    o, ht, g = verify.emulate(consts, xs, initial_state=h0, do=do, dht=dht, scale=scale)
    o_r, ht_r = reference.run(consts, initial_state=h0, scale=scale, **xs)
    g_r = reference.grad(consts, do=do, dht=dht, initial_state=h0, scale=scale, **xs)
    assert rel(o, o_r) <= 1e-5 and rel(ht, ht_r) <= 1e-5
    for name in g_r:
        assert rel(g[name], g_r[name]) <= 1e-4, name
