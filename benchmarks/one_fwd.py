"""One GDN forward launch at a given shape (for ncu): python benchmarks/one_fwd.py B T H D"""
import sys

import mlx.core as mx

from recgen import specs
from recgen.ops import Op

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_gpu import inputs  # noqa: E402

B, T, H, D = map(int, sys.argv[1:5])
xs = inputs("gated_delta_net", B, T, H, D)
op = Op(specs.gated_delta_net, backend="cuda")
mx.eval(op(*xs, check_finite=False)[0])
mx.eval(op(*xs, check_finite=False)[0])
