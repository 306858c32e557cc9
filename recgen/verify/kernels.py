"""recgen's own Metal kernels through every verification layer, on Linux.

For a spec and numpy inputs (IR layouts): render the recurrent forward and backward for Metal,
capture the exact source MLX would compile (``capture``), type-check it with address spaces
(``typecheck``), lint it against Apple-GPU limits (``limits``), run it on the CPU emulator
(``cpu_exec``, optionally under ASan/UBSan or TSan) with the very launch recipe the MLX op uses
(``runtime.recurrent.forward_launch`` / ``backward_launch``), and finish the gradients as the op does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..codegen.backends import METAL
from ..spec.ir import Recurrence
from ..runtime.recurrent import Launch, backward_launch, finish_grads, forward_launch, normalized_readout
from ..codegen.lower import plan as make_plan
from ..spec.layouts import infer_sizes
from .capture import wrapped_source
from .cpu_exec import run_msl
from .limits import lint
from .typecheck import typecheck


class VerificationError(AssertionError):
    """A layer rejected a generated kernel; the message names the kernel and the layer."""


@dataclass
class Report:
    """What each layer said, per kernel name (for ``recgen check``)."""

    sources: dict = field(default_factory=dict)   # kernel name -> wrapped MSL
    layers: list = field(default_factory=list)    # (kernel name, layer, ok, detail)


def _np(dtype: str):
    return {"float32": np.float32, "int32": np.int32, "bfloat16": "bfloat16", "float16": np.float16}[dtype]


def _run(launch: Launch, user: dict, extra: dict, report: Report, sanitizer) -> list[np.ndarray]:
    src = launch.source
    ins = dict(user)
    ins.update({n: np.asarray(v, dtype=_np(dt)) for n, v, dt in launch.runtime})
    ins.update(extra)
    arrays = [ins[n] for n in src.inputs]  # to the capture as given: an mx array keeps its dtype (a bfloat buffer)
    ins = {n: _host(v) for n, v in ins.items()}
    tmpl = [(n, v if not isinstance(v, str) else _mx_dtype(v)) for n, v in launch.template]
    msl = wrapped_source(src.name, list(src.inputs), list(src.outputs), src.source, src.header, arrays,
                         [s for s, _ in launch.outputs], [_mx_dtype(dt) for _, dt in launch.outputs],
                         launch.grid, launch.threadgroup, tmpl)
    report.sources[src.name] = msl
    tc = typecheck(msl)
    report.layers.append((src.name, "clang type check", tc.ok, str(tc)))
    if not tc.ok:
        raise VerificationError(f"{src.name}: clang type check failed:\n{tc}")
    issues = lint(msl, launch.threadgroup, template=dict(launch.template))
    report.layers.append((src.name, "limits", not issues, "; ".join(i.message for i in issues)))
    if issues:
        raise VerificationError(f"{src.name}: limit lints: {issues}")
    outs = run_msl(msl, None, ins, {n: (s, _np(dt)) for n, (s, dt) in zip(src.outputs, launch.outputs)},
                   launch.grid, launch.threadgroup, sanitizer=sanitizer)
    report.layers.append((src.name, f"CPU execution ({sanitizer or 'plain'})", True, ""))
    return [outs[n] for n in src.outputs]


def _host(v):
    """An mx array as float32 numpy (the emulator converts to the buffer's declared type); anything else as is."""
    if type(v).__module__.startswith("mlx"):
        import mlx.core as mx

        return np.array(v.astype(mx.float32))
    return v


def run_launch(launch: Launch, inputs: dict, sanitizer=None, report: Report | None = None) -> list[np.ndarray]:
    """Any Metal ``Launch`` (e.g. ``recgen.runtime.chunk_kernels``) through every layer; ``inputs`` maps
    the source's buffer names (runtime ones excluded) to numpy arrays, or mx arrays where a buffer's type
    should be theirs (bfloat16, float16). Returns its outputs."""
    return _run(launch, inputs, {}, report if report is not None else Report(), sanitizer)


def _mx_dtype(name: str):
    import mlx.core as mx

    return getattr(mx, name)


def emulate(rec: Recurrence, inputs: dict, *, initial_state, do, dht, scale: float, sanitizer=None,
            report: Report | None = None):
    """Forward and backward of the Metal kernels on the CPU: (o, final_state, grads dict)."""
    report = report if report is not None else Report()
    sizes = infer_sizes(rec, {k: v.shape for k, v in inputs.items()})
    p = make_plan(rec, sizes)
    user = {f"{x.name}_in": np.asarray(inputs[x.name], dtype=np.float32) for x in rec.inputs}
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    norm = rec.has_normalizer
    states = {"h0": f32(initial_state[0]), "z0": f32(initial_state[1])} if norm else {"h0": f32(initial_state)}
    fl = forward_launch(p, METAL, sizes, scale, "float32", save=True)
    f = _run(fl, user, states, report, sanitizer)
    extra = {"ckpt": f[2], "do_in": f32(do), "dht": f32(dht[0] if norm else dht)}
    if norm:
        extra.update(ckptz=f[4], dhtz=f32(dht[1]), ydo_in=(f32(do) * normalized_readout(p, f, f[0])).sum(axis=-1))
    outs = _run(backward_launch(p, METAL, sizes, scale), user, extra, report, sanitizer)
    grads, dstate = finish_grads(p, sizes, outs)
    g = {x.name: gr for x, gr in zip(rec.inputs, grads)}
    g["initial_state"] = tuple(dstate) if norm else dstate
    return f[0], ((f[1], f[3]) if norm else f[1]), g
