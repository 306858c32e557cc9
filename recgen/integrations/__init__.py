"""Drop-in replacements for other projects' recurrence functions, built on recgen's ops.

- ``recgen.integrations.mlx_lm``: mlx-lm's ``gated_delta_update`` (Qwen3-Next, Qwen3.5, Kimi Linear, ...)
  with ``patch()`` / ``unpatch()``. mlx-lm stays optional: importing the module imports no mlx_lm.
"""
