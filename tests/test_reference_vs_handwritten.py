"""The reference interpreter (``recgen.math.reference``, driven by the IR and the sympy adjoint) against
independent handwritten float64 references (``tests/references/``, plain loops written without the IR):
forward output, final state, and every gradient including the initial state's, to 1e-10 relative.

Inputs: T in {1, 7, 64, 129}, K != V, GQA (Hk < H) where the model has key inputs, strong decays
(log-decay down to -20), fresh random data per test. The FLA-layout references take the GQA keys
[B,T,Hk,K] themselves; one extra check feeds them keys already expanded to H heads (block mapping)
and sums their key gradients back over each group, so the IR's GQA is checked both ways.
"""
from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import numpy as np
import pytest

from helpers import random_cotangents, random_inputs, random_state, rel_err
from recgen.math import reference
from recgen.specs import BUILTINS

REFS = Path(__file__).resolve().parent / "references"
TOL = 1e-10
TS = [1, 7, 64, 129]
B, H, HK, K, V = 2, 4, 2, 5, 3


def load_ref(module: str):
    path = REFS / f"{module}.py"
    if not path.is_file():
        pytest.skip(f"handwritten reference {path} not written yet")
    spec = importlib.util.spec_from_file_location(f"handwritten_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def call(fn, **kw):
    """Call ``fn`` with the keyword arguments its signature accepts (aliases tolerated)."""
    params = inspect.signature(fn).parameters
    aliases = {"initial_state": ("initial_state", "h0", "state"), "dht": ("dht", "dh_t", "dhT"),
               "do": ("do", "dout"), "g": ("g", "log_g"),
               "output_final_state": ("output_final_state",), "scale": ("scale",)}
    args = {}
    for name, val in kw.items():
        for alias in aliases.get(name, (name,)):
            if alias in params:
                args[alias] = val
                break
        else:
            if name != "output_final_state":  # the only optional one
                raise TypeError(f"{fn.__name__} takes no argument {name!r}: {list(params)}")
    return fn(**args)


def grad_of(grads: dict, name: str):
    for key in (f"d{name}", name, *{"g": ("log_g",)}.get(name, ())):
        if key in grads:
            return grads[key]
    if name == "initial_state":
        for key in ("dh0", "dinitial_state", "h0", "dstate"):
            if key in grads:
                return grads[key]
    raise KeyError(f"no gradient for {name!r} in {sorted(grads)}")


def expand_keys(spec, x: dict) -> dict:
    """Keys [B,T,Hk,K] -> [B,T,H,K] (block GQA: key head of value head h is h // (H // Hk))."""
    out = dict(x)
    for inp in spec.inputs:
        if inp.kind == "key":
            out[inp.name] = np.repeat(x[inp.name], H // x[inp.name].shape[2], axis=2)
    return out


def fold_keys(g: np.ndarray, Hk: int) -> np.ndarray:
    """dk [B,T,H,K] -> [B,T,Hk,K]: sum over each GQA group."""
    b, t, h, k = g.shape
    return g.reshape(b, t, Hk, h // Hk, k).sum(axis=3)


def assert_close(name, got, want, tol=TOL):
    err = rel_err(got, want)
    assert err <= tol, f"{name}: rel err {err:.3e}"


# -- FLA-layout models: the IR layout is the reference's layout ----------------------------------------

FLA_MODELS = ["gated_delta_net", "kda", "delta_net", "gla", "simple_gla", "retnet", "hgrn2", "rwkv6", "rwkv7"]


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("name", FLA_MODELS)
def test_fla_models(name, T, rng):
    spec, ref = BUILTINS[name], load_ref(name)
    fwd, bwd = getattr(ref, name), getattr(ref, f"{name}_bwd")
    x = random_inputs(spec, rng, B=B, T=T, H=H, Hk=HK, K=K, V=V)
    h0 = random_state(spec, rng, B=B, H=H, K=K, V=V)
    do, dht = random_cotangents(spec, rng, B=B, T=T, H=H, K=K, V=V)
    for sc in (None, 0.37):  # the default K^-1/2 and another scale
        o, S = reference.run(spec, initial_state=h0, scale=sc, **x)
        o_ref, S_ref = call(fwd, **x, initial_state=h0, scale=sc)
        assert_close("o", o, o_ref)
        assert_close("final_state", S, S_ref)
        g = reference.grad(spec, do=do, dht=dht, initial_state=h0, scale=sc, **x)
        g_ref = call(bwd, **x, do=do, dht=dht, initial_state=h0, scale=sc)
        for inp in spec.inputs:
            assert_close(f"d{inp.name}", g[inp.name], grad_of(g_ref, inp.name))
        assert_close("dh0", g["initial_state"], grad_of(g_ref, "initial_state"))


@pytest.mark.parametrize("name", FLA_MODELS + ["power_retention", "mlstm", "mlstm_sigmoid"])
def test_gqa_against_expanded_keys(name, rng):
    """The IR's GQA == the handwritten model on keys repeated to H heads, key grads summed per group."""
    spec, ref = BUILTINS[name], load_ref(name)
    fwd, bwd = getattr(ref, name), getattr(ref, f"{name}_bwd")
    Kin, T = (3 if spec.features else K), 9
    x = random_inputs(spec, rng, B=B, T=T, H=H, Hk=HK, K=Kin, V=V)
    h0 = random_state(spec, rng, B=B, H=H, K=Kin, V=V)
    do, dht = random_cotangents(spec, rng, B=B, T=T, H=H, K=Kin, V=V)
    o, _ = reference.run(spec, initial_state=h0, **x)
    o_ref, _ = call(fwd, **expand_keys(spec, x), initial_state=h0)
    assert_close("o", o, o_ref)
    g = reference.grad(spec, do=do, dht=dht, initial_state=h0, **x)
    g_ref = call(bwd, **expand_keys(spec, x), do=do, dht=dht, initial_state=h0)
    for inp in spec.inputs:
        want = grad_of(g_ref, inp.name)
        assert_close(f"d{inp.name}", g[inp.name], fold_keys(want, HK) if inp.kind == "key" else want)


def test_tiled_gqa_mapping(rng):
    """gqa="tiled" (llama.cpp): value head h reads key head h % Hk; checked via a key permutation."""
    from recgen.spec.ir import Recurrence
    spec = BUILTINS["simple_gla"]
    tiled = Recurrence("simple_gla_tiled", spec.doc, spec.inputs, spec.step, spec.features, "tiled")
    ref = load_ref("simple_gla")
    x = random_inputs(spec, rng, B=B, T=7, H=H, Hk=HK, K=K, V=V)
    o, _ = reference.run(tiled, **x)
    # tiled key head of h is h % Hk; block with the expanded keys reordered gives the same thing
    xe = dict(x, q=x["q"][:, :, [h % HK for h in range(H)]], k=x["k"][:, :, [h % HK for h in range(H)]])
    o_ref, _ = call(ref.simple_gla, **xe)
    assert_close("o", o, o_ref)


# -- selective scan: mamba's layout ----------------------------------------------------------------------
# IR: x, dt values [B,T,Hg,Vg] (Hg groups of Vg channels), A [Hg,N,Vg], B, C keys [B,T,1,N] shared by
# every group (GQA with Hk = 1), D, dt_bias [Hg,Vg], state [B,Hg,N,Vg].
# mamba: u, delta [B,Dc,L] with Dc = Hg*Vg channels (channel c = h*Vg + j), A [Dc,N], B, C [B,N,L],
# D, delta_bias [Dc], state [B,Dc,N].

HG, VG, N = 2, 3, 4


def to_mamba(x: dict) -> dict:
    def chan(a):  # [B,T,Hg,Vg] -> [B,Dc,T]
        b, t, h, v = a.shape
        return np.ascontiguousarray(a.reshape(b, t, h * v).transpose(0, 2, 1))
    out = dict(u=chan(x["x"]), delta=chan(x["dt"]),
               A=np.ascontiguousarray(x["A"].transpose(0, 2, 1).reshape(HG * VG, N)),
               B=np.ascontiguousarray(x["B"][:, :, 0].transpose(0, 2, 1)),
               C=np.ascontiguousarray(x["C"][:, :, 0].transpose(0, 2, 1)),
               D=x["D"].reshape(HG * VG))
    if "dt_bias" in x:
        out["delta_bias"] = x["dt_bias"].reshape(HG * VG)
    return out


def state_to_mamba(S):  # [B,Hg,N,Vg] -> [B,Dc,N]
    b, h, n, v = S.shape
    return np.ascontiguousarray(S.transpose(0, 1, 3, 2).reshape(b, h * v, n))


def grads_from_mamba(g: dict, T: int) -> dict:
    def unchan(a):  # [B,Dc,T] -> [B,T,Hg,Vg]
        return a.transpose(0, 2, 1).reshape(a.shape[0], T, HG, VG)
    out = dict(x=unchan(grad_of(g, "u")), dt=unchan(grad_of(g, "delta")),
               A=grad_of(g, "A").reshape(HG, VG, N).transpose(0, 2, 1),
               B=grad_of(g, "B").transpose(0, 2, 1)[:, :, None], C=grad_of(g, "C").transpose(0, 2, 1)[:, :, None],
               D=grad_of(g, "D").reshape(HG, VG),
               initial_state=grad_of(g, "initial_state").reshape(-1, HG, VG, N).transpose(0, 1, 3, 2))
    if g.get("delta_bias") is not None:
        out["dt_bias"] = grad_of(g, "delta_bias").reshape(HG, VG)
    return out


def _check_layout_roundtrip(x):
    m = to_mamba(x)
    # channel c = h*Vg + j, and A_ir[h, :, j] = A_mamba[c, :]
    assert np.array_equal(m["u"][:, 1 * VG + 2, :], x["x"][:, :, 1, 2])
    assert np.array_equal(m["A"][1 * VG + 2], x["A"][1, :, 2])


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("name", ["selective_scan", "selective_scan_linear_dt"])
def test_selective_scan(name, T, rng):
    spec, ref = BUILTINS[name], load_ref("selective_scan")
    x = random_inputs(spec, rng, B=B, T=T, H=HG, Hk=1, K=N, V=VG)
    _check_layout_roundtrip(x)
    h0 = random_state(spec, rng, B=B, H=HG, K=N, V=VG)
    do, dht = random_cotangents(spec, rng, B=B, T=T, H=HG, K=N, V=VG)
    m = to_mamba(x)
    flags = dict(delta_softplus=name == "selective_scan")

    o, S = reference.run(spec, initial_state=h0, **x)
    res = call(ref.selective_scan, **m, **flags, initial_state=state_to_mamba(h0), output_final_state=True)
    o_ref, S_ref = res[0], res[1]
    assert_close("o", o, o_ref.transpose(0, 2, 1).reshape(B, T, HG, VG))
    assert_close("final_state", state_to_mamba(S), S_ref)

    g = reference.grad(spec, do=do, dht=dht, initial_state=h0, **x)
    do_m = np.ascontiguousarray(do.reshape(B, T, HG * VG).transpose(0, 2, 1))
    g_ref = grads_from_mamba(call(ref.selective_scan_bwd, **m, **flags, do=do_m, dht=state_to_mamba(dht),
                                  initial_state=state_to_mamba(h0)), T)
    for inp in spec.inputs:
        assert_close(f"d{inp.name}", g[inp.name], g_ref[inp.name])
    assert_close("dh0", g["initial_state"], g_ref["initial_state"])


# -- Mamba-2: mamba_ssm's layout, the state [B,H,P,N] transposed against the IR's [B,H,N,P] ---------------
# IR: x [B,T,H,P] (V = P), dt [B,T,H], A, dt_bias [H], B, C keys [B,T,G,N] (Hk = G), D [H,P]. The handwritten
# reference takes the same arrays under the same names; only the state is transposed.

@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("name", ["mamba2", "mamba2_linear_dt"])
def test_mamba2(name, T, rng):
    spec, ref = BUILTINS[name], load_ref("mamba2")
    x = random_inputs(spec, rng, B=B, T=T, H=H, Hk=HK, K=N, V=VG)
    h0 = random_state(spec, rng, B=B, H=H, K=N, V=VG)
    do, dht = random_cotangents(spec, rng, B=B, T=T, H=H, K=N, V=VG)
    m = dict(x)
    # the spec has no clip: mamba's clip to [0, inf) is the identity on its Δ > 0
    flags = dict(dt_softplus=name == "mamba2", dt_limit=(0.0, np.inf))
    o, S = reference.run(spec, initial_state=h0, **x)
    o_ref, S_ref = ref.mamba2(**m, **flags, initial_states=h0.swapaxes(-1, -2))
    assert_close("o", o, o_ref)
    assert_close("final_state", S, S_ref.swapaxes(-1, -2))
    g = reference.grad(spec, do=do, dht=dht, initial_state=h0, **x)
    g_ref = ref.mamba2_bwd(**m, **flags, dout=do, dht=dht.swapaxes(-1, -2), initial_states=h0.swapaxes(-1, -2))
    for inp in spec.inputs:
        assert_close(f"d{inp.name}", g[inp.name], g_ref[inp.name])
    assert_close("dh0", g["initial_state"], g_ref["initial_states"].swapaxes(-1, -2))


# -- normalizer states: (S, z) ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlstm", "mlstm_sigmoid"])
@pytest.mark.parametrize("T", TS)
def test_mlstm(name, T, rng):
    spec, ref = BUILTINS[name], load_ref(name)
    x = random_inputs(spec, rng, B=B, T=T, H=H, Hk=HK, K=K, V=V)
    h0 = random_state(spec, rng, B=B, H=H, K=K, V=V)
    do, dht = random_cotangents(spec, rng, B=B, T=T, H=H, K=K, V=V)
    for sc in (None, 0.6):
        o, (S, z) = reference.run(spec, initial_state=h0, scale=sc, **x)
        o_ref, st_ref = getattr(ref, name)(**x, initial_state=h0, scale=sc)
        assert_close("o", o, o_ref)
        assert_close("final C", S, st_ref[0])
        assert_close("final n", z, st_ref[1])
        g = reference.grad(spec, do=do, dht=dht, initial_state=h0, scale=sc, **x)
        g_ref = getattr(ref, f"{name}_bwd")(**x, do=do, dht=dht, initial_state=h0, scale=sc)
        for inp in spec.inputs:
            assert_close(f"d{inp.name}", g[inp.name], g_ref[inp.name])
        assert_close("dC0", g["initial_state"][0], g_ref["initial_state"][0])
        assert_close("dn0", g["initial_state"][1], g_ref["initial_state"][1])


@pytest.mark.parametrize("T", TS)
def test_power_retention(T, rng):
    spec, ref = BUILTINS["power_retention"], load_ref("power_retention")
    Kin = 3  # state rows: Kin (Kin + 1) / 2 = 6 != V
    x = random_inputs(spec, rng, B=B, T=T, H=H, Hk=HK, K=Kin, V=V)
    h0 = random_state(spec, rng, B=B, H=H, K=Kin, V=V)
    do, dht = random_cotangents(spec, rng, B=B, T=T, H=H, K=Kin, V=V)
    for sc in (None, 0.8):
        o, (S, z) = reference.run(spec, initial_state=h0, scale=sc, **x)
        o_ref, st_ref = call(ref.power_retention, **x, initial_state=h0, scale=sc)
        assert_close("o", o, o_ref)
        assert_close("final S", S, st_ref[0])
        assert_close("final z", z, st_ref[1])
        g = reference.grad(spec, do=do, dht=dht, initial_state=h0, scale=sc, **x)
        g_ref = call(ref.power_retention_bwd, **x, do=do, dht=dht, initial_state=h0, scale=sc)
        for inp in spec.inputs:
            assert_close(f"d{inp.name}", g[inp.name], grad_of(g_ref, inp.name))
        dh0, dh0_ref = g["initial_state"], grad_of(g_ref, "initial_state")
        assert_close("dS0", dh0[0], dh0_ref[0])
        assert_close("dz0", dh0[1], dh0_ref[1])


def test_every_builtin_is_covered():
    covered = set(FLA_MODELS) | {"selective_scan", "selective_scan_linear_dt", "power_retention", "mamba2",
                                 "mamba2_linear_dt", "mlstm", "mlstm_sigmoid"}
    assert covered == set(BUILTINS)


@pytest.mark.parametrize("T", [1, 7, 33])
def test_rwkv6_against_fla_naive(T, rng):
    """The IR's RWKV-6 against FLA's own ``naive_recurrent_rwkv6`` (torch, float32, head-first [B,H,T,D]): forward,
    final state and, through torch autograd of the naive loop, every gradient (u's included). Skipped where torch or
    FLA is not installed."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fla")
    from fla.ops.rwkv6.recurrent_naive import naive_recurrent_rwkv6

    spec = BUILTINS["rwkv6"]
    x = random_inputs(spec, rng, B=B, T=T, H=H, Hk=H, K=K, V=V)  # FLA's r and k have H heads
    x = {n: a.astype(np.float32).astype(np.float64) for n, a in x.items()}  # what the float32 naive loop sees
    h0 = random_state(spec, rng, B=B, H=H, K=K, V=V).astype(np.float32).astype(np.float64)
    do, dht = (a.astype(np.float32).astype(np.float64) for a in random_cotangents(spec, rng, B=B, T=T, H=H, K=K, V=V))
    o, S = reference.run(spec, initial_state=h0, **x)
    g = reference.grad(spec, do=do, dht=dht, initial_state=h0, **x)

    head_first = lambda a: torch.tensor(a.transpose(0, 2, 1, 3), dtype=torch.float32, requires_grad=True)  # noqa: E731
    tr, tk, tv, tw = (head_first(x[n]) for n in ("r", "k", "v", "w"))
    tu = torch.tensor(x["u"], dtype=torch.float32, requires_grad=True)
    th0 = torch.tensor(h0, dtype=torch.float32, requires_grad=True)
    to, tS = naive_recurrent_rwkv6(tr, tk, tv, tw, tu, initial_state=th0, output_final_state=True)
    f32 = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    ((to * f32(do.transpose(0, 2, 1, 3))).sum() + (tS * f32(dht)).sum()).backward()
    np64 = lambda t: t.detach().double().numpy()  # noqa: E731
    back = lambda t: np64(t).transpose(0, 2, 1, 3)  # noqa: E731
    assert_close("o", back(to), o, 1e-5)
    assert_close("final_state", np64(tS), S, 1e-5)
    for n, t in (("r", tr), ("k", tk), ("v", tv), ("w", tw)):
        assert_close(f"d{n}", back(t.grad), g[n], 1e-4)
    assert_close("du", np64(tu.grad), g["u"], 1e-4)
    assert_close("dh0", np64(th0.grad), g["initial_state"], 1e-4)


@pytest.mark.parametrize("T", [1, 7, 33])
def test_rwkv7_against_fla_naive(T, rng):
    """The IR's RWKV-7 against FLA's own naive DPLR loop (``dplr_recurrence``, which ``chunk_rwkv7`` matches: torch,
    float32, head-first [B,H,T,D], alpha = a and beta = b, gk the log-decay, the readout scale fixed at K^-1/2):
    forward, final state and, through torch autograd of the loop, every gradient. Skipped where torch or FLA is
    not installed."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fla")
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence

    spec = BUILTINS["rwkv7"]
    x = random_inputs(spec, rng, B=B, T=T, H=H, Hk=H, K=K, V=V)  # FLA's r, k, a, b have H heads
    x = {n: a.astype(np.float32).astype(np.float64) for n, a in x.items()}  # what the float32 loop sees
    h0 = random_state(spec, rng, B=B, H=H, K=K, V=V).astype(np.float32).astype(np.float64)
    do, dht = (a.astype(np.float32).astype(np.float64) for a in random_cotangents(spec, rng, B=B, T=T, H=H, K=K, V=V))
    o, S = reference.run(spec, initial_state=h0, scale=K ** -0.5, **x)
    g = reference.grad(spec, do=do, dht=dht, initial_state=h0, scale=K ** -0.5, **x)

    head_first = lambda a: torch.tensor(a.transpose(0, 2, 1, 3), dtype=torch.float32, requires_grad=True)  # noqa: E731
    t = {n: head_first(x[n]) for n in ("r", "w", "k", "v", "a", "b")}
    th0 = torch.tensor(h0, dtype=torch.float32, requires_grad=True)
    to, tS = dplr_recurrence(t["r"], t["k"], t["v"], t["a"], t["b"], t["w"], initial_state=th0,
                             output_final_state=True)
    f32 = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    ((to * f32(do.transpose(0, 2, 1, 3))).sum() + (tS * f32(dht)).sum()).backward()
    np64 = lambda a: a.detach().double().numpy()  # noqa: E731
    back = lambda a: np64(a).transpose(0, 2, 1, 3)  # noqa: E731
    assert_close("o", back(to), o, 1e-5)
    assert_close("final_state", np64(tS), S, 1e-5)
    for n, tn in t.items():
        assert_close(f"d{n}", back(tn.grad), g[n], 1e-4)
    assert_close("dh0", np64(th0.grad), g["initial_state"], 1e-4)
