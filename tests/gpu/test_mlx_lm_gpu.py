"""mlx-lm's models patched against unpatched, on the GPU: the model-level checks of tests/test_mlx_lm.py (tiny
random-config qwen3_5, qwen3_next and kimi_linear: logits and a LoRA step's gradients, left- and right-padded
batches through their caches, generation with a cache) and the unit check against mlx-lm's own ops, run on the
default device, which here is the CUDA GPU. float32 with MLX_ENABLE_TF32=0 (tests/gpu/conftest.py), so the
CPU's tolerances hold. Each model is its own xdist group (its kernels compile once per process)."""
from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm")
import test_mlx_lm as cpu  # noqa: E402  (tests/ is on the path, as for helpers)

pytestmark = pytest.mark.gpu

MODELS = [pytest.param(n, marks=pytest.mark.xdist_group(f"mlx_lm-{n}")) for n in cpu.MODELS]
UNIT = [pytest.param(*c, marks=pytest.mark.xdist_group("mlx_lm-unit")) for c in cpu.CASES]


@pytest.mark.parametrize("name", MODELS)
def test_model_logits_and_lora_gradients(name, rng):
    cpu.test_model_logits_and_lora_gradients(name, rng)


@pytest.mark.parametrize("name", MODELS)
def test_model_left_padded_prefill_and_decode(name, rng):
    cpu.test_model_left_padded_prefill_and_decode(name, rng)


@pytest.mark.parametrize("name", MODELS)
def test_model_right_padded_prefill(name, rng):
    cpu.test_model_right_padded_prefill(name, rng)


@pytest.mark.parametrize("name", MODELS)
def test_generate_with_cache(name):
    cpu.test_generate_with_cache(name)


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv,vector,mask,lb,neg,state", UNIT)
def test_matches_mlx_lm_ops_forward_and_gradients(rng, B, T, Hk, Hv, Dk, Dv, vector, mask, lb, neg, state):
    cpu.test_matches_mlx_lm_ops_forward_and_gradients(rng, B, T, Hk, Hv, Dk, Dv, vector, mask, lb, neg, state)
