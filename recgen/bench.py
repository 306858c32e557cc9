"""``recgen bench``: time a spec's forward, forward+backward and peak memory on MLX's default device, as a model
sees them, against the naive per-token MLX loop and, where installed, FLA (in a separate process).

    result = run(rec, Shape.parse("4,4096,16,128"), dtype="bfloat16", baselines=("naive", "fla"))
    json.dump(result.to_json(), f)

How (``METHOD`` is written into every JSON):

- **Chained calls.** MLX overlaps independent work queued before one ``eval`` (on CUDA, within a graph), which
  measures the throughput of parallel calls, not the latency of a layer whose input is the previous layer's
  output. So each timed call waits for the previous one: the spec's smallest input of call i+1 is that input
  plus an exact zero computed from one element of call i's output (of every gradient, for forward+backward).
  The link is one element of work (its input is donated, so it is updated in place); every call sees the same
  well-conditioned inputs. N calls, one ``eval`` and ``synchronize`` at the end, wall time / N; median of rounds.
- **Forward+backward**: ``mx.vjp`` of the output with a fixed random cotangent ``do`` (the gradient of the scalar
  ``sum(o * do)``, without timing the loss) with respect to every input, and the output itself: a model's loss
  reads o, and FLA's ``backward`` runs after its forward. (Gradients alone let MLX skip a forward that no
  gradient reads, which a kernel op whose backward recomputes the chunked form has: that would time less work
  than a training step does.)
- **Peak memory**: ``mx.reset_peak_memory()`` then ``mx.get_peak_memory()`` around one synchronized call; the
  inputs are resident, so they count (as they do in FLA's ``torch.cuda.max_memory_allocated``).
- **Decode** (``--passes decode``): T = 1 steps as a generate loop runs them: each step starts from the last
  step's final state, one ``mx.async_eval`` a step (the host builds step t+1 while the device runs step t),
  against a device copy of the same state bytes timed the same way (a step reads and writes its state once).
- Inputs: random, drawn on the device by ``recgen.testing.input_law`` (log-decays to -20, unit-norm delta-rule
  keys), no GQA, the op's default arguments.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from .chunked import naive_loop
from .errors import InputError
from .op_args import FLOAT_DTYPES
from .ops import choose_backend, load
from .spec import ir
from .spec.layouts import Sizes
from .specs import BUILTINS
from .testing import input_law, input_shape
from .tuning import current
from .version import __version__

PASSES = ("fwd", "fwdbwd", "peak", "decode")
BASELINES = ("naive", "fla")
BACKEND_CHOICES = ("auto", "metal", "cuda", "mlx")
GIB = 2 ** 30
ROUND_SECONDS = 0.25      # the auto call count aims a round at this much wall time
ROUNDS = 3
SYNC_REPS = 5
NAIVE_BUDGET_S = 60.0     # the naive loop is skipped where its estimated time exceeds this
NAIVE_PROBE_T = 16        # the short run the estimate extrapolates from
DECODE_TOKENS = 200       # timed decode steps, after DECODE_WARM
DECODE_WARM = 20
FLA_TIMEOUT_S = 270
# the built-ins FLA has a chunk op for (the FLA worker maps these names to its functions)
FLA_OPS = {"gated_delta_net": "fla.ops.gated_delta_rule.chunk_gated_delta_rule",
           "delta_net": "fla.ops.delta_rule.chunk_delta_rule",
           "gla": "fla.ops.gla.chunk_gla",
           "simple_gla": "fla.ops.simple_gla.chunk_simple_gla"}

METHOD = {
    "fwd": "chained: N calls, each call's smallest input waits (an exact +0 from one element) on the previous "
           "call's output; one mx.eval + mx.synchronize after the N calls; ms = wall time / N, median of rounds, "
           "after a warm-up call",
    "fwdbwd": "the same chain over mx.vjp of the output with a fixed random cotangent do (the gradient of "
              "sum(o * do)) with respect to every input; the link waits on one element of the output and of "
              "every gradient (the output too: a model's loss reads it)",
    "sync_ms": "one call at a time: mx.eval + mx.synchronize around each call, median of 5",
    "link_ms": "the link alone, chained the same way: an upper bound on its share of a chained call",
    "first_call_s": "the warm-up: one synchronized call in a fresh process, kernel builds and graph tracing "
                    "included (what a program's first step waits for)",
    "peak": "mx.reset_peak_memory() then mx.get_peak_memory() around one synchronized call, inputs resident, GiB",
    "decode": f"T = 1 steps chained through the state (each step's initial state the last step's final state), "
              f"one mx.async_eval a step as a generate loop runs, {DECODE_TOKENS} steps after {DECODE_WARM}; "
              "copy_ms: a device copy (x * 1) of the same float32 state timed the same way; of_copy = copy_ms / ms",
    "naive": "recgen.chunked.naive_loop (the per-token MLX loop) timed the same way; skipped where a run at "
             f"T={NAIVE_PROBE_T} extrapolates past {NAIVE_BUDGET_S:.0f} s or the device's memory",
    "fla": "FLA chunk op in a separate process (torch and MLX keep separate CUDA allocators): "
           "triton.testing.do_bench medians; fwd under torch.no_grad; fwd+bwd: o.backward(do); peak: "
           "torch.cuda.max_memory_allocated after a reset around one synchronized call; the same input laws",
    "inputs": "random on the device by recgen.testing.input_law; no GQA; the op's default arguments",
}


@dataclass(frozen=True)
class Shape:
    """B, T, H and the head sizes: K the width of the key inputs (the feature map's input width for specs with
    one), V the value width; Hk the key heads (GQA: H value heads share them; None: H)."""
    B: int
    T: int
    H: int
    K: int
    V: int
    Hk: int | None = None

    @staticmethod
    def parse(text: str) -> "Shape":
        """'B,T,H,D' (K = V = D) or 'B,T,H,K,V'."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (4, 5) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise InputError(f"--shape {text!r}: expected B,T,H,D or B,T,H,K,V (positive integers)")
        n = [int(p) for p in parts]
        return Shape(*n) if len(n) == 5 else Shape(n[0], n[1], n[2], n[3], n[3])

    def text(self) -> str:
        head = f"{self.K}" if self.K == self.V else f"{self.K},{self.V}"
        gqa = f" ({self.Hk} key heads)" if self.Hk not in (None, self.H) else ""
        return f"{self.B},{self.T},{self.H},{head}{gqa}"

    def sizes(self, rec: ir.Recurrence) -> Sizes:
        K = rec.features[0].width(self.K) if rec.features else self.K
        return Sizes(self.B, self.T, self.H, self.Hk or self.H, self.K, K, self.V)

    def with_t(self, T: int) -> "Shape":
        return Shape(self.B, T, self.H, self.K, self.V, self.Hk)

    def with_key_heads(self, Hk: int | None) -> "Shape":
        """The shape with Hk key heads (dividing H), or as it is for None."""
        if Hk is None:
            return self
        if Hk <= 0 or self.H % Hk:
            raise InputError(f"--key-heads {Hk}: expected a positive divisor of H = {self.H}")
        return Shape(self.B, self.T, self.H, self.K, self.V, Hk)


@dataclass(frozen=True)
class Measure:
    """One number: ``impl`` ("recgen" | "naive" | "fla") and ``kind`` ("fwd" | "fwdbwd" in ms,
    "peak_fwd" | "peak_fwdbwd" in GiB); ``value`` None with a ``note`` when skipped."""
    impl: str
    kind: str
    value: float | None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def unit(self) -> str:
        return "GiB" if self.kind.startswith("peak") else "ms"


@dataclass(frozen=True)
class Result:
    spec: str
    spec_hash: str
    shape: Shape
    dtype: str
    backend: str           # as asked ("auto" ...)
    backend_used: str      # as the op resolved it on this device
    measures: tuple
    environment: dict      # device, versions, date, tuning

    def get(self, impl: str, kind: str) -> Measure | None:
        return next((m for m in self.measures if m.impl == impl and m.kind == kind), None)

    def ratio(self, kind: str, baseline: str) -> float | None:
        """recgen / baseline for ``kind``, None where either is missing."""
        a, b = self.get("recgen", kind), self.get(baseline, kind)
        if a is None or b is None or a.value is None or b.value is None or b.value <= 0:
            return None
        return a.value / b.value

    def to_json(self) -> dict:
        kinds = sorted({m.kind for m in self.measures})
        return {
            "spec": self.spec, "spec_hash": self.spec_hash,
            "shape": asdict(self.shape), "dtype": self.dtype,
            "backend": self.backend, "backend_used": self.backend_used,
            **self.environment,
            "method": METHOD,
            "results": [{"impl": m.impl, "kind": m.kind, "unit": m.unit, "value": m.value,
                         **({"note": m.note} if m.note else {}), **m.extra} for m in self.measures],
            "ratios": {f"{k}/{b}": self.ratio(k, b) for k in kinds for b in BASELINES
                       if self.ratio(k, b) is not None},
        }


# -- inputs ---------------------------------------------------------------------------------------

def _draw(law: tuple, shape: tuple, key) -> mx.array:
    """``recgen.testing.input_law`` on the device, float32."""
    if law[0] == "cubed":
        return law[1] * mx.random.uniform(shape=shape, key=key) ** 3
    if law[0] == "sigmoid":
        return mx.sigmoid(mx.random.normal(shape, key=key))
    if law[0] == "normal":
        a = mx.random.normal(shape, key=key)
        return a * mx.rsqrt((a * a).sum(-1, keepdims=True)) if law[1] else a
    return law[3] * mx.random.uniform(law[1], law[2], shape, key=key)


def make_inputs(rec: ir.Recurrence, shape: Shape, dtype: str, seed: int = 0) -> tuple[dict, mx.array]:
    """(inputs by name in ``dtype``, a cotangent ``do`` [B,T,H,V]), evaluated."""
    sizes = shape.sizes(rec)
    keys = mx.random.split(mx.random.key(seed), len(rec.inputs) + 1)
    dt = getattr(mx, dtype)
    xs = {x.name: _draw(input_law(rec, x), input_shape(x, sizes), keys[i]).astype(dt)
          for i, x in enumerate(rec.inputs)}
    do = mx.random.normal((sizes.B, sizes.T, sizes.H, sizes.V), key=keys[-1]).astype(dt)
    mx.eval(xs, do)
    return xs, do


def fla_inputs(rec: ir.Recurrence, shape: Shape) -> list:
    """[name, shape, law] of each input: what the FLA worker draws with torch."""
    sizes = shape.sizes(rec)
    return [[x.name, list(input_shape(x, sizes)), list(input_law(rec, x))] for x in rec.inputs]


def tie_input(inputs: dict) -> str:
    """The input the chain runs through: the smallest (the link updates one element of it)."""
    return min(inputs, key=lambda n: inputs[n].size)


# -- the chain ------------------------------------------------------------------------------------

def dependency(elements: list) -> mx.array:
    """An exact float32 zero that depends on each (one-element) array of ``elements`` (NaN and Inf included)."""
    s = elements[0].astype(mx.float32)
    for e in elements[1:]:
        s = s + e.astype(mx.float32)
    return mx.where(s == s, 0.0, 0.0)


def link(tie: mx.array, outputs: list) -> mx.array:
    """``tie`` unchanged in value, as a new array that waits for every array of ``outputs``: one element of each
    is read (a view shares the producer's buffer, so on CUDA the graph edge is to the kernel that wrote it)."""
    first = [o[(0,) * o.ndim] for o in outputs]
    return tie.at[(0,) * tie.ndim].add(dependency(first).astype(tie.dtype))


def time_chained(step, start, calls: int, rounds: int = ROUNDS) -> list[float]:
    """ms per call of each round: ``calls`` calls of ``step``, each on the carry the previous one returned, from a
    fresh ``start()`` (evaluated first), with one eval and synchronize after the last."""
    out = []
    for _ in range(rounds):
        carry = start()
        mx.eval(carry)
        mx.synchronize()
        t0 = time.perf_counter()
        carry = run_steps(step, carry, calls)
        out.append((time.perf_counter() - t0) * 1e3 / calls)
        del carry
    return out


def run_steps(step, carry, n: int, pipelined: bool = False):
    """``n`` calls of ``step``, each on the carry the last returned (with ``pipelined``, one ``mx.async_eval`` a
    call, as a generate loop runs), then eval and synchronize; returns the carry."""
    for _ in range(n):
        carry = step(carry)
        if pipelined:
            mx.async_eval(carry)
    mx.eval(carry)
    mx.synchronize()
    return carry


def time_sync(fn, reps: int = SYNC_REPS) -> list[float]:
    """ms of each of ``reps`` calls, one at a time: eval and synchronize around each."""
    out = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def peak_gib(fn) -> float:
    """Peak device memory (GiB) of one synchronized call, resident inputs included."""
    mx.synchronize()
    mx.reset_peak_memory()
    mx.eval(fn())
    mx.synchronize()
    return mx.get_peak_memory() / GIB


@dataclass(frozen=True)
class Steps:
    """One implementation's calls at one point: ``fwd()`` / ``fwdbwd()`` evaluate-able outputs, ``*_step`` their
    chained forms on the tie input, ``start`` a fresh copy of the tie input."""
    fwd: object
    fwdbwd: object
    fwd_step: object
    fwdbwd_step: object
    start: object


def steps(forward, inputs: dict, do: mx.array, compiled: bool = False) -> Steps:
    """The calls of ``forward`` (inputs by name -> o) at ``inputs``; the chain runs through ``tie_input``.
    ``compiled``: each call (forward, or forward and backward) as one ``mx.compile``d function, as a compiled
    training step (mlx-lm's trainer compiles its step) runs it. MLX compiles nothing inside a transformation
    (``mx.vjp`` traces a compiled function's graph as plain ops), so without it a backward's elementwise work
    runs op by op; with it the whole graph, backward included, is fused."""
    names = list(inputs)
    tie = tie_input(inputs)
    linked = mx.compile(lambda t, *outs: link(t, list(outs)))  # the link's elementwise work as one kernel

    def fwd_args(*a):
        return forward(dict(zip(names, a)))

    def grads_args(*a):  # the output and every gradient, as a training step evaluates them
        outs, gs = mx.vjp(lambda *p: forward(dict(zip(names, p))), list(a), [do])
        return [*outs, *gs]

    fwd_fn, grads_fn = (mx.compile(fwd_args), mx.compile(grads_args)) if compiled else (fwd_args, grads_args)

    def call(fn, xs):
        return fn(*[xs[n] for n in names])

    def fwd_step(t):
        return linked(t, call(fwd_fn, {**inputs, tie: t}))

    def fwdbwd_step(t):
        return linked(t, *call(grads_fn, {**inputs, tie: t}))

    return Steps(fwd=lambda: call(fwd_fn, inputs), fwdbwd=lambda: call(grads_fn, inputs), fwd_step=fwd_step,
                 fwdbwd_step=fwdbwd_step, start=lambda: inputs[tie] * 1)


def calls_for(ms: float, repeat: int | None) -> int:
    """Chained calls a round: ``repeat`` if given, else enough for ``ROUND_SECONDS`` (3 to 100)."""
    if repeat:
        return repeat
    return max(3, min(100, math.ceil(ROUND_SECONDS * 1e3 / max(ms, 1e-3))))


def measure_timed(impl: str, kind: str, call, step, start, repeat: int | None = None, rounds: int = ROUNDS,
                  warm: bool = True, sync_reps: int = SYNC_REPS, link_alone: bool = False) -> Measure:
    """A chained measure of ``step`` (``call`` its one-shot form): warm-up, ``sync_reps`` synchronized calls (they
    size the chain), ``rounds`` chains. ``link_alone`` also times the link by itself (``METHOD['link_ms']``)."""
    extra = {}
    if warm:  # compile and first-call costs, the op's and the link's
        t0 = time.perf_counter()
        mx.eval(call())
        mx.synchronize()
        extra["first_call_s"] = time.perf_counter() - t0
        time_chained(step, start, 1, 1)
    sync = None
    if sync_reps:
        sync = statistics.median(time_sync(call, reps=sync_reps))
        extra["sync_ms"] = sync
    calls = calls_for(sync, repeat) if sync is not None else (repeat or 1)
    rounds_ms = time_chained(step, start, calls, rounds)
    extra.update(rounds_ms=rounds_ms, calls=calls)
    if link_alone:
        const = mx.zeros((1,), dtype=mx.float32)  # not the carry: a view of the carry would keep it from donation
        alone = mx.compile(lambda t, e: link(t, [e]))
        time_chained(lambda t: alone(t, const), start, 1, 1)
        extra["link_ms"] = time_chained(lambda t: alone(t, const), start, calls, 1)[0]
    return Measure(impl, kind, statistics.median(rounds_ms), extra=extra)


# -- the implementations --------------------------------------------------------------------------

def recgen_forward(rec: ir.Recurrence, backend: str):
    op = load(rec, backend=None if backend == "auto" else backend)  # what a user's load() gives
    return lambda xs: op(**xs)[0]


def naive_forward(rec: ir.Recurrence, shape: Shape):
    scale = shape.K ** -0.5 if rec.default_scale == "key" else 1.0  # the op's default
    return lambda xs: naive_loop(rec, xs, scale=scale)[0]


def device_memory() -> int | None:
    info = mx.device_info()
    for key in ("memory_size", "total_memory"):
        if isinstance(info.get(key), int):
            return info[key]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def naive_estimates(rec: ir.Recurrence, shape: Shape, dtype: str, passes: tuple) -> dict:
    """kind -> (seconds a call at ``shape`` would take, GiB it would peak at), extrapolated linearly in T
    from one synchronized call at T = ``NAIVE_PROBE_T``."""
    T0 = min(shape.T, NAIVE_PROBE_T)
    xs, do = make_inputs(rec, shape.with_t(T0), dtype)
    s = steps(naive_forward(rec, shape), xs, do)
    out = {}
    for kind, call in (("fwd", s.fwd), ("fwdbwd", s.fwdbwd)):
        if kind in passes or "peak" in passes:
            mx.eval(call())
            ms = time_sync(call, reps=1)[0]
            gib = peak_gib(call)
            out[kind] = (ms / 1e3 * shape.T / T0, gib * shape.T / T0)
    return out


# -- the run --------------------------------------------------------------------------------------

def plan(passes: tuple, baselines: tuple) -> list[str]:
    """The steps ``run`` reports through ``on_step``, in order."""
    kinds = [p for p in ("fwd", "fwdbwd") if p in passes]
    labels = ["recgen decode"] if "decode" in passes else []
    labels += [f"recgen {k}" for k in kinds]
    if "peak" in passes:
        labels.append("recgen peak")
    if "naive" in baselines and set(passes) - {"decode"}:
        labels += ["naive estimate"] + [f"naive {k}" for k in kinds] + (["naive peak"] if "peak" in passes else [])
    if "fla" in baselines and set(passes) - {"decode"}:
        labels.append("fla (separate process)")
    return labels


def check_args(passes: tuple, baselines: tuple, dtype: str, backend: str) -> None:
    bad = [p for p in passes if p not in PASSES]
    if bad or not passes:
        raise InputError(f"--passes {','.join(passes)!r}: expected a comma list of {', '.join(PASSES)}")
    bad = [b for b in baselines if b not in BASELINES]
    if bad:
        raise InputError(f"--baseline {','.join(baselines)!r}: expected a comma list of {', '.join(BASELINES)}")
    if dtype not in FLOAT_DTYPES:
        raise InputError(f"--dtype {dtype!r}: expected one of {', '.join(FLOAT_DTYPES)}")
    if backend not in BACKEND_CHOICES:
        raise InputError(f"--backend {backend!r}: expected one of {', '.join(BACKEND_CHOICES)}")
    gpu = {"metal": mx.metal, "cuda": mx.cuda}.get(backend)
    if gpu is not None and not gpu.is_available():
        raise InputError(f"--backend {backend}: MLX has no {backend} device on this machine")


def run(rec: ir.Recurrence, shape: Shape, dtype: str = "bfloat16", backend: str = "auto",
        passes: tuple = PASSES, baselines: tuple = (), repeat: int | None = None, on_step=None,
        fla_timeout: float = FLA_TIMEOUT_S, compiled: bool = False) -> Result:
    """Measure ``rec`` at ``shape``; ``on_step(label)`` is called before each step of ``plan(passes, baselines)``.
    ``compiled``: recgen's and the naive loop's calls each as one compiled function (``steps``)."""
    check_args(passes, baselines, dtype, backend)
    if repeat is not None and repeat < 1:
        raise InputError(f"--repeat {repeat}: expected a positive count")
    on_step = on_step or (lambda label: None)
    tun = current()  # the backend's choice: no self-test needed
    used = choose_backend(tun, None if backend == "auto" else backend)
    measures = []
    if "decode" in passes:
        on_step("recgen decode")
        measures.append(measure_decode(rec, shape, dtype, backend))

    timed = tuple(p for p in passes if p != "decode")  # on the shape's T; FLA's chunk ops have no decode step
    if timed:
        measures += _timed(rec, shape, dtype, backend, timed, baselines, repeat, on_step, compiled)
    if "fla" in baselines and timed:
        on_step("fla (separate process)")
        mx.clear_cache()  # hand cached device memory back before the other process allocates
        measures += fla_measures(rec, shape, dtype, timed, fla_timeout)

    env = {"device": {"default_device": str(mx.default_device()), **_jsonable(mx.device_info())},
           "mlx_version": mx.__version__, "recgen_version": __version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": sys.version.split()[0], "tuning": _jsonable(asdict(tun)), "compiled": compiled}
    return Result(rec.name, rec.spec_hash(), shape, dtype, backend, used, tuple(measures), env)


def _timed(rec, shape, dtype, backend, passes, baselines, repeat, on_step, compiled) -> list:
    """recgen's (and the naive loop's) forward, forward+backward and peaks at ``shape``."""
    kinds = [p for p in ("fwd", "fwdbwd") if p in passes]
    peaks = kinds if kinds else ["fwd", "fwdbwd"]
    measures = []
    xs, do = make_inputs(rec, shape, dtype)
    s = steps(recgen_forward(rec, backend), xs, do, compiled)
    calls = {"fwd": (s.fwd, s.fwd_step), "fwdbwd": (s.fwdbwd, s.fwdbwd_step)}
    for k in kinds:
        on_step(f"recgen {k}")
        measures.append(measure_timed("recgen", k, *calls[k], s.start, repeat, link_alone=True))
    if "peak" in passes:
        on_step("recgen peak")
        for k in peaks:
            if k not in kinds:
                mx.eval(calls[k][0]())
            measures.append(Measure("recgen", f"peak_{k}", peak_gib(calls[k][0])))
    del s, calls
    if "naive" in baselines:
        measures += _naive(rec, shape, dtype, passes, kinds, peaks, xs, do, repeat, on_step, compiled)
    return measures


def pipelined(step, carry, tokens: int = DECODE_TOKENS, warm: int = DECODE_WARM) -> float:
    """ms a step of ``tokens`` chained calls of ``step`` (carry -> carry), one ``mx.async_eval`` each."""
    carry = run_steps(step, carry, warm, pipelined=True)
    t0 = time.perf_counter()
    run_steps(step, carry, tokens, pipelined=True)
    return (time.perf_counter() - t0) * 1e3 / tokens


def measure_decode(rec: ir.Recurrence, shape: Shape, dtype: str, backend: str = "auto",
                   tokens: int = DECODE_TOKENS) -> Measure:
    """A decode step (``METHOD['decode']``) at ``shape`` (its T is not used), from a random float32 state (a
    normalizer's z positive, as the recurrence keeps it where its updates are), against a copy of the state."""
    op = load(rec, backend=None if backend == "auto" else backend)
    xs, _ = make_inputs(rec, shape.with_t(1), dtype)
    sizes = shape.sizes(rec)
    keys = mx.random.split(mx.random.key(1))
    S0 = mx.random.normal(sizes.state_shape, key=keys[0])
    state = (S0, mx.random.uniform(shape=sizes.state_shape[:3], key=keys[1])) if rec.has_normalizer else S0
    mx.eval(state)
    parts = list(state) if rec.has_normalizer else [state]

    def step(carry):  # [o, final state]: a generate loop reads o too
        o, st = op(**xs, initial_state=carry[1], output_final_state=True)
        return [o, st]

    ms = pipelined(step, [None, state], tokens)
    copy_ms = pipelined(lambda c: [x * 1.0 for x in c], parts, tokens)
    nbytes = 2 * sum(x.nbytes for x in parts)
    return Measure("recgen", "decode", ms, extra={"copy_ms": copy_ms, "of_copy": copy_ms / ms,
                                                  "state_bytes_moved": nbytes, "tokens": tokens})


def _naive(rec, shape, dtype, passes, kinds, peaks, xs, do, repeat, on_step, compiled=False) -> list:
    on_step("naive estimate")
    est = naive_estimates(rec, shape, dtype, passes)
    mem = device_memory()
    s = steps(naive_forward(rec, shape), xs, do, compiled)
    calls = {"fwd": (s.fwd, s.fwd_step), "fwdbwd": (s.fwdbwd, s.fwdbwd_step)}
    why = {}
    for k, (sec, gib) in est.items():
        if sec > NAIVE_BUDGET_S:
            why[k] = f"skipped: about {sec:.0f} s a call (extrapolated from T={min(shape.T, NAIVE_PROBE_T)})"
        elif mem and gib * GIB > 0.9 * mem:
            why[k] = f"skipped: about {gib:.1f} GiB (extrapolated from T={min(shape.T, NAIVE_PROBE_T)})"
    out = []
    for k in kinds:
        on_step(f"naive {k}")
        if k in why:
            out.append(Measure("naive", k, None, why[k]))
            continue
        sec = est[k][0]
        if sec > ROUND_SECONDS:  # a long loop: one call a round, few rounds, no warm-up beyond the short run
            rounds = max(1, min(ROUNDS, int(NAIVE_BUDGET_S / 3 / sec)))
            out.append(measure_timed("naive", k, *calls[k], s.start, repeat or 1, rounds, warm=False, sync_reps=0))
        else:
            out.append(measure_timed("naive", k, *calls[k], s.start, repeat))
    if "peak" in passes:
        on_step("naive peak")
        for k in peaks:
            out.append(Measure("naive", f"peak_{k}", None, why[k]) if k in why
                       else Measure("naive", f"peak_{k}", peak_gib(calls[k][0])))
    return out


def _jsonable(d):
    return json.loads(json.dumps(d, default=str))


# -- FLA, in a separate process --------------------------------------------------------------------

WORKER = Path(__file__).with_name("fla_worker.py")


def fla_job(name: str, shape: Shape, dtype: str = "bfloat16", passes: tuple = ("fwd", "fwdbwd"),
            profile: bool = False) -> dict:
    """``fla_worker.py``'s job for the built-in ``name`` at ``shape``: its inputs' shapes and laws, the passes,
    dy's shape; ``profile``: the worker profiles FLA's kernels instead of timing them."""
    return ({"op": name, "dtype": dtype, "inputs": fla_inputs(BUILTINS[name], shape), "passes": list(passes),
             "do_shape": [shape.B, shape.T, shape.H, shape.V]} | ({"profile": True} if profile else {}))


def fla_measures(rec: ir.Recurrence, shape: Shape, dtype: str, passes: tuple, timeout: float) -> list:
    """FLA's numbers for ``rec`` (one of its built-ins) from ``fla_worker.py`` in a separate process, or one
    skipped measure with the reason (no FLA op, torch/fla/CUDA missing, a failure, a timeout)."""
    kinds = [p for p in ("fwd", "fwdbwd") if p in passes]
    peaks = [f"peak_{k}" for k in (kinds or ["fwd", "fwdbwd"])] if "peak" in passes else []
    reason = None
    if rec.name not in FLA_OPS or BUILTINS[rec.name].spec_hash() != rec.spec_hash():
        reason = f"FLA has no chunk op for {rec.name}"
    else:
        job = fla_job(rec.name, shape, dtype, passes)
        try:
            p = subprocess.run([sys.executable, str(WORKER), json.dumps(job)], capture_output=True, text=True,
                               timeout=timeout)
            lines = p.stdout.splitlines()
            got = next((ln for ln in reversed(lines) if ln.startswith(("RESULT ", "SKIP "))), None)
            if got is None:
                reason = f"FLA worker failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-300:]}"
            elif got.startswith("SKIP "):
                reason = got[5:]
            else:
                res = json.loads(got[7:])
                info = res.pop("info", {})
                return [Measure("fla", k, v.get("value"), v.get("note", ""), {**v.get("extra", {}), **info})
                        for k, v in res.items()]
        except subprocess.TimeoutExpired:
            reason = f"FLA worker timed out after {timeout:.0f} s (Triton autotuning)"
    return [Measure("fla", k, None, reason) for k in kinds + peaks]
