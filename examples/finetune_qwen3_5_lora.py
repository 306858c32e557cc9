"""Fine-tune a tiny Qwen3.5 with LoRA through recgen, then generate from it, on any MLX device.

mlx-lm's gated-delta layers call ``mlx_lm.models.gated_delta.gated_delta_update``; in training that is a
per-token loop whose autodiff keeps every state. ``recgen.integrations.mlx_lm.patch()`` points them at
recgen's ops (generated kernels on Metal and CUDA, the chunked form elsewhere), for training and
generation alike. The model here has a random config and random weights (nothing is downloaded): a
token-successor rule is learned in a few steps, and greedy decoding with mlx-lm's cache follows it.

    pip install -e ".[cpu,test]"     # or .[metal] / .[cuda], plus mlx-lm
    python examples/finetune_qwen3_5_lora.py
"""
from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_5
from mlx_lm.tuner.utils import linear_to_lora_layers

from recgen.integrations import mlx_lm as recgen_mlx_lm

VOCAB = 32
STEPS = 60


def tiny_qwen3_5():
    """2 gated-delta layers and 1 full-attention layer; GQA in the gated-delta layers (2 key heads, 4 value)."""
    args = qwen3_5.ModelArgs.from_dict(dict(model_type="qwen3_5", text_config=dict(
        model_type="qwen3_5", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=3,
        rms_norm_eps=1e-6)))
    return qwen3_5.Model(args)


def successor(tokens):
    """The rule to learn: each token is followed by (5·token + 3) mod VOCAB."""
    return (5 * tokens + 3) % VOCAB


def batch(step: int, B: int = 8, T: int = 48):
    """Sequences that follow ``successor`` from random first tokens."""
    x = [mx.random.randint(0, VOCAB, (B,), key=mx.random.key(step))]
    for _ in range(T - 1):
        x.append(successor(x[-1]))
    return mx.stack(x, axis=1)


def main():
    mx.random.seed(0)
    model = tiny_qwen3_5()
    model.freeze()
    linear_to_lora_layers(model, num_layers=3, config={"rank": 8, "scale": 10.0, "dropout": 0.0})
    model.unfreeze(keys=["A_log", "dt_bias"], strict=False)  # the recurrence's decay parameters train too
    trainable = sum(p.size for _, p in tree_flatten(model.trainable_parameters()))
    print(f"trainable parameters: {trainable}")

    def loss_fn(m, x):
        return nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:], reduction="mean")

    opt = optim.Adam(learning_rate=2e-2)
    step = nn.value_and_grad(model, loss_fn)
    with recgen_mlx_lm.patch():
        model.train()
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(STEPS):
            loss, grads = step(model, batch(i))
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state, loss)
            if i % 10 == 0 or i == STEPS - 1:
                print(f"step {i:2d}  loss {loss.item():.3f}")
        print(f"{STEPS} LoRA steps in {time.perf_counter() - t0:.1f} s ({time.process_time() - c0:.1f} s of CPU) "
              f"on {mx.default_device()}")

        model.eval()
        prompt = batch(1000, B=1, T=20)[0]
        out = [int(tok) for tok, _ in generate_step(prompt, model, max_tokens=24)]
    want = [int(successor(prompt[-1]))]
    for _ in range(23):
        want.append(int(successor(mx.array(want[-1]))))
    correct = sum(a == b for a, b in zip(out, want))
    print("prompt   ", [int(t) for t in prompt])
    print("generated", out)
    print(f"{correct}/24 generated tokens follow the rule")

if __name__ == "__main__":
    main()
