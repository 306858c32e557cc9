"""``launch.mlx_call``: what MLX's kernel object receives (on a GPU the kernel runs; here a recorder stands in)."""
import mlx.core as mx

from recgen.codegen.backends import get
from recgen.runtime import chunk_kernels as ck
from recgen.runtime import launch as L


def test_mlx_call_passes_the_launch_recipe_in_source_order(monkeypatch):
    lau = ck.feature_jac_launch("cuda", 4, 32, 8, 5, (2, 3))  # a runtime input (ns), one output, a template
    seen = []

    def kernel(src, factory, debug=False):
        def call(**kw):
            seen.append((factory, kw))
            return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        return call

    monkeypatch.setattr(L, "mlx_kernel", kernel)
    X, S, Y = mx.ones((4, 32, 8)), mx.ones((6, 36, 5)), mx.ones((4, 32, 5))
    for _ in range(2):  # the second call reuses the arguments made for the first
        (out,) = L.mlx_call(lau, get("cuda"), [X, S, Y], [])
        assert out.shape == (4, 32, 8) and out.dtype == mx.float32
    assert len(seen) == 2 and seen[0][1] is not seen[1][1]
    factory, kw = seen[1]
    assert factory == get("cuda").mlx_factory
    assert kw["inputs"][:3] == [X, S, Y] and len(kw["inputs"]) == 4  # the user's arrays, then ns
    assert kw["inputs"][3].tolist() == [2, 3] and kw["inputs"][3].dtype == mx.int32
    assert kw["grid"] == lau.grid and kw["threadgroup"] == lau.threadgroup
    assert kw["output_shapes"] == [(4, 32, 8)] and kw["output_dtypes"] == [mx.float32]
    assert kw["template"] == [(n, v) for n, v in lau.template]  # all ints here: none names a dtype
    assert L.launch_arguments(lau) is L.launch_arguments(lau)
