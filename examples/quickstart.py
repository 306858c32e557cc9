"""Run a built-in recgen kernel as an MLX op and check it against the float64 reference.

    python examples/quickstart.py

Gated DeltaNet, B=2, T=64, 4 value heads sharing 2 key heads (GQA), K=32, V=48, bfloat16 inputs:
forward, final state and gradients (to every input and the initial state) through whatever backend
this machine has: the generated Metal kernels on Apple silicon, the generated CUDA kernels with MLX's
CUDA backend, else the chunked fallback built from MLX ops.
"""
import mlx.core as mx
import numpy as np

import recgen as rg

rng = np.random.default_rng(0)
B, T, H, Hk, K, V = 2, 64, 4, 2, 32, 48
k = rng.standard_normal((B, T, Hk, K))
inputs = {"q": rng.standard_normal((B, T, Hk, K)), "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
          "v": rng.standard_normal((B, T, H, V)), "g": -rng.uniform(0, 3, (B, T, H)),
          "beta": 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))}
h0 = rng.standard_normal((B, H, K, V))

xs = {n: mx.array(a.astype(np.float32)).astype(mx.bfloat16) for n, a in inputs.items()}
op = rg.ops.gated_delta_net
o, state = op(*xs.values(), initial_state=mx.array(h0.astype(np.float32)), output_final_state=True)

seen = {n: np.array(a.astype(mx.float32)).astype(np.float64) for n, a in xs.items()}  # what the op saw
o_ref, state_ref = rg.reference.run(rg.specs.gated_delta_net, initial_state=h0, **seen)
err = lambda a, b: float(np.linalg.norm(np.array(a.astype(mx.float32)) - b) / np.linalg.norm(b))  # noqa: E731
print(f"backend {rg.ops.choose_backend(rg.tuning.current())}: o rel. error {err(o, o_ref):.1e}, final state {err(state, state_ref):.1e}")
assert err(o, o_ref) < 1e-2 and err(state, state_ref) < 1e-2

do = rng.standard_normal((B, T, H, V))
grads = mx.grad(lambda *a: (op(*a)[0].astype(mx.float32) * mx.array(do.astype(np.float32))).sum(),
                argnums=(0, 1, 2, 3, 4))(*xs.values())
g_ref = rg.reference.grad(rg.specs.gated_delta_net, do=do, **seen)
for name, g in zip(xs, grads):
    print(f"  d{name:5s} rel. error {err(g, g_ref[name]):.1e}")
    assert err(g, g_ref[name]) < 2e-2
print("ok")
