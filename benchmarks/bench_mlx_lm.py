"""mlx-lm's Qwen3.5 through recgen's patch against mlx-lm as shipped, in one process.

    python benchmarks/bench_mlx_lm.py [--T 2048] [--layers 4] [--train-unpatched-max-T 2048]
                                      [--prompt 512] [--decode 256] [--dtype float32] [--reps 3]

A tiny-config qwen3_5 (random weights): ``--layers`` layers, every fourth (``--full-attention-interval``) full
attention, the others gated DeltaNet with Hk=16 key heads, Hv=32 value heads, Dk=Dv=128 (hidden 256, vocab 1024
unless set: small, so that the recurrence and not the projections dominates).

- Training step: forward + backward of the mean cross-entropy over the logits of B x T tokens, gradients
  of every parameter (``nn.value_and_grad``), model in training mode (mlx-lm then calls its gated delta with
  ``use_kernel=False``: the per-token loop). Each measured run: ``mx.eval`` of everything before, then
  ``mx.reset_peak_memory()``, the step, ``mx.eval`` of loss and gradients; time is the median of ``--reps``
  runs after one warm-up (with the process's CPU seconds beside it: on a shared machine wall time includes
  waiting for cores), peak memory ``mx.get_peak_memory()``. The unpatched loop keeps every state for its
  backward (several B·Hv·Dk·Dv float32 arrays per token and layer), so above ``--train-unpatched-max-T`` it is
  not run (the report says so) and the ratio is taken at the largest T that both ran.
- ``--op``: the gated delta alone at the same shapes (one layer's recurrence, forward + backward).
- ``--floor``: the same step with the gated delta replaced by y = v (no recurrence), i.e. what the rest of the
  model (projections, short convolutions, attention, MLP, logits) costs on this machine.
- Generation: mlx-lm's ``generate_step`` (its prefill in ``prefill_step_size`` pieces, then one token per step
  with its cache), greedy, a random prompt of ``--prompt`` tokens and ``--decode`` new tokens. Reported: prefill
  time (to the first token) and decode tokens/s over the rest; and whether both runs produced the same ids.
"""
from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_5

from recgen.integrations import mlx_lm as recgen_mlx_lm


def build(args):
    mx.random.seed(0)
    cfg = dict(model_type="qwen3_5", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
               num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
               vocab_size=args.vocab, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=args.full_attention_interval, rms_norm_eps=1e-6)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(dict(model_type="qwen3_5", text_config=cfg)))
    if args.dtype != "float32":  # A_log stays float32, as mlx-lm loads it
        dt = getattr(mx, args.dtype)
        model.update(tree_map_with_path(lambda k, v: v if k.endswith("A_log") else v.astype(dt), model.parameters()))
    mx.eval(model.parameters())
    return model


def gib(n: int) -> float:
    return n / 2**30


def stub_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kw):
    """No recurrence: y = v, the state passed through (``--floor``: what the rest of the model costs)."""
    B, _, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    return v.astype(q.dtype), mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32) if state is None else state


class _stub:
    """mlx-lm's gated delta replaced by ``stub_update`` in the qwen3_5 module for the duration."""

    def __enter__(self):
        self.saved = qwen3_5.gated_delta_update
        qwen3_5.gated_delta_update = stub_update
        return self

    def __exit__(self, *exc):
        qwen3_5.gated_delta_update = self.saved
        return False


def train_step(model, T: int, args, patched):
    """(median seconds, median CPU seconds, peak bytes, loss) of one forward+backward at T tokens;
    ``patched``: True (recgen), False (mlx-lm), "stub" (no recurrence)."""
    tokens = mx.random.randint(0, args.vocab, (args.B, T + 1), key=mx.random.key(T))
    model.train()

    def loss_fn(m, x):
        return nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:], reduction="mean")

    grad_step = nn.value_and_grad(model, loss_fn)
    step = grad_step
    if args.compiled:  # as mlx-lm's trainer runs its step: one compiled graph, the model's arrays as inputs
        compiled = mx.compile(lambda x: grad_step(model, x), inputs=[model.state], outputs=[model.state])
        step = lambda m, x: compiled(x)  # noqa: E731
    times, cpus, peaks, loss = [], [], [], None
    with _stub() if patched == "stub" else recgen_mlx_lm.patch() if patched else contextlib.nullcontext():
        for i in range(args.reps + 1):
            mx.eval(tokens, model.parameters())
            mx.clear_cache()
            mx.reset_peak_memory()
            t0, c0 = time.perf_counter(), time.process_time()
            loss, grads = step(model, tokens)
            mx.eval(loss, grads)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            peak = mx.get_peak_memory()
            del grads
            if i:  # the first run warms up (kernel builds, compilation)
                times.append(dt)
                cpus.append(dc)
                peaks.append(peak)
    return statistics.median(times), statistics.median(cpus), max(peaks), loss.item()


def op_step(T: int, args, patched: bool):
    """(median seconds, median CPU seconds, peak bytes) of the gated delta alone, forward + backward, at the
    model's shapes (B, T, Hk=16, Hv=32, Dk=Dv=128), gradients of every input."""
    from mlx_lm.models import gated_delta

    keys = mx.random.split(mx.random.key(T), 7)
    B, Hk, Hv, D = args.B, 16, 32, 128
    dtype = getattr(mx, args.dtype)
    q, k = (mx.random.normal((B, T, Hk, D), key=kk) for kk in keys[:2])
    q, k = gated_delta.normalize_qk(q, k, inv_scale=D ** -0.5, eps=1e-6)
    xs = [q.astype(dtype), k.astype(dtype), mx.random.normal((B, T, Hv, D), key=keys[2]).astype(dtype),
          mx.random.normal((B, T, Hv), key=keys[3]).astype(dtype),
          mx.random.normal((B, T, Hv), key=keys[4]).astype(dtype),
          mx.random.uniform(-1, 1, (Hv,), key=keys[5]), mx.random.uniform(-1, 1, (Hv,), key=keys[6])]
    fn = recgen_mlx_lm.gated_delta_update if patched else gated_delta.gated_delta_update

    def loss(*a):
        y, s = fn(*a, use_kernel=False)
        return (y.astype(mx.float32) ** 2).sum() + s.sum()

    grad = mx.grad(loss, argnums=tuple(range(len(xs))))
    times, cpus, peaks = [], [], []
    for i in range(args.reps + 1):
        mx.eval(xs)
        mx.clear_cache()
        mx.reset_peak_memory()
        t0, c0 = time.perf_counter(), time.process_time()
        mx.eval(grad(*xs))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i:
            times.append(dt)
            cpus.append(dc)
            peaks.append(mx.get_peak_memory())
    return statistics.median(times), statistics.median(cpus), max(peaks)


def generate(model, args, patched: bool):
    """(prefill seconds, decode tokens/s, ids) through mlx-lm's generate_step."""
    model.eval()
    prompt = mx.random.randint(0, args.vocab, (args.prompt,), key=mx.random.key(1))
    with recgen_mlx_lm.patch() if patched else contextlib.nullcontext():
        for warm in (True, False):
            n = 8 if warm else args.decode
            mx.eval(prompt)
            t0 = time.perf_counter()
            ids = []
            for tok, _ in generate_step(prompt, model, max_tokens=n):
                ids.append(int(tok))  # int(): the token is on the host, as a caller would use it
                if len(ids) == 1:
                    t1 = time.perf_counter()
            t2 = time.perf_counter()
    return t1 - t0, (len(ids) - 1) / (t2 - t1), ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", default="2048", help="training lengths, comma-separated")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--full-attention-interval", type=int, default=4,
                    help="every N-th layer is full attention (qwen3_5 needs at least one)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--train-unpatched-max-T", type=int, default=None,
                    help="run the unpatched training step only up to this T (its memory grows with T)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--compiled", action="store_true", help="compile the training step (as mlx-lm's trainer does)")
    ap.add_argument("--op", action="store_true", help="also time the gated delta alone (one layer's recurrence)")
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--floor", action="store_true",
                    help="also time the step with the recurrence replaced by y = v (the rest of the model's cost)")
    args = ap.parse_args()

    model = build(args)
    n_params = sum(p.size for _, p in tree_flatten(model.parameters()))
    n_gdn = sum(1 for layer in model.layers if layer.is_linear)
    print(f"# {platform.machine()} {mx.default_device()}, mlx {mx.__version__}, qwen3_5 tiny: {args.layers} layers "
          f"({n_gdn} gated DeltaNet: Hk=16, Hv=32, Dk=Dv=128), hidden {args.hidden}, vocab {args.vocab}, "
          f"{n_params / 1e6:.1f}M params, {args.dtype}, B={args.B}")
    if not args.skip_train:
        compiled = ", compiled" if args.compiled else ""
        print(f"\n## training step (forward + backward, every parameter's gradient{compiled})")
        print("| T | recgen s (CPU s) | recgen peak GiB | mlx-lm s (CPU s) | mlx-lm peak GiB | speedup (CPU) | "
              "memory ratio | loss diff |")
        print("|---|---|---|---|---|---|---|---|")
        for T in (int(t) for t in args.T.split(",")):
            t_p, c_p, m_p, l_p = train_step(model, T, args, patched=True)
            if args.train_unpatched_max_T is None or T <= args.train_unpatched_max_T:
                t_u, c_u, m_u, l_u = train_step(model, T, args, patched=False)
                print(f"| {T} | {t_p:.3f} ({c_p:.2f}) | {gib(m_p):.2f} | {t_u:.3f} ({c_u:.2f}) | {gib(m_u):.2f} | "
                      f"{t_u / t_p:.1f}x ({c_u / c_p:.1f}x) | {m_u / m_p:.1f}x | {abs(l_p - l_u):.1e} |", flush=True)
            else:
                print(f"| {T} | {t_p:.3f} ({c_p:.2f}) | {gib(m_p):.2f} | not run | | | | |", flush=True)
            if args.floor:
                t_s, c_s, m_s, _ = train_step(model, T, args, patched="stub")
                print(f"| {T}, no recurrence | {t_s:.3f} ({c_s:.2f}) | {gib(m_s):.2f} | | | | | |", flush=True)
    if args.op:
        print("\n## the gated delta alone (one layer: forward + backward, every input's gradient)")
        print("| T | recgen s (CPU s) | recgen peak GiB | mlx-lm s (CPU s) | mlx-lm peak GiB | speedup (CPU) | "
              "memory ratio |")
        print("|---|---|---|---|---|---|---|")
        for T in (int(t) for t in args.T.split(",")):
            t_p, c_p, m_p = op_step(T, args, patched=True)
            if args.train_unpatched_max_T is None or T <= args.train_unpatched_max_T:
                t_u, c_u, m_u = op_step(T, args, patched=False)
                print(f"| {T} | {t_p:.3f} ({c_p:.2f}) | {gib(m_p):.2f} | {t_u:.3f} ({c_u:.2f}) | {gib(m_u):.2f} | "
                      f"{t_u / t_p:.1f}x ({c_u / c_p:.1f}x) | {m_u / m_p:.1f}x |", flush=True)
            else:
                print(f"| {T} | {t_p:.3f} ({c_p:.2f}) | {gib(m_p):.2f} | not run | | | |", flush=True)
    if not args.skip_generate:
        print(f"\n## generation: prompt {args.prompt} tokens, then {args.decode} (mlx-lm generate_step, greedy)")
        print("| | prefill s | decode tok/s |")
        print("|---|---|---|")
        p_p, d_p, ids_p = generate(model, args, patched=True)
        p_u, d_u, ids_u = generate(model, args, patched=False)
        print(f"| recgen | {p_p:.3f} | {d_p:.1f} |")
        print(f"| mlx-lm | {p_u:.3f} | {d_u:.1f} |")
        same = sum(a == b for a, b in zip(ids_p, ids_u))
        print(f"\nsame token ids: {same}/{len(ids_u)}")


if __name__ == "__main__":
    main()
