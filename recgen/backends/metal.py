"""Metal Shading Language spellings (through mx.fast.metal_kernel)."""
from .dialect import Dialect

# NOTE: MSL has no log1p; softplus uses log(1 + e) on the non-positive branch, where e <= 1.
PRELUDE = """\
inline float rg_sigmoid(float x) { return 0.5f * (1.0f + metal::precise::tanh(0.5f * x)); }
inline float rg_softplus(float x) { return x > 0.0f ? x + metal::log(1.0f + metal::exp(-x)) : metal::log(1.0f + metal::exp(x)); }
inline float rg_logsigmoid(float x) { return -rg_softplus(-x); }
"""

METAL = Dialect(
    name="metal", ext="metal", mlx_factory="metal_kernel",
    lane="thread_index_in_simdgroup", thread_in_tg="thread_position_in_threadgroup.x",
    tg_x="threadgroup_position_in_grid.x", tg_y="threadgroup_position_in_grid.y",
    shfl_xor="simd_shuffle_xor({x}, {m})",
    barrier="threadgroup_barrier(metal::mem_flags::mem_threadgroup)",
    smem="threadgroup", int64="int64_t", global_space="device ", shared_space="threadgroup ",
    smem_bytes=32 * 1024,  # maxTotalThreadgroupMemoryLength of Apple GPUs
    fns={"exp": "metal::exp", "log": "metal::log", "sqrt": "metal::sqrt", "tanh": "metal::precise::tanh",
         "sigmoid": "rg_sigmoid", "softplus": "rg_softplus", "logsigmoid": "rg_logsigmoid", "Abs": "metal::abs"},
    dtypes={"float32": "float", "float16": "half", "bfloat16": "bfloat16_t"},
    prelude=PRELUDE,
)
