"""``mx.compile`` on the GPU: each built-in op's forward and ``mx.grad`` through it (every input and the initial
state, with a cotangent on the final state), compiled, match the uncompiled op. The default dispatch (the CUDA
kernels) for the built-ins with a recurrent kernel, and the chunked form (backend "mlx") for every built-in.
float32 at a shape the other checks compile already; tolerances those of float32 against the reference.
Default arguments: the finite check is a debug mode, off, so nothing on the op's path waits for the device."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import rel_err
from op_check import CASES, KERNEL_SPECS, TOL, case_inputs, group, over_tolerance

import recgen.ops
from recgen import specs

pytestmark = pytest.mark.gpu

CASE = CASES[1]
PARAMS = [pytest.param(n, b, id=f"{n}-{b or 'default'}", marks=pytest.mark.xdist_group(group(n, "float32")))
          for n in specs.BUILTINS for b in ((None, "mlx") if n in KERNEL_SPECS else ("mlx",))]


@pytest.mark.parametrize("name,backend", PARAMS)
def test_compiled_op_matches_uncompiled(name, backend, rng):
    rec = specs.BUILTINS[name]
    op = recgen.ops.load(rec)  # the spec's own op (ops.retnet and ops.mamba2 wrap theirs in upstream signatures)
    xs, h0, do, dht = case_inputs(rec, CASE, rng)
    n, norm = len(rec.inputs), rec.has_normalizer
    parts = lambda s: list(s) if norm else [s]  # noqa: E731
    m32 = lambda a: mx.array(np.asarray(a, np.float32))  # noqa: E731
    prim = [m32(xs[x.name]) for x in rec.inputs] + [m32(s) for s in parts(h0)]
    cots = [m32(do)] + [m32(s) for s in parts(dht)]

    def fwd(*args):
        state = tuple(args[n:]) if norm else args[n]
        o, ht = op(*args[:n], initial_state=state, output_final_state=True, backend=backend)
        return (o, *parts(ht))

    def loss(*args):
        return sum((a * c).sum() for a, c in zip(fwd(*args), cots))

    grad = mx.grad(loss, argnums=list(range(len(prim))))
    eager = (fwd(*prim), grad(*prim))
    mx.eval(eager)  # first: what the op caches on a first call (kernels, small constants) exists before a trace
    compiled = (mx.compile(fwd)(*prim), mx.compile(grad)(*prim))
    mx.eval(compiled)
    names = ["o", "ht", "zt"][:1 + len(parts(h0))] + [f"d{x.name}" for x in rec.inputs] + ["dh0", "dz0"]
    errs = {k: rel_err(np.array(c), np.array(e))
            for k, c, e in zip(names, [*compiled[0], *compiled[1]], [*eager[0], *eager[1]])}
    bad = over_tolerance(errs, "float32")  # op_check's bounds (a decay parameter's gradient is a sum over B·T)
    assert not bad, f"compiled against uncompiled, above {TOL['float32']}: {bad} (all: {errs})"
