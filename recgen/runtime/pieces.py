"""The pieces a chunked body is made of (a forward and its written VJP), and the whole body's VJP as one graph.

A ``Piece`` is called like the ``mx.custom_function`` it is: MLX's autodiff calls its VJP. That leaves the glue between
the pieces (role math, casts, layouts, the readout) to MLX's autodiff and to Python: under ``mx.vjp`` MLX records
nothing (``runtime.replay``), so each eager training call runs the body's Python again. ``whole`` makes the body one
custom function whose forward and VJP are each one recorded graph (``replay.Replay``), and MLX serializes no custom
function, so neither graph may hold one. Two modes of the pieces make that possible:

- *taped*: a piece runs its forward as plain ops and notes its arguments and outputs on a tape. The body's forward,
  so run, is a plain graph; it returns the outputs and, after them, every piece's arguments and outputs (what the
  VJP needs, and what MLX's autodiff would have kept).
- *cut*: a piece returns given outputs (the forward's) and notes the arguments the glue formed. The body so run is
  the glue alone, a function of (inputs, the pieces' outputs) -> (outputs, each piece's arguments), which MLX
  differentiates as plain ops.

The VJP then walks the pieces backwards: the glue's VJP from the outputs' cotangents gives the cotangents of the
inputs and of the pieces' outputs; each piece's own VJP (last piece first) turns its outputs' cotangents into its
arguments', and the glue's VJP that formed those arguments carries them on to the inputs and the earlier pieces'
outputs. Each glue VJP is taken only with respect to what reaches it (read once from an export of the glue's graph):
MLX would answer the rest with zero arrays, and adding those would cost a pass over each. The glue's forward ops that
its VJP reads are formed again inside the VJP's graph (elementwise work, mostly), where autodiff would have kept them.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

from .replay import Replay, signature

_mode: contextvars.ContextVar = contextvars.ContextVar("recgen_piece_mode", default=None)


@dataclass
class _Taped:
    tape: list = field(default_factory=list)  # (piece, args, outputs) in call order


@dataclass
class _Cut:
    given: list                               # each piece's outputs, in call order
    seen: list = field(default_factory=list)  # each piece's arguments as the glue formed them


@contextlib.contextmanager
def _in(mode):
    token = _mode.set(mode)
    try:
        yield mode
    finally:
        _mode.reset(token)


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


class Piece:
    """``fwd(*args) -> tuple`` with its VJP ``vjp(args, outputs, cotangents) -> tuple`` (a cotangent for each
    argument; the outputs' cotangents are zeros where none came), called as an ``mx.custom_function`` of
    ``wrap(fwd)`` and ``wrap(vjp)`` (``chunk_kernels.replayed``, say); inside ``whole``'s graphs it is taped or cut
    instead, its plain ``fwd`` and ``vjp`` run as they are (see the module docstring)."""

    def __init__(self, fwd, vjp, wrap=lambda f, name: f, name: str = "piece"):
        import mlx.core as mx

        self.fwd, self.vjp = fwd, vjp
        run_fwd, vjps = wrap(fwd, name), {}

        def run_vjp(na: int, no: int):
            """The VJP as a function of (*args, *outputs, *cotangents), wrapped once per arity."""
            if (na, no) not in vjps:
                vjps[na, no] = wrap(lambda *f: tuple(vjp(f[:na], f[na:na + no], f[na + no:])), f"{name}_vjp")
            return vjps[na, no]

        @mx.custom_function
        def call(*args):
            return tuple(run_fwd(*args))

        @call.vjp
        def call_vjp(primals, cotangents, outputs):
            args, outs = _as_tuple(primals), _as_tuple(outputs)  # one array: MLX passes it as it is
            cots = tuple(mx.zeros_like(o) if c is None else c for c, o in zip(_as_tuple(cotangents), outs))
            grads = tuple(run_vjp(len(args), len(outs))(*args, *outs, *cots))
            return grads if len(grads) > 1 else grads[0]

        self.custom = call

    def __call__(self, *args) -> tuple:
        mode = _mode.get()
        if mode is None:
            return _as_tuple(self.custom(*args))
        if isinstance(mode, _Taped):
            outs = tuple(self.fwd(*args))
            mode.tape.append((self, args, outs))
            return outs
        mode.seen.append(args)
        return mode.given[len(mode.seen) - 1]


def _reach(fn, args) -> list:
    """For each output of the plain function ``fn``, the indices of ``args`` its graph reads: MLX's export of the
    graph through a callback hands its nodes over in the order they run, so one pass gathers each node's sources."""
    import mlx.core as mx

    sources: dict = {}
    outs: list = []

    def note(event):
        if event["type"] == "inputs":
            sources.update((n, frozenset([i])) for i, (n, *_) in enumerate(event["inputs"]))
        elif event["type"] == "outputs":
            outs.extend(n for n, *_ in event["outputs"])
        elif event["type"] == "primitive":
            read = frozenset().union(*(sources.get(n, frozenset()) for n, *_ in event["inputs"]))
            sources.update((n, read) for n, *_ in event["outputs"])

    mx.export_function(note, fn, *args)
    return [sorted(sources.get(n, ())) for n in outs]


def whole(fn, name: str, active=lambda: True):
    """``fn(*arrays) -> tuple`` (a body of ``Piece`` calls and glue) as one ``mx.custom_function`` whose forward and
    VJP are each recorded once per input signature and replayed (see the module docstring); ``active``: as
    ``Replay``'s. Returns a function of the arrays that gives ``fn``'s outputs."""
    import mlx.core as mx

    shapes: dict = {}  # input signature -> the pieces in call order, each with its numbers of arguments and outputs
    n_out = []         # fn's number of outputs (one body: the same at every signature), set by its first run

    def taped(arrays):
        """fn run with its pieces taped: (its outputs, the tape), the signature's pieces noted."""
        with _in(_Taped()) as m:
            outs = tuple(fn(*arrays))
        shapes[signature(arrays)] = [(p, len(a), len(o)) for p, a, o in m.tape]
        n_out[:] = [len(outs)]
        return outs, m.tape

    def forward(*arrays):
        outs, tape = taped(arrays)
        return outs + tuple(x for _, a, o in tape for x in (*a, *o))

    def backward(na: int, *flat):
        arrays = flat[:na]
        if signature(arrays) not in shapes:  # the forward was recorded at another signature
            taped(arrays)
        pieces = shapes[signature(arrays)]
        saved, k = [], na
        for _, n_args, n_outs in pieces:
            saved.append((flat[k:k + n_args], flat[k + n_args:k + n_args + n_outs]))
            k += n_args + n_outs
        cots = flat[k:]
        given = [o for _, o in saved]
        at = [0]  # where each piece's outputs start among the glue's primals, after the arrays
        for o in given:
            at.append(at[-1] + len(o))
        rows = [n_out[0]]  # where each piece's arguments start among the glue's outputs, after fn's
        for a, _ in saved:
            rows.append(rows[-1] + len(a))
        primals = [*arrays, *(x for o in given for x in o)]

        def glue(*xs):
            """(inputs, every piece's outputs) -> (fn's outputs, every piece's arguments)."""
            with _in(_Cut([tuple(xs[na + at[j]:na + at[j + 1]]) for j in range(len(given))])) as c:
                outs = tuple(fn(*xs[:na]))
            return outs + tuple(x for a in c.seen for x in a)

        try:
            reach = _reach(glue, primals)
        except (ValueError, RuntimeError):  # not recordable: every primal, at the cost of zero arrays added
            reach = [list(range(len(primals)))] * rows[-1]
        grads = [None] * len(primals)

        def back(outs, out_cots):
            """The glue's VJP for its outputs ``outs`` with these cotangents, added into ``grads``."""
            used = [(r, c) for r, c in zip(outs, out_cots) if reach[r]]
            wrt = sorted({i for r, _ in used for i in reach[r]})
            if not used:
                return

            def part(*sub):
                xs = list(primals)
                for i, s in zip(wrt, sub):
                    xs[i] = s
                got = glue(*xs)
                # each a node of its own (an addition of 0, never run: its VJP passes the cotangent through): MLX's
                # vjp keeps one cotangent an array, so an array handed out twice (one input as two arguments) would
                # lose all but one
                return [got[r] + 0 for r, _ in used]

            for i, g in zip(wrt, mx.vjp(part, [primals[i] for i in wrt], [c for _, c in used])[1]):
                grads[i] = g if grads[i] is None else grads[i] + g

        back(range(n_out[0]), cots)
        for j in reversed(range(len(pieces))):
            args, outs = saved[j]
            out_cots = [grads[na + at[j] + i] for i in range(len(outs))]
            if all(c is None for c in out_cots):
                continue
            out_cots = tuple(mx.zeros_like(o) if c is None else c for c, o in zip(out_cots, outs))
            back(range(rows[j], rows[j + 1]), pieces[j][0].vjp(args, outs, out_cots))
        return tuple(mx.zeros_like(a) if g is None else g for a, g in zip(arrays, grads[:na]))

    fwd_replay, bwd_replays = Replay(forward, f"{name}_whole", active), {}

    @mx.custom_function
    def call(*arrays):
        return fwd_replay(*arrays)

    @call.vjp
    def call_vjp(primals, cotangents, outputs):
        primals, outputs = _as_tuple(primals), _as_tuple(outputs)
        na, no = len(primals), n_out[0]
        cots = tuple(mx.zeros_like(o) if c is None else c for c, o in zip(_as_tuple(cotangents)[:no], outputs))
        if na not in bwd_replays:
            bwd_replays[na] = Replay(lambda *flat: backward(na, *flat), f"{name}_whole_vjp", active)
        grads = bwd_replays[na](*primals, *outputs[no:], *cots)
        return grads if len(grads) > 1 else grads[0]

    def run(*arrays):
        return _as_tuple(call(*arrays))[:n_out[0]]  # the rest: the pieces' arguments and outputs, for the VJP

    return run
