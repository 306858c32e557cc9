"""The handwritten references against upstream's own naive code, where torch and FLA (or mamba_ssm) are installed;
skipped otherwise. FLA: ``naive_retention`` (head-first, RetNet's decays, no initial state) and
``naive_recurrent_simple_gla`` for retnet, ``naive_recurrent_gla(q, 1 - exp(g), v, g)`` for hgrn2 (what FLA's HGRN2
layer runs); mamba_ssm: ``ssd_minimal_discrete`` (X = Δx, A = ΔA, B and C per head) and
``ssd_chunk_scan_combined_ref`` (D, z, dt_bias, softplus); FLA's ``naive_recurrent_gated_delta_product`` for
gated_delta_product (gated and g=None). Upstream computes in float32: 1e-5 relative."""
from __future__ import annotations

import numpy as np
import pytest

from recgen.testing import rel_err
from references.gated_delta_product import gated_delta_product
from references.hgrn2 import hgrn2, hgrn2_gate
from references.mamba2 import mamba2
from references.retnet import retnet, retnet_log_gamma

TOL = 1e-5
B, T, H, K, V = 2, 16, 4, 8, 6


def _torch():
    return pytest.importorskip("torch")


def test_retnet_against_fla_naive_retention(rng):
    torch = _torch()
    naive = pytest.importorskip("fla.ops.retention.naive")
    q, k, v = (rng.standard_normal((B, T, H, d)) for d in (K, K, V))
    t = lambda a: torch.tensor(a, dtype=torch.float32).transpose(1, 2).contiguous()  # noqa: E731  head-first
    o_fla = naive.naive_retention(t(q), t(k), t(v)).transpose(1, 2).double().numpy()
    assert rel_err(o_fla, retnet(q, k, v)[0]) <= TOL


def test_retnet_against_fla_recurrent_simple_gla_with_state(rng):
    torch = _torch()
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    q, k, v = (rng.standard_normal((B, T, H, d)) for d in (K, K, V))
    h0 = rng.standard_normal((B, H, K, V))
    g = np.broadcast_to(retnet_log_gamma(H), (B, T, H)).copy()  # chunk_retention's g_gamma
    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    o, ht = naive.naive_recurrent_simple_gla(t(q), t(k), t(v), t(g), initial_state=t(h0), output_final_state=True)
    o_r, ht_r = retnet(q, k, v, initial_state=h0)
    assert rel_err(o.double().numpy(), o_r) <= TOL and rel_err(ht.double().numpy(), ht_r) <= TOL


def test_hgrn2_against_fla_naive_gla(rng):
    torch = _torch()
    naive = pytest.importorskip("fla.ops.gla.naive")
    q, v = rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, V))
    g = hgrn2_gate(3 * rng.standard_normal((B, T, H, K)), rng.uniform(0, 0.9, (H, K)))
    h0 = rng.standard_normal((B, H, K, V))
    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    o, ht = naive.naive_recurrent_gla(t(q), t(1 - np.exp(g)), t(v), t(g), initial_state=t(h0), output_final_state=True)
    o_r, ht_r = hgrn2(q, v, g, initial_state=h0)
    assert rel_err(o.double().numpy(), o_r) <= TOL and rel_err(ht.double().numpy(), ht_r) <= TOL


def _mamba_data(rng, G=2, P=5, N=4):
    return dict(x=rng.standard_normal((B, T, H, P)), dt=rng.standard_normal((B, T, H)),
                A=-np.exp(rng.uniform(np.log(0.5), np.log(20.0), H)),
                B=rng.standard_normal((B, T, G, N)), C=rng.standard_normal((B, T, G, N)))


def test_mamba2_against_ssd_minimal_discrete(rng):
    torch = _torch()
    ssd = pytest.importorskip("mamba_ssm.modules.ssd_minimal")
    d = _mamba_data(rng)
    delta = np.logaddexp(0.0, d["dt"])
    h0 = rng.standard_normal((B, H, 5, 4))
    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    heads = lambda a: np.repeat(a, H // a.shape[2], axis=2)  # noqa: E731  groups to heads (block)
    y, final = ssd.ssd_minimal_discrete(t(d["x"] * delta[..., None]), t(d["A"] * delta), t(heads(d["B"])),
                                        t(heads(d["C"])), block_len=8, initial_states=t(h0[:, None]))
    out_r, final_r = mamba2(**d, dt_softplus=True, initial_states=h0)
    assert rel_err(y.double().numpy(), out_r) <= TOL and rel_err(final.double().numpy(), final_r) <= TOL


def test_mamba2_against_ssd_chunk_scan_combined_ref(rng):
    torch = _torch()
    comb = pytest.importorskip("mamba_ssm.ops.triton.ssd_combined")
    d = _mamba_data(rng)
    D, z, dt_bias = rng.standard_normal(H), rng.standard_normal((B, T, H, 5)), 0.5 * rng.standard_normal(H)
    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    out = comb.ssd_chunk_scan_combined_ref(*(t(d[n]) for n in ("x", "dt", "A", "B", "C")), 8, D=t(D), z=t(z),
                                           dt_bias=t(dt_bias), dt_softplus=True)
    out_r, _ = mamba2(**d, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    assert rel_err(out.double().numpy(), out_r) <= TOL


@pytest.mark.parametrize("n,gated", [(2, True), (3, True), (2, False)])
def test_gated_delta_product_against_fla_naive(n, gated, rng):
    """At scale 1: FLA's naive loop multiplies q by ``scale`` in 0.6.0 and ignores it in later versions."""
    torch = _torch()
    naive = pytest.importorskip("fla.ops.gated_delta_product.naive")
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T * n, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, beta = rng.standard_normal((B, T * n, H, V)), 1 / (1 + np.exp(-rng.standard_normal((B, T * n, H))))
    g = -np.exp(rng.uniform(np.log(1e-3), np.log(20.0), (B, T, H))) if gated else None
    h0 = rng.standard_normal((B, H, K, V))
    t = lambda a: None if a is None else torch.tensor(a, dtype=torch.float32)  # noqa: E731
    o, ht = naive.naive_recurrent_gated_delta_product(t(q), t(k), t(v), t(g), t(beta), 1.0, None,
                                                      initial_state=t(h0), output_final_state=True,
                                                      num_householder=n)
    o_r, ht_r = gated_delta_product(q, k, v, g, beta, n, scale=1.0, initial_state=h0)
    assert rel_err(o.double().numpy(), o_r) <= TOL and rel_err(ht.double().numpy(), ht_r) <= TOL
