"""recgen: declare a linear recurrence, get fused differentiable kernels for MLX.

Nothing here imports MLX or builds a kernel: ``import recgen`` and ``recgen emit`` work anywhere.
"""
__version__ = "0.1.0"
