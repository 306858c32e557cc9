"""Verify recgen's Metal kernels without a Mac.

Layers (docs/design.md, "Verifying Metal without a Mac"):
  capture.wrapped_source  -- the exact MSL MLX compiles, captured from mlx[cpu] on Linux;
  typecheck.typecheck     -- clang -fsyntax-only with an address-space shim (msl_shim.h);
  cpu_exec.run_msl        -- execution on the CPU, one thread per GPU thread, under ASan/UBSan or TSan;
  limits.lint             -- Apple-GPU limits (threads, threadgroup memory, buffers, ASCII, double).
None of this is Apple's compiler or GPU: passing it is evidence, not proof.
"""
from .capture import CaptureError, wrapped_source
from .cpu_exec import MSLCompileError, MSLRuntimeError, run_msl
from .limits import LintIssue, lint
from .typecheck import CheckResult, Diagnostic, typecheck

__all__ = ["CaptureError", "CheckResult", "Diagnostic", "LintIssue", "MSLCompileError", "MSLRuntimeError",
           "lint", "run_msl", "typecheck", "wrapped_source"]
